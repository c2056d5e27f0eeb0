//! Checkpoints in and out: HF directories (single or sharded safetensors), model ids
//! resolved offline from the hf-hub cache, and GGUF files; saving in HF layout that
//! transformers' `LlamaForCausalLM` loads.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use tokenizers::Tokenizer;
use twell::{Activation, FfnMode};

use crate::adapter::LoraAdapter;
use crate::config::{Config, LlamaConfig};
use crate::error::{err, LlamaError};
use crate::gguf::{load_gguf, GgufTensors};
use crate::model::Llama;
use crate::tokenizer::{load_tokenizer, ChatFormat};

/// Where the weights are.
pub enum Weights {
    /// Safetensors files, memory-mapped on load.
    Safetensors(Vec<PathBuf>),
    /// Tensors already in memory, HF names, f32 on the CPU.
    Tensors(HashMap<String, Tensor>),
    /// A GGUF's tensors, each dequantized when asked for, with an adapter merged into
    /// each as it is read: loading never holds the whole f32 copy.
    Gguf {
        file: Arc<GgufTensors>,
        adapter: Option<Arc<LoraAdapter>>,
    },
}

/// A VarBuilder backend over [`Weights::Gguf`].
struct GgufBackend {
    file: Arc<GgufTensors>,
    adapter: Option<Arc<LoraAdapter>>,
    /// Leaves the adapter's low-rank factors of the attention out: the model applies
    /// them itself ([`Llama::load_quantized`]).
    attention_factors_apart: bool,
}

impl GgufBackend {
    fn read(&self, name: &str) -> Result<Tensor> {
        let t = self.file.tensor(name)?;
        match &self.adapter {
            Some(a) => {
                let factors = !(self.attention_factors_apart && is_attention_weight(name));
                a.merge_parts(name, t, factors)
            }
            None => Ok(t),
        }
    }
}

/// Whether an HF weight name is one of a layer's attention projections.
fn is_attention_weight(name: &str) -> bool {
    name.contains(".self_attn.") && name.ends_with("_proj.weight")
}

impl candle_nn::var_builder::SimpleBackend for GgufBackend {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = self.read(name)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt());
        }
        t.to_dtype(dtype)?.to_device(dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.read(name)?.to_dtype(dtype)?.to_device(dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.file.contains(name)
    }
}

/// A checkpoint opened but not yet placed on a device.
pub struct Checkpoint {
    pub config: LlamaConfig,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<String>,
    /// The directory or file it came from.
    pub source: PathBuf,
    /// For a GGUF, the block type its layers' matrices share (e.g. Q4_1), while the
    /// weights are the file's own: quantized inference can keep that format without
    /// rounding anything again. `None` elsewhere, and after an adapter is merged.
    pub layer_block_type: Option<candle_core::quantized::GgmlDType>,
    /// The same for the attention's matrices, which stay the file's own also under an
    /// adapter that changes them through low-rank factors only: quantized CPU inference
    /// runs those factors beside the file's blocks ([`Checkpoint::load_model_quantized`]).
    pub attention_block_type: Option<candle_core::quantized::GgmlDType>,
}

/// Overrides applied when building the model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Replace the checkpoint's activation (e.g. ReLU on a SiLU model).
    pub activation: Option<Activation>,
    pub ffn_mode: Option<FfnMode>,
}

pub(crate) fn io_err(path: &Path, e: std::io::Error) -> candle_core::Error {
    LlamaError::Io {
        path: path.to_path_buf(),
        source: e,
    }
    .into()
}

impl Checkpoint {
    /// Opens `spec`: an HF checkpoint directory, a `.gguf` file, or a model id
    /// (`org/name`) found in the local hf-hub cache (never downloaded).
    pub fn open(spec: &str) -> Result<Self> {
        let path = Path::new(spec);
        if path.is_dir() {
            return Self::open_dir(path);
        }
        if path.is_file() {
            return match path.extension().and_then(|e| e.to_str()) {
                Some("gguf") => Self::open_gguf(path),
                _ => err(LlamaError::Unsupported(format!(
                    "{spec}: a model file must be .gguf (or pass an HF checkpoint directory)"
                ))),
            };
        }
        if spec.split('/').count() == 2 && !spec.starts_with('.') && !spec.contains("..") {
            return Self::open_hub(spec);
        }
        err(LlamaError::NotFound(format!(
            "'{spec}' is neither a directory, a .gguf file, nor an org/name model id"
        )))
    }

