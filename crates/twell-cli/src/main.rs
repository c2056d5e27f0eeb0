//! `twell`: generate, fine-tune, evaluate, benchmark and convert sparse-FFN Llama models.

mod bench;
mod chart;
mod convert;
mod corpus_args;
mod curves;
mod device;
mod eval;
mod finetune;
mod generate;
mod host_tuning;
mod launch;
mod model_args;
mod output;
mod sample;
mod serve;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "twell",
    version,
    about = "Sparse (TwELL) feed-forward layers for Candle Llama models"
)]
struct Cli {
    /// Leave the host as the system has it: glibc's malloc thresholds, 4 KB pages for the
    /// CPU weights, and rayon workers that sleep between one-token calls (by default
    /// `twell` tunes all three for speed; see `docs/design.md`).
    #[arg(long, global = true)]
    no_host_tuning: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text (prompt or chat), streaming, with prefill/decode speed.
    Generate(generate::GenerateArgs),
    /// L1 sparsity fine-tuning (ReLU gate, loss = CE + λ·L1).
    Finetune(Box<finetune::FinetuneArgs>),
    /// Perplexity on held-out text and per-layer FFN sparsity.
    Eval(eval::EvalArgs),
    /// Texts sampled from a model, prompted from training documents: more text for
    /// `finetune --extra-data`.
    Sample(sample::SampleArgs),
    /// An OpenAI-compatible HTTP server (chat and text completions, streaming,
    /// continuous batching) over the model `generate` would run.
    Serve(serve::ServeArgs),
    /// Convert a checkpoint (e.g. GGUF) to an HF directory.
    Convert(convert::ConvertArgs),
    /// Training curves (validation perplexity, mean L0) of `finetune` logs as one SVG.
    Curves(curves::CurvesArgs),
    /// Benchmarks, dense and sparse side by side.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// One MLP layer: candle dense vs TwELL sparse, over shapes, tokens and densities.
    Mlp(bench::mlp::MlpBenchArgs),
    /// A decode step's projections at a few rows: the few-row kernel against cuBLAS
    /// (CUDA).
    Linear(bench::linear::LinearBenchArgs),
    /// One MLP layer's training step (forward + backward): candle dense autograd vs
    /// TwELL, with peak device memory.
    MlpTrain(bench::mlp_train::MlpTrainBenchArgs),
    /// A whole model: prefill, decode and training step, dense vs TwELL FFN, with peak
    /// memory and energy on GPUs.
    Model(bench::model::ModelBenchArgs),
    /// One MLP layer over the Llama family's shapes, every size and a range of densities:
    /// TwELL and `Auto` against dense, and per shape the worst `Auto` ratio.
    Sweep(bench::sweep::SweepArgs),
    /// A real model's MLP layers, each on the rows its text feeds it: TwELL and `Auto`
    /// against dense at each token count (default: the sparse default model).
    Layers(bench::layers::LayersArgs),
    /// How evenly a real model's active neurons fall across the parts of a
    /// tensor-parallel FFN, in its own neuron order and in a balanced one.
    Shards(bench::shards::ShardsArgs),
    /// The training losses over the vocabulary (cross-entropy, distillation KL),
    /// forward + backward: candle ops vs the fused ops, with peak device memory.
    Loss(bench::loss::LossBenchArgs),
    /// Prefill of a random sparse model with its MLPs split over N processes (one a GPU
    /// with --gpus), against the whole model on one, and the split model's logits error.
    TensorParallel(bench::tensor_parallel::TensorParallelBenchArgs),
    /// Load on a running OpenAI-compatible server: streamed chat requests at several
    /// concurrencies; tokens/s and time to first token (bench/serve-load.sh runs it
    /// against the dense and the sparse server).
    Serve(bench::serve::ServeBenchArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Before any tensor exists: candle's host temporaries are then reused, not faulted
    // in and zeroed again each step.
    host_tuning::tune_host(!cli.no_host_tuning);
    // The command runs on a worker of the rayon pool that the CPU kernels use: a
    // parallel call then starts on the calling thread, and no call ends by waking a
    // thread outside the pool (on this 2-core VM, about 10 µs a call, 150 calls a
    // decode step). A large stack, as the main thread's: autograd walks the graph
    // recursively.
    let pool = rayon::ThreadPoolBuilder::new()
        .stack_size(64 << 20)
        .build()?;
    pool.install(|| run(cli))
}

impl Command {
    /// The files the command writes once its work is done, with their flags: checked
    /// before it starts ([`output`]).
    fn outputs(&self) -> Vec<(&'static str, &std::path::Path)> {
        fn json(p: &Option<std::path::PathBuf>) -> Option<(&'static str, &std::path::Path)> {
            p.as_deref().map(|p| ("--json", p))
        }
        fn svg(p: &Option<std::path::PathBuf>) -> Option<(&'static str, &std::path::Path)> {
            p.as_deref().map(|p| ("--svg", p))
        }
        let files = match self {
            Command::Generate(a) => vec![json(&a.json)],
            Command::Eval(a) => vec![json(&a.json), svg(&a.svg)],
            Command::Curves(a) => vec![Some(("--svg", a.svg.as_path()))],
            Command::Finetune(_) | Command::Sample(_) | Command::Serve(_) | Command::Convert(_) => {
                vec![]
            }
            Command::Bench(b) => match b {
                BenchCommand::Mlp(a) => vec![json(&a.json), svg(&a.svg)],
                BenchCommand::Linear(a) => vec![json(&a.json)],
                BenchCommand::MlpTrain(a) => vec![json(&a.json), svg(&a.svg)],
                BenchCommand::Model(a) => vec![json(&a.json), svg(&a.svg)],
                BenchCommand::Sweep(a) => vec![json(&a.json)],
                BenchCommand::Layers(a) => vec![json(&a.json)],
                BenchCommand::Shards(a) => vec![json(&a.json)],
                BenchCommand::Loss(a) => vec![json(&a.json)],
                BenchCommand::Serve(a) => vec![json(&a.json)],
                BenchCommand::TensorParallel(a) => vec![json(&a.json)],
            },
        };
        files.into_iter().flatten().collect()
    }
}

fn run(cli: Cli) -> Result<()> {
    output::check_all(cli.command.outputs())?;
    match cli.command {
        Command::Generate(args) => generate::run(&args)?,
        Command::Finetune(args) => finetune::run(&args)?,
        Command::Eval(args) => eval::run(&args)?,
        Command::Sample(args) => sample::run(&args)?,
        Command::Serve(args) => serve::run(&args)?,
        Command::Convert(args) => convert::run(&args)?,
        Command::Curves(args) => curves::run(&args)?,
        Command::Bench(BenchCommand::Model(args)) => {
            let report = bench::model::run(&args)?;
            bench::model::print(&report);
            if let Some(path) = &args.json {
                output::write_json(path, &report)?;
            }
            if let Some(path) = &args.svg {
                chart::model_speedups(path, &report)?;
            }
        }
        Command::Bench(BenchCommand::Mlp(args)) => {
            let report = bench::mlp::run(&args)?;
            bench::mlp::print(&report);
        }
        Command::Bench(BenchCommand::Loss(args)) => {
            let report = bench::loss::run(&args)?;
            bench::loss::print(&report);
            if let Some(path) = &args.json {
                output::write_json(path, &report)?;
            }
        }
        Command::Bench(BenchCommand::Linear(args)) => {
            let rows = bench::linear::run(&args)?;
            bench::linear::print(&rows);
            if let Some(path) = &args.json {
                output::write_json(path, &rows)?;
            }
        }
        Command::Bench(BenchCommand::Sweep(args)) => {
            bench::sweep::run(&args)?;
        }
        Command::Bench(BenchCommand::Layers(args)) => {
            let report = bench::layers::run(&args)?;
            bench::layers::print(&report);
        }
        Command::Bench(BenchCommand::Shards(args)) => {
            let report = bench::shards::run(&args)?;
            bench::shards::print(&report);
        }
        Command::Bench(BenchCommand::Serve(args)) => {
            let levels = bench::serve::run(&args)?;
            bench::serve::print(&levels);
        }
        Command::Bench(BenchCommand::TensorParallel(args)) => {
            if let Some(report) = bench::tensor_parallel::run(&args)? {
                bench::tensor_parallel::print(&report);
                if let Some(path) = &args.json {
                    output::write_json(path, &report)?;
                }
            }
        }
        Command::Bench(BenchCommand::MlpTrain(args)) => {
            let report = bench::mlp_train::run(&args)?;
            bench::mlp_train::print(&report);
        }
    }
    Ok(())
}
