//! Launchers of `kernels/gate_l0.cu`: the smooth count of positive gates and its backward.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};
use half::bf16;

use super::{bf16_view, typed_view};

const GATE_L0_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gate_l0.ptx"));

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
    gate: &'a CudaView<'a, bf16>,
    first: &'a CudaView<'a, f32>,
    second: &'a CudaView<'a, f32>,
    n: i32,
    f: i32,
    scale: f32,
    eps: f32,
}

impl<'a> GateArgs<'a> {
    fn new(
        gate: &'a CudaView<'a, bf16>,
        first: &'a CudaView<'a, f32>,
        second: &'a CudaView<'a, f32>,
        (n, f): (usize, usize),
        (scale, eps): (f32, f32),
    ) -> Self {
        Self {
            gate,
            first,
            second,
            n: n as i32,
            f: f as i32,
            scale,
            eps,
        }
    }

    /// Launches kernel `name` of `kernels/gate_l0.cu` over `cfg`, writing `out`.
    fn launch<T>(
        &self,
        dev: &CudaDevice,
        name: &str,
        out: &mut CudaSlice<T>,
        cfg: LaunchConfig,
    ) -> Result<()> {
        let func = dev.get_or_load_custom_func(name, "gate_l0", GATE_L0_PTX)?;
        let mut b = func.builder();
        b.arg(self.gate)
            .arg(self.first)
            .arg(self.second)
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
}

/// `gate [n, f]` bf16, `x_norm [n]` and `w_norm [f]` f32: each row's count, `[n]` f32.
pub fn gate_l0(
    (gs, gl): Input,
    (xs, xl): Input,
    (ws, wl): Input,
    (n, f): (usize, usize),
    (scale, eps): (f32, f32),
) -> Result<CudaStorage> {
    let gv = bf16_view("gate_l0: gate", gs, gl)?;
    let xv = typed_view::<f32>("gate_l0: x_norm", xs, xl, DType::F32)?;
    let wv = typed_view::<f32>("gate_l0: w_norm", ws, wl, DType::F32)?;
    let dev = gs.device().clone();
    // SAFETY: the kernel writes every row.
    let mut out = unsafe { dev.alloc::<f32>(n)? };
    if n > 0 {
        let args = GateArgs::new(&gv, &xv, &wv, (n, f), (scale, eps));
        args.launch(
            &dev,
            "gate_l0_fwd_bf16",
            &mut out,
            super::grid_1d(n, THREADS),
        )?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The gates' gradient, `[n, f]` bf16: `gate [n, f]` bf16, `norms [n + f]` (x_norm then
/// w_norm) and `go [n]` f32.
pub fn gate_l0_grad_gate(
    (gs, gl): Input,
    (ns, nl): Input,
    (os, ol): Input,
    (n, f): (usize, usize),
    (scale, eps): (f32, f32),
) -> Result<CudaStorage> {
    let gv = bf16_view("gate_l0: gate", gs, gl)?;
    let nv = typed_view::<f32>("gate_l0: norms", ns, nl, DType::F32)?;
    let ov = typed_view::<f32>("gate_l0: output gradient", os, ol, DType::F32)?;
    let dev = gs.device().clone();
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { dev.alloc::<bf16>(n * f)? };
    if n > 0 && f > 0 {
        let args = GateArgs::new(&gv, &nv, &ov, (n, f), (scale, eps));
        args.launch(
            &dev,
            "gate_l0_grad_gate_bf16",
            &mut out,
            super::grid_1d(n, THREADS),
        )?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The norms' gradients, `[n + f]` f32 (x_norm's, then w_norm's); inputs as
/// [`gate_l0_grad_gate`].
pub fn gate_l0_grad_norms(
    (gs, gl): Input,
    (ns, nl): Input,
    (os, ol): Input,
    (n, f): (usize, usize),
    (scale, eps): (f32, f32),
) -> Result<CudaStorage> {
    let gv = bf16_view("gate_l0: gate", gs, gl)?;
    let nv = typed_view::<f32>("gate_l0: norms", ns, nl, DType::F32)?;
    let ov = typed_view::<f32>("gate_l0: output gradient", os, ol, DType::F32)?;
    let dev = gs.device().clone();
    // Zeros: with no rows the columns' gradients are 0, and the other way round.
    let mut out = dev.alloc_zeros::<f32>(n + f)?;
    if n == 0 || f == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(out, dev));
    }
    let args = GateArgs::new(&gv, &nv, &ov, (n, f), (scale, eps));
    // The rows' gradients fill the first n entries; the columns' come after them.
    args.launch(
        &dev,
        "gate_l0_grad_rows_bf16",
        &mut out,
        super::grid_1d(n, THREADS),
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
    args.launch(&dev, "gate_l0_grad_column_partials_bf16", &mut partial, cfg)?;
    {
        let func = dev.get_or_load_custom_func("gate_l0_grad_columns", "gate_l0", GATE_L0_PTX)?;
        let mut columns = out.slice_mut(n..n + f);
        let chunks_i = chunks as i32;
        let mut b = func.builder();
        b.arg(&partial)
            .arg(&nv)
            .arg(&mut columns)
            .arg(&args.n)
            .arg(&args.f)
            .arg(&chunks_i);
        // SAFETY: a thread per column, bounded by f.
        unsafe { b.launch(super::grid_1d(column_blocks as usize, THREADS)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