    /// A model id from the hf-hub cache (`$HF_HOME`, default `~/.cache/huggingface`),
    /// offline.
    pub fn open_hub(model_id: &str) -> Result<Self> {
        Self::open_hub_in(hf_hub::Cache::from_env().path(), model_id)
    }

    /// A model id from the hf-hub cache rooted at `cache_dir` (the `hub` folder).
    pub fn open_hub_in(cache_dir: &Path, model_id: &str) -> Result<Self> {
        let cache = hf_hub::Cache::new(cache_dir.to_path_buf());
        match cache.model(model_id.to_string()).get("config.json") {
            Some(config) => match config.parent() {
                Some(dir) => Self::open_dir(dir),
                None => err(LlamaError::NotFound(format!("{model_id}: bad cache path"))),
            },
            None => err(LlamaError::NotFound(format!(
                "model '{model_id}' is not in the hf-hub cache at {} (this tool never downloads; fetch it first)",
                cache.path().display()
            ))),
        }
    }

    /// An HF checkpoint directory: `config.json`, `tokenizer.json`, and
    /// `model.safetensors` or `model.safetensors.index.json` with its shards.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            return err(LlamaError::NotFound(format!(
                "{} (not an HF checkpoint directory)",
                config_path.display()
            )));
        }
        let config = LlamaConfig::from_file(&config_path)?;
        let tokenizer = load_tokenizer(&dir.join("tokenizer.json"))?;
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files = if single.exists() {
            vec![single]
        } else if index.exists() {
            shard_files(&index)?
        } else {
            return err(LlamaError::NotFound(format!(
                "{}: no model.safetensors nor model.safetensors.index.json",
                dir.display()
            )));
        };
        check_safetensors(&files)?;
        let chat_template = read_chat_template(&dir.join("tokenizer_config.json"));
        Ok(Self {
            config,
            weights: Weights::Safetensors(files),
            tokenizer,
            chat_template,
            source: dir.to_path_buf(),
            layer_block_type: None,
            attention_block_type: None,
        })
    }

    pub fn open_gguf(path: &Path) -> Result<Self> {
        let g = load_gguf(path)?;
        Ok(Self {
            config: g.config,
            weights: Weights::Gguf {
                file: Arc::new(g.tensors),
                adapter: None,
            },
            tokenizer: g.tokenizer,
            chat_template: g.chat_template,
            source: path.to_path_buf(),
            layer_block_type: g.layer_block_type,
            attention_block_type: g.layer_block_type,
        })
    }

    /// The runtime config with `opts` applied.
    pub fn runtime_config(&self, opts: &LoadOptions) -> Result<Config> {
        let mut cfg = self.config.clone().try_into_config(false)?;
        if let Some(a) = opts.activation {
            cfg.activation = a;
        }
        if let Some(m) = opts.ffn_mode {
            cfg.ffn_mode = m;
        }
        if cfg.activation == Activation::Silu && cfg.ffn_mode == FfnMode::Sparse {
            return err(LlamaError::Invalid(
                "--ffn sparse needs a ReLU model (hidden_act \"relu\"): SiLU activations are never exactly zero".into(),
            ));
        }
        if cfg.mlp_bias && cfg.ffn_mode == FfnMode::Sparse {
            return Err(twell::TwellError::SparseBias.into());
        }
        if cfg.activation == Activation::Silu || cfg.mlp_bias {
            cfg.ffn_mode = FfnMode::Dense;
        }
        Ok(cfg)
    }

    pub fn var_builder(&self, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
        match &self.weights {
            // SAFETY: the files are not modified while mapped (we only read checkpoints).
            Weights::Safetensors(files) => unsafe {
                VarBuilder::from_mmaped_safetensors(files, dtype, device)
            },
            Weights::Tensors(t) => Ok(VarBuilder::from_tensors(t.clone(), dtype, device)),
            Weights::Gguf { file, adapter } => {
                let backend: Box<dyn candle_nn::var_builder::SimpleBackend> =
                    Box::new(GgufBackend {
                        file: file.clone(),
                        adapter: adapter.clone(),
                        attention_factors_apart: false,
                    });
                Ok(VarBuilder::from_backend(backend, dtype, device.clone()))
            }
        }
    }

    /// Builds the model on `device` in `dtype`.
    pub fn load_model(&self, dtype: DType, device: &Device, opts: &LoadOptions) -> Result<Llama> {
        let cfg = self.runtime_config(opts)?;
        Llama::load(self.var_builder(dtype, device)?, &cfg)
    }

    /// The model for inference on the CPU through quantized rows, quantized layer by
    /// layer as it loads ([`Llama::load_quantized`]).
    pub fn load_model_quantized(
        &self,
        opts: &LoadOptions,
        plan: crate::model::CpuQuantization,
    ) -> Result<Llama> {
        let cfg = self.runtime_config(opts)?;
        match &self.weights {
            // The attention's factors beside the file's blocks: no rounding of a merged
            // weight, and the base's 4-bit bytes.
            Weights::Gguf {
                file,
                adapter: Some(adapter),
            } if plan.attention.is_some() && self.attention_block_type.is_some() => {
                let backend = GgufBackend {
                    file: file.clone(),
                    adapter: Some(adapter.clone()),
                    attention_factors_apart: true,
                };
                let vb = VarBuilder::from_backend(Box::new(backend), DType::F32, Device::Cpu);
                Llama::load_quantized(vb, &cfg, plan, Some(adapter))
            }
            _ => Llama::load_quantized(
                self.var_builder(DType::F32, &Device::Cpu)?,
                &cfg,
                plan,
                None,
            ),
        }
    }

    /// Every weight, HF-named, on `device` in `dtype` (for training and conversion).
    pub fn tensors(&self, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
        match &self.weights {
            Weights::Tensors(t) => t
                .iter()
                .map(|(k, v)| Ok((k.clone(), v.to_dtype(dtype)?.to_device(device)?)))
                .collect(),
            Weights::Gguf { file, adapter } => {
                let backend = GgufBackend {
                    file: file.clone(),
                    adapter: adapter.clone(),
                    attention_factors_apart: false,
                };
                file.names()
                    .map(|k| {
                        Ok((
                            k.clone(),
                            backend.read(k)?.to_dtype(dtype)?.to_device(device)?,
                        ))
                    })
                    .collect()
            }
            Weights::Safetensors(files) => {
                let mut out = HashMap::new();
                for f in files {
                    for (k, v) in candle_core::safetensors::load(f, &Device::Cpu)? {
                        out.insert(k, v.to_dtype(dtype)?.to_device(device)?);
                    }
                }
                Ok(out)
            }
        }
    }

    /// Merges a LoRA adapter ([`crate::adapter`]) into the weights, checking first that
    /// this checkpoint's file is the base it was trained on, and takes the adapter's
    /// activation (a sparse fine-tune's is ReLU).
    pub fn with_adapter(mut self, adapter: &LoraAdapter) -> Result<Self> {
        if self.source.is_file() {
            adapter.check_base(&self.source)?;
        }
        let weights = std::mem::replace(&mut self.weights, Weights::Tensors(HashMap::new()));
        self.weights = match weights {
            Weights::Gguf {
                file,
                adapter: None,
            } => {
                adapter.check_names(|name| file.dims(name))?;
                Weights::Gguf {
                    file,
                    adapter: Some(Arc::new(adapter.clone())),
                }
            }
            Weights::Gguf { .. } => {
                return err(LlamaError::Invalid(
                    "an adapter is merged into this checkpoint already".into(),
                ))
            }
            Weights::Tensors(mut tensors) => {
                adapter.merge_into(&mut tensors)?;
                Weights::Tensors(tensors)
            }
            Weights::Safetensors(files) => {
                self.weights = Weights::Safetensors(files);
                let mut tensors = self.tensors(DType::F32, &Device::Cpu)?;
                adapter.merge_into(&mut tensors)?;
                Weights::Tensors(tensors)
            }
        };
        self.layer_block_type = None;
        let whole_attention_delta = adapter
            .full
            .iter()
            .any(|(name, _)| is_attention_weight(name));
        if whole_attention_delta || !matches!(self.weights, Weights::Gguf { .. }) {
            self.attention_block_type = None;
        }
        self.config.hidden_act = adapter.activation()?.hf_name().into();
        Ok(self)
    }

    /// How to lay out a chat prompt for this model.
    pub fn chat_format(&self) -> Result<ChatFormat> {
        match &self.chat_template {
            Some(t) => ChatFormat::from_template(t),
            None => err(LlamaError::Unsupported(
                "this checkpoint has no chat template; use a plain prompt".into(),
            )),
        }
    }
}

