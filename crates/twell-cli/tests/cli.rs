//! The `twell` binary: bad flags and inputs fail with a clear message and a non-zero
//! exit, never a panic.

use std::process::Command;

fn twell(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_twell"))
        .args(args)
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

fn fails_with(args: &[&str], needle: &str) {
    let (ok, text) = twell(args);
    assert!(!ok, "twell {args:?} should fail:\n{text}");
    assert!(
        text.contains(needle),
        "twell {args:?}: expected '{needle}' in:\n{text}"
    );
}

#[test]
fn bad_generate_flags_are_rejected() {
    fails_with(
        &["generate", "--prompt", "x", "--model", "/no/such/model"],
        "neither a directory",
    );
    fails_with(
        &["generate", "--prompt", "x", "--temperature=-1"],
        "--temperature",
    );
    fails_with(&["generate", "--prompt", "x", "--top-p", "1.5"], "--top-p");
    fails_with(&["generate", "--prompt", "x", "--top-k", "0"], "--top-k");
    fails_with(
        &["generate", "--prompt", "x", "--repeat-penalty", "0"],
        "--repeat-penalty",
    );
    fails_with(
        &[
            "generate",
            "--prompt",
            "x",
            "--ffn",
            "turbo",
            "--model",
            "/no/such/model",
        ],
        "neither a directory",
    );
    fails_with(
        &["generate", "--prompt", "x", "--device", "tpu"],
        "--device 'tpu'",
    );
    fails_with(
        &["generate", "--prompt", "x", "--dtype", "f8"],
        "--dtype 'f8'",
    );
    fails_with(&["generate"], "--prompt");
}

#[test]
fn bad_bench_flags_are_rejected() {
    fails_with(&["bench", "mlp", "--shape", "2048by5632"], "HIDDENxFFN");
    fails_with(&["bench", "mlp", "--shape", "1x10"], "hidden >= 2");
    fails_with(&["bench", "mlp", "--density", "1.5"], "(0, 1)");
    fails_with(&["bench", "mlp", "--tokens", "0"], "at least 1");
    fails_with(&["bench", "mlp", "--reps", "0"], "at least 1");
    fails_with(&["bench", "mlp", "--device", "cuda:x"], "cuda:N");
}

#[test]
fn cuda_without_the_feature_is_explained() {
    if cfg!(feature = "cuda") {
        return;
    }
    fails_with(&["bench", "mlp", "--device", "cuda"], "--features cuda");
    fails_with(&["check-gpu"], "--features cuda");
}

#[test]
fn convert_needs_an_output_and_a_model() {
    fails_with(&["convert"], "--out");
    fails_with(
        &["convert", "--model", "/no/such.gguf", "--out", "/tmp/x"],
        "neither a directory",
    );
}

#[test]
fn tiny_mlp_bench_runs_and_writes_json() {
    let dir = std::env::temp_dir().join(format!("twell-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.json");
    let svg = dir.join("bench.svg");
    let (ok, text) = twell(&[
        "bench",
        "mlp",
        "--shape",
        "64x256",
        "--tokens",
        "1,8",
        "--density",
        "0.05",
        "--reps",
        "2",
        "--warmup",
        "1",
        "--json",
        json.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["rows"].as_array().unwrap().len(), 2);
    assert!(report["rows"][0]["speedup"].as_f64().unwrap() > 0.0);
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    std::fs::remove_dir_all(&dir).ok();
}
