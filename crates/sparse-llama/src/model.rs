//! The Llama architecture with a swappable feed-forward, written to read top to bottom.
//!
//! Public API shaped like candle-transformers' `models::llama` (`Config`, `Cache`,
//! `Llama::load(vb, &cfg)`, `forward(x, index_pos, &mut cache)`), so a program switches
//! by changing its import. On top of that:
//!
//! * each layer's MLP is a [`twell::SparseMlp`]: dense SwiGLU, dense ReGLU or TwELL;
//! * [`Llama::forward_all`] returns logits at every position (perplexity);
//! * [`Llama::forward_train`] is differentiable end to end: candle's fused rms-norm,
//!   softmax and rope have no backward pass, so training uses their plain-op forms,
//!   except on CUDA, where our attention, RoPE and residual add + norm ops have one;
//! * [`Llama::ffn_stats`] reports each layer's activation density after a forward.

use std::collections::HashMap;
use std::sync::Arc;

use crate::adapter::LoraAdapter;
use crate::tensor_parallel::{rank_share, Ranks};
use candle_core::{DType, Device, IndexOp, Module, Result, Tensor, D};
use candle_nn::{embedding, linear_b, Embedding, Linear, RmsNorm, VarBuilder};
use fused_ops::RopeTable;
use twell::cpu::low_rank::{AdaptedRows, LowRankStack};
use twell::cpu::quant::{QuantFormat, QuantRows};
use twell::{FfnMode, MlpBias, MlpStats, SparseMlp};

pub use crate::config::{Config, LlamaConfig, LlamaEosToks};

/// Key/value cache and causal masks for incremental decoding.
#[derive(Debug, Clone)]
pub struct Cache {
    masks: HashMap<(usize, usize), Tensor>,
    pub use_kv_cache: bool,
    /// Per layer, keys and values side by side, `[b, T, 2 · kv_heads · hd]`.
    kvs: Vec<Option<LayerKv>>,
    rope: RopeTable,
    device: Device,
}

/// Positions a layer's KV buffer grows by.
const KV_CHUNK: usize = 256;

/// One layer's cached keys and values: a `[b, capacity, 2 · kv_heads · hd]` buffer (each
/// position's keys, then its values) holding `len` positions. A step writes its new rows
/// in place, and the buffer grows by whole chunks of [`KV_CHUNK`] positions (copying
/// what it holds once a chunk); the first rows (a prompt) are kept as given until a
/// second append needs room. Joining the cache with each step's rows (`Tensor::cat`)
/// copied all of it for every token, quadratic in the generated length (at batch 16 and
/// 512 positions of the 2B shape, 2 GB a step), in two launches per tensor.
///
/// A clone shares the buffer, so it is marked `shared` and copies into a buffer of its own
/// before its first write; the original writes only past the positions the clone holds.
/// A cloned [`Cache`] (a shared prompt prefix, a branch of a sequence) then never sees
/// another's rows.
#[derive(Debug)]
struct LayerKv {
    kv: Tensor,
    len: usize,
    shared: bool,
}

impl Clone for LayerKv {
    fn clone(&self) -> Self {
        Self {
            kv: self.kv.clone(),
            len: self.len,
            shared: true,
        }
    }
}

impl LayerKv {
    /// Appends `kv [b, t, width]` to the layer's cache (started when `slot` is empty)
    /// and returns the cached `[b, len, width]` (a view of the buffer: with several
    /// sequences, each one's rows are contiguous, the batch stride the buffer's).
    fn append(slot: &mut Option<LayerKv>, kv: &Tensor) -> Result<Tensor> {
        let (b, t, width) = kv.dims3()?;
        let Some(c) = slot.as_ref() else {
            // A prefill that is not followed by decoding copies nothing it need not; the
            // first decode step moves these rows into a chunked buffer.
            let kv = kv.contiguous()?;
            *slot = Some(LayerKv {
                kv: kv.clone(),
                len: t,
                shared: false,
            });
            return Ok(kv);
        };
        let (cb, _, cw) = c.kv.dims3()?;
        if (cb, cw) != (b, width) {
            candle_core::bail!(
                "the KV cache holds batch {cb} of width {cw}, got batch {b} of width {width}: \
                 reset the cache for a new batch"
            );
        }
        let c = slot.as_mut().expect("checked above");
        let len = c.len;
        c.reserve(t)?;
        c.kv.slice_set(&kv.contiguous()?, 1, len)?;
        c.len += t;
        c.kv.narrow(1, 0, c.len)
    }

    /// Makes room for `t` more positions: a buffer of whole chunks, what the cache holds
    /// copied over (always, for a buffer shared with a clone).
    fn reserve(&mut self, t: usize) -> Result<()> {
        let (b, capacity, width) = self.kv.dims3()?;
        let needed = self.len + t;
        if needed > capacity || self.shared {
            let grown = needed.div_ceil(KV_CHUNK) * KV_CHUNK;
            let buffer = Tensor::zeros((b, grown, width), self.kv.dtype(), self.kv.device())?;
            buffer.slice_set(&self.kv.narrow(1, 0, self.len)?, 1, 0)?;
            self.kv = buffer;
            self.shared = false;
        }
        Ok(())
    }
}

/// RoPE tables `cos, sin [positions, head_dim / 2]` (rotate-half convention, as HF).
fn rope_tables(
    cfg: &Config,
    positions: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let head_dim = cfg.head_dim();
    let mut inv_freq: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / head_dim as f32))
        .collect();
    if let Some(scaling) = &cfg.rope_scaling {
        scaling.scale_inv_freq(&mut inv_freq);
    }
    let n = inv_freq.len();
    let inv_freq = Tensor::from_vec(inv_freq, (1, n), device)?;
    let t = Tensor::arange(0u32, positions as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((positions, 1))?;
    let freqs = t.matmul(&inv_freq)?;
    Ok((freqs.cos()?.to_dtype(dtype)?, freqs.sin()?.to_dtype(dtype)?))
}

