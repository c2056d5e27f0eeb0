//! The files a command writes once its work is done (`--json`, `--svg`).
//!
//! Each is checked before the work starts, so a long evaluation or benchmark cannot end
//! in an error about a path it could have reported at once, its results lost. Each is
//! written whole or not at all (a temporary file in the same folder, renamed over the
//! path), so a failed write never leaves half a report where an older one stood.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The folder a file at `path` goes into (`.` for a bare file name).
fn folder_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// A temporary file beside `path`, named after it and this process.
fn temporary_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    folder_of(path).join(format!(".{name}.{}.tmp", std::process::id()))
}

/// Fails, naming `flag`, unless a file can be written at `path`: its folder exists and
/// takes a new file, and `path` is not itself a folder. Leaves nothing behind.
pub fn check_writable(flag: &str, path: &Path) -> Result<()> {
    let shown = path.display();
    if path.file_name().is_none() {
        bail!("{flag} {shown}: not a file name");
    }
    if path.is_dir() {
        bail!("{flag} {shown}: is a folder, not a file");
    }
    let folder = folder_of(path);
    if !folder.is_dir() {
        bail!(
            "{flag} {shown}: the folder {} does not exist",
            folder.display()
        );
    }
    let probe = temporary_beside(path);
    std::fs::File::create(&probe).with_context(|| {
        format!(
            "{flag} {shown}: cannot create a file in {}",
            folder.display()
        )
    })?;
    std::fs::remove_file(&probe).with_context(|| format!("removing {}", probe.display()))?;
    Ok(())
}

/// Checks every `(flag, path)` with [`check_writable`].
pub fn check_all<'a>(outputs: impl IntoIterator<Item = (&'static str, &'a Path)>) -> Result<()> {
    outputs
        .into_iter()
        .try_for_each(|(flag, path)| check_writable(flag, path))
}

/// Writes `contents` to `path` whole: into a temporary file beside it, then renamed over
/// it, so the path holds either its old contents or the new ones.
pub fn write(path: &Path, contents: impl AsRef<[u8]>) -> Result<()> {
    let temporary = temporary_beside(path);
    let written = (|| -> std::io::Result<()> {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(contents.as_ref())?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if let Err(e) = written {
        // Best effort: the error that matters is the write's.
        let _ = std::fs::remove_file(&temporary);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
}

/// [`write`] of `value` as pretty-printed JSON.
pub fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    write(path, serde_json::to_string_pretty(value)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("twell-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_missing_folder_is_reported_with_the_flag_and_leaves_nothing() {
        let dir = scratch("missing");
        let path = dir.join("absent").join("report.json");
        let e = check_writable("--json", &path).unwrap_err().to_string();
        assert!(e.contains("--json") && e.contains("does not exist"), "{e}");
        assert!(!dir.join("absent").exists());
    }

    #[test]
    fn a_folder_is_not_a_file() {
        let dir = scratch("folder");
        let e = check_writable("--svg", &dir).unwrap_err().to_string();
        assert!(e.contains("--svg") && e.contains("folder"), "{e}");
    }

    #[test]
    fn a_writable_path_passes_and_leaves_no_probe() {
        let dir = scratch("writable");
        let path = dir.join("report.json");
        check_writable("--json", &path).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    }

    #[test]
    fn write_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = scratch("write");
        let path = dir.join("report.json");
        std::fs::write(&path, "old").unwrap();
        write_json(&path, &serde_json::json!({"tokens": 3})).unwrap();
        let back: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back["tokens"], 3);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    }

    #[test]
    fn a_failed_write_keeps_what_stood_there_and_removes_its_temporary() {
        let dir = scratch("failed");
        // The rename cannot replace a folder that holds something.
        let taken = dir.join("report.json");
        std::fs::create_dir_all(taken.join("inner")).unwrap();
        let e = write(&taken, "new").unwrap_err().to_string();
        assert!(e.contains("report.json"), "{e}");
        assert!(taken.join("inner").is_dir());
        assert!(!temporary_beside(&taken).exists());
    }
}
