//! Plain-text corpora: files from a directory or a glob, ordered by name, split into
//! training and held-out documents, tokenized and joined with EOS.

use std::path::{Path, PathBuf};

use candle_core::Result;
use tokenizers::Tokenizer;

use crate::error::{err, LlamaError};

/// The documents of a corpus, sorted by file name (the SOTU files start with the year,
/// so this is chronological).
#[derive(Clone, Debug)]
pub struct Corpus {
    pub files: Vec<PathBuf>,
}

impl Corpus {
    /// `spec` is a directory (its `*.txt` files), a single file, or a glob pattern
    /// with `*` in the file name (e.g. `data/sotu/19*.txt`).
    pub fn open(spec: &str) -> Result<Self> {
        let path = Path::new(spec);
        let files = if path.is_dir() {
            list(path, |name| name.ends_with(".txt"))?
        } else if path.is_file() {
            vec![path.to_path_buf()]
        } else if let Some(name) = path
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| n.contains('*'))
        {
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let pattern = name.to_string();
            list(dir, |n| glob_match(&pattern, n))?
        } else {
            return err(LlamaError::NotFound(format!(
                "text corpus '{spec}' (a directory, file, or dir/*.txt glob)"
            )));
        };
        if files.is_empty() {
            return err(LlamaError::NotFound(format!(
                "no text files match '{spec}'"
            )));
        }
        Ok(Self { files })
    }

    /// `(training, held-out)`: the last `holdout` documents are held out.
    pub fn split(&self, holdout: usize) -> Result<(Corpus, Corpus)> {
        if holdout >= self.files.len() {
            return err(LlamaError::Invalid(format!(
                "cannot hold out {holdout} of {} documents and still train",
                self.files.len()
            )));
        }
        let cut = self.files.len() - holdout;
        Ok((
            Corpus {
                files: self.files[..cut].to_vec(),
            },
            Corpus {
                files: self.files[cut..].to_vec(),
            },
        ))
    }

    /// The last `n` documents.
    pub fn last(&self, n: usize) -> Corpus {
        let start = self.files.len().saturating_sub(n);
        Corpus {
            files: self.files[start..].to_vec(),
        }
    }

    /// All documents tokenized (no special tokens added), joined by `eos`.
    pub fn tokenize(&self, tokenizer: &Tokenizer, eos: Option<u32>) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for (i, f) in self.files.iter().enumerate() {
            let text = std::fs::read_to_string(f).map_err(|e| LlamaError::Io {
                path: f.clone(),
                source: e,
            })?;
            let enc = tokenizer
                .encode(text.trim(), false)
                .map_err(|e| LlamaError::Tokenizer(format!("{}: {e}", f.display())))?;
            if i > 0 {
                out.extend(eos);
            }
            out.extend_from_slice(enc.get_ids());
        }
        Ok(out)
    }
}

fn list(dir: &Path, keep: impl Fn(&str) -> bool) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| LlamaError::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.file_name().and_then(|n| n.to_str()).is_some_and(&keep))
        .collect();
    files.sort();
    Ok(files)
}

/// `*` matches any run of characters; everything else matches itself.
fn glob_match(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first)
        || !name[first.len()..].ends_with(last)
        || name.len() < first.len() + last.len()
    {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(at) => rest = &rest[at + p.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn globs() {
        assert!(glob_match("*.txt", "a.txt"));
        assert!(glob_match("19*_d.txt", "1933_roosevelt_d.txt"));
        assert!(!glob_match("19*.txt", "2001.txt"));
        assert!(!glob_match("a*a", "a"));
        assert!(glob_match("*", "x"));
    }
}