/// `-inf` above the diagonal: query `i` (at absolute position `index_pos + i`) sees
/// keys `0..=index_pos + i`. Shape `[seq_len, index_pos + seq_len]`, f32.
fn causal_mask(seq_len: usize, index_pos: usize, device: &Device) -> Result<Tensor> {
    let kv_len = index_pos + seq_len;
    let mask: Vec<f32> = (0..seq_len)
        .flat_map(|i| {
            (0..kv_len).map(move |j| {
                if j > index_pos + i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (seq_len, kv_len), device)
}

impl Cache {
    pub fn new(use_kv_cache: bool, dtype: DType, config: &Config, device: &Device) -> Result<Self> {
        config.validate()?;
        let (cos, sin) = rope_tables(config, config.max_position_embeddings, dtype, device)?;
        let rope = RopeTable::new(&cos, &sin)?;
        Ok(Self {
            masks: HashMap::new(),
            use_kv_cache,
            kvs: vec![None; config.num_hidden_layers],
            rope,
            device: device.clone(),
        })
    }

    /// Forgets the cached keys and values (a new sequence).
    pub fn reset(&mut self) {
        self.kvs.iter_mut().for_each(|kv| *kv = None);
    }

    /// Tokens held in the cache.
    pub fn len(&self) -> usize {
        match self.kvs.first() {
            Some(Some(kv)) => kv.len,
            _ => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Layer `l`'s cached keys and values, `[b, len, 2 · kv_heads · hd]`.
    pub(crate) fn layer_kv(&self, l: usize) -> Result<Option<Tensor>> {
        match self.kvs.get(l) {
            Some(Some(c)) => Ok(Some(c.kv.narrow(1, 0, c.len)?)),
            _ => Ok(None),
        }
    }

    /// The angles of every position.
    pub(crate) fn rope(&self) -> &RopeTable {
        &self.rope
    }

    fn mask(&mut self, seq_len: usize, index_pos: usize) -> Result<Tensor> {
        if let Some(mask) = self.masks.get(&(seq_len, index_pos)) {
            return Ok(mask.clone());
        }
        let mask = causal_mask(seq_len, index_pos, &self.device)?;
        self.masks.insert((seq_len, index_pos), mask.clone());
        Ok(mask)
    }
}

/// Whether a pass runs the fused causal attention: on CUDA in bf16 with a supported
/// head size ([`AttentionPath::Plain`] turns it off). Training takes
/// it too (its backward recomputes the scores). On the CPU, decode steps (one token a
/// sequence) take it: it reads the KV cache in place, where the plain ops copy every
/// cached row of every layer each token (at 1,500 positions most of a step); prompts
/// and training keep the plain ops, whose matrix products are faster there than the
/// op's row loop. `rows` is batch × query heads.
///
/// A one-token step over up to `CUDA_DECODE_MAX_KEYS` keys runs the kernel that spreads
/// the keys over a block. Past that the prefill kernel would take the step with one
/// query row busy in each warp, so it gets the step only when the batch brings enough
/// (batch, head) rows. This rule was measured with the prefill kernel's CUDA-core
/// version: at batch 1 it lost to the plain ops (114 vs 150 tokens/s at context 512),
/// at batch 16 it won (1166 vs 909).
///
/// Decided once per forward pass, before any layer: only the plain path needs the
/// causal mask (the fused kernels apply it themselves), so a fused pass skips building it.
fn fused_attention(
    device: &Device,
    dtype: DType,
    head_dim: usize,
    rows: usize,
    tokens: usize,
    keys: usize,
) -> bool {
    if device.is_cpu() {
        return tokens == 1;
    }
    if !device.is_cuda() || dtype != DType::BF16 || !fused_ops::CUDA_HEAD_DIMS.contains(&head_dim) {
        return false;
    }
    tokens > 1 || keys <= fused_ops::CUDA_DECODE_MAX_KEYS || rows >= 256
}

/// Whether a forward pass must keep the autograd graph intact.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Fused kernels, KV cache.
    Inference,
    /// Plain differentiable ops, no cache.
    Train,
}

#[derive(Debug, Clone)]
struct CausalSelfAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    /// The three projections as one, once [`Llama::fuse_qkv`] has run (the split ones
    /// are then views of its weight).
    qkv_proj: Option<Linear>,
    /// The keys and values rows of the same weight (a view), for the inference prefill
    /// that projects q and `k | v` apart and turns the keys in place.
    kv_proj: Option<Linear>,
    o_proj: Linear,
    /// Quantized copies of the stacked q, k, v and of the output projection, for
    /// inference on the CPU ([`Llama::quantize_for_cpu`]).
    quantized: Option<QuantizedAttention>,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
}

impl CausalSelfAttention {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let q = cfg.num_attention_heads * hd;
        let kv = cfg.num_key_value_heads * hd;
        let bias = cfg.attention_bias;
        Ok(Self {
            q_proj: linear_b(h, q, bias, vb.pp("q_proj"))?,
            k_proj: linear_b(h, kv, bias, vb.pp("k_proj"))?,
            v_proj: linear_b(h, kv, bias, vb.pp("v_proj"))?,
            qkv_proj: None,
            kv_proj: None,
            o_proj: linear_b(q, h, bias, vb.pp("o_proj"))?,
            quantized: None,
            num_attention_heads: cfg.num_attention_heads,
            num_key_value_heads: cfg.num_key_value_heads,
            head_dim: hd,
        })
    }

    /// `x [b · t, h]` rows of `batch = (b, t)` → the heads' output rows `[b · t, heads ·
    /// hd]`, before the output projection (the caller applies it, or adds its product
    /// to the residual in one GEMM). `rope` holds the angles of positions `index_pos..
    /// index_pos + t`; `mask` is `[t, kv_len]`, or `None` for one token and for the fused
    /// kernels (`fused`), which apply the causal mask themselves.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        x: &Tensor,
        batch: (usize, usize),
        rope: &RopeTable,
        mask: Option<&Tensor>,
        mut kv_cache: Option<&mut Option<LayerKv>>,
        pass: Pass,
        fused: bool,
    ) -> Result<Tensor> {
        let (b, t) = batch;
        let (nq, nkv, hd) = (
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        );
        // Rows `[b · positions, n · hd]` as the contiguous `[b, n, positions, hd]` the
        // plain ops take.
        let heads = |r: &Tensor, n: usize| -> Result<Tensor> {
            r.reshape((b, r.dim(0)? / b, n, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        // Training on the plain ops: RoPE and attention as differentiable candle ops.
        if pass == Pass::Train && !fused {
            let turn = |x: Tensor| candle_nn::rotary_emb::rope_slow(&x, &rope.cos, &rope.sin);
            let q = turn(heads(&self.q_proj.forward(x)?, nq)?)?;
            let k = turn(heads(&self.k_proj.forward(x)?, nkv)?)?;
            let v = heads(&self.v_proj.forward(x)?, nkv)?;
            return self.plain_attention(q, k, v, mask, pass);
        }
        // RoPE and the fused attention take the projections' rows `[b · t, heads · hd]` as
        // they come: a reshape or transpose is an autograd node, and the backward gives
        // every node a zeros tensor and an add over its size. Training gets here with the
        // fused ops only, whose backward passes exist (split projections, no cache).
        // Inference after `fuse_qkv` takes the keys and values side by side (`kv`), as
        // the cache keeps them: with the fused attention, q and `k | v` are two products
        // and the keys turn in place (the fewest passes over q, k and v), elsewhere
        // one product and one RoPE launch for q and one for `k | v`.
        let w = nkv * hd;
        // A decode step with fused projections on the GPU: RoPE, the cache append and the
        // attention in one launch, which writes the new row into the layer's buffer.
        if let (Some(qkv_proj), Some(Some(slot)), true, 1) =
            (&self.qkv_proj, kv_cache.as_deref_mut(), fused, t)
        {
            if slot.kv.dim(0)? == b && fused_ops::step_on_device(x, hd, slot.len) {
                slot.reserve(1)?;
                let qkv = qkv_proj.forward(x)?;
                let y = fused_ops::causal_attention_step(&qkv, rope, &slot.kv, slot.len, nq, nkv)?;
                slot.len += 1;
                return Ok(y);
            }
        }
        // With fused weights under the fused attention at inference, q and `k | v` come
        // apart and the attention turns q; elsewhere one product and RoPE turn both.
        // Not over quantized copies: those hold q, k and v stacked only.
        let keys_in_place = fused && pass != Pass::Train && self.quantized.is_none();
        // `q_turned` is false where q is still the projection's: the fused attention
        // turns it as it reads it, one pass over q fewer.
        let (q, mut k, mut v, kv, q_turned) = match (&self.qkv_proj, &self.kv_proj) {
            // q and `k | v` apart (`k | v` as the cache keeps them), the keys turned in
            // place: RoPE reads and writes the keys only.
            (Some(_), Some(kv_proj)) if keys_in_place => {
                let q = self.q_proj.forward(x)?;
                let kv = kv_proj.forward(x)?;
                fused_ops::rope_keys_in_place(&kv, rope, nkv)?;
                (q, kv.narrow(1, 0, w)?, kv.narrow(1, w, w)?, Some(kv), false)
            }
            (Some(qkv), _) => {
                let projected = match &self.quantized {
                    Some(quantized) if quantized.takes(x) => quantized.qkv(x, qkv.bias())?,
                    _ => qkv.forward(x)?,
                };
                let (q, kv) = fused_ops::rope_qkv(&projected, rope, nq, nkv)?;
                (q, kv.narrow(1, 0, w)?, kv.narrow(1, w, w)?, Some(kv), true)
            }
            (None, _) => (
                fused_ops::rope(&self.q_proj.forward(x)?, rope)?,
                fused_ops::rope(&self.k_proj.forward(x)?, rope)?,
                self.v_proj.forward(x)?,
                None,
                true,
            ),
        };
        if let Some(slot) = kv_cache {
            let kv = match kv {
                Some(kv) => kv,
                None => Tensor::cat(&[&k, &v], 1)?,
            };
            // `[b, T, 2w]`, each sequence's rows in place in the layer's buffer.
            let cached = LayerKv::append(slot, &kv.reshape((b, t, 2 * w))?)?;
            (k, v) = (cached.narrow(2, 0, w)?, cached.narrow(2, w, w)?);
            if !fused {
                let rows = b * cached.dim(1)?;
                (k, v) = (k.reshape((rows, w))?, v.reshape((rows, w))?);
            }
        }
        if fused {
            // The scores stay on chip; the mask is the causal one the kernel applies. The
            // op reads strided keys and values (views of `kv` or of the cache) in place.
            let y = if q_turned {
                fused_ops::causal_attention_rows(&q, &k, &v, b, hd)?
            } else {
                fused_ops::causal_attention_rows_turning_q(&q, rope, &k, &v, b, hd)?
            };
            return Ok(y);
        }
        self.plain_attention(heads(&q, nq)?, heads(&k, nkv)?, heads(&v, nkv)?, mask, pass)
    }

    /// `adapter`'s factors for this attention (layer `layer`): of q, k and v stacked as
    /// [`CausalSelfAttention::fuse_qkv`] stacks them, and of the output projection.
    fn low_rank_factors(
        &self,
        adapter: &LoraAdapter,
        layer: usize,
    ) -> Result<(Option<LowRankStack>, Option<LowRankStack>)> {
        let name = |proj: &str| format!("model.layers.{layer}.self_attn.{proj}.weight");
        let rows = |l: &Linear| l.weight().dim(0);
        let cols = self.q_proj.weight().dim(1)?;
        let qkv = adapter.low_rank_stack(
            &[
                (name("q_proj"), rows(&self.q_proj)?),
                (name("k_proj"), rows(&self.k_proj)?),
                (name("v_proj"), rows(&self.v_proj)?),
            ],
            cols,
        )?;
        let o = adapter.low_rank_stack(
            &[(name("o_proj"), rows(&self.o_proj)?)],
            self.o_proj.weight().dim(1)?,
        )?;
        Ok((qkv, o))
    }

    /// The output projection of the heads' rows `y`.
    fn output(&self, y: &Tensor) -> Result<Tensor> {
        match &self.quantized {
            Some(quantized) if quantized.takes(y) => {
                with_bias(quantized.o.forward(&y.contiguous()?)?, self.o_proj.bias())
            }
            _ => project(&self.o_proj, y),
        }
    }

    /// Replaces the three projections by one product over their stacked weights, for
    /// inference (see [`Llama::fuse_qkv`]).
    fn fuse_qkv(&mut self) -> Result<()> {
        if self.qkv_proj.is_some() {
            return Ok(());
        }
        let parts = [&self.q_proj, &self.k_proj, &self.v_proj];
        let weight = Tensor::cat(&parts.map(|l| l.weight()), 0)?;
        let bias = match parts.map(|l| l.bias()) {
            [Some(q), Some(k), Some(v)] => Some(Tensor::cat(&[q, k, v], 0)?),
            _ => None,
        };
        // The split projections become views of the stacked weight (no second copy).
        let mut start = 0;
        for part in [&mut self.q_proj, &mut self.k_proj, &mut self.v_proj] {
            let n = part.weight().dim(0)?;
            let b = bias.as_ref().map(|b| b.narrow(0, start, n)).transpose()?;
            *part = Linear::new(weight.narrow(0, start, n)?, b);
            start += n;
        }
        let (q_rows, kv_rows) = (
            self.q_proj.weight().dim(0)?,
            2 * self.k_proj.weight().dim(0)?,
        );
        let kv_bias = bias
            .as_ref()
            .map(|b| b.narrow(0, q_rows, kv_rows))
            .transpose()?;
        self.kv_proj = Some(Linear::new(weight.narrow(0, q_rows, kv_rows)?, kv_bias));
        self.qkv_proj = Some(Linear::new(weight, bias));
        Ok(())
    }

    /// Attention as plain candle ops: f32 scores `[b, heads, t, T]`, the mask added, a
    /// softmax; the heads' rows `[b · t, heads · hd]`. Training takes candle's composite
    /// softmax, which it can differentiate; inference its fused one.
    fn plain_attention(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Option<&Tensor>,
        pass: Pass,
    ) -> Result<Tensor> {
        let (b, nq, t, hd) = q.dims4()?;
        let hidden = nq * hd;
        let nkv = k.dim(1)?;
        let rep = nq / nkv;
        let k = candle_transformers::utils::repeat_kv(k, rep)?;
        let v = candle_transformers::utils::repeat_kv(v, rep)?;

        let in_dtype = q.dtype();
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let mut att = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?;
        if let Some(mask) = mask {
            att = att.broadcast_add(mask)?;
        }
        let att = match pass {
            Pass::Inference => candle_nn::ops::softmax_last_dim(&att)?,
            Pass::Train => candle_nn::ops::softmax(&att, D::Minus1)?,
        };
        let y = att.matmul(&v.contiguous()?)?.to_dtype(in_dtype)?;
        y.transpose(1, 2)?.reshape((b * t, hidden))
    }
}

/// RMS norm with both the fused kernel (inference) and the differentiable form.
#[derive(Debug, Clone)]
struct Norm {
    inner: RmsNorm,
    weight: Tensor,
    eps: f64,
}

impl Norm {
    fn load(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self::new(vb.get(size, "weight")?, eps))
    }

    fn new(weight: Tensor, eps: f64) -> Self {
        Self {
            inner: RmsNorm::new(weight.clone(), eps),
            weight,
            eps,
        }
    }

    fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        match pass {
            Pass::Inference => self.inner.forward(x),
            Pass::Train => candle_nn::ops::rms_norm_slow(x, &self.weight, self.eps as f32),
        }
    }

    /// `(x + y, norm(x + y))`: one kernel on CUDA (with a backward kernel), candle's
    /// ops elsewhere.
    fn add_forward(&self, x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
        fused_ops::add_rms_norm(x, y, &self.weight, self.eps)
    }
}

#[derive(Debug)]
struct Block {
    input_layernorm: Norm,
    self_attn: CausalSelfAttention,
    post_attention_layernorm: Norm,
    mlp: SparseMlp,
    /// With [`Llama::shard_ffn`]: `mlp` is this rank's share, its output summed over them.
    ranks: Option<Ranks>,
}

/// A weight's stand-in once its quantized copy is all a model keeps: the same shape,
/// no storage.
fn released(w: &Tensor) -> Result<Tensor> {
    Tensor::zeros((), w.dtype(), w.device())?.broadcast_as(w.shape())
}

impl Block {
    /// Quantizes the parts `plan` names and lets their f32 weights go
    /// ([`Llama::load_quantized`]).
    /// `adapter`'s low-rank factors of the attention (layer `layer`) run beside its
    /// quantized rows, unmerged: the loader left them out of the weights.
    fn quantize_and_release(
        &mut self,
        plan: CpuQuantization,
        layer: usize,
        adapter: Option<&LoraAdapter>,
    ) -> Result<()> {
        if let Some(format) = plan.attention {
            let attn = &mut self.self_attn;
            let factors = match adapter {
                Some(adapter) => attn.low_rank_factors(adapter, layer)?,
                None => (None, None),
            };
            attn.fuse_qkv()?;
            let qkv = attn.qkv_proj.as_ref().expect("fused above");
            attn.quantized = Some(QuantizedAttention::new(
                qkv,
                &attn.o_proj,
                format,
                true,
                factors,
            )?);
            let stand_in = |l: &Linear| -> Result<Linear> {
                Ok(Linear::new(released(l.weight())?, l.bias().cloned()))
            };
            for l in [
                &mut attn.q_proj,
                &mut attn.k_proj,
                &mut attn.v_proj,
                &mut attn.o_proj,
            ] {
                *l = stand_in(l)?;
            }
            for l in [&mut attn.qkv_proj, &mut attn.kv_proj]
                .into_iter()
                .flatten()
            {
                *l = stand_in(l)?;
            }
        }
        if let Some(format) = plan.mlp {
            self.mlp.quantize_for_cpu(format)?;
            self.mlp.release_f32_weights()?;
        }
        Ok(())
    }

    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let mut mlp = SparseMlp::load(
            vb.pp("mlp"),
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.activation,
            cfg.ffn_mode,
        )?
        .with_twell_config(cfg.twell);
        if cfg.mlp_bias {
            let bias = MlpBias::load(&vb.pp("mlp"), cfg.hidden_size, cfg.intermediate_size)?;
            mlp = mlp.with_bias(bias)?;
        }
        Ok(Self {
            input_layernorm: Norm::load(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("input_layernorm"),
            )?,
            self_attn: CausalSelfAttention::load(vb.pp("self_attn"), cfg)?,
            post_attention_layernorm: Norm::load(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp,
            ranks: None,
        })
    }

    /// The MLP sublayer of an inference pass: the residual add and norm before the MLP,
    /// the MLP, then the add and `next`'s norm after it; one call into the MLP where it is
    /// whole. A tensor-parallel share's output is summed over the ranks before its add.
    fn mlp_sublayer(&self, x: &Tensor, attn: &Tensor, next: &Norm) -> Result<(Tensor, Tensor)> {
        let norm = &self.post_attention_layernorm;
        match &self.ranks {
            None => self.mlp.forward_sublayer(
                x,
                attn,
                (&norm.weight, norm.eps),
                (&next.weight, next.eps),
            ),
            Some(ranks) => {
                let (sum, h) = norm.add_forward(x, attn)?;
                let out = ranks.sum(&self.mlp.forward(&h)?)?;
                next.add_forward(&sum, &out)
            }
        }
    }
}

/// A Llama causal LM whose feed-forward can run dense or TwELL-sparse.
#[derive(Debug)]
pub struct Llama {
    embed_tokens: Embed,
    blocks: Vec<Block>,
    norm: Norm,
    lm_head: Head,
    config: Config,
    attention_path: AttentionPath,
    /// Some f32 weights were let go ([`Llama::load_quantized`]).
    f32_released: bool,
}

/// Which implementation a forward pass takes for the attention (and, in training, for
/// RoPE and the residual add + norm around it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionPath {
    /// Our fused ops where their kernels run (CUDA, bf16, a head size they are built
    /// for), plain candle ops elsewhere.
    #[default]
    Auto,
    /// Our fused ops on every device. On the CPU they run their reference
    /// implementations, so tests can hold the GPU's training path against the plain one
    /// without a GPU. On CUDA the kernels need bf16 and a supported head size.
    Fused,
    /// Plain candle ops on every device.
    Plain,
}

/// Quantized copies of an attention's stacked q, k, v weight and output weight; the
/// biases, if any, stay the `Linear`s'.
#[derive(Debug, Clone)]
struct QuantizedAttention {
    qkv: AdaptedRows,
    o: AdaptedRows,
    /// Every call takes the copies (the f32 weights are released,
    /// [`Llama::load_quantized`]), not the decode sizes alone.
    every_row: bool,
}

/// Rows up to which the attention takes its quantized copies: decode steps read each
/// weight for a row or a few, and there the bytes decide; a prefill's many rows run
/// faster through the f32 GEMM, which stays beside the copies.
const QUANTIZED_MAX_ROWS: usize = 16;

impl QuantizedAttention {
    /// `factors`: low-rank adapters of the stacked q/k/v and of the output projection,
    /// applied beside the rows.
    fn new(
        qkv: &Linear,
        o: &Linear,
        format: QuantFormat,
        every_row: bool,
        factors: (Option<LowRankStack>, Option<LowRankStack>),
    ) -> Result<Self> {
        Ok(Self {
            qkv: AdaptedRows::new(quantized_rows(qkv.weight(), format)?, factors.0)?,
            o: AdaptedRows::new(quantized_rows(o.weight(), format)?, factors.1)?,
            every_row,
        })
    }

    fn takes(&self, x: &Tensor) -> bool {
        self.every_row
            || x.dims()
                .first()
                .is_some_and(|&rows| rows <= QUANTIZED_MAX_ROWS)
    }

    fn qkv(&self, x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        with_bias(self.qkv.forward(x)?, bias)
    }
}

fn with_bias(y: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// A copy of the `[out, in]` weight `w` in quantized rows.
fn quantized_rows(w: &Tensor, format: QuantFormat) -> Result<QuantRows> {
    let (rows, cols) = w.dims2()?;
    let v = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    QuantRows::quantize(&v, rows, cols, format)
}

/// Which weights CPU inference reads through quantized rows
/// ([`Llama::quantize_for_cpu`]) and in which format; `None` keeps a part's f32 weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuQuantization {
    /// The output projection, read whole every token (the default model's tied head is
    /// 113 MB in f32).
    pub head: Option<QuantFormat>,
    /// The fused q/k/v and the output projections, at decode sizes.
    pub attention: Option<QuantFormat>,
    /// The MLPs, at every size: the sparse path over quantized rows where the MLP is
    /// sparse (ReLU, not `--ffn dense`), else the dense one.
    pub mlp: Option<QuantFormat>,
}

/// `l`'s product, through [`fused_ops::linear_rows`] for one row of a bias-free layer (a
/// one-sequence decode step), where cuBLAS's GEMM tiles are mostly idle: on an H200 the
/// SmolLM2-135M shape's graph step went from 979 to 1,064 tokens/s dense and from 1,461 to
/// 1,651 sparse, the 1.5B shape's stayed within noise, and at 4 and 8 rows the kernel was
/// slower than cuBLAS (docs/benchmarks.md, "The decode step, kernel by kernel").
fn project(l: &Linear, x: &Tensor) -> Result<Tensor> {
    match (l.bias(), x.dims()) {
        (None, &[1, _]) => fused_ops::linear_rows(x, l.weight()),
        _ => l.forward(x),
    }
}

/// The output projection: candle's `Linear`, or, for inference on the CPU, a quantized
/// copy of its weight ([`Llama::quantize_for_cpu`]).
#[derive(Debug)]
enum Head {
    Linear(Linear),
    Quantized(Arc<QuantRows>),
}

impl Head {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Head::Linear(l) => project(l, x),
            Head::Quantized(q) => q.forward(&x.contiguous()?),
        }
    }
}

