//! Perplexity over held-out text: non-overlapping windows of a fixed context, each
//! window scored from scratch (no carried cache), every token after the first of a
//! window predicted.

use candle_core::{DType, Device, Result, Tensor, D};

use crate::error::LlamaError;
use crate::model::{Cache, Llama};

#[derive(Clone, Debug, serde::Serialize)]
pub struct Perplexity {
    pub tokens_scored: usize,
    pub windows: usize,
    pub context: usize,
    pub mean_nll: f64,
    pub perplexity: f64,
}

/// Scores `tokens` in windows of `context` tokens, `batch` windows per forward.
/// `after_batch(done, total)` is called after each forward (e.g. to read the model's
/// FFN statistics or move a progress bar); an error from it stops the evaluation.
pub fn perplexity(
    model: &Llama,
    tokens: &[u32],
    context: usize,
    batch: usize,
    device: &Device,
    mut after_batch: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Perplexity> {
    if context < 2 {
        return Err(LlamaError::Invalid(format!(
            "context must be at least 2 tokens, got {context}"
        ))
        .into());
    }
    if context > model.config().max_position_embeddings {
        return Err(LlamaError::Invalid(format!(
            "context {context} exceeds the model's {} positions",
            model.config().max_position_embeddings
        ))
        .into());
    }
    let windows: Vec<&[u32]> = tokens.chunks(context).filter(|w| w.len() >= 2).collect();
    if windows.is_empty() {
        return Err(LlamaError::Invalid(
            "not enough text to score (need at least 2 tokens)".into(),
        )
        .into());
    }
    let batch = batch.max(1);
    let dtype = model.dtype();
    let mut cache = Cache::new(false, dtype, model.config(), device)?;
    let mut nll = 0f64;
    let mut scored = 0usize;
    let mut done = 0;
    // Full windows go in batches; a shorter last window runs alone.
    let groups: Vec<Vec<&[u32]>> = {
        let (full, short): (Vec<&[u32]>, Vec<&[u32]>) =
            windows.iter().partition(|w| w.len() == context);
        let mut g: Vec<Vec<&[u32]>> = full.chunks(batch).map(|c| c.to_vec()).collect();
        g.extend(short.into_iter().map(|w| vec![w]));
        g
    };
    for group in groups {
        let t = group[0].len();
        let flat: Vec<u32> = group.iter().flat_map(|w| w.iter().copied()).collect();
        let x = Tensor::from_vec(flat, (group.len(), t), device)?;
        let logits = model.forward_all(&x, 0, &mut cache)?; // [b, t, V] f32
        let logp =
            candle_nn::ops::log_softmax(&logits.narrow(1, 0, t - 1)?, D::Minus1)?.contiguous()?;
        let targets = x.narrow(1, 1, t - 1)?.unsqueeze(2)?.contiguous()?;
        let picked = logp.gather(&targets, 2)?.to_dtype(DType::F64)?;
        nll -= picked.sum_all()?.to_scalar::<f64>()?;
        scored += group.len() * (t - 1);
        done += group.len();
        after_batch(done, windows.len())?;
    }
    let mean_nll = nll / scored as f64;
    Ok(Perplexity {
        tokens_scored: scored,
        windows: windows.len(),
        context,
        mean_nll,
        perplexity: mean_nll.exp(),
    })
}