fn shard_files(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|e| io_err(index, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| LlamaError::BadFile {
        path: index.to_path_buf(),
        detail: format!("invalid JSON: {e}"),
    })?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        return err(LlamaError::BadFile {
            path: index.to_path_buf(),
            detail: "no \"weight_map\" object".into(),
        });
    };
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut seen = HashSet::new();
    let mut files = Vec::new();
    for v in map.values() {
        let Some(name) = v.as_str() else {
            return err(LlamaError::BadFile {
                path: index.to_path_buf(),
                detail: "weight_map values must be file names".into(),
            });
        };
        if seen.insert(name.to_string()) {
            let f = dir.join(name);
            if !f.exists() {
                return err(LlamaError::NotFound(format!(
                    "shard {} named in {}",
                    f.display(),
                    index.display()
                )));
            }
            files.push(f);
        }
    }
    files.sort();
    Ok(files)
}

/// Rejects unreadable safetensors and non-float weights up front, so a bad file is
/// named instead of failing (or silently converting) deep inside loading.
fn check_safetensors(files: &[PathBuf]) -> Result<()> {
    for f in files {
        let bytes = std::fs::read(f).map_err(|e| io_err(f, e))?;
        let st =
            safetensors::SafeTensors::deserialize(&bytes).map_err(|e| LlamaError::BadFile {
                path: f.clone(),
                detail: format!("not a valid safetensors file: {e}"),
            })?;
        for (name, view) in st.tensors() {
            use safetensors::Dtype::*;
            if !matches!(view.dtype(), F32 | F16 | BF16 | F64) {
                return err(LlamaError::Unsupported(format!(
                    "{}: tensor '{name}' has dtype {:?} (float weights only)",
                    f.display(),
                    view.dtype()
                )));
            }
        }
    }
    Ok(())
}