/// The token embeddings: candle's table, or, after [`Llama::load_quantized`], rows of
/// the quantized head they are tied to, dequantized per token.
#[derive(Debug)]
enum Embed {
    Table(Embedding),
    Rows(Arc<QuantRows>, Device),
}

impl Embed {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Embed::Table(t) => t.forward(ids),
            Embed::Rows(rows, device) => {
                let flat = ids.flatten_all()?.to_vec1::<u32>()?;
                let (vocab, d) = (rows.rows(), rows.cols());
                let mut out = vec![0f32; flat.len() * d];
                for (o, &id) in out.chunks_exact_mut(d).zip(&flat) {
                    if id as usize >= vocab {
                        candle_core::bail!("token id {id} is past the vocabulary of {vocab}");
                    }
                    rows.dequantize_row(id as usize, o);
                }
                let mut dims = ids.dims().to_vec();
                dims.push(d);
                Tensor::from_vec(out, dims, device)
            }
        }
    }

    /// The f32 table, where there is one.
    fn table(&self) -> Result<&Tensor> {
        match self {
            Embed::Table(t) => Ok(t.embeddings()),
            Embed::Rows(..) => candle_core::bail!(
                "this model's embeddings are quantized rows (load_quantized): inference on the CPU only"
            ),
        }
    }
}

