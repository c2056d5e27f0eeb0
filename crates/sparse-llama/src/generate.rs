//! The generation loop: prefill, then one token at a time with the KV cache,
//! streaming text as it comes and timing both phases.

use std::time::Instant;

use candle_core::{Device, Result, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use tokenizers::Tokenizer;

use crate::decode::{DecodeOptions, DecodeRow, SlotDecoder};
use crate::error::LlamaError;
use crate::model::{Cache, Llama};

/// Sampling settings.
#[derive(Clone, Debug)]
pub struct GenerationConfig {
    pub max_new_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    /// 1.0 disables the penalty.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
    /// Where [`crate::SlotDecoder`] takes the model (CUDA, bf16), each decode step is
    /// one replayed CUDA graph; off, the same step's ops are launched one by one.
    pub graphs: bool,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 64,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 299792458,
            graphs: true,
        }
    }
}

impl GenerationConfig {
    fn sampling(&self) -> Sampling {
        if self.temperature <= 0.0 {
            return Sampling::ArgMax;
        }
        let temperature = self.temperature;
        match (self.top_k, self.top_p) {
            (None, None) => Sampling::All { temperature },
            (Some(k), None) => Sampling::TopK { k, temperature },
            (None, Some(p)) => Sampling::TopP { p, temperature },
            (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        }
    }
}

/// What a generation did and how fast.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// The first decode step's part of `decode_secs`: it also pays once-per-run work
    /// (loading the decode kernels, capturing a CUDA graph), which a short answer feels
    /// and a long one does not.
    pub first_decode_step_secs: f64,
    pub stopped_on_eos: bool,
    /// Mean FFN density (fraction of d_ff active) over layers and generated tokens,
    /// when the model was asked to record it.
    pub mean_ffn_density: Option<f64>,
    /// How many layer calls of the decode steps ran each FFN path ("sparse",
    /// "products", "dense"), as each MLP reports the side it ran.
    pub decode_ffn_paths: std::collections::BTreeMap<String, usize>,
    /// Whether the decode steps ran in the CUDA decode engine ([`crate::SlotDecoder`]).
    /// Their activations then stay on the device, and `mean_ffn_density` is the
    /// prompt's.
    pub decode_engine: bool,
    /// Whether its steps replayed a CUDA graph.
    pub decode_graph: bool,
}

impl GenerationStats {
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_secs)
    }
    pub fn decode_tokens_per_sec(&self) -> f64 {
        // The first generated token comes from the prefill; the rest from decode steps.
        rate(self.generated_tokens.saturating_sub(1), self.decode_secs)
    }
    /// The decode rate after the first decode step: what a long answer runs at.
    pub fn later_decode_tokens_per_sec(&self) -> f64 {
        rate(
            self.generated_tokens.saturating_sub(2),
            self.decode_secs - self.first_decode_step_secs,
        )
    }
}

/// Tokens per second, 0 where nothing was timed (no prefill or no decode step ran), not
/// a count divided by a clock's zero.
fn rate(tokens: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        tokens as f64 / secs
    } else {
        0.0
    }
}

/// Where the decode steps run: the model's own forward over a KV cache, or a slot of
/// the CUDA decode engine.
enum Decoding {
    Cache(Cache),
    Slot(SlotDecoder),
}

/// Turns a growing token list into text pieces, holding back bytes that do not yet
/// form whole characters.
pub struct TokenStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    emitted: usize,
}

impl<'a> TokenStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            emitted: 0,
        }
    }

    fn decode(&self, tokens: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| LlamaError::Tokenizer(e.to_string()).into())
    }

    /// Adds a token; returns the new text, if any is complete.
    pub fn push(&mut self, token: u32) -> Result<Option<String>> {
        self.tokens.push(token);
        let text = self.decode(&self.tokens)?;
        if text.ends_with('\u{fffd}') {
            return Ok(None);
        }
        let old = text.get(..self.emitted).map(|_| self.emitted).unwrap_or(0);
        let new = text[old..].to_string();
        self.emitted = text.len();
        Ok(if new.is_empty() { None } else { Some(new) })
    }

    pub fn text(&self) -> Result<String> {
        self.decode(&self.tokens)
    }
}

