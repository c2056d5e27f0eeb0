//! `twell serve`: the OpenAI-compatible server (`twell-serve`) over the model
//! `--model` loads (the sparse default without one), as `generate` loads it.

use anyhow::{Context, Result};
use twell_serve::{EngineModel, ServeOptions, Served};

use crate::device::FfnArg;
use crate::model_args::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (loopback by default: pass 0.0.0.0 to serve other hosts).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences decoded at once; further requests wait in the queue.
    #[arg(long, default_value_t = 16)]
    pub max_sequences: usize,
    /// Requests that may wait for a slot; past it the server answers 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Prompt tokens a sequence prefills per step, so that a long prompt does not stall
    /// the streams already running.
    #[arg(long, default_value_t = 128)]
    pub prefill_chunk: usize,
    /// Prompt prefixes kept prefilled for new requests that start with them (a chat
    /// template's system turn, a shared preamble); 0 turns the cache off.
    #[arg(long, default_value_t = 8)]
    pub prefix_cache: usize,
    /// Largest request body accepted (bytes); larger ones get 413.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// On CUDA, launch each decode step's ops one by one instead of replaying the step
    /// captured as a CUDA graph.
    #[arg(long)]
    pub no_graph: bool,
    /// The id the model answers to (besides `default`); by default its file or
    /// directory name.
    #[arg(long)]
    pub model_id: Option<String>,
}

pub fn run(args: &ServeArgs) -> Result<()> {
    // A server's batches change size from step to step, so unless --ffn says otherwise
    // each MLP call takes the side its own timings find faster at that size (`auto`),
    // whatever path a merged adapter declares for one sequence at a time.
    let mut model_args = args.model.clone();
    model_args.ffn.get_or_insert(FfnArg::Auto);
    let (ck, mut llama) = model_args.open_for_inference()?;
    let ffn = llama.config().ffn_mode.name();
    let relu = llama.config().activation == twell::Activation::Relu;
    llama.record_ffn_stats(relu);
    let device = llama.device().clone();
    let dtype = llama.dtype();
    let mut eos = llama.config().eos_ids();
    if let Some(id) = ck.tokenizer.token_to_id("<|im_end|>") {
        eos.push(id);
    }
    let chat = ck.chat_format().ok();
    let model_id = match &args.model_id {
        Some(id) => id.clone(),
        None if args.model.model.is_none() && !args.model.dense => "smollm2-135m-sparse".into(),
        None => ck
            .source
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into()),
    };
    let served = Served {
        model: EngineModel {
            llama,
            tokenizer: ck.tokenizer.clone(),
            eos,
            device,
            dtype,
        },
        model_id: model_id.clone(),
        chat,
    };
    let opts = ServeOptions {
        host: args.host.clone(),
        port: args.port,
        max_sequences: args.max_sequences,
        queue: args.queue,
        prefill_chunk: args.prefill_chunk,
        prefix_cache: args.prefix_cache,
        max_body_bytes: args.max_body_bytes,
        graphs: !args.no_graph,
    };
    twell_serve::serve(served, &opts, |addr| {
        eprintln!("serving {model_id} (ffn {ffn}) at http://{addr}/v1 (Ctrl-C stops)");
    })
    .context("twell serve")
}
