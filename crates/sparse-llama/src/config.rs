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
    pub rope_scaling: Option<serde_json::Value>,
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

    /// Checks what we support and builds the runtime config. `use_flash_attn` is
    /// there for signature parity with candle-transformers; flash attention is not
    /// supported and asking for it is an error.
    pub fn into_config(self, use_flash_attn: bool) -> Result<Config> {
        if use_flash_attn {
            return err(LlamaError::Unsupported("flash attention".into()));
        }
        if let Some(archs) = &self.architectures {
            if !archs.iter().any(|a| a == "LlamaForCausalLM") {
                return err(LlamaError::Unsupported(format!(
                    "architecture {archs:?}: only LlamaForCausalLM is supported"
                )));
            }
        }
        if let Some(kind) = &self.model_type {
            if kind != "llama" {
                return err(LlamaError::Unsupported(format!(
                    "model_type '{kind}': only 'llama' is supported"
                )));
            }
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return err(LlamaError::Unsupported(
                "rope_scaling is not supported yet".into(),
            ));
        }
        let heads = self.num_attention_heads;
        let kv = self.num_key_value_heads();
        if self.hidden_size == 0
            || heads == 0
            || kv == 0
            || self.num_hidden_layers == 0
            || self.vocab_size == 0
            || self.intermediate_size == 0
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
        if let Some(hd) = self.head_dim {
            if hd * heads != self.hidden_size {
                return err(LlamaError::Unsupported(format!(
                    "head_dim {hd} x {heads} heads != hidden_size"
                )));
            }
        }
        if !(self.hidden_size / heads).is_multiple_of(2) {
            return err(LlamaError::BadConfig(
                "head_dim must be even for RoPE".into(),
            ));
        }
        let activation = Activation::from_hf(&self.hidden_act)?;
        let settings = self.twell.clone().unwrap_or_default();
        let ffn_mode = settings.ffn_mode;
        let twell = TwellConfig::new(settings.tile, settings.compression)?;
        Ok(Config {
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
            ffn_mode,
            twell,
            l1_coefficient: settings.l1_coefficient,
        })
    }
}

impl Config {
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
            rope_scaling: None,
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
