//! The engine: one thread owns the model and runs every sequence in flight. Each step
//! prefills a chunk of every prompt still coming in, then decodes one token for every
//! other sequence in one batched pass (`Llama::forward_decode_batch`: each sequence
//! attends over its own KV cache at its own position; the projections after the
//! attention, the MLPs and the head read their weights once for all of them). New
//! requests join between steps (continuous batching), and a long prompt does not stall
//! the streams already running.
//!
//! On CUDA (bf16) the decode steps go through the decode engine instead
//! ([`sparse_llama::SlotDecoder`]): once its prompt is in, a sequence's cache moves into a
//! slot of one preallocated cache, and each step (all sequences' attention in one launch
//! a layer) replays a CUDA graph captured once per batch size.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use sparse_llama::{Cache, DecodeOptions, DecodeRow, Llama, SlotDecoder};
use tokenizers::Tokenizer;
use tokio::sync::mpsc;

use crate::metrics::{FfnTally, Metrics, Phase};
use crate::sample::{read_logits, Sampler};

/// How a request samples and when it stops.
#[derive(Clone, Debug)]
pub struct SamplingParams {
    pub max_tokens: usize,
    /// 0 is greedy.
    pub temperature: f64,
    pub top_p: Option<f64>,
    pub seed: u64,
    /// Texts that end the completion (not included in it).
    pub stop: Vec<String>,
    /// 1.0 is none (llama.cpp's and vLLM's `repetition_penalty`).
    pub repeat_penalty: f32,
    /// Generate to `max_tokens` whatever the model predicts.
    pub ignore_eos: bool,
}

/// Why a completion ended, as the OpenAI API names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token or a stop text.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// What the engine sends back for a request, in order: text pieces, then `Done` or
/// `Failed`.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed(String),
}

/// A request for the engine.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub events: mpsc::UnboundedSender<Event>,
    pub queued_at: Instant,
}

/// Limits of the engine.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Sequences in flight at once; more wait in the queue.
    pub max_sequences: usize,
    /// Prompt tokens a sequence prefills per step.
    pub prefill_chunk: usize,
    /// Prompt prefixes kept prefilled ([`PrefixCache`]); 0 is none.
    pub prefix_cache: usize,
    /// On CUDA, replay each decode step as a CUDA graph (off: the decode engine's
    /// steps launch their ops one by one).
    pub graphs: bool,
}

/// The model as the engine runs it.
pub struct EngineModel {
    pub llama: Llama,
    pub tokenizer: Tokenizer,
    /// Token ids that end a sequence.
    pub eos: Vec<u32>,
    pub device: Device,
    pub dtype: DType,
}

/// One sequence in flight.
struct Sequence {
    job: Job,
    cache: Cache,
    sampler: Sampler,
    /// Prompt tokens prefilled so far.
    prefilled: usize,
    /// Every token so far (prompt and generated), for the repeat penalty.
    tokens: Vec<u32>,
    generated: Vec<u32>,
    /// The generated text as far as it is decoded.
    text: String,
    /// `generated[prefix_offset..read_offset]` are the tokens of the last decoded piece:
    /// decoding again from there keeps the spacing a tokenizer gives a piece in context.
    prefix_offset: usize,
    read_offset: usize,
    /// Bytes of `text` already sent.
    sent: usize,
    /// The token the next decode step feeds, once the prefill is done.
    next_input: Option<u32>,
    /// The decode engine's slot holding the sequence's cache, once its prompt is in.
    slot: Option<usize>,
    /// A prompt length at which the prefill stops once, to keep the cache so far as a
    /// shared prefix ([`PrefixCache::plan`]).
    keep_prefix_at: Option<usize>,
}

/// What one step of a sequence did.
enum StepResult {
    Running,
    Finished,
}

impl EngineModel {
    fn new_cache(&self) -> candle_core::Result<Cache> {
        Cache::new(true, self.dtype, self.llama.config(), &self.device)
    }

    /// A sequence for `job`, over its own `cache`.
    fn start(&self, job: Job, cache: Cache) -> Sequence {
        let p = &job.params;
        Sequence {
            cache,
            sampler: Sampler::new(p.seed, p.temperature, p.top_p, p.repeat_penalty),
            prefilled: 0,
            tokens: job.prompt.clone(),
            generated: Vec::new(),
            text: String::new(),
            prefix_offset: 0,
            read_offset: 0,
            sent: 0,
            next_input: None,
            slot: None,
            keep_prefix_at: None,
            job,
        }
    }

