//! What the sparse MLP ops return ([`MlpOutput`]), and the layout they take their up and
//! down weights in ([`up_down_matrix`]).
//!
//! The ops that produce an MLP output return one flat tensor of
//! [`mlp_result_len`]`(M, d)` elements: the `[M, d]` output rows, then each token's L1
//! term `Σ_j |h_j|` (a CustomOp has one output). Both come from the same pass, and both
//! carry gradients, so the L1 penalty costs no extra sweep; the output rows stay
//! contiguous, so a residual add or the next matmul reads them without a copy. A pass
//! that may be differentiated gives them as two graph nodes instead of two views (see
//! `twell_mlp`), so the backward pads nothing.
//! Weights for up and down travel as one neuron-major matrix `w_ud [f, 2d]` whose
//! row `j` is `[Wu_j | Wd_j]`: an active neuron's weights are one contiguous read.

use std::sync::Arc;

#[cfg(feature = "cuda")]
use candle_core::Storage;
use candle_core::{CpuStorage, DType, Result, Tensor};
use fused_ops::checks::matrix_dims;

use crate::error::{err, TwellError};
use crate::format::TwellPattern;

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
    pub(crate) fn split(
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
    pub(crate) fn views(joined: &Tensor, m: usize, d: usize) -> Result<(Tensor, Tensor)> {
        Ok((
            joined.narrow(0, 0, m * d)?.reshape((m, d))?,
            joined.narrow(0, m * d, m)?,
        ))
    }

    /// A pass's `out [M, d]` and `l1 [M]` with what it saw.
    pub(crate) fn new(
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
        fused_ops::checks::reshaped(&self.out, &dims)
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
    fused_ops::host::storage_from_f32(values, dtype)
}
