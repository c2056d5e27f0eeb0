//! `twell curves`: validation perplexity and mean L0 against step, from the JSON-lines
//! logs `twell finetune` writes, several runs in one chart. The validation batches' L0
//! (where a log has it) shows as dots beside the training line.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

pub use crate::chart::Curve;

#[derive(clap::Args, Debug)]
pub struct CurvesArgs {
    /// `train_log.jsonl` files (one per run).
    #[arg(required = true)]
    pub logs: Vec<PathBuf>,
    /// Legend labels, one per log (default: the file or run directory name).
    #[arg(long, value_delimiter = ',')]
    pub labels: Vec<String>,
    #[arg(long)]
    pub svg: PathBuf,
}

pub fn run(args: &CurvesArgs) -> Result<()> {
    if !args.labels.is_empty() && args.labels.len() != args.logs.len() {
        bail!(
            "--labels: {} labels for {} logs",
            args.labels.len(),
            args.logs.len()
        );
    }
    let curves = args
        .logs
        .iter()
        .enumerate()
        .map(|(i, path)| read(path, args.labels.get(i).cloned()))
        .collect::<Result<Vec<_>>>()?;
    crate::chart::training_curves(&args.svg, &curves)?;
    eprintln!("curves: wrote {}", args.svg.display());
    Ok(())
}

/// Reads one log; `label` defaults to the run's name.
pub fn read(path: &Path, label: Option<String>) -> Result<Curve> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut curve = Curve {
        label: label.unwrap_or_else(|| run_name(path)),
        perplexity: Vec::new(),
        l0: Vec::new(),
        val_l0: Vec::new(),
    };
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let entry: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not JSON", path.display(), n + 1))?;
        let Some(step) = entry["step"].as_f64() else {
            bail!("{} line {}: no \"step\"", path.display(), n + 1);
        };
        if let Some(l0) = entry["mean_l0"].as_f64() {
            curve.l0.push((step, l0));
        }
        if let Some(ce) = entry["val_ce"].as_f64() {
            curve.perplexity.push((step, ce.exp()));
        }
        if let Some(l0) = entry["val_l0"].as_f64() {
            curve.val_l0.push((step, l0));
        }
    }
    if curve.l0.is_empty() {
        bail!("{}: no training steps in this log", path.display());
    }
    Ok(curve)
}

/// `runs/l1-3e-2/train_log.jsonl` → `l1-3e-2`; `train-x.jsonl` → `train-x`.
fn run_name(path: &Path) -> String {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
    match stem.as_deref() {
        Some("train_log") => path
            .parent()
            .and_then(|p| p.file_name())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "run".into()),
        Some(s) => s.to_string(),
        None => "run".into(),
    }
}
