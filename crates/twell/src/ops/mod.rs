//! Candle CustomOps over TwELL, each with a backward pass.
//!
//! * [`gate_pack`]: `relu(x · Wgᵀ)` packed to TwELL (the D2T step);
//! * [`gated_t2d`]: the sparse up and down projections of a packed gate;
//! * [`twell_mlp`]: both fused, the whole ReGLU MLP, and [`twell_mlp_products`], the same
//!   MLP for inference at higher densities (cuBLAS GEMMs around one element-wise kernel);
//! * [`causal_attention_rows`] (and [`causal_attention`] on `[b, heads, t, hd]` views):
//!   fused causal attention for the model around the MLP, and
//!   [`attention_softmax_grad`], the row-wise middle of its backward;
//! * [`add_rms_norm`]: the residual add and the RMS norm after it, for the same model
//!   (in training the add and [`RmsNorm`]);
//! * [`rope`]: rotary position embedding of its queries and keys;
//! * [`cross_entropy`]: the language-model loss over its logits, and [`embedding`] the
//!   token embedding at its input (a one-pass backward);
//! * [`kl_divergence`]: the distillation loss between a teacher's and a student's logits;
//! * [`gate_l0`]: the smooth count of positive gates that fine-tuning can penalise
//!   ([`crate::L1Term::GateL0`]), and [`relu_grad_window`], a ReLU whose gradient also
//!   reaches the gates just below zero;
//! * [`adamw_step`] and [`adamw_step_mixed`]: the optimizer's update of one parameter, in
//!   place (f32, or a bf16 variable on an f32 master), and [`sum_squares`] for the
//!   gradient norm.
//!
//! The ops that produce an MLP output return one flat tensor of
//! [`mlp_result_len`]`(M, d)` elements: the `[M, d]` output rows, then each token's L1
//! term `Σ_j |h_j|` (a CustomOp has one output). Both come from the same pass, and both
//! carry gradients, so the L1 penalty costs no extra sweep; the output rows stay
//! contiguous, so a residual add or the next matmul reads them without a copy. A pass
//! that may be differentiated gives them as two graph nodes instead of two views (see
//! `twell_mlp.rs`), so the backward pads nothing.
//! Weights for up and down travel as one neuron-major matrix `w_ud [f, 2d]` whose
//! row `j` is `[Wu_j | Wd_j]`: an active neuron's weights are one contiguous read.

mod adamw;
mod add_rms_norm;
mod attention_softmax_grad;
mod causal_attention;
mod cross_entropy;
mod embedding;
mod gate_l0;
mod gate_pack;
mod gated_t2d;
mod kl_divergence;
mod relu_grad_window;
mod residual_linear;
mod rope;
mod twell_mlp;
mod twell_mlp_products;

pub use adamw::{adamw_step, adamw_step_mixed, sum_squares, AdamwStep};
pub use add_rms_norm::{add_rms_norm, rms_norm, AddRmsNorm, RmsNorm};
pub use attention_softmax_grad::{attention_row_dot, attention_softmax_grad, AttentionSoftmaxGrad};
pub use causal_attention::{
    causal_attention, causal_attention_reference, causal_attention_rows,
    causal_attention_rows_turning_q, causal_attention_step, fused_on_device,
    kernel_name as causal_attention_kernel_name, step_on_device, CausalAttention,
    CausalAttentionStep, CUDA_DECODE_MAX_KEYS, CUDA_HEAD_DIMS,
};
pub use cross_entropy::{cross_entropy, CrossEntropy};
pub use embedding::{embedding, Embedding};
pub use gate_l0::{gate_l0, gate_l0_reference, GateL0};
pub use gate_pack::{gate_pack, GatePack};
pub use gated_t2d::{gated_t2d, GatedT2d};
pub use kl_divergence::{
    kl_divergence, kl_divergence_fused, kl_divergence_reference, KlDivergence,
};
pub(crate) use relu_grad_window::check_window as check_relu_grad_window;
pub use relu_grad_window::{relu_grad_window, ReluGradWindow};
pub use residual_linear::residual_add_linear;
pub use rope::{
    prefill_rope, rope, rope_keys_in_place, rope_qkv, rope_qkv_part, PrefillRope, QkvPart, Rope,
    RopeQkv, RopeTable,
};
pub use twell_mlp::{
    add_norm_fuses, gate_screen, norm_add_norm_runs, pre_norm_folds, twell_mlp, twell_mlp_add_norm,
    twell_mlp_norm_add_norm, twell_mlp_screened, twell_mlp_with_backward_path, BackwardPath,
    TwellMlp,
};
pub use twell_mlp_products::{products_run, twell_mlp_products};

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Device, Layout, Result, Storage, Tensor};