    /// A chunk of `seq`'s prompt; the first new token once the prompt is all in. With
    /// the decode engine, a sequence that goes on moves its cache into one of
    /// `free_slots`.
    fn prefill_step(
        &self,
        seq: &mut Sequence,
        cfg: &EngineConfig,
        metrics: &Metrics,
        tally: &mut FfnTally,
        prefixes: &mut PrefixCache,
        slots: Option<(&mut SlotDecoder, &mut Vec<usize>)>,
    ) -> candle_core::Result<StepResult> {
        let start = seq.prefilled;
        let mut end = (start + cfg.prefill_chunk).min(seq.job.prompt.len());
        if let Some(at) = seq.keep_prefix_at.filter(|&at| at > start) {
            end = end.min(at);
        }
        let x = Tensor::new(&seq.job.prompt[start..end], &self.device)?.unsqueeze(0)?;
        let logits = self.llama.forward(&x, start, &mut seq.cache)?.squeeze(0)?;
        tally.record(&self.llama)?;
        seq.prefilled = end;
        if seq.keep_prefix_at == Some(end) {
            prefixes.insert(seq.job.prompt[..end].to_vec(), seq.cache.clone());
            seq.keep_prefix_at = None;
        }
        if end < seq.job.prompt.len() {
            return Ok(StepResult::Running);
        }
        let row = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let next = seq.sampler.sample(&row, &seq.tokens);
        let result = self.take(seq, next, metrics)?;
        if let (StepResult::Running, Some((decoder, free_slots))) = (&result, slots) {
            // One slot per running sequence: there is always a free one.
            let slot = free_slots.pop().expect("a free slot per running sequence");
            decoder.load_cache(slot, &seq.cache)?;
            seq.cache.reset();
            seq.slot = Some(slot);
        }
        Ok(result)
    }

    /// One new token for each of `seqs` (all past their prompts) in one step of the
    /// decode engine: greedy rows take the step's own argmax, the others sample from
    /// their row of logits, copied back once for all rows.
    fn decode_step_on_slots(
        &mut self,
        decoder: &mut SlotDecoder,
        seqs: &mut [&mut Sequence],
        metrics: &Metrics,
    ) -> candle_core::Result<Vec<candle_core::Result<StepResult>>> {
        let rows: Vec<DecodeRow> = seqs
            .iter()
            .map(|s| DecodeRow {
                slot: s.slot.expect("decoding sequences hold a slot"),
                token: s.next_input.expect("decoding sequences have a next input"),
                position: s.job.prompt.len() + s.generated.len() - 1,
            })
            .collect();
        let timer = Instant::now();
        decoder.step(&mut self.llama, &rows)?;
        let greedy = match seqs.iter().any(|s| s.sampler.is_plain_greedy()) {
            true => decoder.greedy_tokens()?,
            false => Vec::new(),
        };
        let logits = match seqs.iter().all(|s| s.sampler.is_plain_greedy()) {
            true => None,
            false => Some(read_logits(&decoder.logits()?)?),
        };
        metrics.add_phase(Phase::Decode, timer.elapsed());
        let next = sample_rows(seqs, logits.as_deref(), &greedy, metrics)?;
        Ok(self.take_all(seqs, next, metrics))
    }

    /// One new token for each of `seqs` (all past their prompts), in one batched step.
    fn decode_step(
        &self,
        seqs: &mut [&mut Sequence],
        metrics: &Metrics,
        tally: &mut FfnTally,
    ) -> candle_core::Result<Vec<candle_core::Result<StepResult>>> {
        let tokens: Vec<u32> = seqs
            .iter()
            .map(|s| s.next_input.expect("decoding sequences have a next input"))
            .collect();
        let positions: Vec<usize> = seqs
            .iter()
            .map(|s| s.job.prompt.len() + s.generated.len() - 1)
            .collect();
        let timer = Instant::now();
        let mut caches: Vec<&mut Cache> = seqs.iter_mut().map(|s| &mut s.cache).collect();
        let logits = self
            .llama
            .forward_decode_batch(&tokens, &positions, &mut caches)?;
        let logits = read_logits(&logits)?;
        tally.record(&self.llama)?;
        metrics.add_phase(Phase::Decode, timer.elapsed());
        let next = sample_rows(seqs, Some(&logits), &[], metrics)?;
        Ok(self.take_all(seqs, next, metrics))
    }

