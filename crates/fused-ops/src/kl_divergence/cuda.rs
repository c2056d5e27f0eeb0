//! Launchers of `kernels/src/kl_divergence.cu`: per-row KL divergence of a teacher's and a
//! student's logits, and its backward.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};
use half::bf16;

use crate::cuda::{bf16_view, typed_view};

const KL_DIVERGENCE_PTX: &str = twell_kernels::KL_DIVERGENCE;

/// Threads per row (`KL_THREADS` in the .cu).
const THREADS: u32 = 256;

type Input<'a> = (&'a CudaStorage, &'a Layout);

/// The teacher's logits as the kernels read them: bf16 like the student, or f32.
enum Teacher<'a> {
    Bf16(CudaView<'a, bf16>),
    F32(CudaView<'a, f32>),
}

impl<'a> Teacher<'a> {
    fn view((ts, tl): Input<'a>) -> Result<Self> {
        const WHAT: &str = "kl_divergence: teacher logits";
        match ts.dtype() {
            DType::F32 => Ok(Self::F32(typed_view(WHAT, ts, tl, DType::F32)?)),
            _ => Ok(Self::Bf16(bf16_view(WHAT, ts, tl)?)),
        }
    }

    /// The kernel's name suffix for this teacher (see the entry points in the .cu).
    fn suffix(&self) -> &'static str {
        match self {
            Self::Bf16(_) => "",
            Self::F32(_) => "_f32",
        }
    }
}

/// Launches kernel `name` (plus the teacher's dtype suffix) with a block per row over
/// the student's and the teacher's logits (and the backward's `[3, n]` f32 side input),
/// writing every one of `len` outputs.
fn run_rows<T: CudaDType + DeviceRepr>(
    name: &str,
    (ss, sl): Input,
    teacher: Input,
    aux: Option<&CudaView<f32>>,
    (n, v): (usize, usize),
    len: usize,
) -> Result<CudaStorage> {
    let student = bf16_view("kl_divergence: student logits", ss, sl)?;
    let teacher = Teacher::view(teacher)?;
    let dev = ss.device().clone();
    // SAFETY: the kernel writes every element.
    let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>(len)? };
    let name = format!("{name}{}", teacher.suffix());
    let func = dev.get_or_load_custom_func(&name, "kl_divergence", KL_DIVERGENCE_PTX)?;
    let (n_i, v_i) = (n as i32, v as i32);
    let mut b = func.builder();
    b.arg(&student);
    match &teacher {
        Teacher::Bf16(t) => b.arg(t),
        Teacher::F32(t) => b.arg(t),
    };
    if let Some(aux) = aux {
        b.arg(aux);
    }
    b.arg(&mut out).arg(&n_i).arg(&v_i);
    if n > 0 {
        // SAFETY: a block per row, columns bounded by v; shapes checked by the op.
        unsafe { b.launch(crate::cuda::grid_1d(n, THREADS)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `student` logits `[n, v]` bf16 and `teacher` logits bf16 or f32: returns `[3, n]`
/// f32, each row's `KL(teacher ‖ student)`, then the student's and the teacher's
/// log-sum-exps.
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
