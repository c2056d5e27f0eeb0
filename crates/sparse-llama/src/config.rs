//! Model configuration: HF `config.json` (LlamaForCausalLM) in, runtime [`Config`] out,
//! and back again.
//!
//! Our own settings live in an optional `"twell"` block that transformers ignores, so
//! a saved sparse checkpoint stays a plain Llama checkpoint.

use std::path::Path;

use candle_core::Result;
use serde::{Deserialize, Serialize};
use twell::{Activation, FfnMode, TwellConfig};

use crate::error::{err, LlamaError};

/// The context candle-transformers' Llama assumes when a config gives none.
pub const DEFAULT_MAX_SEQ_LEN: usize = 4096;

/// HF `rope_scaling.rope_type` (candle-transformers' names).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Llama3RopeType {
    #[serde(rename = "llama3")]
    Llama3,
    #[default]
    #[serde(rename = "default")]
    Default,
}

/// HF `rope_scaling` of Llama 3.1 and later: long wavelengths slowed by `factor`, short
/// ones kept, a smooth blend between.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeConfig {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
    pub rope_type: Llama3RopeType,
}

impl Llama3RopeConfig {
    /// Scales RoPE's inverse frequencies (`inv_freq[i] = θ^(-2i/d)`) as Llama 3 does.
    pub fn scale_inv_freq(&self, inv_freq: &mut [f32]) {
        if self.rope_type == Llama3RopeType::Default {
            return;
        }
        let old = self.original_max_position_embeddings as f32;
        let low_wavelen = old / self.low_freq_factor;
        let high_wavelen = old / self.high_freq_factor;
        for f in inv_freq.iter_mut() {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            if wavelen < high_wavelen {
                continue;
            }
            if wavelen > low_wavelen {
                *f /= self.factor;
            } else {
                let smooth = (old / wavelen - self.low_freq_factor)
                    / (self.high_freq_factor - self.low_freq_factor);
                *f = (1.0 - smooth) * *f / self.factor + smooth * *f;
            }
        }
    }
}

/// End-of-sequence ids: HF allows one or several.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LlamaEosToks {
    Single(u32),
    Multiple(Vec<u32>),
}

impl LlamaEosToks {
    pub fn ids(&self) -> Vec<u32> {
        match self {
            Self::Single(id) => vec![*id],
            Self::Multiple(ids) => ids.clone(),
        }
    }
}

/// Our optional block in `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SparseSettings {
    /// The feed-forward path, written "dense", "sparse" or "auto".
    #[serde(default, with = "ffn_mode_name")]
    pub ffn_mode: FfnMode,
    /// TwELL tile width.
    #[serde(default = "default_tile")]
    pub tile: usize,
    /// TwELL compression factor.
    #[serde(default = "default_compression")]
    pub compression: usize,
    /// The L1 coefficient the checkpoint was fine-tuned with, for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l1_coefficient: Option<f64>,
}

/// [`FfnMode`] in `config.json`: its lowercase name.
mod ffn_mode_name {
    use serde::{Deserialize, Deserializer, Serializer};
    use twell::FfnMode;