/// The name a program uses when it means the sparse-capable model.
pub type SparseLlama = Llama;

/// What a differentiable forward pass returns.
pub struct TrainOutput {
    /// `[b, t, vocab]`, in the model's dtype.
    pub logits: Tensor,
    /// Mean over layers of (mean over tokens of `Σ_j |h_j|`): the L1 penalty term.
    pub l1: Tensor,
}

impl Llama {
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        Self::load_with(vb, cfg, None, |_, _| Ok(()))
    }

    /// [`Llama::load`], the head quantized to `head` (the embeddings, if tied, served
    /// from its rows) before the blocks are read, and `prepare` run on each block as
    /// soon as it is read.
    fn load_with(
        vb: VarBuilder,
        cfg: &Config,
        head: Option<QuantFormat>,
        prepare: impl Fn(usize, &mut Block) -> Result<()>,
    ) -> Result<Self> {
        cfg.validate()?;
        let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
        let (embed_tokens, lm_head) = match head {
            Some(format) if cfg.tie_word_embeddings => {
                let table = vb.pp("model.embed_tokens").get((vocab, hidden), "weight")?;
                let rows = Arc::new(quantized_rows(&table, format)?);
                (
                    Embed::Rows(rows.clone(), vb.device().clone()),
                    Head::Quantized(rows),
                )
            }
            Some(format) => {
                let w = vb.pp("lm_head").get((vocab, hidden), "weight")?;
                (
                    Embed::Table(embedding(vocab, hidden, vb.pp("model.embed_tokens"))?),
                    Head::Quantized(Arc::new(quantized_rows(&w, format)?)),
                )
            }
            None => {
                let table = embedding(vocab, hidden, vb.pp("model.embed_tokens"))?;
                let head = Head::Linear(if cfg.tie_word_embeddings {
                    Linear::new(table.embeddings().clone(), None)
                } else {
                    candle_nn::linear_no_bias(hidden, vocab, vb.pp("lm_head"))?
                });
                (Embed::Table(table), head)
            }
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                let mut block = Block::load(vb.pp(format!("model.layers.{i}")), cfg)?;
                prepare(i, &mut block)?;
                Ok(block)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embed_tokens,
            blocks,
            norm: Norm::load(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("model.norm"))?,
            lm_head,
            config: cfg.clone(),
            attention_path: AttentionPath::Auto,
            f32_released: false,
        })
    }

    /// [`Llama::load`] for inference on the CPU through quantized rows: as soon as a layer
    /// is read, its q, k and v are fused, the parts `plan` names are quantized (as
    /// [`Llama::quantize_for_cpu`] does) and their f32 weights let go. Loading then never
    /// holds the f32 model: with a GGUF, whose tensors are read one at a time, the peak
    /// is the quantized model, one layer in f32 and the embedding table. A quantized tied
    /// head also serves the embeddings. The quantized parts run at every size, and the
    /// model cannot train.
    ///
    /// `attention_adapter`: a LoRA adapter whose attention factors `vb` does not merge
    /// (they run beside the quantized rows, which then keep the base's own blocks).
    pub fn load_quantized(
        vb: VarBuilder,
        cfg: &Config,
        plan: CpuQuantization,
        attention_adapter: Option<&LoraAdapter>,
    ) -> Result<Self> {
        if !vb.device().is_cpu() || vb.dtype() != DType::F32 {
            candle_core::bail!("load_quantized: the quantized rows run on the CPU in f32");
        }
        if attention_adapter.is_some() && plan.attention.is_none() {
            candle_core::bail!(
                "load_quantized: unmerged attention factors need quantized attention"
            );
        }
        let mut model = Self::load_with(vb, cfg, plan.head, |layer, block| {
            block.quantize_and_release(plan, layer, attention_adapter)
        })?;
        model.f32_released = plan.attention.is_some() || plan.mlp.is_some();
        Ok(model)
    }

    /// Stacks each layer's q, k and v projection weights into one matrix, so that an
    /// inference pass runs one product and one RoPE launch for the three (and the KV
    /// cache appends keys and values with one copy). A decode step at batch 1 is bound by
    /// launches on the host; this takes four of them out of every layer.
    ///
    /// For inference only: the stacked weight is no variable a trainer holds, so
    /// [`Llama::forward_train`] refuses a fused model (load it again to train).
    pub fn fuse_qkv(&mut self) -> Result<()> {
        self.blocks
            .iter_mut()
            .try_for_each(|b| b.self_attn.fuse_qkv())
    }

    /// Folds the weight of each block's norm before the MLP into the MLP's gate and up
    /// weights ([`SparseMlp::fold_pre_norm`]), the norm keeping a unit weight: the same
    /// function, for inference. An inference prefill then adds the attention's output
    /// projection to the residual in one GEMM (`ops::residual_add_linear`) and the MLP
    /// sublayer starts from the sum ([`SparseMlp::forward_sublayer_from_sum`]): on the
    /// sparse CUDA path the normalised rows are never written. Like [`Llama::fuse_qkv`],
    /// [`Llama::forward_train`] refuses a folded model.
    pub fn fold_mlp_norms(&mut self) -> Result<()> {
        if self.is_tensor_parallel() {
            candle_core::bail!("fold_mlp_norms: a tensor-parallel model's MLPs stay unfolded");
        }
        for block in &mut self.blocks {
            if block.mlp.pre_norm_folded() {
                continue;
            }
            let norm = &mut block.post_attention_layernorm;
            block.mlp.fold_pre_norm(&norm.weight)?;
            *norm = Norm::new(norm.weight.ones_like()?, norm.eps);
        }
        Ok(())
    }

    /// Builds each MLP's inference-only structures now rather than at its first call
    /// ([`twell::SparseMlp::prepare_inference`]).
    pub fn prepare_inference(&self) -> Result<()> {
        self.blocks
            .iter()
            .try_for_each(|b| b.mlp.prepare_inference())
    }

    /// Runs the parts `plan` names through quantized copies of their weights, for
    /// inference on the CPU: a decode step reads every weight once, and the bytes set
    /// its speed (the default model's f32 head is 113 MB, its attention 106 MB; Q8 reads
    /// about a quarter of that, Q4_1 an eighth). Needs [`Llama::fuse_qkv`] for the
    /// attention. For inference only: [`Llama::forward_train`] refuses a model whose head
    /// is quantized, and the MLPs' training passes keep their f32 weights.
    pub fn quantize_for_cpu(&mut self, plan: CpuQuantization) -> Result<()> {
        if plan == CpuQuantization::default() {
            return Ok(());
        }
        if !self.device().is_cpu() {
            candle_core::bail!("quantize_for_cpu: the quantized matmuls run on the CPU only");
        }
        if plan.attention.is_some() && !self.is_qkv_fused() {
            candle_core::bail!("quantize_for_cpu: call fuse_qkv first");
        }
        if plan.mlp.is_some() && self.is_tensor_parallel() {
            candle_core::bail!("quantize_for_cpu: a tensor-parallel model's MLP shares stay f32");
        }
        if let (Some(format), Head::Linear(linear)) = (plan.head, &self.lm_head) {
            self.lm_head = Head::Quantized(Arc::new(quantized_rows(linear.weight(), format)?));
        }
        for block in &mut self.blocks {
            if let Some(format) = plan.attention {
                let attn = &mut block.self_attn;
                if let Some(qkv) = &attn.qkv_proj {
                    attn.quantized = Some(QuantizedAttention::new(
                        qkv,
                        &attn.o_proj,
                        format,
                        false,
                        (None, None),
                    )?);
                }
            }
            if let Some(format) = plan.mlp {
                block.mlp.quantize_for_cpu(format)?;
            }
        }
        Ok(())
    }

    /// Whether [`Llama::fold_mlp_norms`] has run.
    pub fn are_mlp_norms_folded(&self) -> bool {
        self.blocks.iter().any(|b| b.mlp.pre_norm_folded())
    }

    /// Whether [`Llama::fuse_qkv`] has run.
    pub fn is_qkv_fused(&self) -> bool {
        self.blocks.iter().any(|b| b.self_attn.qkv_proj.is_some())
    }

    /// Keeps this rank's share of every MLP, for tensor parallelism over `ranks`: the
    /// neurons [`crate::tensor_parallel::shard_neurons`] gives it for `orders[layer]` (each a
    /// permutation of the layer's neurons, e.g. [`crate::sparsity::balanced_neuron_order`];
    /// the identity where `None`). Each MLP's output is then summed over the ranks before
    /// its residual add. Every rank must load the same model, shard it with the same
    /// orders and run the same passes with the same rows. Inference only, op by op (the
    /// decode engine's graphs cannot hold a host all-reduce), on MLPs without biases,
    /// quantized rows or folded norms.
    pub fn shard_ffn(&mut self, ranks: Ranks, orders: Option<&[Vec<usize>]>) -> Result<()> {
        if self.is_tensor_parallel() {
            candle_core::bail!("shard_ffn: the model is sharded already");
        }
        if let Some(o) = orders {
            if o.len() != self.blocks.len() {
                candle_core::bail!(
                    "shard_ffn: {} neuron orders for {} layers",
                    o.len(),
                    self.blocks.len()
                );
            }
        }
        let (rank, world) = ranks.rank_and_world()?;
        let shares = self
            .blocks
            .iter()
            .enumerate()
            .map(|(l, b)| rank_share(&b.mlp, orders.map(|o| o[l].as_slice()), rank, world))
            .collect::<Result<Vec<_>>>()?;
        for (block, (part, _)) in self.blocks.iter_mut().zip(shares) {
            block.mlp = part;
            block.ranks = Some(ranks.clone());
        }
        Ok(())
    }

    /// Whether [`Llama::shard_ffn`] has run.
    pub fn is_tensor_parallel(&self) -> bool {
        self.blocks.iter().any(|b| b.ranks.is_some())
    }

    /// Chooses the attention implementation of the following passes (see
    /// [`AttentionPath`]).
    pub fn set_attention_path(&mut self, path: AttentionPath) {
        self.attention_path = path;
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn embed(&self, x: &Tensor) -> Result<Tensor> {
        self.embed_tokens.forward(x)
    }

    /// The dtype the model computes in (its embeddings'), which a KV cache must hold.
    pub fn dtype(&self) -> DType {
        match &self.embed_tokens {
            Embed::Table(t) => t.embeddings().dtype(),
            Embed::Rows(..) => DType::F32,
        }
    }

    /// The device the model's weights live on.
    pub fn device(&self) -> &Device {
        match &self.embed_tokens {
            Embed::Table(t) => t.embeddings().device(),
            Embed::Rows(_, device) => device,
        }
    }

    /// Runs the blocks; returns the final hidden states and, for training, each
    /// layer's mean L1 term.
    fn run(
        &self,
        tokens: &Tensor,
        index_pos: usize,
        cache: Option<&mut Cache>,
        pass: Pass,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let (b, t) = tokens.dims2()?;
        if pass == Pass::Train && self.is_qkv_fused() {
            candle_core::bail!(
                "this model's q, k, v projections are fused for inference (fuse_qkv): their \
                 gradients would reach no trained variable; load the model again to train"
            );
        }
        if pass == Pass::Train && self.are_mlp_norms_folded() {
            candle_core::bail!(
                "this model's MLP norms are folded into its weights for inference \
                 (fold_mlp_norms): their gradients would reach no trained variable; load \
                 the model again to train"
            );
        }
        // The residual stream is `[b · t, hidden]` rows from here to the last norm: a
        // reshape is an autograd node, and the backward pays each node a zeros tensor and
        // an add over its size, so the block keeps the shape its matmuls and norms take.
        let ids = tokens.flatten_all()?;
        // Training takes our embedding op for its one-pass backward (candle's is an
        // `index_add` on two thread blocks); it checks the ids, a read-back per pass.
        let x = match pass {
            Pass::Train => fused_ops::embedding(&ids, self.embed_tokens.table()?)?,
            Pass::Inference => self.embed_tokens.forward(&ids)?,
        };
        self.run_embedded(x, (b, t), index_pos, cache, pass)
    }

    /// [`Self::run`] from the embedded rows `x [b · t, hidden]` on.
    fn run_embedded(
        &self,
        mut x: Tensor,
        (b, t): (usize, usize),
        index_pos: usize,
        mut cache: Option<&mut Cache>,
        pass: Pass,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        if index_pos + t > self.config.max_position_embeddings {
            candle_core::bail!(
                "sequence reaches position {} but the model supports {}",
                index_pos + t,
                self.config.max_position_embeddings
            );
        }
        let rows_to_batch = |h: Tensor| h.reshape((b, t, self.config.hidden_size));
        let cached = cache.as_deref().is_some_and(|c| c.use_kv_cache);
        let fused = match self.attention_path {
            AttentionPath::Auto => fused_attention(
                x.device(),
                x.dtype(),
                self.config.head_dim(),
                b * self.config.num_attention_heads,
                t,
                if cached { index_pos + t } else { t },
            ),
            AttentionPath::Fused => true,
            AttentionPath::Plain => false,
        };
        let needs_mask = t > 1 && !fused;
        let (rope, mask) = match cache.as_deref_mut() {
            Some(c) => {
                let mask = if needs_mask {
                    Some(c.mask(t, index_pos)?)
                } else {
                    None
                };
                (c.rope.narrow(index_pos, t)?, mask)
            }
            None => {
                let (cos, sin) = rope_tables(&self.config, index_pos + t, x.dtype(), x.device())?;
                let mask = if needs_mask {
                    Some(causal_mask(t, index_pos, x.device())?)
                } else {
                    None
                };
                (RopeTable::new(&cos, &sin)?.narrow(index_pos, t)?, mask)
            }
        };
        let mut l1 = Vec::new();
        // Inference fuses each residual add with the norm after it (`add_rms_norm`), so
        // `h` (the next sublayer's normalised input) is carried from one step to the next.
        let mut h = match self.blocks.first() {
            Some(block) => block.input_layernorm.forward(&x, pass)?,
            None => return Ok((rows_to_batch(self.norm.forward(&x, pass)?)?, l1)),
        };
        for (i, block) in self.blocks.iter().enumerate() {
            let kv = match cache.as_deref_mut() {
                Some(c) if c.use_kv_cache => Some(&mut c.kvs[i]),
                _ => None,
            };
            let y = block
                .self_attn
                .attend(&h, (b, t), &rope, mask.as_ref(), kv, pass, fused)?;
            // The norm of the next sublayer: this block's MLP, then the next block's
            // attention (or the final norm).
            let next = match self.blocks.get(i + 1) {
                Some(b) => &b.input_layernorm,
                None => &self.norm,
            };
            // After `fold_mlp_norms`, an inference prefill adds the output projection to
            // the residual in its GEMM, and the MLP sublayer starts from that sum.
            let o_proj = &block.self_attn.o_proj;
            if pass == Pass::Inference
                && fused
                && b * t > 1
                && block.mlp.pre_norm_folded()
                && o_proj.bias().is_none()
                && block.self_attn.quantized.is_none()
            {
                let s = fused_ops::residual_add_linear(x, &y, o_proj.weight())?;
                (x, h) = block.mlp.forward_sublayer_from_sum(
                    &s,
                    block.post_attention_layernorm.eps,
                    (&next.weight, next.eps),
                )?;
                continue;
            }
            let attn = block.self_attn.output(&y)?;
            match (pass, fused) {
                (Pass::Train, false) => {
                    x = (attn + &x)?;
                    let hm = block.post_attention_layernorm.forward(&x, pass)?;
                    let (out, l1_tokens) = block.mlp.forward_with_l1(&hm)?;
                    l1.push(l1_tokens.to_dtype(DType::F32)?.mean_all()?);
                    x = (out + &x)?;
                    h = next.forward(&x, pass)?;
                }
                // The fused add + norm has a backward, so training with the fused ops
                // takes it as inference does.
                _ => {
                    (x, h) = match pass {
                        Pass::Train => {
                            let (sum, hm) =
                                block.post_attention_layernorm.add_forward(&x, &attn)?;
                            let (out, l1_tokens) = block.mlp.forward_with_l1(&hm)?;
                            l1.push(l1_tokens.to_dtype(DType::F32)?.mean_all()?);
                            next.add_forward(&sum, &out)?
                        }
                        // A one-token step on the sparse CUDA path runs the whole MLP
                        // sublayer, the add + norm on each side included, as one launch.
                        Pass::Inference => block.mlp_sublayer(&x, &attn, next)?,
                    };
                }
            }
        }
        Ok((rows_to_batch(h)?, l1))
    }

    /// One decode step of several sequences at once, each with its own cache and at its
    /// own position: `tokens[i]` at `positions[i]` of `caches[i]` (continuous batching:
    /// the sequences need not have started together). Returns logits `[n, vocab]`.
    ///
    /// The attention runs per sequence, over its own cache; the output projections, the
    /// MLPs and the head run once over the n rows, so a step reads their weights once
    /// for all the sequences instead of once each.
    pub fn forward_decode_batch(
        &self,
        tokens: &[u32],
        positions: &[usize],
        caches: &mut [&mut Cache],
    ) -> Result<Tensor> {
        let n = tokens.len();
        if n == 0 || positions.len() != n || caches.len() != n {
            candle_core::bail!(
                "forward_decode_batch: {} tokens, {} positions and {} caches (want as many, at least one)",
                n,
                positions.len(),
                caches.len()
            );
        }
        let max_pos = self.config.max_position_embeddings;
        for (i, (&pos, cache)) in positions.iter().zip(caches.iter()).enumerate() {
            if pos >= max_pos {
                candle_core::bail!(
                    "sequence {i} reaches position {} but the model supports {max_pos}",
                    pos + 1
                );
            }
            if !cache.use_kv_cache || cache.len() != pos {
                candle_core::bail!(
                    "sequence {i}: its cache holds {} positions, the step is at {pos} (a decode step continues its cache)",
                    cache.len()
                );
            }
        }
        let device = self.device();
        let ids = Tensor::new(tokens, device)?;
        let x = self.embed_tokens.forward(&ids)?;
        let ropes = positions
            .iter()
            .zip(caches.iter())
            .map(|(&pos, c)| c.rope.narrow(pos, 1))
            .collect::<Result<Vec<_>>>()?;
        let longest = positions.iter().max().copied().unwrap_or(0) + 1;
        let fused = match self.attention_path {
            AttentionPath::Auto => fused_attention(
                device,
                x.dtype(),
                self.config.head_dim(),
                self.config.num_attention_heads,
                1,
                longest,
            ),
            AttentionPath::Fused => true,
            AttentionPath::Plain => false,
        };
        self.decode_layers(x, |l, block, h| {
            let ys = caches
                .iter_mut()
                .zip(&ropes)
                .enumerate()
                .map(|(i, (cache, rope))| {
                    block.self_attn.attend(
                        &h.narrow(0, i, 1)?,
                        (1, 1),
                        rope,
                        None,
                        Some(&mut cache.kvs[l]),
                        Pass::Inference,
                        fused,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&ys, 0)
        })
    }

    /// One decode step over slotted caches ([`crate::decode::SlotDecoder`]): `ids`,
    /// `positions` and `slots` (`[n]` u32 on the device) give each row's token, its
    /// position and its cache slot in every layer's `kv[l]` (`[slots, capacity, 2 ·
    /// kv_heads · hd]`). Every shape is fixed by `n` and no value is read on the host,
    /// so the step can be captured as a CUDA graph. Returns logits `[n, vocab]` in f32.
    pub(crate) fn forward_decode_slots(
        &self,
        (ids, positions, slots): (&Tensor, &Tensor, &Tensor),
        kv: &[Tensor],
        attention: &fused_ops::SlotAttention,
        rope: &RopeTable,
    ) -> Result<Tensor> {
        let x = self.embed_tokens.forward(ids)?;
        self.decode_layers(x, |l, block, h| {
            let Some(qkv_proj) = &block.self_attn.qkv_proj else {
                candle_core::bail!(
                    "decoding over slots needs fused q, k, v projections (fuse_qkv)"
                );
            };
            attention.forward(&project(qkv_proj, h)?, rope, &kv[l], positions, slots)
        })
    }

    /// The layers of a decode step (one row a sequence) from the embedded rows `x`:
    /// `attend(l, block, h)` gives layer `l`'s attention rows before the output
    /// projection, from its normalised input `h`; the output projection, the MLP
    /// sublayer (with the norms on each side) and the head run once over all rows.
    /// Returns logits `[rows, vocab]` in f32.
    fn decode_layers(
        &self,
        mut x: Tensor,
        mut attend: impl FnMut(usize, &Block, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let Some(first) = self.blocks.first() else {
            return self
                .lm_head
                .forward(&self.norm.forward(&x, Pass::Inference)?)?
                .to_dtype(DType::F32);
        };
        let mut h = first.input_layernorm.forward(&x, Pass::Inference)?;
        for (l, block) in self.blocks.iter().enumerate() {
            let attn = block.self_attn.output(&attend(l, block, &h)?)?;
            let next = match self.blocks.get(l + 1) {
                Some(b) => &b.input_layernorm,
                None => &self.norm,
            };
            (x, h) = block.mlp_sublayer(&x, &attn, next)?;
        }
        self.lm_head.forward(&h)?.to_dtype(DType::F32)
    }

    /// Logits of the last position, `[b, vocab]` in f32 (as candle-transformers).
    pub fn forward(&self, x: &Tensor, index_pos: usize, cache: &mut Cache) -> Result<Tensor> {
        let (_, t) = x.dims2()?;
        let (h, _) = self.run(x, index_pos, Some(cache), Pass::Inference)?;
        let last = h.i((.., t - 1, ..))?.contiguous()?;
        self.lm_head.forward(&last)?.to_dtype(DType::F32)
    }

    /// [`Self::forward`] from input embeddings `[b, t, hidden]` instead of token ids
    /// (as candle-transformers, for models such as LLaVA that splice in other
    /// embeddings).
    pub fn forward_input_embed(
        &self,
        input_embed: &Tensor,
        index_pos: usize,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let (b, t, h) = input_embed.dims3()?;
        if h != self.config.hidden_size {
            candle_core::bail!(
                "forward_input_embed: embeddings of width {h}, the model's hidden size is {}",
                self.config.hidden_size
            );
        }
        let x = input_embed
            .to_dtype(self.dtype())?
            .reshape((b * t, h))?
            .contiguous()?;
        let (hidden, _) = self.run_embedded(x, (b, t), index_pos, Some(cache), Pass::Inference)?;
        let last = hidden.i((.., t - 1, ..))?.contiguous()?;
        self.lm_head.forward(&last)?.to_dtype(DType::F32)
    }

    /// Logits of every position, `[b, t, vocab]` in f32.
    pub fn forward_all(&self, x: &Tensor, index_pos: usize, cache: &mut Cache) -> Result<Tensor> {
        let (h, _) = self.run(x, index_pos, Some(cache), Pass::Inference)?;
        self.lm_head.forward(&h)?.to_dtype(DType::F32)
    }

    /// Differentiable forward over whole sequences (no cache): all logits and the L1 term
    /// averaged over layers.
    pub fn forward_train(&self, x: &Tensor) -> Result<TrainOutput> {
        if self.is_tensor_parallel() {
            candle_core::bail!("a tensor-parallel model (shard_ffn) runs inference only");
        }
        if self.f32_released {
            candle_core::bail!(
                "this model keeps quantized rows only (load_quantized): load it again to train"
            );
        }
        if matches!(self.lm_head, Head::Quantized(_)) {
            candle_core::bail!(
                "this model's head is quantized for inference (quantize_for_cpu): its gradient \
                 would reach no trained variable; load the model again to train"
            );
        }
        let (h, l1) = self.run(x, 0, None, Pass::Train)?;
        // In the model's dtype: the loss reads bf16 logits itself (`fused_ops::
        // cross_entropy`), where an f32 copy would be the largest tensor of the step.
        let logits = self.lm_head.forward(&h)?;
        let l1 = Tensor::stack(&l1, 0)?.mean_all()?;
        Ok(TrainOutput { logits, l1 })
    }

    /// Sets every layer's sparsity term (see [`SparseMlp::set_l1_term`]).
    pub fn set_l1_term(&mut self, term: twell::L1Term) {
        for b in &mut self.blocks {
            b.mlp.set_l1_term(term);
        }
    }

    /// Sets the feed-forward path of every layer.
    pub fn set_ffn_mode(&mut self, mode: FfnMode) -> Result<()> {
        for b in &mut self.blocks {
            b.mlp.set_mode(mode)?;
        }
        self.config.ffn_mode = mode;
        Ok(())
    }

    /// Sets the feed-forward path of one layer.
    pub fn set_layer_ffn_mode(&mut self, layer: usize, mode: FfnMode) -> Result<()> {
        match self.blocks.get_mut(layer) {
            Some(b) => b.mlp.set_mode(mode),
            None => candle_core::bail!(
                "layer {layer} out of range (model has {})",
                self.blocks.len()
            ),
        }
    }

    /// Keep per-layer FFN statistics of each forward (costs a pass over `h` on the
    /// dense path).
    pub fn record_ffn_stats(&mut self, on: bool) {
        for b in &mut self.blocks {
            b.mlp.set_record_stats(on);
        }
    }

    /// Keep every layer's MLP input rows from here on (see
    /// [`SparseMlp::set_keep_inputs`]): what the model's own text feeds each layer, for
    /// benchmarks on real activations.
    pub fn keep_mlp_inputs(&mut self, on: bool) {
        for b in &mut self.blocks {
            b.mlp.set_keep_inputs(on);
        }
    }

    /// Each layer's MLP input rows kept since the last call, `[rows, hidden]` (the
    /// forwards' rows one after another; empty where none were kept).
    pub fn take_mlp_inputs(&self) -> Result<Vec<Tensor>> {
        self.blocks
            .iter()
            .map(|b| {
                let rows = b.mlp.take_inputs();
                match rows.is_empty() {
                    true => {
                        Tensor::zeros((0, self.config.hidden_size), self.dtype(), self.device())
                    }
                    false => Tensor::cat(&rows, 0),
                }
            })
            .collect()
    }

    /// Each layer's FFN statistics from the last forward (with `record_ffn_stats`).
    pub fn ffn_stats(&self) -> Result<Vec<Option<MlpStats>>> {
        self.blocks.iter().map(|b| b.mlp.last_stats()).collect()
    }

    /// The layers' MLPs, e.g. to read weights for saving.
    pub fn mlps(&self) -> impl Iterator<Item = &SparseMlp> {
        self.blocks.iter().map(|b| &b.mlp)
    }
}

#[cfg(test)]
mod tests {
    use super::{LayerKv, KV_CHUNK};
    use candle_core::{DType, Device, Result, Tensor};

    /// Rows that tell positions apart: `[b, t, 8]` from `start`.
    fn rows(b: usize, t: usize, start: usize) -> Result<Tensor> {
        let n = b * t * 8;
        Tensor::arange(start as u32 * 1000, (start * 1000 + n) as u32, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .reshape((b, t, 8))
    }

    #[test]
    fn kv_cache_appends_across_chunks_as_a_concatenation_would() -> Result<()> {
        // A 200-row prompt is kept as given; + 100 grows to two chunks; + 1 is a step.
        let mut slot = None;
        let mut all = Vec::new();
        for (i, t) in [200usize, 100, 1].into_iter().enumerate() {
            let kv = rows(2, t, 10 * i)?;
            let cached = LayerKv::append(&mut slot, &kv)?;
            all.push(kv);
            let want = Tensor::cat(&all, 1)?;
            assert_eq!(cached.dims(), want.dims());
            let diff = (cached - want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "after {t} more");
        }
        let kv = slot.clone().expect("filled");
        assert_eq!(kv.len, 301);
        assert_eq!(kv.kv.dim(1)?, 2 * KV_CHUNK);
        // Another batch size without a reset is an error, not garbage.
        let err = LayerKv::append(&mut slot, &rows(3, 1, 0)?).unwrap_err();
        assert!(err.to_string().contains("reset the cache"), "{err}");
        Ok(())
    }
}
