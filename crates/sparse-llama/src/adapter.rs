//! Low-rank adapters (LoRA) in Hugging Face PEFT's layout, merged into a checkpoint's
//! weights at load: `W' = m ⊙ (W + (alpha / r)·B·A)`, with `m` an optional scale per
//! output row (1 where absent).
//!
//! The sparse default model ships this way: a few MB of factors beside the base GGUF,
//! instead of a second copy of the model. A directory holds
//! - `adapter_config.json`: PEFT's keys (`r`, `lora_alpha`, `target_modules`, ...);
//! - `adapter_model.safetensors`: `base_model.model.<module>.lora_A.weight` `[r, in]`
//!   and `...lora_B.weight` `[out, r]` per adapted module, and optionally
//!   `...row_scale` `[out]` (our addition: PEFT has no per-row scale of this form);
//! - `twell_adapter.json`: what PEFT has no key for: the activation the merged model
//!   runs (`"relu"` for a sparse fine-tune) and the SHA-256 of the base it was trained
//!   on, so that merging onto another base fails instead of producing garbage;
//! - `full_deltas.gguf` (optional): for weights trained whole rather than through
//!   low-rank factors (the MLP gate and up projections of a ReLU conversion), what
//!   training added to the base's, in Q4_0 blocks under their HF names. A delta, not the
//!   weight: its quantization error is a small fraction of the change, where re-quantizing
//!   the weight would add the base's whole quantization error again;
//! - `SHA256SUMS` (optional): checked before anything is read.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use twell::cpu::low_rank::{LowRankFactors, LowRankStack};
use twell::Activation;

use crate::checkpoint::io_err;
use crate::error::{err, LlamaError};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
pub const TWELL_FILE: &str = "twell_adapter.json";
pub const CHECKSUMS_FILE: &str = "SHA256SUMS";
pub const FULL_DELTAS_FILE: &str = "full_deltas.gguf";

/// How the deltas of fully trained weights are stored: Q4_0 blocks (4.5 bits a weight,
/// symmetric about zero as a delta is).
const FULL_DELTAS_DTYPE: candle_core::quantized::GgmlDType =
    candle_core::quantized::GgmlDType::Q4_0;

/// The prefix PEFT puts before a module's name in its weight files.
const PEFT_PREFIX: &str = "base_model.model.";

/// The part of PEFT's `adapter_config.json` that merging needs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeftConfig {
    pub peft_type: String,
    pub r: usize,
    pub lora_alpha: f64,
    pub target_modules: Vec<String>,
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    #[serde(default)]
    pub task_type: Option<String>,
    #[serde(default)]
    pub bias: Option<String>,
}

/// What the merged model is, beyond PEFT's keys.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TwellAdapterInfo {
    /// The MLP gate's activation after merging (HF `hidden_act`: "relu" or "silu").
    pub hidden_act: String,
    /// SHA-256 (hex) of the base file the adapter was trained on, when it is one file.
    #[serde(default)]
    pub base_sha256: Option<String>,
    /// The base's file name, for messages.
    #[serde(default)]
    pub base_file: Option<String>,
    /// The FFN path the merged model runs by default ("dense", "sparse" or "auto"), when
    /// the adapter's maker chose one: the sparse default model says "sparse".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn_mode: Option<String>,
}

/// One adapted weight: `weight` (HF name, e.g. `model.layers.0.mlp.gate_proj.weight`)
/// gains `scale · b · a`.
#[derive(Clone, Debug)]
pub struct LoraFactor {
    pub weight: String,
    /// `[r, in]`.
    pub a: Tensor,
    /// `[out, r]`.
    pub b: Tensor,
    /// `[out]`, applied after the sum.
    pub row_scale: Option<Tensor>,
}

/// A loaded adapter.
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    pub config: PeftConfig,
    pub info: TwellAdapterInfo,
    pub factors: Vec<LoraFactor>,
    /// Deltas added to whole weights of the base (HF names, on the CPU), kept in their
    /// file's Q4_0 blocks until a merge reads each (in f32 they would be 7x the bytes).
    pub full: Vec<(String, Arc<candle_core::quantized::QTensor>)>,
    pub dir: PathBuf,
}