use crate::cpu::float::{is_value_dtype, Rows};
use crate::error::{err, TwellError};
use crate::format::TwellPattern;

/// `x` with shape `dims`: `x` itself when it has them already. A reshape is a node of
/// candle's autograd graph even when nothing changes, and the backward pays every node
/// a zeros tensor and an add over its size (a 33 MB pass per `[8192, 2048]` bf16 node).
pub fn reshaped(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    if x.dims() == dims {
        return Ok(x.clone());
    }
    x.reshape(dims)
}

/// Elements of a sparse MLP op's result for `m` tokens of `d` outputs: the `[m, d]`
/// output rows, then the `m` L1 terms.
pub fn mlp_result_len(m: usize, d: usize) -> usize {
    m * (d + 1)
}

/// The output of a sparse MLP op.
#[derive(Clone, Debug)]
pub struct MlpOutput {
    /// `[M, d]`.
    pub out: Tensor,
    /// `[M]`: `Σ_j |h_j|` of each token, differentiable.
    pub l1: Tensor,
    /// Where the gate was active (host ops): per-token L0, density and overflow.
    pub pattern: Option<Arc<TwellPattern>>,
    /// The gate values in the pattern's value layout (f32, host), where the op kept
    /// them anyway: needed to see which neurons fired inside overflow tiles.
    pub gate_values: Option<Arc<Vec<f32>>>,
    /// `[M, n_tiles]` u32 nonzero counts (device ops), read back only when asked.
    pub counts: Option<Tensor>,
    /// The TwELL configuration the op ran with.
    pub config: crate::format::TwellConfig,
    /// Neurons (d_ff).
    pub ffn: usize,
}

impl MlpOutput {
    /// The same result with `out` and `l1` cut from the autograd graph.
    pub fn detach(&self) -> Self {
        Self {
            out: self.out.detach(),
            l1: self.l1.detach(),
            ..self.clone()
        }
    }

    /// Views of an op's flat result `[mlp_result_len(m, d)]`.
    fn split(
        joined: Tensor,
        (m, d): (usize, usize),
        activity: Activity,
        config: crate::format::TwellConfig,
        ffn: usize,
    ) -> Result<Self> {
        let (out, l1) = Self::views(&joined, m, d)?;
        Self::new(out, l1, activity, config, ffn)
    }

    /// The `[m, d]` output rows and the `m` L1 terms of a flat result, as views.
    fn views(joined: &Tensor, m: usize, d: usize) -> Result<(Tensor, Tensor)> {
        Ok((
            joined.narrow(0, 0, m * d)?.reshape((m, d))?,
            joined.narrow(0, m * d, m)?,
        ))
    }

    /// A pass's `out [M, d]` and `l1 [M]` with what it saw.
    fn new(
        out: Tensor,
        l1: Tensor,
        activity: Activity,
        config: crate::format::TwellConfig,
        ffn: usize,
    ) -> Result<Self> {
        let (pattern, gate_values, counts) = match activity {
            Activity::Host { pattern, gate } => (Some(pattern), gate, None),
            Activity::Device { counts } => (None, None, Some(counts)),
        };
        Ok(Self {
            out,
            l1,
            pattern,
            gate_values,
            counts,
            config,
            ffn,
        })
    }

