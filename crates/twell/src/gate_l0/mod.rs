//! `gate_l0`: the smooth count of positive gates behind [`crate::L1Term::GateL0`], as one
//! op with a backward.
//!
//! Per token `i`: `Σ_j φ(z_ij)`, `z_ij = relu(g_ij)·c / (‖x_i‖·‖Wg_j‖)`, `φ(z) = z / (z + ε)`.
//! As candle ops ([`gate_l0_reference`]) that is about twenty launches and as many f32
//! passes over `[tokens, d_ff]` per layer, forward and backward: a fifth of a fine-tuning
//! step. The op reads the gates once forward; its backward reads them twice (for the
//! gates' gradient, then for the norms' gradients, which are row and column sums).
//!
//! The backward, with `φ'(z) = ε / (z + ε)²` and `t_ij = φ'(z_ij)·z_ij` (0 where `g ≤ 0`):
//! `∂/∂g_ij = go_i·φ'(z_ij)·c / (‖x_i‖·‖Wg_j‖)`, `∂/∂‖x_i‖ = −go_i·Σ_j t_ij / ‖x_i‖`,
//! `∂/∂‖Wg_j‖ = −Σ_i go_i·t_ij / ‖Wg_j‖`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::error::{err, TwellError};
use fused_ops::host::{storage_from_f32, Rows};

#[cfg(feature = "cuda")]
mod cuda;

/// The forward: inputs `(gate [N, f] f32 or bf16, x_norm [N] f32, w_norm [f] f32)`, output
/// `[N]` f32, each token's count.
pub struct GateL0 {
    /// `c`, the factor that puts `z` of a random gate at unit spread (`√d`).
    pub scale: f32,
    /// `ε` of `φ`.
    pub eps: f32,
}

/// `(N, f)` of a call, checked.
fn dims(gate: &Layout, x_norm: &Layout, w_norm: &Layout) -> Result<(usize, usize)> {
    let (n, f) = gate.shape().dims2()?;
    if x_norm.dims() != [n] || w_norm.dims() != [f] {
        return err(TwellError::ShapeMismatch {
            what: "gate_l0",
            detail: format!(
                "gate {:?}, x_norm {:?}, w_norm {:?}: want [N, f], [N] and [f]",
                gate.dims(),
                x_norm.dims(),
                w_norm.dims()
            ),
        });
    }
    Ok((n, f))
}

/// An f32 input of a CPU call, contiguous.
fn f32_input<'a>(what: &'static str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        (CpuStorage::F32(_), None) => err(TwellError::Invalid(format!(
            "gate_l0: {what} must be contiguous"
        ))),
        _ => err(TwellError::Invalid(format!(
            "gate_l0: {what} must be f32, got {:?}",
            s.dtype()
        ))),
    }
}

/// The per-element quantities of the term, shared by the forward and both backward ops.
#[derive(Clone, Copy)]
struct Term {
    scale: f32,
    eps: f32,
}

impl Term {
    /// `z` of one gate, or `None` where the gate is not positive (nothing flows there).
    #[inline]
    fn z(self, g: f32, x_norm: f32, w_norm: f32) -> Option<f32> {
        (g > 0.0).then(|| g * self.scale / (x_norm * w_norm))
    }

    /// `φ'(z)`.
    #[inline]
    fn slope(self, z: f32) -> f32 {
        let s = z + self.eps;
        self.eps / (s * s)
    }
}

/// The inputs of a CPU call, the gate widened to f32.
struct CpuInputs<'a> {
    n: usize,
    f: usize,
    gate: Vec<f32>,
    x_norm: &'a [f32],
    w_norm: &'a [f32],
}