fn bad(path: &Path, detail: impl Into<String>) -> candle_core::Error {
    LlamaError::BadFile {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
    .into()
}

/// The SHA-256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Checks every file `dir/SHA256SUMS` lists (`<hex>  <name>` lines, as sha256sum
/// writes them). A missing or changed file is an error naming it.
pub fn verify_checksums(dir: &Path) -> Result<()> {
    let list = dir.join(CHECKSUMS_FILE);
    let text = std::fs::read_to_string(&list).map_err(|e| io_err(&list, e))?;
    let mut checked = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Some((want, name)) = line.split_once(char::is_whitespace) else {
            return Err(bad(&list, format!("malformed line '{line}'")));
        };
        let name = name.trim_start().trim_start_matches('*');
        if name.contains('/') || name.contains("..") {
            return Err(bad(
                &list,
                format!("'{name}' is not a file of this directory"),
            ));
        }
        let path = dir.join(name);
        if !path.is_file() {
            return Err(bad(&path, "missing (listed in SHA256SUMS)"));
        }
        let got = sha256_file(&path)?;
        if !got.eq_ignore_ascii_case(want) {
            return Err(bad(
                &path,
                format!("checksum mismatch: SHA256SUMS says {want}, the file hashes to {got} (a corrupted or truncated copy)"),
            ));
        }
        checked += 1;
    }
    if checked == 0 {
        return Err(bad(&list, "lists no files"));
    }
    Ok(())
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    serde_json::from_str(&text).map_err(|e| bad(path, format!("invalid JSON: {e}")))
}

fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text =
        serde_json::to_string_pretty(value).map_err(|e| LlamaError::Invalid(e.to_string()))?;
    std::fs::write(path, text).map_err(|e| io_err(path, e))
}

impl LoraAdapter {
    /// `alpha / r`, the factor on `B·A`.
    pub fn scale(&self) -> f64 {
        self.config.lora_alpha / self.config.r as f64
    }

    /// The activation the merged model runs.
    pub fn activation(&self) -> Result<Activation> {
        match self.info.hidden_act.as_str() {
            "relu" => Ok(Activation::Relu),
            "silu" => Ok(Activation::Silu),
            other => err(LlamaError::Unsupported(format!(
                "{}: hidden_act '{other}' (relu or silu)",
                self.dir.join(TWELL_FILE).display()
            ))),
        }
    }

    /// The FFN path the adapter declares, if any.
    pub fn ffn_mode(&self) -> Result<Option<twell::FfnMode>> {
        self.info
            .ffn_mode
            .as_deref()
            .map(|m| {
                m.parse()
                    .map_err(|e| bad(&self.dir.join(TWELL_FILE), format!("ffn_mode '{m}': {e}")))
            })
            .transpose()
    }

