//! `--data`, `--holdout`: the documents `finetune` trains on and `sample` takes prompts
//! from, with the same documents held out by both.

use anyhow::{Context, Result};
use sparse_llama::corpus::Corpus;

use crate::model_args::default_corpus;

#[derive(clap::Args, Debug, Clone)]
pub struct CorpusArgs {
    /// Training text: a directory of .txt files, a file, or dir/*.txt (default: the
    /// State of the Union corpus in the data directory).
    #[arg(long)]
    pub data: Option<String>,
    /// The last N documents are held out for validation: never trained on, and no
    /// prompt of `sample` comes from them.
    #[arg(long, default_value_t = 10)]
    pub holdout: usize,
}

impl CorpusArgs {
    /// The training documents and the held-out ones.
    pub fn split(&self) -> Result<(Corpus, Corpus)> {
        let text = self.data.clone().unwrap_or_else(default_corpus);
        let corpus = Corpus::open(&text).with_context(|| format!("opening --data {text}"))?;
        Ok(corpus.split(self.holdout)?)
    }
}
