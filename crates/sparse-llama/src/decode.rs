//! The CUDA decode engine: sequences decode together in slots of a preallocated KV
//! cache, and each batch size's step is captured once as a CUDA graph and replayed for
//! every token after.
//!
//! Launching a step's hundreds of kernels one by one costs the host more than the GPU
//! takes to run them at small batches (the step is bound by the host). A graph launches
//! them all in one call. A captured step must not read anything back to the host nor
//! change shape, so the cache is allocated up front (`slots × context` positions a
//! layer), and the tokens, positions and slots of a step sit in a device buffer written
//! before each replay. Each row carries its own position and slot, so sequences that
//! started at different times share a step (continuous batching).
//!
//! Batch sizes round up to a bucket (1, 2, 4, … up to the slot count); the padding rows
//! write into a spare slot no sequence uses. With `Auto` MLPs, a bucket's graph is
//! captured for the sparse and for the dense MLP, both are timed over replays, and the
//! faster one is kept: the choice is made on the whole step as it runs, so decoding is
//! never slower than the dense step it was timed against.

use std::collections::HashMap;

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use fused_ops::{RopeTable, SlotAttention};
use twell::{Activation, FfnMode};

use crate::model::{Cache, Llama};

/// Sizes of a [`SlotDecoder`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Sequences decoded at once, at most.
    pub slots: usize,
    /// Positions each slot holds: prompt and generated tokens together.
    pub context: usize,
    /// Capture each batch size's step as a CUDA graph (off: launch the same step op by
    /// op, for debugging and to compare against).
    pub graphs: bool,
}

/// One row of a decode step: the token at `position` of the sequence in `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeRow {
    pub slot: usize,
    pub token: u32,
    pub position: usize,
}

/// A captured step.
#[cfg(feature = "cuda")]
type Graph = candle_core::cuda_backend::cudarc::driver::CudaGraph;
/// Without the cuda feature there are no graphs (and no decoder: it takes CUDA only).
#[cfg(not(feature = "cuda"))]
enum Graph {}

/// What one batch size's step runs on.
struct Bucket {
    attention: SlotAttention,
    /// `None` where steps run op by op (asked for, or a capture failed).
    graph: Option<Graph>,
    /// The MLP path the step runs.
    side: FfnMode,
}

/// Decodes up to `slots` sequences a step over a preallocated KV cache, replaying one
/// captured CUDA graph per batch size ([module docs](self)).
pub struct SlotDecoder {
    options: DecodeOptions,
    /// Per layer, `[slots + 1, context, 2 · kv_heads · hd]` (the last slot takes the
    /// padding rows).
    kv: Vec<Tensor>,
    rope: RopeTable,
    /// `[3, slots]` u32: the step's tokens, positions and slots, row by row.
    inputs: Tensor,
    /// `[slots, vocab]` f32: the last step's logits.
    logits: Tensor,
    /// `[slots]` u32: the last step's greedy tokens.
    greedy: Tensor,
    buckets: HashMap<usize, Bucket>,
    /// Rows of the last step.
    rows: usize,
    /// Why graphs are off, when a capture failed.
    graph_failure: Option<String>,
    device: Device,
}

impl SlotDecoder {
    /// Why the decoder cannot run `model`, if it cannot: it takes CUDA, bf16, fused q,
    /// k, v projections ([`Llama::fuse_qkv`]) and the attention kernels' head sizes.
    pub fn unsupported(model: &Llama) -> Option<String> {
        let head_dim = model.config().head_dim();
        if !model.device().is_cuda() {
            Some(
                "the slot decoder runs on CUDA; on the CPU decode with Llama::forward_decode_batch"
                    .into(),
            )
        } else if model.dtype() != DType::BF16 {
            Some(format!(
                "the slot decoder takes a bf16 model, got {:?}",
                model.dtype()
            ))
        } else if !model.is_qkv_fused() {
            Some("the slot decoder needs fused q, k, v projections: call Llama::fuse_qkv".into())
        } else if model.is_tensor_parallel() {
            Some(
                "a tensor-parallel model (Llama::shard_ffn) decodes through \
                 Llama::forward_decode_batch: its all-reduce runs on the host, outside a graph"
                    .into(),
            )
        } else if !fused_ops::CUDA_HEAD_DIMS.contains(&head_dim) {
            Some(format!(
                "the slot decoder's attention takes head sizes {:?}, the model's is {head_dim}",
                fused_ops::CUDA_HEAD_DIMS
            ))
        } else {
            None
        }
    }

