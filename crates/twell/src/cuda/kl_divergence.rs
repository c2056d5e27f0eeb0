//! Launchers of `kernels/kl_divergence.cu`: per-row KL divergence of a teacher's and a
//! student's logits, and its backward.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};
use half::bf16;

use super::{bf16_view, typed_view};

const KL_DIVERGENCE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kl_divergence.ptx"));

/// Threads per row (`KL_THREADS` in the .cu).
const THREADS: u32 = 256;

type Input<'a> = (&'a CudaStorage, &'a Layout);

/// Launches kernel `name` with a block per row over the student's and the teacher's
/// logits (and the backward's `[3, n]` f32 side input), writing every one of `len`
/// outputs.
fn run_rows<T: CudaDType + DeviceRepr>(
    name: &str,
    (ss, sl): Input,
    (ts, tl): Input,
    aux: Option<&CudaView<f32>>,
    (n, v): (usize, usize),
    len: usize,
) -> Result<CudaStorage> {
    let student = bf16_view("kl_divergence: student logits", ss, sl)?;
    let teacher = bf16_view("kl_divergence: teacher logits", ts, tl)?;
    let dev = ss.device().clone();
    // SAFETY: the kernel writes every element.
    let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>(len)? };
    let func = dev.get_or_load_custom_func(name, "kl_divergence", KL_DIVERGENCE_PTX)?;
    let (n_i, v_i) = (n as i32, v as i32);
    let mut b = func.builder();
    b.arg(&student).arg(&teacher);
    if let Some(aux) = aux {
        b.arg(aux);
    }
    b.arg(&mut out).arg(&n_i).arg(&v_i);
    if n > 0 {
        // SAFETY: a block per row, columns bounded by v; shapes checked by the op.
        unsafe { b.launch(super::grid_1d(n, THREADS)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `student` and `teacher` logits `[n, v]` bf16: returns `[3, n]` f32, each row's
/// `KL(teacher ‖ student)`, then the student's and the teacher's log-sum-exps.
pub fn kl_divergence(student: Input, teacher: Input, dims: (usize, usize)) -> Result<CudaStorage> {
    run_rows::<f32>(
        "kl_divergence_fwd_bf16",
        student,
        teacher,
        None,
        dims,
        3 * dims.0,
    )
}

/// The backward: the logits as [`kl_divergence`] and `aux [3, n]` f32 (the student's
/// lse, the teacher's lse, each row's gradient): returns `g · (q − p)` as `[n, v]` bf16.
pub fn kl_divergence_bwd(
    student: Input,
    teacher: Input,
    (xs, xl): Input,
    (n, v): (usize, usize),
) -> Result<CudaStorage> {
    let aux = typed_view::<f32>("kl_divergence: lse and gradient", xs, xl, DType::F32)?;
    run_rows::<bf16>(
        "kl_divergence_bwd_bf16",
        student,
        teacher,
        Some(&aux),
        (n, v),
        n * v,
    )
}
