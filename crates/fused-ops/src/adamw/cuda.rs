//! Launchers of `kernels/src/adamw.cu`: the AdamW moments and the parameter update, each
//! in place in one pass.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};

use crate::error::{err, OpError};

const ADAMW_PTX: &str = twell_kernels::ADAMW;

const THREADS: u32 = 256;
/// Enough blocks to fill the GPU several times; each thread strides over the rest.
const MAX_BLOCKS: usize = 132 * 16;

/// A contiguous bf16 or f32 input of the kernels instantiated for both (`name_bf16`,
/// `name_f32`).
enum FloatView<'a> {
    Bf16(CudaView<'a, half::bf16>),
    F32(CudaView<'a, f32>),
}

impl<'a> FloatView<'a> {
    /// bf16 as bf16, anything else checked as f32.
    fn of(what: &str, s: &'a CudaStorage, l: &Layout) -> Result<Self> {
        Ok(match s.dtype() {
            DType::BF16 => Self::Bf16(crate::cuda::typed_view(what, s, l, DType::BF16)?),
            _ => Self::F32(crate::cuda::typed_view(what, s, l, DType::F32)?),
        })
    }

    /// The kernel name's dtype suffix.
    fn suffix(&self) -> &'static str {
        match self {
            Self::Bf16(_) => "bf16",
            Self::F32(_) => "f32",
        }
    }

    fn push<'b>(&'b self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'b>) {
        match self {
            Self::Bf16(v) => b.arg(v),
            Self::F32(v) => b.arg(v),
        };
    }
}

/// The updated tensor's f32 slice and its `[a, b)` range, checked contiguous.
fn f32_target<'a>(
    s: &'a mut CudaStorage,
    l: &Layout,
) -> Result<(&'a mut CudaSlice<f32>, usize, usize)> {
    crate::cuda::check_dtype("adamw: the updated tensor", s, DType::F32)?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok((s.as_cuda_slice_mut::<f32>()?, a, b)),
        None => err(OpError::Invalid(
            "adamw: the updated tensor must be contiguous".into(),
        )),
    }
}

fn launch(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `moment ← beta·moment + (1 − beta)·(scale·grad)` (squared first with `square`).
pub fn adamw_moment(
    moment: &mut CudaStorage,
    ml: &Layout,
    grad: &CudaStorage,
    gl: &Layout,
    (beta, scale, square): (f32, f32, bool),
) -> Result<()> {
    let dev = grad.device().clone();
    let gv = crate::cuda::typed_view::<f32>("adamw: grad", grad, gl, DType::F32)?;
    let (slice, a, b) = f32_target(moment, ml)?;
    let mut target = slice.slice_mut(a..b);
    let n = (b - a) as i64;
    let square = i32::from(square);
    let func = dev.get_or_load_custom_func("adamw_moment_f32", "adamw", ADAMW_PTX)?;
    let mut builder = func.builder();
    builder
        .arg(&mut target)
        .arg(&gv)
        .arg(&n)
        .arg(&beta)
        .arg(&scale)
        .arg(&square);
    // SAFETY: a grid-stride loop bounded by n over contiguous f32 ranges of equal length
    // (checked by the op).
    unsafe { builder.launch(launch(n as usize)) }.w()?;
    Ok(())
}

/// `param ← param·decay − lr·(m·inv_c1) / (√(v·inv_c2) + eps)`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    param: &mut CudaStorage,
    pl: &Layout,
    m: &CudaStorage,
    ml: &Layout,
    v: &CudaStorage,
    vl: &Layout,
    (lr, decay, inv_c1, inv_c2, eps): (f32, f32, f32, f32, f32),
) -> Result<()> {
    let dev = m.device().clone();
    let (mv, vv) = (
        crate::cuda::typed_view::<f32>("adamw: m", m, ml, DType::F32)?,
        crate::cuda::typed_view::<f32>("adamw: v", v, vl, DType::F32)?,
    );
    let (slice, a, b) = f32_target(param, pl)?;
    let mut target = slice.slice_mut(a..b);
    let n = (b - a) as i64;
    let func = dev.get_or_load_custom_func("adamw_update_f32", "adamw", ADAMW_PTX)?;
    let mut builder = func.builder();
    builder
        .arg(&mut target)
        .arg(&mv)
        .arg(&vv)
        .arg(&n)
        .arg(&lr)
        .arg(&decay)
        .arg(&inv_c1)
        .arg(&inv_c2)
        .arg(&eps);
    // SAFETY: as above.
    unsafe { builder.launch(launch(n as usize)) }.w()?;
    Ok(())
}

