//! `twell sample`: text from a model's own distribution, to train on.
//!
//! Fine-tuning on the 2M-token default corpus overfits within a few epochs, for the
//! λ = 0 run and the sparse one alike (docs/finetuning.md). Continuations sampled from
//! the teacher, prompted with windows of the training documents only, add text that
//! follows the teacher's distribution without touching the held-out documents.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sparse_train::sample::{sample_batch, BatchSampling};

use crate::corpus_args::CorpusArgs;
use crate::model_args::{DefaultModel, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct SampleArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The training documents give the prompts.
    #[command(flatten)]
    pub corpus: CorpusArgs,
    /// How many texts to write.
    #[arg(long, default_value_t = 256)]
    pub count: usize,
    /// Texts decoded together (one KV cache).
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Tokens of training text each prompt takes, from a random place.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// New tokens per text (a text ends early at an end-of-text token).
    #[arg(long, default_value_t = 480)]
    pub max_tokens: usize,
    /// 1 samples the model's distribution as it is; 0 is greedy. At 1 the far tail of
    /// a 135M model derails some texts into strings of unrelated tokens (seen on the
    /// default model); 0.8 keeps them on topic.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sample whole chat exchanges instead of continuing the training documents: every
    /// text starts at the chat template's user turn (system message included), and the
    /// model writes the user's message, then its reply. Texts keep the template's
    /// markers, which tokenize back into the same special tokens when trained on.
    #[arg(long)]
    pub chat: bool,
    /// Directory for the texts (`sample-NNNNNN.txt`, prompt then continuation).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: &SampleArgs) -> Result<()> {
    if args.count == 0 || args.batch == 0 || args.prompt_tokens == 0 || args.max_tokens == 0 {
        bail!("--count, --batch, --prompt-tokens and --max-tokens must each be at least 1");
    }
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        bail!("--temperature must be a finite number >= 0");
    }
    let (ck, model) = args.model.open_for_inference_as(DefaultModel::Base)?;
    let device = model.device().clone();
    let eos = model.config().eos_ids();

    // A chat text runs through several end-of-turn tokens: it ends at the length cap,
    // or at an end-of-text token where the vocabulary has one.
    let (eos, chat_opening) = match args.chat {
        true => {
            let opening = ck.chat_format()?.user_turn_opening(None);
            let ids = ck
                .tokenizer
                .encode(opening.as_str(), false)
                .map_err(anyhow::Error::msg)
                .context("tokenizing the chat opening")?
                .get_ids()
                .to_vec();
            let end_of_text = ck.tokenizer.token_to_id("<|endoftext|>");
            (end_of_text.into_iter().collect(), Some(ids))
        }
        false => (eos, None),
    };
    // Chat texts start from the template, not from the documents: none to read then.
    let tokens = match chat_opening {
        Some(_) => Vec::new(),
        None => {
            let (train_docs, _) = args.corpus.split()?;
            train_docs.tokenize(&ck.tokenizer, eos.first().copied())?
        }
    };
    if chat_opening.is_none() && tokens.len() <= args.prompt_tokens {
        bail!(
            "the training documents hold {} tokens, too few for prompts of {}",
            tokens.len(),
            args.prompt_tokens
        );
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;

    let mut rng = StdRng::seed_from_u64(args.seed);
    let bar = ProgressBar::new(args.count as u64).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} texts [{elapsed}<{eta}] {msg}")
            .expect("static progress template"),
    );
    let started = std::time::Instant::now();
    let mut written = 0;
    let mut new_tokens = 0;
    while written < args.count {
        let rows = args.batch.min(args.count - written);
        let prompts: Vec<Vec<u32>> = (0..rows)
            .map(|_| match &chat_opening {
                Some(opening) => opening.clone(),
                None => {
                    let start = rng.random_range(0..tokens.len() - args.prompt_tokens);
                    tokens[start..start + args.prompt_tokens].to_vec()
                }
            })
            .collect();
        let cfg = BatchSampling {
            max_new_tokens: args.max_tokens,
            temperature: args.temperature,
            seed: args.seed,
            first_row: written,
        };
        let continuations = sample_batch(&model, &prompts, &eos, &cfg, &device)?;
        for (prompt, continuation) in prompts.iter().zip(&continuations) {
            let ids: Vec<u32> = prompt.iter().chain(continuation).copied().collect();
            let text = ck
                .tokenizer
                .decode(&ids, !args.chat)
                .map_err(anyhow::Error::msg)
                .context("decoding a sampled text")?;
            let path = args.out.join(format!("sample-{written:06}.txt"));
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            new_tokens += continuation.len();
            written += 1;
        }
        bar.set_position(written as u64);
        bar.set_message(format!(
            "{:.0} new tokens/s",
            new_tokens as f64 / started.elapsed().as_secs_f64()
        ));
    }
    bar.finish();
    eprintln!(
        "sample: {written} texts, {new_tokens} new tokens in {:.1} s ({:.0} tokens/s) in {}",
        started.elapsed().as_secs_f64(),
        new_tokens as f64 / started.elapsed().as_secs_f64(),
        args.out.display()
    );
    Ok(())
}