    /// Appends each sequence's next token, in order, and sends what each makes certain.
    fn take_all(
        &self,
        seqs: &mut [&mut Sequence],
        next: Vec<u32>,
        metrics: &Metrics,
    ) -> Vec<candle_core::Result<StepResult>> {
        let timer = Instant::now();
        let results = seqs
            .iter_mut()
            .zip(next)
            .map(|(seq, token)| self.take(seq, token, metrics))
            .collect();
        metrics.add_phase(Phase::Emit, timer.elapsed());
        results
    }

    /// Appends `next` to `seq` and sends what it makes certain.
    fn take(
        &self,
        seq: &mut Sequence,
        next: u32,
        metrics: &Metrics,
    ) -> candle_core::Result<StepResult> {
        // No next input yet: this is the sequence's first token.
        if seq.next_input.is_none() {
            metrics.record_first_token(seq.job.queued_at.elapsed());
        }
        if !seq.job.params.ignore_eos && self.eos.contains(&next) {
            self.finish(seq, Finish::Stop)?;
            return Ok(StepResult::Finished);
        }
        metrics.add_generated(1);
        seq.tokens.push(next);
        seq.generated.push(next);
        seq.next_input = Some(next);
        if self.emit(seq)? {
            return Ok(StepResult::Finished);
        }
        if seq.generated.len() >= seq.job.params.max_tokens {
            self.finish(seq, Finish::Length)?;
            return Ok(StepResult::Finished);
        }
        Ok(StepResult::Running)
    }

    fn text(&self, tokens: &[u32]) -> candle_core::Result<String> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| candle_core::Error::Msg(format!("detokenizing: {e}")))
    }

    /// Extends `seq.text` by what its newest tokens spell, decoding only the tokens since
    /// the last whole piece (decoding the whole text every token grows with its length).
    /// Tokens that do not yet form whole characters wait, unless `last`.
    fn advance_text(&self, seq: &mut Sequence, last: bool) -> candle_core::Result<()> {
        let prefix = self.text(&seq.generated[seq.prefix_offset..seq.read_offset])?;
        let full = self.text(&seq.generated[seq.prefix_offset..])?;
        if full.ends_with('\u{fffd}') && !last {
            return Ok(());
        }
        if let Some(new) = full
            .get(prefix.len()..)
            .filter(|_| full.starts_with(&prefix))
        {
            seq.text.push_str(new);
            seq.prefix_offset = seq.read_offset;
            seq.read_offset = seq.generated.len();
        }
        Ok(())
    }

    /// Sends the text that is now certain: whole characters, and nothing that a stop
    /// text could still begin. Returns true if a stop text ended the sequence.
    fn emit(&self, seq: &mut Sequence) -> candle_core::Result<bool> {
        self.advance_text(seq, false)?;
        let text = &seq.text;
        if let Some(at) = seq
            .job
            .params
            .stop
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            if at > seq.sent {
                let _ = seq.job.events.send(Event::Text(text[seq.sent..at].into()));
                seq.sent = at;
            }
            self.send_done(seq, Finish::Stop);
            return Ok(true);
        }
        // Hold back the longest tail that is a prefix of a stop text.
        let held = seq
            .job
            .params
            .stop
            .iter()
            .flat_map(|s| {
                (1..s.len()).filter(|&n| s.is_char_boundary(n) && text.ends_with(&s[..n]))
            })
            .max()
            .unwrap_or(0);
        let mut upto = text.len() - held;
        while !text.is_char_boundary(upto) {
            upto -= 1;
        }
        if upto > seq.sent {
            let piece = text[seq.sent..upto].to_string();
            let _ = seq.job.events.send(Event::Text(piece));
            seq.sent = upto;
        }
        Ok(false)
    }

    /// Sends what is left of the text, then `Done`.
    fn finish(&self, seq: &mut Sequence, finish: Finish) -> candle_core::Result<()> {
        self.advance_text(seq, true)?;
        if seq.text.len() > seq.sent {
            let _ = seq
                .job
                .events
                .send(Event::Text(seq.text[seq.sent..].into()));
            seq.sent = seq.text.len();
        }
        self.send_done(seq, finish);
        Ok(())
    }

    fn send_done(&self, seq: &Sequence, finish: Finish) {
        let _ = seq.job.events.send(Event::Done {
            finish,
            prompt_tokens: seq.job.prompt.len(),
            completion_tokens: seq.generated.len(),
        });
    }
}

/// Shared prompt prefixes shorter than this get no cache entry.
const MIN_SHARED_PREFIX: usize = 16;
/// Recent prompts kept to find the prefixes new ones share.
const RECENT_PROMPTS: usize = 16;