    /// A decoder for `model` (see [`Self::unsupported`]).
    pub fn new(model: &Llama, options: DecodeOptions) -> Result<Self> {
        let cfg = model.config();
        let device = model.device().clone();
        if let Some(why) = Self::unsupported(model) {
            candle_core::bail!("{why}");
        }
        if options.slots == 0 || options.context == 0 {
            candle_core::bail!(
                "the slot decoder needs at least one slot and one position, got {} slots of {}",
                options.slots,
                options.context
            );
        }
        if options.context > cfg.max_position_embeddings {
            candle_core::bail!(
                "a context of {} positions is past the model's {}",
                options.context,
                cfg.max_position_embeddings
            );
        }
        let width = 2 * cfg.num_key_value_heads * cfg.head_dim();
        let kv = (0..cfg.num_hidden_layers)
            .map(|_| {
                Tensor::zeros(
                    (options.slots + 1, options.context, width),
                    DType::BF16,
                    &device,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let rope = Cache::new(true, DType::BF16, cfg, &device)?.rope().clone();
        Ok(Self {
            options,
            kv,
            rope,
            inputs: Tensor::zeros((3, options.slots), DType::U32, &device)?,
            logits: Tensor::zeros((options.slots, cfg.vocab_size), DType::F32, &device)?,
            greedy: Tensor::zeros(options.slots, DType::U32, &device)?,
            buckets: HashMap::new(),
            rows: 0,
            graph_failure: None,
            device,
        })
    }

    pub fn options(&self) -> DecodeOptions {
        self.options
    }

    /// Why steps run without graphs although they were asked for: a capture failed.
    pub fn graph_failure(&self) -> Option<&str> {
        self.graph_failure.as_deref()
    }

    /// The MLP path the step of `rows` rows runs, once it has run.
    pub fn side(&self, rows: usize) -> Option<FfnMode> {
        self.buckets.get(&self.bucket_of(rows)).map(|b| b.side)
    }

    /// Fills `slot` with `prompt` (run through the model's ordinary forward pass) and
    /// returns the logits after its last token, `[vocab]` f32. The sequence's next
    /// decode row is then at position `prompt.len()`.
    pub fn prefill(&mut self, model: &Llama, slot: usize, prompt: &[u32]) -> Result<Tensor> {
        if slot >= self.options.slots {
            candle_core::bail!("slot {slot} is past the decoder's {}", self.options.slots);
        }
        if prompt.is_empty() || prompt.len() >= self.options.context {
            candle_core::bail!(
                "a prompt of {} tokens: want 1 to {} (the decoder's context less one)",
                prompt.len(),
                self.options.context - 1
            );
        }
        let mut cache = Cache::new(true, DType::BF16, model.config(), &self.device)?;
        let ids = Tensor::new(prompt, &self.device)?.unsqueeze(0)?;
        let logits = model.forward(&ids, 0, &mut cache)?.squeeze(0)?;
        self.load_cache(slot, &cache)?;
        Ok(logits)
    }

    /// Copies a sequence's cache (one sequence, filled by the model's forward pass, in
    /// chunks or at once) into `slot`: its next decode row is at position `cache.len()`.
    pub fn load_cache(&mut self, slot: usize, cache: &Cache) -> Result<()> {
        let (slots, context) = (self.options.slots, self.options.context);
        if slot >= slots {
            candle_core::bail!("slot {slot} is past the decoder's {slots}");
        }
        let t = cache.len();
        if t == 0 || t >= context {
            candle_core::bail!(
                "a cache of {t} positions: the slot takes 1 to {} (the decoder's context less one)",
                context - 1
            );
        }
        for (l, kv) in self.kv.iter().enumerate() {
            let Some(rows) = cache.layer_kv(l)? else {
                candle_core::bail!("the cache holds nothing for layer {l}");
            };
            let (b, _, width) = rows.dims3()?;
            if b != 1 || width != kv.dim(2)? || rows.dtype() != DType::BF16 {
                candle_core::bail!(
                    "a cache of batch {b}, width {width}, {:?}: the slot takes one bf16 sequence of width {}",
                    rows.dtype(),
                    kv.dim(2)?
                );
            }
            // The buffer as rows of positions: the slot's first `t` positions start at
            // row `slot · context`.
            let flat = kv.reshape((kv.dim(0)? * context, width))?;
            flat.slice_set(&rows.reshape((t, width))?.contiguous()?, 0, slot * context)?;
        }
        Ok(())
    }

    /// Decodes one token for each row: writes its key and value at its position of its
    /// slot, and leaves the logits and greedy tokens for [`Self::logits`] and
    /// [`Self::greedy_tokens`]. The slots must be distinct, the positions below the
    /// context, and each slot must hold its sequence's positions before `position`.
    pub fn step(&mut self, model: &mut Llama, rows: &[DecodeRow]) -> Result<()> {
        let n = rows.len();
        let (slots, context) = (self.options.slots, self.options.context);
        if n == 0 || n > slots {
            candle_core::bail!("a decode step of {n} rows: the decoder takes 1 to {slots}");
        }
        let mut seen = vec![false; slots];
        for (i, r) in rows.iter().enumerate() {
            if r.slot >= slots || std::mem::replace(&mut seen[r.slot], true) {
                candle_core::bail!("row {i}: slot {} is past {slots} or taken twice", r.slot);
            }
            if r.position >= context {
                candle_core::bail!(
                    "row {i}: position {} is past the decoder's context of {context}",
                    r.position
                );
            }
            if r.token as usize >= model.config().vocab_size {
                candle_core::bail!(
                    "row {i}: token {} is past the vocabulary of {}",
                    r.token,
                    model.config().vocab_size
                );
            }
        }
        let bucket = self.bucket_of(n);
        // Padding rows: token 0 at position 0 of the spare slot.
        let mut host = vec![0u32; 3 * slots];
        for i in 0..bucket {
            host[2 * slots + i] = slots as u32;
        }
        for (i, r) in rows.iter().enumerate() {
            host[i] = r.token;
            host[slots + i] = r.position as u32;
            host[2 * slots + i] = r.slot as u32;
        }
        self.inputs
            .slice_set(&Tensor::from_vec(host, (3, slots), &self.device)?, 0, 0)?;
        self.rows = n;
        if !self.buckets.contains_key(&bucket) {
            return self.first_step(model, bucket);
        }
        self.replay(model, bucket)
    }

    /// The last step's logits, `[rows, vocab]` f32 (a view of the decoder's buffer,
    /// overwritten by the next step).
    pub fn logits(&self) -> Result<Tensor> {
        self.logits.narrow(0, 0, self.rows)
    }

    /// The last step's greedy (argmax) tokens, one per row.
    pub fn greedy_tokens(&self) -> Result<Vec<u32>> {
        self.greedy.narrow(0, 0, self.rows)?.to_vec1::<u32>()
    }

    /// The nodes of the graph a step of `rows` rows replays, counted by kind (kernel,
    /// memset, memcpy, ...), once its bucket has been captured: what a replay asks of
    /// the driver.
    pub fn graph_nodes(&self, rows: usize) -> Result<Option<Vec<(String, usize)>>> {
        match self.buckets.get(&self.bucket_of(rows)) {
            Some(Bucket { graph: Some(g), .. }) => graph_census(g).map(Some),
            _ => Ok(None),
        }
    }

    /// Batch sizes round up to a power of two, up to the slot count.
    fn bucket_of(&self, rows: usize) -> usize {
        rows.next_power_of_two().min(self.options.slots)
    }

    /// The step of `bucket` rows, op by op: reads the inputs buffer, writes the
    /// logits and greedy buffers.
    fn run(&self, model: &Llama, bucket: usize, attention: &SlotAttention) -> Result<()> {
        let column = |k: usize| self.inputs.i(k)?.narrow(0, 0, bucket);
        let (ids, positions, slots) = (column(0)?, column(1)?, column(2)?);
        let logits = model.forward_decode_slots(
            (&ids, &positions, &slots),
            &self.kv,
            attention,
            &self.rope,
        )?;
        let greedy = fused_ops::argmax_rows(&logits)?;
        self.logits.slice_set(&logits, 0, 0)?;
        self.greedy.slice_set(&greedy, 0, 0)?;
        Ok(())
    }

    /// The paths a bucket may be captured with: with `Auto` ReLU MLPs, the sparse and
    /// the dense one; otherwise the model's own.
    fn candidates(model: &Llama) -> Vec<FfnMode> {
        let sparse_capable = model
            .mlps()
            .all(|m| m.activation() == Activation::Relu && !m.has_bias());
        match (sparse_capable, model.config().ffn_mode) {
            (false, _) => vec![FfnMode::Dense],
            (true, FfnMode::Auto) => vec![FfnMode::Sparse, FfnMode::Dense],
            (true, mode) => vec![mode],
        }
    }

    /// A bucket's first step: run it, then capture its graph (one per candidate path,
    /// the fastest kept) for the steps after; without graphs, run it on the first
    /// candidate op by op.
    fn first_step(&mut self, model: &mut Llama, bucket: usize) -> Result<()> {
        let cfg = model.config();
        let attention = SlotAttention::new(
            &self.device,
            bucket,
            (
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim(),
            ),
            self.options.context,
        )?;
        let candidates = Self::candidates(model);
        let captured = match self.options.graphs && self.graph_failure.is_none() {
            true => self.capture_fastest(model, bucket, &attention, &candidates)?,
            false => None,
        };
        let (graph, side) = match captured {
            Some((graph, side)) => (Some(graph), side),
            None => {
                self.run_on(model, candidates[0], |d, m| d.run(m, bucket, &attention))?;
                (None, candidates[0])
            }
        };
        self.buckets.insert(
            bucket,
            Bucket {
                attention,
                graph,
                side,
            },
        );
        Ok(())
    }

    /// A later step of a bucket: its graph replayed, or its ops run one by one.
    fn replay(&mut self, model: &mut Llama, bucket: usize) -> Result<()> {
        let b = &self.buckets[&bucket];
        if let Some(graph) = &b.graph {
            return launch(graph);
        }
        self.run_on(model, b.side, |d, m| d.run(m, bucket, &b.attention))
    }

    /// Runs `work` with every MLP on `side` and statistics off (they keep each
    /// forward's device tensors, which a captured step must not leave behind, and an
    /// op-by-op step runs what a captured one runs), then puts both back.
    fn run_on<R>(
        &self,
        model: &mut Llama,
        side: FfnMode,
        work: impl FnOnce(&Self, &Llama) -> Result<R>,
    ) -> Result<R> {
        let mode = model.config().ffn_mode;
        let stats = model.mlps().any(|m| m.records_stats());
        model.record_ffn_stats(false);
        let done = model.set_ffn_mode(side).and_then(|()| work(self, model));
        model.record_ffn_stats(stats);
        model.set_ffn_mode(mode)?;
        done
    }
}

#[cfg(feature = "cuda")]
fn launch(graph: &Graph) -> Result<()> {
    use candle_core::cuda_backend::WrapErr;
    graph.launch().w()
}

#[cfg(not(feature = "cuda"))]
fn launch(graph: &Graph) -> Result<()> {
    match *graph {}
}

/// `graph`'s nodes counted by kind, in the driver's order of kinds.
#[cfg(feature = "cuda")]
fn graph_census(graph: &Graph) -> Result<Vec<(String, usize)>> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::WrapErr;
    let g = graph.cu_graph();
    let mut n = 0usize;
    // SAFETY: a null node array asks for the count only.
    unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) }
        .result()
        .w()?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds `n` entries, the count the driver gave.
    unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) }
        .result()
        .w()?;
    let mut counts: Vec<(String, usize)> = Vec::new();
    for &node in &nodes[..n] {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is a node of the live graph.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }
            .result()
            .w()?;
        let name = format!("{kind:?}")
            .trim_start_matches("CU_GRAPH_NODE_TYPE_")
            .to_lowercase();
        match counts.iter_mut().find(|(k, _)| *k == name) {
            Some((_, c)) => *c += 1,
            None => counts.push((name, 1)),
        }
    }
    Ok(counts)
}