fn read_chat_template(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json.get("chat_template")?.as_str().map(str::to_string)
}

/// The HF `torch_dtype` name of a candle dtype.
pub fn torch_dtype_name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("float32"),
        DType::BF16 => Ok("bfloat16"),
        DType::F16 => Ok("float16"),
        other => err(LlamaError::Unsupported(format!(
            "saving weights as {other:?}"
        ))),
    }
}

/// Saves an HF checkpoint directory: `model.safetensors` (in `dtype`), `config.json`,
/// `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`.
pub fn save_hf(
    dir: &Path,
    tensors: &HashMap<String, Tensor>,
    config: &Config,
    tokenizer: &Tokenizer,
    chat_template: Option<&str>,
    dtype: DType,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let torch_dtype = torch_dtype_name(dtype)?;
    let mut out = HashMap::new();
    for (name, t) in tensors {
        if config.tie_word_embeddings && name == "lm_head.weight" {
            continue;
        }
        out.insert(
            name.clone(),
            t.to_dtype(dtype)?.to_device(&Device::Cpu)?.contiguous()?,
        );
    }
    // Write to a temporary name first: a crash never leaves a truncated checkpoint.
    let weights = dir.join("model.safetensors");
    let partial = dir.join("model.safetensors.partial");
    candle_core::safetensors::save(&out, &partial)?;
    std::fs::rename(&partial, &weights).map_err(|e| io_err(&weights, e))?;

    let write_json = |name: &str, value: &serde_json::Value| -> Result<()> {
        let p = dir.join(name);
        let text =
            serde_json::to_string_pretty(value).map_err(|e| LlamaError::Invalid(e.to_string()))?;
        std::fs::write(&p, text).map_err(|e| io_err(&p, e))
    };
    let hf = serde_json::to_value(config.to_hf(torch_dtype))
        .map_err(|e| LlamaError::Invalid(e.to_string()))?;
    write_json("config.json", &hf)?;
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| LlamaError::Tokenizer(e.to_string()))?;
    let token = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i));
    let eos = config.eos_ids().first().copied();
    let mut tc = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.max_position_embeddings,
        "bos_token": token(config.bos_token_id),
        "eos_token": token(eos),
        "clean_up_tokenization_spaces": false,
    });
    if let Some(t) = chat_template {
        tc["chat_template"] = serde_json::Value::String(t.to_string());
    }
    write_json("tokenizer_config.json", &tc)?;
    write_json(
        "generation_config.json",
        &serde_json::json!({ "bos_token_id": config.bos_token_id, "eos_token_id": eos }),
    )?;
    Ok(())
}
