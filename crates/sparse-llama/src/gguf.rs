//! GGUF checkpoints (llama.cpp's format): renamed to HF names, each tensor read and
//! dequantized to f32 when asked for (so a model quantized as it loads never holds the
//! whole f32 copy), with Q/K rows un-permuted and the tokenizer rebuilt from the
//! metadata.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{Device, Result, Tensor};
use tokenizers::Tokenizer;

use crate::config::{LlamaConfig, LlamaEosToks};
use crate::error::{err, LlamaError};
use crate::tokenizer::tokenizer_from_gguf;

/// What a GGUF file holds, in HF terms.
pub struct GgufCheckpoint {
    pub config: LlamaConfig,
    /// The tensors, HF-named, read when asked for.
    pub tensors: GgufTensors,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<String>,
    /// The block type all the layers' matrices share in the file, if one.
    pub layer_block_type: Option<candle_core::quantized::GgmlDType>,
}

fn meta_usize(c: &gguf_file::Content, key: &str) -> Result<Option<usize>> {
    let Some(v) = c.metadata.get(key) else {
        return Ok(None);
    };
    let n = v
        .to_u32()
        .map(|x| x as u64)
        .or_else(|_| v.to_u64())
        .or_else(|_| v.to_i32().map(|x| x as u64))
        .or_else(|_| v.to_i64().map(|x| x as u64));
    match n {
        Ok(n) => Ok(Some(n as usize)),
        Err(_) => err(LlamaError::Invalid(format!(
            "GGUF metadata '{key}' is not an integer"
        ))),
    }
}

fn need_usize(c: &gguf_file::Content, key: &str) -> Result<usize> {
    match meta_usize(c, key)? {
        Some(n) => Ok(n),
        None => err(LlamaError::Invalid(format!("GGUF metadata has no '{key}'"))),
    }
}

fn meta_f32(c: &gguf_file::Content, key: &str) -> Option<f32> {
    c.metadata.get(key).and_then(|v| v.to_f32().ok())
}

/// HF name of a GGUF tensor, or `None` for tensors we do not use.
fn hf_name(name: &str) -> Result<Option<String>> {
    let direct = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        "rope_freqs.weight" => return Ok(None),
        _ => None,
    };
    if let Some(n) = direct {
        return Ok(Some(n.to_string()));
    }
    let Some(rest) = name.strip_prefix("blk.") else {
        return err(LlamaError::Unsupported(format!("GGUF tensor '{name}'")));
    };
    let (layer, tail) = rest.split_once('.').unwrap_or((rest, ""));
    let part = match tail {
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        _ => return err(LlamaError::Unsupported(format!("GGUF tensor '{name}'"))),
    };
    Ok(Some(format!("model.layers.{layer}.{part}")))
}

/// Undoes the GGUF converter's Q/K row permutation (made for llama.cpp's interleaved
/// RoPE), so rotate-half RoPE applies: `[heads, rows/heads/2, 2, in]`, swap axes 1, 2.
pub fn unpermute_qk(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    if out % (2 * heads) != 0 {
        return err(LlamaError::Invalid(format!(
            "{out} rows do not split into {heads} heads of rotary pairs"
        )));
    }
    w.reshape((heads, out / heads / 2, 2, inp))?
        .transpose(1, 2)?
        .reshape((out, inp))?
        .contiguous()
}

