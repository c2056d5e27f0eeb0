//! Random-weight Llama models of any shape whose FFN activation density is set in
//! advance, for benchmarks at sizes no checkpoint here has.
//!
//! The trick of `twell::density`, carried through a whole model: channel 0 of every
//! token embedding is the constant 1, and no layer writes to it (row 0 of every
//! `o_proj` and `down_proj` is zero), so the residual stream keeps that constant
//! feature. Each gate's column 0 is then a negative bias `−Φ⁻¹(1 − p)·σ·√(d − 1)`, which
//! makes every neuron fire with probability about `p`. The RMS norm rescales the
//! feature a little per token, so the measured density is reported, never assumed.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use rand::rngs::StdRng;
use rand::SeedableRng;
use twell::density::{gaussian, inverse_normal_cdf};

use crate::config::{Config, LlamaConfig};

/// The HF config of a random model: `hidden`, `ffn`, `layers`, `heads` (and KV heads),
/// `vocab`, ReLU gate.
pub fn config(
    hidden: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
) -> Result<Config> {
    let hf: LlamaConfig = serde_json::from_value(serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": true,
        "hidden_act": "relu",
        "bos_token_id": 256,
        "eos_token_id": 257
    }))
    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    hf.try_into_config(false)
}

/// Weights (HF names) for `cfg` with FFN density about `density`, made on the CPU in
/// f32 and moved to `device` in `dtype` one tensor at a time.
pub fn weights(
    cfg: &Config,
    density: f64,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    if !(density > 0.0 && density < 1.0) {
        candle_core::bail!("density must be in (0, 1), got {density}");
    }
    let (h, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let kv = cfg.num_key_value_heads * cfg.head_dim();
    // Weight scale of a typical init; outputs into the residual stream are kept small
    // so the stream's scale (and the constant feature's share) stays put with depth.
    let std = 0.02;
    let out_std = 0.02 / (2.0 * cfg.num_hidden_layers as f64).sqrt();
    let bias = -inverse_normal_cdf(1.0 - density) * std * ((h - 1) as f64).sqrt();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = HashMap::new();
    let mut put = |name: String, data: Vec<f32>, shape: &[usize]| -> Result<()> {
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?;
        out.insert(name, t);
        Ok(())
    };
    let mut emb = gaussian(&mut rng, v * h, 1.0);
    for r in 0..v {
        emb[r * h] = 1.0;
    }
    put("model.embed_tokens.weight".into(), emb, &[v, h])?;
    put("model.norm.weight".into(), vec![1.0; h], &[h])?;
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        put(
            format!("{p}.self_attn.q_proj.weight"),
            gaussian(&mut rng, h * h, std),
            &[h, h],
        )?;
        put(
            format!("{p}.self_attn.k_proj.weight"),
            gaussian(&mut rng, kv * h, std),
            &[kv, h],
        )?;
        put(
            format!("{p}.self_attn.v_proj.weight"),
            gaussian(&mut rng, kv * h, std),
            &[kv, h],
        )?;
        let mut o = gaussian(&mut rng, h * h, out_std);
        o[..h].iter_mut().for_each(|x| *x = 0.0); // never write channel 0
        put(format!("{p}.self_attn.o_proj.weight"), o, &[h, h])?;
        let mut gate = gaussian(&mut rng, f * h, std);
        for j in 0..f {
            gate[j * h] = bias as f32;
        }
        put(format!("{p}.mlp.gate_proj.weight"), gate, &[f, h])?;
        put(
            format!("{p}.mlp.up_proj.weight"),
            gaussian(&mut rng, f * h, std),
            &[f, h],
        )?;
        let mut down = gaussian(&mut rng, h * f, out_std);
        down[..f].iter_mut().for_each(|x| *x = 0.0); // never write channel 0
        put(format!("{p}.mlp.down_proj.weight"), down, &[h, f])?;
        put(format!("{p}.input_layernorm.weight"), vec![1.0; h], &[h])?;
        put(
            format!("{p}.post_attention_layernorm.weight"),
            vec![1.0; h],
            &[h],
        )?;
    }
    Ok(out)
}
