//! Launchers of `kernels/gate_l0.cu`: the smooth count of positive gates and its backward.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};
use half::bf16;

use fused_ops::cuda::{bf16_view, typed_view};

const GATE_L0_PTX: &str = twell_kernels::GATE_L0;

/// Threads per block (`GL0_THREADS` in the .cu).
const THREADS: u32 = 256;
/// Rows per block of the column partial sums (`GL0_CHUNK`).
const CHUNK: usize = 64;

type Input<'a> = (&'a CudaStorage, &'a Layout);

/// The arguments all but the last kernel share, in their order: the gates, two f32
/// vectors (the norms, then the output gradient or `w_norm`), the output, `n`, `f`,
/// `scale`, `eps`. The kernels write inside `out` by row (or chunk) and column only,
/// so it may be longer than they need.
struct GateArgs<'a> {
    dev: CudaDevice,
    gate: CudaView<'a, bf16>,
    first: CudaView<'a, f32>,
    second: CudaView<'a, f32>,
    n: i32,
    f: i32,
    scale: f32,
    eps: f32,
}

impl<'a> GateArgs<'a> {
    /// Views of the bf16 gate and the two f32 vectors, each named for its error.
    fn new(
        (gs, gl): Input<'a>,
        ((fs, fl), first_what): (Input<'a>, &'static str),
        ((ss, sl), second_what): (Input<'a>, &'static str),
        (n, f): (usize, usize),
        (scale, eps): (f32, f32),
    ) -> Result<Self> {
        Ok(Self {
            dev: gs.device().clone(),
            gate: bf16_view("gate_l0: gate", gs, gl)?,
            first: typed_view::<f32>(first_what, fs, fl, DType::F32)?,
            second: typed_view::<f32>(second_what, ss, sl, DType::F32)?,
            n: n as i32,
            f: f as i32,
            scale,
            eps,
        })
    }

    /// Launches kernel `name` of `kernels/gate_l0.cu` over `cfg`, writing `out`.
    fn launch<T>(&self, name: &str, out: &mut CudaSlice<T>, cfg: LaunchConfig) -> Result<()> {
        let func = self
            .dev
            .get_or_load_custom_func(name, "gate_l0", GATE_L0_PTX)?;
        let mut b = func.builder();
        b.arg(&self.gate)
            .arg(&self.first)
            .arg(&self.second)
            .arg(out)
            .arg(&self.n)
            .arg(&self.f)
            .arg(&self.scale)
            .arg(&self.eps);
        // SAFETY: each kernel bounds its rows by n and its columns by f; the shapes and
        // lengths were checked by the op, and `out` holds at least what it writes.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// A kernel with a block per row that writes every one of its `len` outputs.
    fn run_rows<T: CudaDType + DeviceRepr>(&self, name: &str, len: usize) -> Result<CudaStorage> {
        // SAFETY: the kernel writes every element before anything reads it.
        let mut out = unsafe { self.dev.alloc::<T>(len)? };
        if len > 0 {
            let cfg = fused_ops::cuda::grid_1d(self.n as usize, THREADS);
            self.launch(name, &mut out, cfg)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, self.dev.clone()))
    }
}

/// `gate [n, f]` bf16, `x_norm [n]` and `w_norm [f]` f32: each row's count, `[n]` f32.
pub fn gate_l0(
    gate: Input,
    x_norm: Input,
    w_norm: Input,
    dims: (usize, usize),
    consts: (f32, f32),
) -> Result<CudaStorage> {
    let args = GateArgs::new(
        gate,
        (x_norm, "gate_l0: x_norm"),
        (w_norm, "gate_l0: w_norm"),
        dims,
        consts,
    )?;
    args.run_rows::<f32>("gate_l0_fwd_bf16", dims.0)
}

/// The views of a backward call: `gate [n, f]` bf16, `norms [n + f]` (x_norm then
/// w_norm) and `go [n]` f32.
fn backward_args<'a>(
    gate: Input<'a>,
    norms: Input<'a>,
    go: Input<'a>,
    dims: (usize, usize),
    consts: (f32, f32),
) -> Result<GateArgs<'a>> {
    GateArgs::new(
        gate,
        (norms, "gate_l0: norms"),
        (go, "gate_l0: output gradient"),
        dims,
        consts,
    )
}

/// The gates' gradient, `[n, f]` bf16; inputs as [`backward_args`].
pub fn gate_l0_grad_gate(
    gate: Input,
    norms: Input,
    go: Input,
    (n, f): (usize, usize),
    consts: (f32, f32),
) -> Result<CudaStorage> {
    let args = backward_args(gate, norms, go, (n, f), consts)?;
    args.run_rows::<bf16>("gate_l0_grad_gate_bf16", n * f)
}

/// The norms' gradients, `[n + f]` f32 (x_norm's, then w_norm's); inputs as
/// [`backward_args`].
pub fn gate_l0_grad_norms(
    gate: Input,
    norms: Input,
    go: Input,
    (n, f): (usize, usize),
    consts: (f32, f32),
) -> Result<CudaStorage> {
    let args = backward_args(gate, norms, go, (n, f), consts)?;
    let dev = args.dev.clone();
    // Zeros: with no rows the columns' gradients are 0, and the other way round.
    let mut out = dev.alloc_zeros::<f32>(n + f)?;
    if n == 0 || f == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(out, dev));
    }
    // The rows' gradients fill the first n entries; the columns' come after them.
    args.launch(
        "gate_l0_grad_rows_bf16",
        &mut out,
        fused_ops::cuda::grid_1d(n, THREADS),
    )?;
    let chunks = n.div_ceil(CHUNK);
    let column_blocks = f.div_ceil(THREADS as usize) as u32;
    // SAFETY: the partials kernel writes every (chunk, column) before the sum reads it.
    let mut partial = unsafe { dev.alloc::<f32>(chunks * f)? };
    // A thread per column and a block row per chunk of rows.
    let cfg = LaunchConfig {
        grid_dim: (column_blocks, chunks as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    args.launch("gate_l0_grad_column_partials_bf16", &mut partial, cfg)?;
    {
        let func = dev.get_or_load_custom_func("gate_l0_grad_columns", "gate_l0", GATE_L0_PTX)?;
        let mut columns = out.slice_mut(n..n + f);
        let chunks_i = chunks as i32;
        let mut b = func.builder();
        b.arg(&partial)
            .arg(&args.first)
            .arg(&mut columns)
            .arg(&args.n)
            .arg(&args.f)
            .arg(&chunks_i);
        // SAFETY: a thread per column, bounded by f.
        unsafe { b.launch(fused_ops::cuda::grid_1d(column_blocks as usize, THREADS)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