/// Reads a GGUF Llama checkpoint.
pub fn load_gguf(path: &Path) -> Result<GgufCheckpoint> {
    // Buffered: the metadata (the tokenizer's 49k strings) is read a few bytes a value,
    // about 250k small reads of the file unbuffered (the load's time is set by
    // dequantising, not by them).
    let file = std::fs::File::open(path).map_err(|e| LlamaError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let mut file = std::io::BufReader::with_capacity(1 << 20, file);
    let content = gguf_file::Content::read(&mut file).map_err(|e| LlamaError::BadFile {
        path: path.to_path_buf(),
        detail: format!("not a readable GGUF file: {e}"),
    })?;
    let arch = content
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok().cloned())
        .unwrap_or_default();
    if arch != "llama" {
        return err(LlamaError::Unsupported(format!(
            "GGUF architecture '{arch}' (only 'llama')"
        )));
    }
    let hidden = need_usize(&content, "llama.embedding_length")?;
    let heads = need_usize(&content, "llama.attention.head_count")?;
    let kv_heads = meta_usize(&content, "llama.attention.head_count_kv")?.unwrap_or(heads);
    let tokenizer = tokenizer_from_gguf(&content)?;
    let vocab = match meta_usize(&content, "llama.vocab_size")? {
        Some(v) => v,
        None => tokenizer.get_vocab_size(true),
    };
    let tie = !content.tensor_infos.contains_key("output.weight");
    let config = LlamaConfig {
        architectures: Some(vec!["LlamaForCausalLM".into()]),
        model_type: Some("llama".into()),
        hidden_size: hidden,
        intermediate_size: need_usize(&content, "llama.feed_forward_length")?,
        vocab_size: vocab,
        num_hidden_layers: need_usize(&content, "llama.block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        head_dim: None,
        rms_norm_eps: meta_f32(&content, "llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5)
            as f64,
        rope_theta: meta_f32(&content, "llama.rope.freq_base").unwrap_or(10_000.0),
        bos_token_id: meta_usize(&content, "tokenizer.ggml.bos_token_id")?.map(|v| v as u32),
        eos_token_id: meta_usize(&content, "tokenizer.ggml.eos_token_id")?
            .map(|v| LlamaEosToks::Single(v as u32)),
        rope_scaling: None,
        max_position_embeddings: meta_usize(&content, "llama.context_length")?.unwrap_or(2048),
        tie_word_embeddings: Some(tie),
        hidden_act: "silu".into(),
        attention_bias: Some(false),
        mlp_bias: Some(false),
        torch_dtype: Some("float32".into()),
        twell: None,
    };
    let mut layer_types = std::collections::HashSet::new();
    let mut names = HashMap::new();
    for (name, info) in &content.tensor_infos {
        let Some(hf) = hf_name(name)? else { continue };
        if name.starts_with("blk.") && info.shape.rank() == 2 {
            layer_types.insert(info.ggml_dtype);
        }
        names.insert(hf, name.clone());
    }
    // The data are read when asked for; a truncated file is refused now, not then.
    let file_len = std::fs::metadata(path)
        .map_err(|e| LlamaError::Io {
            path: path.to_path_buf(),
            source: e,
        })?
        .len();
    for (name, info) in &content.tensor_infos {
        let bytes =
            info.shape.elem_count() / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        let end = content.tensor_data_offset + info.offset + bytes as u64;
        if end > file_len {
            return err(LlamaError::BadFile {
                path: path.to_path_buf(),
                detail: format!(
                    "tensor '{name}' ends at byte {end}, past the file's {file_len} (truncated?)"
                ),
            });
        }
    }
    let tensors = GgufTensors {
        path: path.to_path_buf(),
        content,
        names,
        heads,
        kv_heads,
    };
    let chat_template = tensors
        .content
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok().cloned());
    let layer_block_type = match layer_types.len() {
        1 => layer_types.into_iter().next(),
        _ => None,
    };
    Ok(GgufCheckpoint {
        config,
        tensors,
        tokenizer,
        chat_template,
        layer_block_type,
    })
}

/// A GGUF's tensors under their HF names, read from the file one at a time.
pub struct GgufTensors {
    path: PathBuf,
    content: gguf_file::Content,
    /// HF name → GGUF name.
    names: HashMap<String, String>,
    heads: usize,
    kv_heads: usize,
}

impl GgufTensors {
    /// The HF names of the tensors.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.names.keys()
    }

    pub fn contains(&self, hf: &str) -> bool {
        self.names.contains_key(hf)
    }

    /// The HF-layout shape of a tensor, without reading it.
    pub fn dims(&self, hf: &str) -> Option<Vec<usize>> {
        let info = self.content.tensor_infos.get(self.names.get(hf)?)?;
        Some(info.shape.dims().to_vec())
    }

    /// One tensor in f32 on the CPU, Q/K rows un-permuted.
    pub fn tensor(&self, hf: &str) -> Result<Tensor> {
        let Some(name) = self.names.get(hf) else {
            return err(LlamaError::Invalid(format!(
                "{} has no tensor '{hf}'",
                self.path.display()
            )));
        };
        let io = |e: std::io::Error| LlamaError::Io {
            path: self.path.clone(),
            source: e,
        };
        let mut file = std::fs::File::open(&self.path).map_err(io)?;
        let q = self
            .content
            .tensor(&mut file, name, &Device::Cpu)
            .map_err(|e| LlamaError::BadFile {
                path: self.path.clone(),
                detail: format!("tensor '{name}': {e}"),
            })?;
        let t = q.dequantize(&Device::Cpu)?;
        if hf.ends_with("q_proj.weight") {
            unpermute_qk(&t, self.heads)
        } else if hf.ends_with("k_proj.weight") {
            unpermute_qk(&t, self.kv_heads)
        } else {
            Ok(t)
        }
    }
}