/// The mixed-precision step on `state [3, n]` (f32 master, m, v) with a bf16 or f32
/// gradient of `n` elements: all three rows in place, one pass. The hyper-parameters
/// are `(beta1, beta2, scale, lr, decay, inv_c1, inv_c2, eps)`.
pub fn adamw_mixed(
    state: &mut CudaStorage,
    sl: &Layout,
    grad: &CudaStorage,
    gl: &Layout,
    hp: [f32; 8],
) -> Result<()> {
    let dev = grad.device().clone();
    let (slice, a, b) = f32_target(state, sl)?;
    let n = gl.shape().elem_count();
    if b - a != 3 * n {
        return err(OpError::ShapeMismatch {
            what: "adamw_mixed",
            detail: format!("state holds {} values, want 3 x {n}", b - a),
        });
    }
    let mut target = slice.slice_mut(a..b);
    let n_i = n as i64;
    let gv = FloatView::of("adamw: grad", grad, gl)?;
    let func =
        dev.get_or_load_custom_func(&format!("adamw_mixed_{}", gv.suffix()), "adamw", ADAMW_PTX)?;
    let mut builder = func.builder();
    builder.arg(&mut target);
    gv.push(&mut builder);
    builder.arg(&n_i);
    for x in &hp {
        builder.arg(x);
    }
    // SAFETY: a grid-stride loop bounded by n; state holds 3n contiguous f32 (checked
    // above), the gradient n contiguous values.
    unsafe { builder.launch(launch(n)) }.w()?;
    Ok(())
}

/// `param (bf16) ← master` rounded, with the master the first row of `state [3, n]`.
pub fn bf16_from_master(
    param: &mut CudaStorage,
    pl: &Layout,
    state: &CudaStorage,
    sl: &Layout,
) -> Result<()> {
    let dev = state.device().clone();
    crate::cuda::check_dtype("adamw: the bf16 variable", param, DType::BF16)?;
    let (a, b) = pl.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("adamw: the bf16 variable must be contiguous".into())
    })?;
    let n = b - a;
    let sv = crate::cuda::typed_view::<f32>("adamw: state", state, sl, DType::F32)?;
    if sv.len() != 3 * n {
        return err(OpError::ShapeMismatch {
            what: "bf16_from_master",
            detail: format!("state holds {} values, want 3 x {n}", sv.len()),
        });
    }
    let master = sv.slice(0..n);
    let slice = param.as_cuda_slice_mut::<half::bf16>()?;
    let mut target = slice.slice_mut(a..b);
    let n_i = n as i64;
    let func = dev.get_or_load_custom_func("bf16_from_master", "adamw", ADAMW_PTX)?;
    let mut builder = func.builder();
    builder.arg(&mut target).arg(&master).arg(&n_i);
    // SAFETY: a grid-stride loop bounded by n over n contiguous values of each.
    unsafe { builder.launch(launch(n)) }.w()?;
    Ok(())
}

/// The sum of squares of a contiguous bf16 or f32 tensor, as a one-element f32 slice.
pub fn sum_squares(x: &CudaStorage, xl: &Layout) -> Result<CudaStorage> {
    let dev = x.device().clone();
    let n = xl.shape().elem_count();
    let mut out = dev.alloc_zeros::<f32>(1)?;
    let n_i = n as i64;
    let xv = FloatView::of("sum_squares", x, xl)?;
    let func =
        dev.get_or_load_custom_func(&format!("sum_squares_{}", xv.suffix()), "adamw", ADAMW_PTX)?;
    let mut builder = func.builder();
    xv.push(&mut builder);
    builder.arg(&n_i).arg(&mut out);
    // SAFETY: a grid-stride loop bounded by n over n contiguous values; one f32 output.
    unsafe { builder.launch(launch(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