impl<'a> CpuInputs<'a> {
    fn read(
        (gs, gl): (&CpuStorage, &Layout),
        (xs, xl): (&'a CpuStorage, &Layout),
        (ws, wl): (&'a CpuStorage, &Layout),
    ) -> Result<Self> {
        let (n, f) = dims(gl, xl, wl)?;
        let gate = Rows::new("gate_l0: gate", gs, gl)?;
        Ok(Self {
            n,
            f,
            gate: gate.to_f32_vec(),
            x_norm: f32_input("x_norm", xs, xl)?,
            w_norm: f32_input("w_norm", ws, wl)?,
        })
    }
}

impl CustomOp3 for GateL0 {
    fn name(&self) -> &'static str {
        "gate-l0"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let inp = CpuInputs::read((gs, gl), (xs, xl), (ws, wl))?;
        let term = Term {
            scale: self.scale,
            eps: self.eps,
        };
        let out: Vec<f32> = inp
            .gate
            .par_chunks(inp.f.max(1))
            .take(inp.n)
            .zip(inp.x_norm.par_iter())
            .map(|(row, &xn)| {
                row.iter()
                    .zip(inp.w_norm)
                    .filter_map(|(&g, &wn)| term.z(g, xn, wn))
                    .map(|z| z / (z + term.eps))
                    .sum()
            })
            .collect();
        Ok((CpuStorage::F32(out), Shape::from(inp.n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, f) = dims(gl, xl, wl)?;
        let out = cuda::gate_l0((gs, gl), (xs, xl), (ws, wl), (n, f), (self.scale, self.eps))?;
        Ok((out, Shape::from(n)))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        x_norm: &Tensor,
        w_norm: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = x_norm.dim(0)?;
        let f = w_norm.dim(0)?;
        // The backward ops take both norms as one [N + f] input (a CustomOp has three).
        let norms = Tensor::cat(&[x_norm, w_norm], 0)?;
        let go = grad_res.to_dtype(DType::F32)?.contiguous()?;
        let grad = |of| GateL0Grad {
            term: self.term(),
            of,
        };
        let grad_gate = gate.apply_op3_no_bwd(&norms, &go, &grad(GradOf::Gate))?;
        let sums = gate.apply_op3_no_bwd(&norms, &go, &grad(GradOf::Norms))?;
        Ok((
            Some(grad_gate),
            Some(sums.narrow(0, 0, n)?),
            Some(sums.narrow(0, n, f)?),
        ))
    }
}

impl GateL0 {
    fn term(&self) -> Term {
        Term {
            scale: self.scale,
            eps: self.eps,
        }
    }
}

/// The inputs of a backward op on the CPU: the gate (widened to f32), both norms, the
/// output's gradient.
struct BackwardInputs<'a> {
    n: usize,
    f: usize,
    gate: Vec<f32>,
    dtype: DType,
    x_norm: &'a [f32],
    w_norm: &'a [f32],
    go: &'a [f32],
}

impl<'a> BackwardInputs<'a> {
    fn read(
        (gs, gl): (&CpuStorage, &Layout),
        (ns, nl): (&'a CpuStorage, &Layout),
        (os, ol): (&'a CpuStorage, &Layout),
    ) -> Result<Self> {
        let (n, f) = gl.shape().dims2()?;
        let norms = f32_input("norms", ns, nl)?;
        let go = f32_input("output gradient", os, ol)?;
        if norms.len() != n + f || go.len() != n {
            return err(TwellError::ShapeMismatch {
                what: "gate_l0 backward",
                detail: format!(
                    "gate [{n}, {f}], norms {:?}, output gradient {:?}",
                    nl.dims(),
                    ol.dims()
                ),
            });
        }
        let gate = Rows::new("gate_l0: gate", gs, gl)?;
        let (x_norm, w_norm) = norms.split_at(n);
        Ok(Self {
            n,
            f,
            dtype: gate.dtype(),
            gate: gate.to_f32_vec(),
            x_norm,
            w_norm,
            go,
        })
    }
}

/// Which gradient a backward op returns.
#[derive(Clone, Copy)]
enum GradOf {
    /// `∂/∂g`, shaped and typed like the gate.
    Gate,
    /// `[∂/∂x_norm | ∂/∂w_norm]`, `[N + f]` f32.
    Norms,
}

/// A backward op of the term: inputs `(gate, [x_norm | w_norm], go [N])`. The two
/// gradients are two ops because each is one pass of its own over the gates.
struct GateL0Grad {
    term: Term,
    of: GradOf,
}

impl GateL0Grad {
    /// `∂/∂g` on the CPU.
    fn gate_cpu(&self, inp: BackwardInputs) -> Result<(CpuStorage, Shape)> {
        let BackwardInputs {
            n,
            f,
            gate,
            dtype,
            x_norm,
            w_norm,
            go,
        } = inp;
        let term = self.term;
        let mut out = vec![0f32; n * f];
        out.par_chunks_mut(f.max(1))
            .zip(gate.par_chunks(f.max(1)))
            .enumerate()
            .for_each(|(i, (o, row))| {
                for ((oj, &g), &wn) in o.iter_mut().zip(row).zip(w_norm) {
                    if let Some(z) = term.z(g, x_norm[i], wn) {
                        *oj = go[i] * term.slope(z) * term.scale / (x_norm[i] * wn);
                    }
                }
            });
        Ok((storage_from_f32(out, dtype)?, Shape::from((n, f))))
    }

    /// The norms' gradients on the CPU.
    fn norms_cpu(&self, inp: BackwardInputs) -> Result<(CpuStorage, Shape)> {
        let BackwardInputs {
            n,
            f,
            gate,
            x_norm,
            w_norm,
            go,
            ..
        } = inp;
        let term = self.term;
        // t_ij = φ'(z)·z per row; the rows' sums weighted by go_i give the columns'.
        let rows: Vec<Vec<f32>> = gate
            .par_chunks(f.max(1))
            .take(n)
            .enumerate()
            .map(|(i, row)| {
                row.iter()
                    .zip(w_norm)
                    .map(|(&g, &wn)| term.z(g, x_norm[i], wn).map_or(0.0, |z| term.slope(z) * z))
                    .collect()
            })
            .collect();
        let mut out = vec![0f32; n + f];
        for (i, t) in rows.iter().enumerate() {
            out[i] = -go[i] * t.iter().sum::<f32>() / x_norm[i];
            for (acc, &tj) in out[n..].iter_mut().zip(t) {
                *acc += go[i] * tj;
            }
        }
        for (acc, &wn) in out[n..].iter_mut().zip(w_norm) {
            *acc = -*acc / wn;
        }
        Ok((CpuStorage::F32(out), Shape::from(n + f)))
    }
}

impl CustomOp3 for GateL0Grad {
    fn name(&self) -> &'static str {
        match self.of {
            GradOf::Gate => "gate-l0-grad-gate",
            GradOf::Norms => "gate-l0-grad-norms",
        }
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        ns: &CpuStorage,
        nl: &Layout,
        os: &CpuStorage,
        ol: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let inp = BackwardInputs::read((gs, gl), (ns, nl), (os, ol))?;
        match self.of {
            GradOf::Gate => self.gate_cpu(inp),
            GradOf::Norms => self.norms_cpu(inp),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        ns: &candle_core::CudaStorage,
        nl: &Layout,
        os: &candle_core::CudaStorage,
        ol: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, f) = gl.shape().dims2()?;
        let consts = (self.term.scale, self.term.eps);
        let (g, nm, o) = ((gs, gl), (ns, nl), (os, ol));
        Ok(match self.of {
            GradOf::Gate => {
                let out = cuda::gate_l0_grad_gate(g, nm, o, (n, f), consts)?;
                (out, Shape::from((n, f)))
            }
            GradOf::Norms => {
                let out = cuda::gate_l0_grad_norms(g, nm, o, (n, f), consts)?;
                (out, Shape::from(n + f))
            }
        })
    }
}

/// Each token's smooth count of positive gates, `[N]` f32, differentiable in `gate [N, f]`,
/// `x_norm [N]` and `w_norm [f]` (f32 norms of the tokens and of the gate rows): `scale`
/// is `c` (`√d`), `eps` is `ε`. One op on the CPU and, for bf16 gates, on CUDA; CUDA in
/// other dtypes takes [`gate_l0_reference`].
pub fn gate_l0(
    gate: &Tensor,
    x_norm: &Tensor,
    w_norm: &Tensor,
    scale: f64,
    eps: f64,
) -> Result<Tensor> {
    dims(gate.layout(), x_norm.layout(), w_norm.layout())?;
    if x_norm.dtype() != DType::F32 || w_norm.dtype() != DType::F32 {
        return err(TwellError::Invalid(format!(
            "gate_l0: the norms must be f32, got {:?} and {:?}",
            x_norm.dtype(),
            w_norm.dtype()
        )));
    }
    if !(scale > 0.0 && eps > 0.0) {
        return err(TwellError::Invalid(format!(
            "gate_l0: scale and eps must be positive, got {scale} and {eps}"
        )));
    }
    if gate.device().is_cuda() && gate.dtype() != DType::BF16 {
        return gate_l0_reference(gate, x_norm, w_norm, scale, eps);
    }
    gate.contiguous()?.apply_op3(
        &x_norm.contiguous()?,
        &w_norm.contiguous()?,
        GateL0 {
            scale: scale as f32,
            eps: eps as f32,
        },
    )
}

/// The same count as candle ops in f32: what [`gate_l0`] is checked against.
pub fn gate_l0_reference(
    gate: &Tensor,
    x_norm: &Tensor,
    w_norm: &Tensor,
    scale: f64,
    eps: f64,
) -> Result<Tensor> {
    let outer = (x_norm.unsqueeze(1)?.broadcast_mul(&w_norm.unsqueeze(0)?)? / scale)?;
    let z = gate.to_dtype(DType::F32)?.relu()?.broadcast_div(&outer)?;
    (&z / (&z + eps)?)?.sum(D::Minus1)
}