/// Generates up to `cfg.max_new_tokens` after `prompt`, calling `on_text` with each
/// decoded piece. Stops at any of `eos_ids`.
pub fn generate(
    model: &mut Llama,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    eos_ids: &[u32],
    cfg: &GenerationConfig,
    device: &Device,
    mut on_text: impl FnMut(&str),
) -> Result<(Vec<u32>, GenerationStats)> {
    if prompt.is_empty() {
        return Err(LlamaError::Invalid("the prompt encodes to no tokens".into()).into());
    }
    let max_pos = model.config().max_position_embeddings;
    // Checked: a huge max_new_tokens must not wrap around and pass.
    if prompt
        .len()
        .checked_add(cfg.max_new_tokens)
        .is_none_or(|end| end > max_pos)
    {
        return Err(LlamaError::Invalid(format!(
            "prompt ({}) + max new tokens ({}) exceeds the model's {} positions",
            prompt.len(),
            cfg.max_new_tokens,
            max_pos
        ))
        .into());
    }
    let dtype = model.dtype();
    // On CUDA the steps run in a slot of the decode engine's preallocated cache (bf16,
    // fused q, k, v: what inference loads give), replaying a captured graph.
    let on_engine = SlotDecoder::unsupported(model).is_none();
    let mut decoding = match on_engine {
        true => Decoding::Slot(SlotDecoder::new(
            model,
            DecodeOptions {
                slots: 1,
                context: prompt.len() + cfg.max_new_tokens.max(1),
                graphs: cfg.graphs,
            },
        )?),
        false => Decoding::Cache(Cache::new(true, dtype, model.config(), device)?),
    };
    let mut sampler = LogitsProcessor::from_sampling(cfg.seed, cfg.sampling());
    let mut stream = TokenStream::new(tokenizer);
    let mut all: Vec<u32> = prompt.to_vec();
    let mut out = Vec::new();
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        decode_engine: on_engine,
        decode_graph: on_engine && cfg.graphs,
        ..Default::default()
    };
    // Counts stay where the MLPs left them until decoding ends: one read-back in all.
    let mut nonzeros = Vec::new();
    let mut activations = 0usize;

    let mut input = prompt.to_vec();
    let mut index_pos = 0;
    let t_start = Instant::now();
    let mut t_decode = None;
    for step in 0..cfg.max_new_tokens {
        let logits = match &mut decoding {
            Decoding::Cache(cache) => {
                let x = Tensor::new(input.as_slice(), device)?.unsqueeze(0)?;
                model.forward(&x, index_pos, cache)?.squeeze(0)?
            }
            Decoding::Slot(decoder) if step == 0 => {
                let logits = decoder.prefill(model, 0, &input)?;
                // Graph steps keep their counts on the device: the density reported
                // is the prompt's.
                for mlp in model.mlps() {
                    if let Some((count, entries)) = mlp.last_nonzeros()? {
                        activations += entries;
                        nonzeros.push(count);
                    }
                }
                logits
            }
            Decoding::Slot(decoder) => {
                let row = DecodeRow {
                    slot: 0,
                    token: input[0],
                    position: index_pos,
                };
                decoder.step(model, &[row])?;
                if let Some(side) = decoder.side(1) {
                    *stats
                        .decode_ffn_paths
                        .entry(side.name().into())
                        .or_default() += model.config().num_hidden_layers;
                }
                decoder.logits()?.squeeze(0)?
            }
        };
        if step > 0 && !on_engine {
            for mlp in model.mlps() {
                if let Some((count, entries)) = mlp.last_nonzeros()? {
                    activations += entries;
                    nonzeros.push(count);
                }
            }
            for side in model.mlps().filter_map(|m| m.last_side()) {
                *stats
                    .decode_ffn_paths
                    .entry(side.name().into())
                    .or_default() += 1;
            }
        }
        let logits = if cfg.repeat_penalty != 1.0 {
            let start = all.len().saturating_sub(cfg.repeat_last_n);
            candle_transformers::utils::apply_repeat_penalty(
                &logits,
                cfg.repeat_penalty,
                &all[start..],
            )?
        } else {
            logits
        };
        let next = sampler.sample(&logits)?;
        if step == 0 {
            device.synchronize()?;
            stats.prefill_secs = t_start.elapsed().as_secs_f64();
            t_decode = Some(Instant::now());
        }
        if let (1, Some(t)) = (step, t_decode) {
            // The sampled token is on the host, so the step has finished.
            stats.first_decode_step_secs = t.elapsed().as_secs_f64();
        }
        index_pos += input.len();
        all.push(next);
        out.push(next);
        if eos_ids.contains(&next) {
            stats.stopped_on_eos = true;
            break;
        }
        if let Some(text) = stream.push(next)? {
            on_text(&text);
        }
        input = vec![next];
    }
    device.synchronize()?;
    stats.decode_secs = t_decode.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
    stats.generated_tokens = out.len();
    if activations > 0 {
        let total = twell::Nonzeros::sum(&nonzeros)?;
        stats.mean_ffn_density = Some(total as f64 / activations as f64);
    }
    Ok((out, stats))
}

#[cfg(test)]
mod tests {
    use super::GenerationStats;

    #[test]
    fn rates_are_zero_where_nothing_was_timed() {
        let none = GenerationStats {
            prompt_tokens: 3,
            generated_tokens: 1,
            ..Default::default()
        };
        assert_eq!(none.prefill_tokens_per_sec(), 0.0);
        assert_eq!(none.decode_tokens_per_sec(), 0.0);
        let timed = GenerationStats {
            prompt_tokens: 4,
            generated_tokens: 5,
            prefill_secs: 0.5,
            decode_secs: 2.0,
            ..Default::default()
        };
        assert_eq!(timed.prefill_tokens_per_sec(), 8.0);
        // Four decode steps: the first generated token came from the prefill.
        assert_eq!(timed.decode_tokens_per_sec(), 2.0);
        let with_first = GenerationStats {
            first_decode_step_secs: 0.5,
            ..timed
        };
        // Three steps after the first, in the 1.5 s left.
        assert_eq!(with_first.later_decode_tokens_per_sec(), 2.0);
    }
}