    /// `out` as `[lead.., d]` (the rows of `lead` multiplied out), a view.
    pub fn out_with_lead(&self, lead: &[usize]) -> Result<Tensor> {
        let mut dims = lead.to_vec();
        dims.push(self.out.dim(1)?);
        reshaped(&self.out, &dims)
    }

    /// The per-(token, tile) nonzero counts, on the host.
    pub fn host_counts(&self) -> Result<Vec<u32>> {
        match (&self.pattern, &self.counts) {
            (Some(p), _) => Ok(p.counts().iter().map(|&c| c as u32).collect()),
            (None, Some(c)) => c.flatten_all()?.to_vec1::<u32>(),
            (None, None) => candle_core::bail!("MlpOutput has no activity record"),
        }
    }

    /// Nonzeros of `h` over all tokens (a sync on GPU). Device counts are added on the
    /// device (in f64: exact) and read back as one number, not `M · n_tiles` of them.
    pub fn nnz(&self) -> Result<usize> {
        if let (None, Some(c)) = (&self.pattern, &self.counts) {
            let total = c
                .to_dtype(candle_core::DType::F64)?
                .sum_all()?
                .to_scalar::<f64>()?;
            return Ok(total as usize);
        }
        Ok(self.host_counts()?.iter().map(|&c| c as usize).sum())
    }

    /// `nnz / (M · f)`.
    pub fn density(&self) -> Result<f64> {
        let m = self.out.dim(0)?;
        Ok(self.nnz()? as f64 / (m * self.ffn).max(1) as f64)
    }

    /// `(overflowing tiles, tokens with an overflowing tile)`.
    pub fn overflow(&self) -> Result<(usize, usize)> {
        let counts = self.host_counts()?;
        let n_tiles = self.config.n_tiles(self.ffn).max(1);
        let cap = self.config.capacity() as u32;
        let tiles = counts.iter().filter(|&&c| c > cap).count();
        let rows = counts
            .chunks(n_tiles)
            .filter(|r| r.iter().any(|&c| c > cap))
            .count();
        Ok((tiles, rows))
    }

    /// How many tokens activated each neuron (`[f]`); `None` after a device op, which
    /// keeps counts per tile only.
    pub fn fired_per_neuron(&self) -> Option<Vec<u32>> {
        let p = self.pattern.as_ref()?;
        let mut fired = vec![0u32; p.cols()];
        match &self.gate_values {
            Some(values) => {
                for r in 0..p.rows() {
                    p.for_each_in_row(r, values, |e| fired[e.col] += 1);
                }
            }
            None => {
                // Without values, overflow tiles cannot be read: count the slots only.
                let (n_tiles, cap, tile) = (p.n_tiles(), p.config().capacity(), p.config().tile());
                for r in 0..p.rows() {
                    for t in 0..n_tiles {
                        let c = p.counts()[r * n_tiles + t] as usize;
                        if c <= cap {
                            let base = (r * n_tiles + t) * cap;
                            for s in 0..c {
                                fired[t * tile + p.indices()[base + s] as usize] += 1;
                            }
                        }
                    }
                }
            }
        }
        Some(fired)
    }
}

/// Builds the neuron-major up/down matrix `[f, 2d]` from HF-layout weights
/// `up [f, d]` and `down [d, f]`. Differentiable, so it can be rebuilt from trained
/// variables at every step; inference builds it once.
pub fn up_down_matrix(up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let (f, d) = matrix_dims("up_proj", up)?;
    let (d2, f2) = matrix_dims("down_proj", down)?;
    if (d2, f2) != (d, f) {
        return err(TwellError::ShapeMismatch {
            what: "up_down_matrix",
            detail: format!(
                "up_proj is [{f}, {d}] so down_proj must be [{d}, {f}], got [{d2}, {f2}]"
            ),
        });
    }
    Tensor::cat(&[up, &down.t()?], 1)?.contiguous()
}

/// A device op's per-(token, tile) counts `[m, n_tiles]` as a tensor outside the graph.
#[cfg(feature = "cuda")]
pub(crate) fn device_counts(
    counts: candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
    dev: candle_core::CudaDevice,
    (m, n_tiles): (usize, usize),
) -> Tensor {
    Tensor::from_storage(
        Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(counts, dev)),
        (m, n_tiles),
        candle_core::op::BackpropOp::none(),
        false,
    )
}