    pub fn serialize<S: Serializer>(mode: &FfnMode, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(mode.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<FfnMode, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}
fn default_tile() -> usize {
    twell::format::DEFAULT_TILE
}
fn default_compression() -> usize {
    twell::format::DEFAULT_COMPRESSION
}

impl Default for SparseSettings {
    fn default() -> Self {
        Self {
            ffn_mode: FfnMode::Auto,
            tile: default_tile(),
            compression: default_compression(),
            l1_coefficient: None,
        }
    }
}

fn default_rope_theta() -> f32 {
    10_000.0
}
fn default_max_pos() -> usize {
    4096
}
fn default_act() -> String {
    "silu".into()
}
fn default_eps() -> f64 {
    1e-6
}

/// HF `config.json` of a `LlamaForCausalLM`, the fields we read and write.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<LlamaEosToks>,
    #[serde(default)]
    pub rope_scaling: Option<Llama3RopeConfig>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub twell: Option<SparseSettings>,
}

/// The runtime configuration, mirroring candle-transformers' `llama::Config`, plus
/// the feed-forward choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<LlamaEosToks>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    /// HF `mlp_bias`: the MLP's three projections have biases (such a model runs the
    /// dense FFN: the TwELL kernels do not apply biases).
    pub mlp_bias: bool,
    /// The gate activation the weights were trained with.
    pub activation: Activation,
    /// Dense, TwELL-sparse, or chosen per call from the measured density.
    pub ffn_mode: FfnMode,
    pub twell: TwellConfig,
    /// The L1 coefficient recorded in the checkpoint, if any.
    pub l1_coefficient: Option<f64>,
    /// Asked for by candle-transformers' signature; flash attention is not built, so a
    /// model is refused with it on.
    pub use_flash_attn: bool,
    pub rope_scaling: Option<Llama3RopeConfig>,
    /// What [`LlamaConfig::into_config`] found that no model can be built from
    /// (candle-transformers' `into_config` cannot fail): [`Config::validate`] reports it
    /// when a model or cache is built.
    pub unsupported: Option<String>,
}

impl LlamaConfig {
    /// Reads and validates a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| LlamaError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        serde_json::from_str(&text).map_err(|e| {
            LlamaError::BadFile {
                path: path.to_path_buf(),
                detail: format!("not a valid Llama config.json: {e}"),
            }
            .into()
        })
    }

    pub fn num_key_value_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// The runtime config, as candle-transformers' `into_config` (which cannot fail):
    /// what cannot run is kept in [`Config::unsupported`] and refused when a model or
    /// cache is built from it ([`Config::validate`]). [`Self::try_into_config`] checks at
    /// once.
    pub fn into_config(self, use_flash_attn: bool) -> Config {
        let mut problems = Vec::new();
        if let Some(archs) = &self.architectures {
            if !archs.iter().any(|a| a == "LlamaForCausalLM") {
                problems.push(format!(
                    "architecture {archs:?}: only LlamaForCausalLM is supported"
                ));
            }
        }
        if let Some(kind) = &self.model_type {
            if kind != "llama" {
                problems.push(format!("model_type '{kind}': only 'llama' is supported"));
            }
        }
        let heads = self.num_attention_heads;
        let kv = self.num_key_value_heads();
        if let Some(hd) = self.head_dim {
            if heads > 0 && hd * heads != self.hidden_size {
                problems.push(format!("head_dim {hd} x {heads} heads != hidden_size"));
            }
        }
        let activation = Activation::from_hf(&self.hidden_act).unwrap_or_else(|e| {
            problems.push(e.to_string());
            Activation::Silu
        });
        let settings = self.twell.clone().unwrap_or_default();
        let twell = TwellConfig::new(settings.tile, settings.compression).unwrap_or_else(|e| {
            problems.push(e.to_string());
            TwellConfig::default()
        });
        Config {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            bos_token_id: self.bos_token_id,
            eos_token_id: self.eos_token_id,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            attention_bias: self.attention_bias.unwrap_or(false),
            mlp_bias: self.mlp_bias.unwrap_or(false),
            activation,
            ffn_mode: settings.ffn_mode,
            twell,
            l1_coefficient: settings.l1_coefficient,
            use_flash_attn,
            rope_scaling: self.rope_scaling,
            unsupported: (!problems.is_empty()).then(|| problems.join("; ")),
        }
    }

    /// [`Self::into_config`], checked ([`Config::validate`]).
    pub fn try_into_config(self, use_flash_attn: bool) -> Result<Config> {
        let cfg = self.into_config(use_flash_attn);
        cfg.validate()?;
        Ok(cfg)
    }
}

impl Config {
    /// candle-transformers' LLaMA-1 7B.
    pub fn config_7b_v1(use_flash_attn: bool) -> Self {
        Self::llama_7b(use_flash_attn, 1e-6)
    }

    /// candle-transformers' Llama-2 7B.
    pub fn config_7b_v2(use_flash_attn: bool) -> Self {
        Self::llama_7b(use_flash_attn, 1e-5)
    }

