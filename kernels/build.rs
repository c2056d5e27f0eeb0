//! Compiles every `src/*.cu` to PTX with nvcc (`NVCC`, else `nvcc` on the path).
//!
//! The PTX targets compute_80, so one build runs on Ampere and Hopper (the driver compiles
//! it for the card at load); the attention is built once more for sm_90a, whose wgmma
//! kernel the launcher picks on a Hopper card. nvcc must be CUDA 13.0 or older than the
//! GPU's driver: newer PTX does not load.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Kernels built a second time for one architecture, as `<name>_<suffix>.ptx`.
const ARCH_SPECIFIC: &[(&str, &str, &str)] = &[("causal_attention", "sm90a", "compute_90a")];

/// The portable target of every kernel.
const PORTABLE_ARCH: &str = "compute_80";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-env-changed=NVCC");
    let src =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR")).join("src");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let mut sources: Vec<String> = std::fs::read_dir(&src)
        .expect("kernels/src")
        .filter_map(|entry| {
            let path = entry.expect("kernels/src entry").path();
            (path.extension()? == "cu").then(|| path.file_stem()?.to_str().map(String::from))?
        })
        .collect();
    sources.sort();
    for name in &sources {
        compile(&nvcc, &src, &out, name, name, PORTABLE_ARCH);
    }
    for (name, suffix, arch) in ARCH_SPECIFIC {
        compile(&nvcc, &src, &out, name, &format!("{name}_{suffix}"), arch);
    }
}

fn compile(nvcc: &str, src: &Path, out: &Path, name: &str, ptx_name: &str, arch: &str) {
    let source = src.join(format!("{name}.cu"));
    let status = Command::new(nvcc)
        .args(["--ptx", "-O3", "-std=c++17", "-lineinfo"])
        .arg(format!("-arch={arch}"))
        .arg("-I")
        .arg(src)
        .arg("-o")
        .arg(out.join(format!("{ptx_name}.ptx")))
        .arg(&source)
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run {nvcc} (source ../shared/cuda/setup-cuda-build.sh?): {e}")
        });
    assert!(status.success(), "nvcc failed on {}", source.display());
}