/// `(rows, cols)` of a rank-2 tensor with a TwELL value dtype and no empty dimension.
/// Where an op recorded which neurons fired.
pub(crate) enum Activity {
    Host {
        pattern: Arc<TwellPattern>,
        gate: Option<Arc<Vec<f32>>>,
    },
    Device {
        counts: Tensor,
    },
}

pub(crate) fn matrix_dims(what: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    let (r, c) = match t.dims() {
        &[r, c] => (r, c),
        d => {
            return err(TwellError::BadRank {
                what,
                expected: 2,
                got: d.to_vec(),
            })
        }
    };
    if !is_value_dtype(t.dtype()) {
        return err(TwellError::BadDtype {
            what,
            dtype: t.dtype(),
        });
    }
    if r == 0 || c == 0 {
        return err(TwellError::Empty {
            what,
            shape: vec![r, c],
        });
    }
    Ok((r, c))
}

pub(crate) fn same_dtype_and_device(what: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return err(TwellError::DtypeMismatch {
            what,
            a: a.dtype(),
            b: b.dtype(),
        });
    }
    if !a.device().same_device(b.device()) {
        return err(TwellError::DeviceMismatch { what });
    }
    Ok(())
}

pub(crate) fn shape_err<T>(what: &'static str, detail: String) -> Result<T> {
    err(TwellError::ShapeMismatch { what, detail })
}

/// Wraps an f32 result as a tensor of `dtype` on `device`.
pub(crate) fn tensor_from_f32(
    values: Vec<f32>,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    Tensor::from_vec(values, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// A tensor's data on the host, ready to be borrowed as [`Rows`]: the tensor itself
/// when it is a contiguous CPU tensor, else a contiguous CPU copy.
pub(crate) fn host(t: &Tensor) -> Result<Tensor> {
    t.to_device(&Device::Cpu)?.contiguous()
}

/// Runs `f` on the rows of a contiguous CPU tensor.
pub(crate) fn with_rows<R>(
    what: &'static str,
    t: &Tensor,
    f: impl FnOnce(Rows<'_>) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(Rows::new(what, cpu, layout)?),
        _ => err(TwellError::Invalid(format!(
            "{what}: expected a host tensor"
        ))),
    }
}

/// An f32 vector from a tensor of any float dtype, on the host.
pub(crate) fn f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
}

/// Dispatches a generic kernel on the dtype of a CPU value storage.
macro_rules! with_values {
    ($storage:expr, $layout:expr, |$v:ident| $body:expr) => {{
        let (start, end) = match $layout.contiguous_offsets() {
            Some(o) => o,
            None => candle_core::bail!("TwELL values must be contiguous"),
        };
        match $storage {
            candle_core::CpuStorage::F32(all) => {
                let $v = &all[start..end];
                $body
            }
            candle_core::CpuStorage::BF16(all) => {
                let $v = &all[start..end];
                $body
            }
            candle_core::CpuStorage::F16(all) => {
                let $v = &all[start..end];
                $body
            }
            other => candle_core::bail!(
                "TwELL values: unsupported dtype {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    }};
}
pub(crate) use with_values;

/// Narrows an f32 result to the storage of `dtype`.
pub(crate) fn cpu_storage(values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    crate::cpu::float::storage_from_f32(values, dtype)
}

/// The layout check shared by the `cpu_fwd`s: contiguous, rank 2.
pub(crate) fn contiguous_2d(what: &'static str, layout: &Layout) -> Result<(usize, usize)> {
    if layout.contiguous_offsets().is_none() {
        return err(TwellError::Invalid(format!(
            "{what}: input must be contiguous"
        )));
    }
    match layout.dims() {
        &[r, c] => Ok((r, c)),
        d => err(TwellError::BadRank {
            what,
            expected: 2,
            got: d.to_vec(),
        }),
    }
}