    /// Reads an adapter directory (checking `SHA256SUMS` first where there is one).
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return err(LlamaError::NotFound(format!(
                "adapter directory {}",
                dir.display()
            )));
        }
        if dir.join(CHECKSUMS_FILE).exists() {
            verify_checksums(dir)?;
        }
        let config_path = dir.join(CONFIG_FILE);
        let config: PeftConfig = read_json(&config_path)?;
        if config.peft_type != "LORA" {
            return Err(bad(
                &config_path,
                format!(
                    "peft_type '{}' (only LORA adapters merge)",
                    config.peft_type
                ),
            ));
        }
        if config.r == 0 || !(config.lora_alpha.is_finite() && config.lora_alpha > 0.0) {
            return Err(bad(&config_path, "r and lora_alpha must be positive"));
        }
        let info: TwellAdapterInfo = read_json(&dir.join(TWELL_FILE))?;
        let weights_path = dir.join(WEIGHTS_FILE);
        let tensors = candle_core::safetensors::load(&weights_path, &Device::Cpu).map_err(|e| {
            bad(
                &weights_path,
                format!("not a readable safetensors file: {e}"),
            )
        })?;
        let mut factors = Vec::new();
        let mut names: Vec<&String> = tensors
            .keys()
            .filter(|k| k.ends_with(".lora_A.weight"))
            .collect();
        names.sort();
        for a_name in names {
            let module = &a_name[..a_name.len() - ".lora_A.weight".len()];
            let b_name = format!("{module}.lora_B.weight");
            let Some(b) = tensors.get(&b_name) else {
                return Err(bad(&weights_path, format!("{a_name} has no {b_name}")));
            };
            let a = &tensors[a_name];
            let (r_a, _) = a
                .dims2()
                .map_err(|_| bad(&weights_path, format!("{a_name} is not a matrix")))?;
            let (_, r_b) = b
                .dims2()
                .map_err(|_| bad(&weights_path, format!("{b_name} is not a matrix")))?;
            if r_a != config.r || r_b != config.r {
                return Err(bad(
                    &weights_path,
                    format!(
                        "{module}: rank {r_a}/{r_b}, adapter_config.json says r = {}",
                        config.r
                    ),
                ));
            }
            let (out, _) = b.dims2()?;
            let row_scale = match tensors.get(&format!("{module}.row_scale")) {
                Some(m) if m.dims() == [out] => Some(m.to_dtype(DType::F32)?),
                Some(m) => {
                    return Err(bad(
                        &weights_path,
                        format!("{module}.row_scale is {:?}, expected [{out}]", m.dims()),
                    ))
                }
                None => None,
            };
            let module = module.strip_prefix(PEFT_PREFIX).unwrap_or(module);
            factors.push(LoraFactor {
                weight: format!("{module}.weight"),
                a: a.to_dtype(DType::F32)?,
                b: b.to_dtype(DType::F32)?,
                row_scale,
            });
        }
        let full = read_full_deltas(&dir.join(FULL_DELTAS_FILE))?;
        if factors.is_empty() && full.is_empty() {
            return Err(bad(&weights_path, "holds no lora_A/lora_B pairs"));
        }
        Ok(Self {
            config,
            info,
            factors,
            full,
            dir: dir.to_path_buf(),
        })
    }

    /// Checks that `base` is the file the adapter was trained on (when it recorded one).
    pub fn check_base(&self, base: &Path) -> Result<()> {
        let Some(want) = &self.info.base_sha256 else {
            return Ok(());
        };
        let got = sha256_file(base)?;
        if !got.eq_ignore_ascii_case(want) {
            return err(LlamaError::Invalid(format!(
                "the adapter in {} was trained on a base with SHA-256 {want} ({}), but {} hashes to {got}",
                self.dir.display(),
                self.info.base_file.as_deref().unwrap_or("unnamed"),
                base.display()
            )));
        }
        Ok(())
    }

    /// Adds `scale · B·A` to each adapted weight of `tensors` (HF names), in f32, keeping
    /// each weight's dtype and device.
    pub fn merge_into(&self, tensors: &mut HashMap<String, Tensor>) -> Result<()> {
        self.check_names(|name| tensors.get(name).map(|t| t.dims().to_vec()))?;
        for name in self.changed_names() {
            let w = tensors[&name].clone();
            tensors.insert(name.clone(), self.merge_one(&name, w)?);
        }
        Ok(())
    }

    /// The weights this adapter changes.
    fn changed_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.full.iter().map(|(n, _)| n.clone()).collect();
        names.extend(self.factors.iter().map(|f| f.weight.clone()));
        names.sort();
        names.dedup();
        names
    }

    /// Checks that every weight the adapter changes exists with the adapter's shape
    /// (`dims` gives a model weight's shape by HF name), before anything is merged.
    pub fn check_names(&self, dims: impl Fn(&str) -> Option<Vec<usize>>) -> Result<()> {
        for (name, t) in &self.full {
            let Some(w) = dims(name) else {
                return err(LlamaError::Invalid(format!(
                    "the adapter in {} changes {name}, which the model does not have",
                    self.dir.display()
                )));
            };
            if w != t.shape().dims() {
                return err(LlamaError::Invalid(format!(
                    "{name}: the adapter's weight is {:?}, the model's {w:?}",
                    t.shape().dims()
                )));
            }
        }
        for f in &self.factors {
            let Some(w) = dims(&f.weight) else {
                return err(LlamaError::Invalid(format!(
                    "the adapter in {} adapts {}, which the model does not have",
                    self.dir.display(),
                    f.weight
                )));
            };
            let (r, a_in) = f.a.dims2()?;
            let (b_out, _) = f.b.dims2()?;
            if w != [b_out, a_in] {
                return err(LlamaError::Invalid(format!(
                    "{}: the adapter's factors are [{b_out}, {r}]·[{r}, {a_in}], the weight is {w:?}",
                    f.weight
                )));
            }
        }
        Ok(())
    }

    /// One weight `w` (HF name `name`) with this adapter's changes to it merged, in f32,
    /// keeping its dtype and device; unchanged if the adapter does not touch it.
    pub fn merge_one(&self, name: &str, w: Tensor) -> Result<Tensor> {
        self.merge_parts(name, w, true)
    }

    /// [`LoraAdapter::merge_one`], merging the low-rank factors only if `factors`: a
    /// quantized model applies them beside the base's own blocks instead
    /// ([`LoraAdapter::low_rank_stack`]).
    pub fn merge_parts(&self, name: &str, w: Tensor, factors: bool) -> Result<Tensor> {
        let dtype = w.dtype();
        let mut merged = None;
        let f32w = || w.to_dtype(DType::F32);
        if let Some((_, t)) = self.full.iter().find(|(n, _)| n == name) {
            merged = Some((f32w()? + t.dequantize(w.device())?)?);
        }
        if let Some(f) = self.factors.iter().find(|f| factors && f.weight == name) {
            let delta =
                (f.b.to_device(w.device())?
                    .matmul(&f.a.to_device(w.device())?)?
                    * self.scale())?;
            let mut m = (match merged.take() {
                Some(m) => m,
                None => f32w()?,
            } + delta)?;
            if let Some(s) = &f.row_scale {
                m = m.broadcast_mul(&s.to_device(w.device())?.unsqueeze(1)?)?;
            }
            merged = Some(m);
        }
        match merged {
            Some(m) => m.to_dtype(dtype),
            None => Ok(w),
        }
    }

    /// Whether a weight (HF name) is trained whole, as a delta in `full_deltas.gguf`.
    pub fn has_full_delta(&self, name: &str) -> bool {
        self.full.iter().any(|(n, _)| n == name)
    }

    /// The factors of the weights `stack` names (HF names, with their row counts), in
    /// the order their rows are stacked, for inputs of width `cols`: `None` if none of
    /// them is adapted.
    pub fn low_rank_stack(
        &self,
        stack: &[(String, usize)],
        cols: usize,
    ) -> Result<Option<LowRankStack>> {
        let scale = self.scale() as f32;
        let values = |t: &Tensor| -> Result<Vec<f32>> {
            t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
        };
        let mut held = Vec::new();
        for (name, rows) in stack {
            let factors = match self.factors.iter().find(|f| &f.weight == name) {
                Some(f) => Some((
                    values(&f.a)?,
                    values(&f.b)?,
                    f.a.dim(0)?,
                    f.row_scale.as_ref().map(values).transpose()?,
                )),
                None => None,
            };
            held.push((*rows, factors));
        }
        let parts: Vec<_> = held
            .iter()
            .map(|(rows, f)| {
                let factors = f.as_ref().map(|(a, b, rank, row_scale)| LowRankFactors {
                    a,
                    b,
                    rank: *rank,
                    scale,
                    row_scale: row_scale.as_deref(),
                });
                (*rows, factors)
            })
            .collect();
        LowRankStack::new(cols, &parts)
    }

    /// Writes an adapter directory, `SHA256SUMS` included, through a temporary
    /// directory renamed into place: a crash never leaves a half-written adapter.
    pub fn save(
        dir: &Path,
        config: &PeftConfig,
        info: &TwellAdapterInfo,
        factors: &[LoraFactor],
        full: &[(String, Tensor)],
        dtype: DType,
    ) -> Result<()> {
        let parent = dir.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
        let tmp = dir.with_extension("partial");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
        let mut out = HashMap::new();
        for f in factors {
            let module = f.weight.strip_suffix(".weight").unwrap_or(&f.weight);
            let cpu = |t: &Tensor| -> Result<Tensor> {
                t.to_dtype(dtype)?.to_device(&Device::Cpu)?.contiguous()
            };
            out.insert(format!("{PEFT_PREFIX}{module}.lora_A.weight"), cpu(&f.a)?);
            out.insert(format!("{PEFT_PREFIX}{module}.lora_B.weight"), cpu(&f.b)?);
            if let Some(m) = &f.row_scale {
                out.insert(format!("{PEFT_PREFIX}{module}.row_scale"), cpu(m)?);
            }
        }
        candle_core::safetensors::save(&out, tmp.join(WEIGHTS_FILE))?;
        write_json(&tmp.join(CONFIG_FILE), config)?;
        write_json(&tmp.join(TWELL_FILE), info)?;
        let mut files = vec![CONFIG_FILE, TWELL_FILE, WEIGHTS_FILE];
        if !full.is_empty() {
            write_full_deltas(&tmp.join(FULL_DELTAS_FILE), full)?;
            files.push(FULL_DELTAS_FILE);
        }
        let mut sums = String::new();
        for name in files {
            sums += &format!("{}  {name}\n", sha256_file(&tmp.join(name))?);
        }
        std::fs::write(tmp.join(CHECKSUMS_FILE), sums).map_err(|e| io_err(&tmp, e))?;
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| io_err(dir, e))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| io_err(dir, e))
    }
}