    fn llama_7b(use_flash_attn: bool, rms_norm_eps: f64) -> Self {
        Self {
            hidden_size: 4096,
            intermediate_size: 11008,
            vocab_size: 32000,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            rms_norm_eps,
            rope_theta: 10_000.0,
            bos_token_id: None,
            eos_token_id: None,
            max_position_embeddings: DEFAULT_MAX_SEQ_LEN,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            activation: Activation::Silu,
            ffn_mode: FfnMode::Auto,
            twell: TwellConfig::default(),
            l1_coefficient: None,
            use_flash_attn,
            rope_scaling: None,
            unsupported: None,
        }
    }

    /// Whether a model can be built from this config: the problems `into_config` kept,
    /// sizes, head counts, flash attention.
    pub fn validate(&self) -> Result<()> {
        if let Some(problem) = &self.unsupported {
            return err(LlamaError::Unsupported(problem.clone()));
        }
        if self.use_flash_attn {
            return err(LlamaError::Unsupported(
                "flash attention (this model runs its own attention kernels)".into(),
            ));
        }
        let (heads, kv) = (self.num_attention_heads, self.num_key_value_heads);
        if self.hidden_size == 0
            || heads == 0
            || kv == 0
            || self.num_hidden_layers == 0
            || self.vocab_size == 0
            || self.intermediate_size == 0
            || self.max_position_embeddings == 0
        {
            return err(LlamaError::BadConfig(
                "every size must be at least 1".into(),
            ));
        }
        if !self.hidden_size.is_multiple_of(heads) || !heads.is_multiple_of(kv) {
            return err(LlamaError::BadConfig(format!(
                "hidden_size {} must divide into {heads} heads, and heads into {kv} kv heads",
                self.hidden_size
            )));
        }
        if !(self.hidden_size / heads).is_multiple_of(2) {
            return err(LlamaError::BadConfig(
                "head_dim must be even for RoPE".into(),
            ));
        }
        if let Some(r) = &self.rope_scaling {
            let finite = [r.factor, r.low_freq_factor, r.high_freq_factor]
                .iter()
                .all(|v| v.is_finite() && *v > 0.0);
            if r.rope_type == Llama3RopeType::Llama3
                && (!finite
                    || r.high_freq_factor <= r.low_freq_factor
                    || r.original_max_position_embeddings == 0)
            {
                return err(LlamaError::BadConfig(format!(
                    "rope_scaling {r:?}: factors must be positive with high_freq_factor > low_freq_factor"
                )));
            }
        }
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// The HF config to save beside the weights (dtype as stored).
    pub fn to_hf(&self, torch_dtype: &str) -> LlamaConfig {
        LlamaConfig {
            architectures: Some(vec!["LlamaForCausalLM".into()]),
            model_type: Some("llama".into()),
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: Some(self.num_key_value_heads),
            head_dim: Some(self.head_dim()),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            bos_token_id: self.bos_token_id,
            eos_token_id: self.eos_token_id.clone(),
            rope_scaling: self.rope_scaling.clone(),
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: Some(self.tie_word_embeddings),
            hidden_act: self.activation.hf_name().into(),
            attention_bias: Some(self.attention_bias),
            mlp_bias: Some(self.mlp_bias),
            torch_dtype: Some(torch_dtype.into()),
            twell: Some(SparseSettings {
                ffn_mode: self.ffn_mode,
                tile: self.twell.tile(),
                compression: self.twell.compression(),
                l1_coefficient: self.l1_coefficient,
            }),
        }
    }

    /// All end-of-sequence ids.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(|e| e.ids())
            .unwrap_or_default()
    }

    /// Parameters of the model (embedding counted once when tied).
    pub fn num_parameters(&self) -> usize {
        let (h, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let kv = self.num_key_value_heads * self.head_dim();
        let attn = h * h * 2 + 2 * h * kv;
        let per_layer = attn + 3 * h * f + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * per_layer + h + head
    }
}