#[cfg(not(feature = "cuda"))]
fn graph_census(graph: &Graph) -> Result<Vec<(String, usize)>> {
    match *graph {}
}

#[cfg(feature = "cuda")]
impl SlotDecoder {
    /// Captures the step under each candidate path and keeps the fastest graph (timed
    /// over replays, which rewrite the same keys and values); the kept graph then runs
    /// once more, so the step's outputs are its path's. `None` when a capture fails:
    /// the decoder then says why and runs op by op.
    fn capture_fastest(
        &mut self,
        model: &mut Llama,
        bucket: usize,
        attention: &SlotAttention,
        candidates: &[FfnMode],
    ) -> Result<Option<(Graph, FfnMode)>> {
        let mut captured = Vec::new();
        for &side in candidates {
            match self.run_on(model, side, |d, m| d.capture(m, bucket, attention)) {
                Ok(graph) => captured.push((graph, side)),
                Err(e) => {
                    let why = format!("CUDA graph capture failed ({e}); decoding op by op");
                    eprintln!("twell: {why}");
                    self.graph_failure = Some(why);
                    return Ok(None);
                }
            }
        }
        if captured.len() == 1 {
            return Ok(captured.pop());
        }
        // Time the candidates in turns, so drift in the card's clock hits both alike.
        const ROUNDS: usize = 5;
        const REPLAYS: usize = 4;
        let mut best = vec![f64::INFINITY; captured.len()];
        for _ in 0..ROUNDS {
            for (k, (graph, _)) in captured.iter().enumerate() {
                self.device.synchronize()?;
                let t0 = std::time::Instant::now();
                for _ in 0..REPLAYS {
                    launch(graph)?;
                }
                self.device.synchronize()?;
                best[k] = best[k].min(t0.elapsed().as_secs_f64());
            }
        }
        let k = (0..captured.len())
            .min_by(|&a, &b| best[a].total_cmp(&best[b]))
            .expect("candidates");
        let kept = captured.swap_remove(k);
        launch(&kept.0)?;
        Ok(Some(kept))
    }