/// Prompt prefixes whose caches new sequences start from, so that text many requests
/// share (a chat template's system turn, a few-shot preamble) is prefilled once, not once
/// a request. A prefix is kept once two prompts share it: the second one's prefill stops
/// there once and leaves a clone of its cache. Entries go least recently used first.
/// Clones share the cached keys and values until they write (`Cache`'s clone).
struct PrefixCache {
    capacity: usize,
    /// Least recently used first.
    entries: Vec<(Vec<u32>, Cache)>,
    recent: std::collections::VecDeque<Vec<u32>>,
}

impl PrefixCache {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: Vec::new(),
            recent: Default::default(),
        }
    }

    /// The longest cached prefix of `prompt` that leaves a token of it to prefill (its
    /// logits give the first new token): its length and a clone of its cache.
    fn take(&mut self, prompt: &[u32]) -> Option<(usize, Cache)> {
        let (best, _) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, (t, _))| t.len() < prompt.len() && prompt.starts_with(t))
            .max_by_key(|(_, (t, _))| t.len())?;
        let entry = self.entries.remove(best);
        let taken = (entry.0.len(), entry.1.clone());
        self.entries.push(entry);
        Some(taken)
    }

    /// Where `prompt` (already `cached` tokens in) should stop its prefill once to keep
    /// a new entry: the longest prefix it shares with a recent prompt, if that is long
    /// enough, past what it started from, and not cached yet.
    fn plan(&mut self, prompt: &[u32], cached: usize) -> Option<usize> {
        if self.capacity == 0 || prompt.is_empty() {
            return None;
        }
        let shared = self
            .recent
            .iter()
            .map(|r| r.iter().zip(prompt).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0)
            .min(prompt.len() - 1);
        if self.recent.len() == RECENT_PROMPTS {
            self.recent.pop_front();
        }
        self.recent.push_back(prompt.to_vec());
        let known = self.entries.iter().any(|(t, _)| t[..] == prompt[..shared]);
        (shared >= MIN_SHARED_PREFIX && shared > cached && !known).then_some(shared)
    }

    fn insert(&mut self, tokens: Vec<u32>, cache: Cache) {
        // Sequences that arrived together may all have planned the same prefix.
        if self.capacity == 0 || self.entries.iter().any(|(t, _)| *t == tokens) {
            return;
        }
        if self.entries.len() == self.capacity {
            self.entries.remove(0);
        }
        self.entries.push((tokens, cache));
    }
}

/// Each sequence's next token from its row of `logits` (rows in `seqs`' order), or from
/// `greedy` where the step's argmax is its answer. Rows sample in parallel: each is a
/// softmax over the vocabulary.
fn sample_rows(
    seqs: &mut [&mut Sequence],
    logits: Option<&[Vec<f32>]>,
    greedy: &[u32],
    metrics: &Metrics,
) -> candle_core::Result<Vec<u32>> {
    let timer = Instant::now();
    let next = seqs
        .par_iter_mut()
        .enumerate()
        .map(|(i, seq)| match (logits, greedy.get(i)) {
            (_, Some(&token)) if seq.sampler.is_plain_greedy() => Ok(token),
            (Some(logits), _) => Ok(seq.sampler.sample(&logits[i], &seq.tokens)),
            (None, _) => Err(candle_core::Error::Msg(format!(
                "row {i} samples, but the step read back no logits"
            ))),
        })
        .collect();
    metrics.add_phase(Phase::Sample, timer.elapsed());
    next
}

/// The decode engine for `model`, where it takes it (CUDA, bf16, fused q, k, v: as
/// inference loads give). A slot per sequence, each as long as the model's context.
/// Without it (or if its cache does not fit) the steps run through
/// `forward_decode_batch`.
fn slot_decoder(model: &EngineModel, cfg: &EngineConfig) -> Option<SlotDecoder> {
    let llama = &model.llama;
    if SlotDecoder::unsupported(llama).is_some() {
        return None;
    }
    let options = DecodeOptions {
        slots: cfg.max_sequences,
        context: llama.config().max_position_embeddings,
        graphs: cfg.graphs,
    };
    match SlotDecoder::new(llama, options) {
        Ok(decoder) => Some(decoder),
        Err(e) => {
            eprintln!(
                "twell serve: decoding without the decode engine: its cache of {} slots \
                 × {} positions could not be made ({})",
                options.slots,
                options.context,
                crate::app::first_line(&e)
            );
            None
        }
    }
}