/// Writes `full` (HF names) as a GGUF of Q4_0 blocks.
fn write_full_deltas(path: &Path, full: &[(String, Tensor)]) -> Result<()> {
    use candle_core::quantized::{gguf_file, QTensor};
    let quantized = full
        .iter()
        .map(|(name, t)| {
            let t = t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            Ok((name.as_str(), QTensor::quantize(&t, FULL_DELTAS_DTYPE)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<(&str, &QTensor)> = quantized.iter().map(|(n, q)| (*n, q)).collect();
    let mut file = std::fs::File::create(path).map_err(|e| io_err(path, e))?;
    gguf_file::write(&mut file, &[], &refs)
}

/// Reads the deltas of [`FULL_DELTAS_FILE`] (none when it is absent), in their blocks.
fn read_full_deltas(path: &Path) -> Result<Vec<(String, Arc<candle_core::quantized::QTensor>)>> {
    use candle_core::quantized::gguf_file;
    if !path.exists() {
        return Ok(Vec::new());
    }
    let mut file = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    let content = gguf_file::Content::read(&mut file)
        .map_err(|e| bad(path, format!("not a readable GGUF file: {e}")))?;
    let mut names: Vec<String> = content.tensor_infos.keys().cloned().collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let q = content
                .tensor(&mut file, &name, &Device::Cpu)
                .map_err(|e| bad(path, format!("tensor {name}: {e}")))?;
            Ok((name, Arc::new(q)))
        })
        .collect()
}

/// PEFT's config for a LoRA of rank `r` on `target_modules` (short names such as
/// `q_proj`).
pub fn peft_config(r: usize, lora_alpha: f64, target_modules: &[&str], base: &str) -> PeftConfig {
    PeftConfig {
        peft_type: "LORA".into(),
        r,
        lora_alpha,
        target_modules: target_modules.iter().map(|s| s.to_string()).collect(),
        base_model_name_or_path: Some(base.to_string()),
        task_type: Some("CAUSAL_LM".into()),
        bias: Some("none".into()),
    }
}
