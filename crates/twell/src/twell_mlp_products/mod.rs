//! `twell_mlp_products`: the ReGLU MLP for inference at densities where the per-pair
//! kernels of [`crate::twell_mlp`] lose to tensor cores.
//!
//! At uniform density p a tile of T tokens needs `1 - (1 - p)^T` of the neurons (86%
//! of them at p = 3% and T = 64), so a tensor-core kernel can skip little, while the
//! per-pair dot products cost about three times a dense projection's work per active
//! pair (docs/design.md). On a GPU this op therefore computes the three
//! projections as cuBLAS GEMMs and `relu(g) ⊙ u` in one element-wise kernel that also
//! counts each tile's positive gates (`kernels/src/twell_mlp_products.cu`): the same result
//! and statistics as [`crate::twell_mlp`], in one pass over `[M, d_ff]` where candle's
//! dense MLP makes three (ReLU, product and their temporaries). On the host it is
//! [`crate::twell_mlp`], whose sparse kernels are the fast path there.
//!
//! No backward: training takes [`crate::twell_mlp`] or the dense path.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use crate::error::{err, TwellError};
use crate::format::TwellConfig;
use crate::output::{Activity, MlpOutput};
use crate::twell_mlp::mlp_dims;

#[cfg(feature = "cuda")]
mod cuda;

/// The op behind [`twell_mlp_products`] on a GPU: inputs `(x, gate_proj, w_ud)`, output
/// `[mlp_result_len(M, d)]`; the per-(token, tile) counts are left in `counts`.
struct TwellMlpProducts {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    config: TwellConfig,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    counts: Arc<Mutex<Option<Tensor>>>,
}

impl CustomOp3 for TwellMlpProducts {
    fn name(&self) -> &'static str {
        "twell-mlp-products"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        // `twell_mlp_products` hands host tensors to `twell_mlp` before this op.
        err(TwellError::Invalid(
            "twell-mlp-products runs on CUDA; on the host call twell_mlp".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (storage, shape, counts) =
            cuda::twell_mlp_products(xs, xl, gs, gl, ws, wl, self.config)?;
        let (m, n_tiles) = (xl.dims()[0], self.config.n_tiles(gl.dims()[0]));
        let counts = crate::output::device_counts(counts, xs.device.clone(), (m, n_tiles));
        *self.counts.lock().expect("counts lock") = Some(counts);
        Ok((storage, shape))
    }
}

/// Whether [`twell_mlp_products`] runs its own GPU path for `x [M, d]` through `f`
/// neurons: CUDA, bf16, hidden and d_ff multiples of 8.
pub fn products_run(x: &Tensor, f: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        if let (true, candle_core::DType::BF16, &[m, d]) =
            (x.device().is_cuda(), x.dtype(), x.dims())
        {
            return cuda::products_take(m, d, f);
        }
    }
    let _ = (x, f);
    false
}

/// The ReGLU MLP `down(relu(gate(x)) ⊙ up(x))` of `x [M, d]`, `gate_proj [f, d]` and
/// `w_ud [f, 2d]` ([`super::up_down_matrix`]) with each token's L1 term and the
/// per-(token, tile) counts of active neurons, as [`crate::twell_mlp`] returns them.
/// For inference: an input that tracks gradients is an error. Where
/// [`products_run`] says no, this is [`crate::twell_mlp`].
pub fn twell_mlp_products(
    x: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    config: TwellConfig,
) -> Result<MlpOutput> {
    let (m, d, f) = mlp_dims("twell_mlp_products", x, gate_proj, w_ud, config)?;
    if [x, gate_proj, w_ud].iter().any(|t| t.track_op()) {
        return err(TwellError::Invalid(
            "twell_mlp_products has no backward: train through twell_mlp or the dense MLP".into(),
        ));
    }
    if !products_run(x, f) {
        return crate::twell_mlp(x, gate_proj, w_ud, config);
    }
    let counts = Arc::new(Mutex::new(None));
    let op = TwellMlpProducts {
        config,
        counts: counts.clone(),
    };
    let (x, gate_proj, w_ud) = (x.contiguous()?, gate_proj.contiguous()?, w_ud.contiguous()?);
    let joined = x.apply_op3(&gate_proj, &w_ud, op)?;
    let Some(counts) = counts.lock().expect("counts lock").take() else {
        candle_core::bail!("twell-mlp-products: the forward left no counts");
    };
    MlpOutput::split(joined, (m, d), Activity::Device { counts }, config, f)
}