    /// Runs the step once op by op (loading its kernels, settling lazily made buffers
    /// and candle's uploads of launch parameters, none of which a capture may do), then
    /// captures it. The capture runs nothing: the op-by-op run is this call's step.
    fn capture(&self, model: &Llama, bucket: usize, attention: &SlotAttention) -> Result<Graph> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        use candle_core::cuda_backend::WrapErr;
        let Device::Cuda(dev) = &self.device else {
            candle_core::bail!("the slot decoder runs on CUDA");
        };
        let _uploads = dev.enable_cuda_graph_htod_cache();
        self.run(model, bucket, attention)?;
        let stream = dev.cuda_stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let ran = self.run(model, bucket, attention);
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        ran?;
        let graph = graph
            .w()?
            .ok_or_else(|| candle_core::Error::Msg("the captured step holds no work".into()))?;
        graph.upload().w()?;
        Ok(graph)
    }
}

#[cfg(not(feature = "cuda"))]
impl SlotDecoder {
    /// Without the cuda feature there is nothing to capture.
    fn capture_fastest(
        &mut self,
        _: &mut Llama,
        _: usize,
        _: &SlotAttention,
        _: &[FfnMode],
    ) -> Result<Option<(Graph, FfnMode)>> {
        Ok(None)
    }
}
