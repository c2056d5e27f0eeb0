//! What the `twell` binary's test files share.
#![allow(dead_code)]

/// A tiny random ReLU Llama checkpoint (10% FFN density) in a fresh directory, and a
/// text file.
pub fn tiny_checkpoint(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    tiny_checkpoint_of_width(dir, 32)
}

/// [`tiny_checkpoint`] with a hidden size of `hidden`.
pub fn tiny_checkpoint_of_width(
    dir: &std::path::Path,
    hidden: usize,
) -> (std::path::PathBuf, std::path::PathBuf) {
    use candle_core::{DType, Device};
    use sparse_llama::synthetic;
    let cfg = synthetic::config(hidden, 96, 2, 2, 1, 258).unwrap();
    let w = synthetic::weights(&cfg, 0.1, 1, DType::F32, &Device::Cpu).unwrap();
    let model = dir.join("tiny");
    let tok = sparse_llama::tokenizer::byte_level_tokenizer().unwrap();
    sparse_llama::checkpoint::save_hf(&model, &w, &cfg, &tok, None, DType::F32).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "It is a great honor to report on the state of our union. ".repeat(8),
    )
    .unwrap();
    (model, text)
}

/// The data directory `scripts/setup.sh` fills: `$TWELL_DATA`, else the repository's
/// `data/`.
#[allow(dead_code)]
pub fn data_dir() -> std::path::PathBuf {
    std::env::var_os("TWELL_DATA")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data"))
}

/// Whether the sparse default model (the GGUF and its adapter) is installed; under
/// `CI=true` it must be.
#[allow(dead_code)]
pub fn sparse_default_installed() -> bool {
    installed(&["SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-sparse"])
}

/// Whether every path of `what` is in the data directory (`scripts/setup.sh` installs
/// them); under `CI=true` they must be, else the test skips.
#[allow(dead_code)]
pub fn installed(what: &[&str]) -> bool {
    let missing: Vec<&str> = what
        .iter()
        .copied()
        .filter(|p| !data_dir().join(p).exists())
        .collect();
    if !missing.is_empty() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{missing:?} missing from the data directory: CI must run scripts/setup.sh"
        );
        eprintln!("skipping: run scripts/setup.sh for {missing:?}");
    }
    missing.is_empty()
}

/// Runs `twell ARGS` (with `envs` set); whether it succeeded, and its stdout and stderr.
/// No run may panic: a bad input gets a clear error.
pub fn twell_with(args: &[&str], envs: &[(&str, &std::ffi::OsStr)]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_twell"))
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .expect("run twell");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("panicked"),
        "twell {args:?} panicked:\n{text}"
    );
    (out.status.success(), text)
}

/// [`twell_with`] and no extra environment.
pub fn twell(args: &[&str]) -> (bool, String) {
    twell_with(args, &[])
}

/// [`twell_with`] on the data directory ([`data_dir`]), where the default model is.
pub fn twell_on_data(args: &[&str]) -> (bool, String) {
    twell_with(args, &[("TWELL_DATA", data_dir().as_os_str())])
}

/// Four short documents in `dir/docs`: a corpus to split into training and held-out text.
pub fn tiny_corpus(dir: &std::path::Path) -> std::path::PathBuf {
    let docs = dir.join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    for k in 0..4 {
        std::fs::write(
            docs.join(format!("{k}.txt")),
            format!("document {k}: the state of our union. ").repeat(30),
        )
        .unwrap();
    }
    docs
}
