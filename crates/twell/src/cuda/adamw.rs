//! Launchers of `kernels/adamw.cu`: the AdamW moments and the parameter update, each
//! in place in one pass.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};

use crate::error::{err, TwellError};

const ADAMW_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx"));

const THREADS: u32 = 256;
/// Enough blocks to fill the GPU several times; each thread strides over the rest.
const MAX_BLOCKS: usize = 132 * 16;

/// The updated tensor's f32 slice and its `[a, b)` range, checked contiguous.
fn f32_target<'a>(
    s: &'a mut CudaStorage,
    l: &Layout,
) -> Result<(&'a mut CudaSlice<f32>, usize, usize)> {
    super::check_dtype("adamw: the updated tensor", s, DType::F32)?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok((s.as_cuda_slice_mut::<f32>()?, a, b)),
        None => err(TwellError::Invalid(
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
    let gv = super::typed_view::<f32>("adamw: grad", grad, gl, DType::F32)?;
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
        super::typed_view::<f32>("adamw: m", m, ml, DType::F32)?,
        super::typed_view::<f32>("adamw: v", v, vl, DType::F32)?,
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