/// Runs the engine until `jobs` is closed (the server shut down) and every sequence in
/// flight has finished or been cancelled.
pub fn run(
    mut model: EngineModel,
    mut jobs: mpsc::Receiver<Job>,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
) {
    let mut decoder = slot_decoder(&model, &cfg);
    let mut prefixes = PrefixCache::new(cfg.prefix_cache);
    let mut running: Vec<Sequence> = Vec::new();
    let mut tally = FfnTally::default();
    let mut open = true;
    loop {
        if running.is_empty() || tally.due() {
            // A count that cannot be read back leaves the densities as they were: the
            // requests themselves are unaffected.
            tally.flush(&metrics).ok();
        }
        // Join: new requests take free slots between steps.
        while open && running.len() < cfg.max_sequences {
            let job = if running.is_empty() {
                // Idle: wait for work rather than spin.
                match jobs.blocking_recv() {
                    Some(job) => job,
                    None => {
                        open = false;
                        break;
                    }
                }
            } else {
                match jobs.try_recv() {
                    Ok(job) => job,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            metrics.queue_left();
            if job.events.is_closed() {
                metrics.cancelled();
                continue;
            }
            // A cached prefix, else a new cache (its RoPE tables made for it).
            let (cached, cache) = match prefixes.take(&job.prompt) {
                Some((tokens, cache)) => {
                    metrics.prefix_hit(tokens);
                    (tokens, Ok(cache))
                }
                None => (0, model.new_cache()),
            };
            match cache {
                Ok(cache) => {
                    let mut seq = model.start(job, cache);
                    seq.prefilled = cached;
                    seq.keep_prefix_at = prefixes.plan(&seq.job.prompt, cached);
                    running.push(seq);
                }
                Err(e) => {
                    let _ = job.events.send(Event::Failed(crate::app::first_line(&e)));
                    metrics.failed();
                }
            }
        }
        if running.is_empty() {
            if open {
                continue;
            }
            return;
        }
        metrics.set_running(running.len());
        // The client went away: free its slot.
        running.retain(|seq| {
            let gone = seq.job.events.is_closed();
            if gone {
                metrics.cancelled();
            }
            !gone
        });
        // Prompts a chunk each, then every other sequence's next token in one step (a
        // sequence whose prompt ends in this step got its first token from the prefill).
        let decodes: Vec<bool> = running.iter().map(|s| s.next_input.is_some()).collect();
        let mut results: Vec<(usize, candle_core::Result<StepResult>)> = Vec::new();
        // The decode engine's slots no running sequence holds, last taken first.
        let mut free_slots: Vec<usize> = (0..cfg.max_sequences)
            .rev()
            .filter(|&slot| running.iter().all(|s| s.slot != Some(slot)))
            .collect();
        let timer = Instant::now();
        for (i, seq) in running.iter_mut().enumerate() {
            if !decodes[i] {
                let slots = decoder.as_mut().map(|d| (d, &mut free_slots));
                results.push((
                    i,
                    model.prefill_step(seq, &cfg, &metrics, &mut tally, &mut prefixes, slots),
                ));
            }
        }
        if decodes.iter().any(|d| !d) {
            metrics.add_phase(Phase::Prefill, timer.elapsed());
        }
        let decoding: Vec<usize> = (0..running.len()).filter(|&i| decodes[i]).collect();
        if !decoding.is_empty() {
            let mut seqs: Vec<&mut Sequence> = running
                .iter_mut()
                .zip(&decodes)
                .filter(|(_, &d)| d)
                .map(|(s, _)| s)
                .collect();
            let step = match decoder.as_mut() {
                Some(d) => model.decode_step_on_slots(d, &mut seqs, &metrics),
                None => model.decode_step(&mut seqs, &metrics, &mut tally),
            };
            match step {
                Ok(each) => results.extend(decoding.iter().copied().zip(each)),
                Err(e) => {
                    let why = crate::app::first_line(&e);
                    for &i in &decoding {
                        results.push((i, Err(candle_core::Error::Msg(why.clone()))));
                    }
                }
            }
        }
        let mut done = vec![false; running.len()];
        for (i, result) in results {
            match result {
                Ok(StepResult::Running) => {}
                Ok(StepResult::Finished) => {
                    metrics.add_prompt(running[i].job.prompt.len());
                    done[i] = true;
                }
                Err(e) => {
                    let why = crate::app::first_line(&e);
                    let _ = running[i].job.events.send(Event::Failed(why.clone()));
                    metrics.failed();
                    done[i] = true;
                }
            }
        }
        let mut index = 0;
        running.retain(|_| {
            index += 1;
            !done[index - 1]
        });
        metrics.set_running(running.len());
    }
}
