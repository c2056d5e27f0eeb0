//! Compiles `kernels/*.cu` to PTX with nvcc when the `cuda` feature is on.
//!
//! The PTX targets compute_80 so one build runs on Ampere and Hopper (the driver
//! compiles it for the card at load); the attention is built once more for sm_90a,
//! whose wgmma kernel the launcher picks on a Hopper card, and the prefill's pack and
//! row kernels for compute_90, with their overlapped-launch waits. nvcc must be CUDA 13.0 or
//! older than the GPU's driver: newer PTX does not load.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../../kernels");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let kernels =
        std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"))
            .join("../../kernels");
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    // (source, PTX name, virtual architecture): every kernel for compute_80, and some
    // once more for Hopper (below).
    let mut builds: Vec<(&str, &str, &str)> = Vec::new();
    for name in [
        "gate_pack",
        "gated_t2d",
        "twell_mlp_bwd",
        "twell_mlp_decode",
        "twell_mlp_products",
        "causal_attention",
        "attention_softmax_grad",
        "cross_entropy",
        "adamw",
        "add_rms_norm",
        "rope",
        "embedding",
        "gate_l0",
        "kl_divergence",
    ] {
        builds.push((name, name, "compute_80"));
    }
    builds.push(("causal_attention", "causal_attention_sm90a", "compute_90a"));
    // The prefill's pack and row kernels once more for compute_90, where their waits for
    // the kernel ahead (programmatic dependent launch, `src/cuda/launch.rs`) compile in.
    builds.push(("gate_pack", "gate_pack_sm90", "compute_90"));
    builds.push(("gated_t2d", "gated_t2d_sm90", "compute_90"));
    for (name, ptx_name, arch) in builds {
        let src = kernels.join(format!("{name}.cu"));
        let ptx = out.join(format!("{ptx_name}.ptx"));
        let status = std::process::Command::new(&nvcc)
            .args([
                "--ptx",
                "-O3",
                "-std=c++17",
                &format!("-arch={arch}"),
                "-lineinfo",
            ])
            .arg("-I")
            .arg(&kernels)
            .arg("-o")
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run {nvcc} (source ../shared/cuda/setup-cuda-build.sh?): {e}")
            });
        assert!(status.success(), "nvcc failed on {}", src.display());
    }
}
