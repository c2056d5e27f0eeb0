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
