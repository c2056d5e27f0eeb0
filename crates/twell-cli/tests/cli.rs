//! The `twell` binary: bad flags and inputs fail with a clear message and a non-zero
//! exit, never a panic.

use std::process::Command;

mod common;
use common::{
    sparse_default_installed, tiny_checkpoint, tiny_checkpoint_of_width, tiny_corpus, twell,
    twell_on_data,
};

fn fails_with(args: &[&str], needle: &str) {
    let (ok, text) = twell(args);
    assert!(!ok, "twell {args:?} should fail:\n{text}");
    assert!(
        text.contains(needle),
        "twell {args:?}: expected '{needle}' in:\n{text}"
    );
}

/// Runs `twell bench ARGS --json REPORT` (and `--svg CHART` when `svg`; `args` split on
/// whitespace) in a temporary folder, asserts that it succeeded and that the chart is an
/// SVG, and returns the report.
fn bench_report(args: &str, svg: bool) -> serde_json::Value {
    bench_run(args, svg).0
}

/// [`bench_report`] with the printed table as well.
fn bench_run(args: &str, svg: bool) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let (json, chart) = (
        dir.path().join("report.json"),
        dir.path().join("report.svg"),
    );
    let mut all = vec!["bench"];
    all.extend(args.split_whitespace());
    all.extend(["--json", json.to_str().unwrap()]);
    if svg {
        all.extend(["--svg", chart.to_str().unwrap()]);
    }
    let (ok, text) = twell(&all);
    assert!(ok, "{text}");
    if svg {
        assert!(std::fs::read_to_string(&chart).unwrap().contains("<svg"));
    }
    (read_json(&json), text)
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
        &["generate", "--prompt", "x", "--max-tokens", "0"],
        "--max-tokens must be at least 1",
    );
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
        "invalid value 'turbo' for '--ffn",
    );
    fails_with(
        &["generate", "--prompt", "x", "--model", "/no/such/model"],
        "neither a directory",
    );
    fails_with(
        &["generate", "--prompt", "x", "--device", "tpu"],
        "'tpu': want cpu, cuda or cuda:N",
    );
    fails_with(
        &["generate", "--prompt", "x", "--dtype", "f8"],
        "invalid value 'f8' for '--dtype",
    );
    fails_with(
        &["generate", "--prompt", "x", "--quantize", "q4"],
        "invalid value 'q4' for '--quantize",
    );
    fails_with(
        &["generate", "--prompt", "x", "--quant-format", "q4k"],
        "invalid value 'q4k' for '--quant-format",
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
    fails_with(
        &["bench", "mlp", "--chain", "0"],
        "--chain 0 must be between 1",
    );
    fails_with(
        &["bench", "mlp", "--chain", "4", "--weight-sets", "3"],
        "weights of its own",
    );
    fails_with(&["bench", "mlp", "--device", "cuda:x"], "cuda:N");
    // The few-row kernel choice names the kernels it takes.
    fails_with(&["bench", "mlp", "--few-rows", "sideways"], "tensor-cores");
    fails_with(&["bench", "sweep", "--few-rows", "sideways"], "cuda-cores");
    for bench in ["mlp", "sweep", "model"] {
        fails_with(
            &["bench", bench, "--staged-rows", "diagonal"],
            "slot-kernels",
        );
    }
    fails_with(
        &["bench", "model", "--staged-rows", "sideways"],
        "spread-kernels",
    );
    // The sweep checks every shape before it measures the first.
    fails_with(
        &["bench", "sweep", "--shape", "64x128,2048by5632"],
        "HIDDENxFFN",
    );
    fails_with(&["bench", "sweep", "--density", "0"], "(0, 1)");
    fails_with(&["bench", "sweep", "--tokens", "0"], "at least 1");
    fails_with(&["bench", "sweep", "--weight-sets", "0"], "at least 1");
    fails_with(
        &["bench", "sweep", "--auto-recheck", "often"],
        "invalid value 'often' for '--auto-recheck",
    );
    // The few-row projection bench checks its flags, then that it has a GPU.
    fails_with(&["bench", "linear", "--shapes", "6144by2048"], "OUTxIN");
    fails_with(&["bench", "linear", "--shapes", "0x2048"], "at least 1");
    fails_with(&["bench", "linear", "--rows", "0"], "--rows");
    fails_with(&["bench", "linear", "--calls", "0"], "--calls");
    fails_with(&["bench", "linear"], "--device cuda");
    // The real-activation bench checks its flags before it loads a model.
    fails_with(&["bench", "layers", "--tokens", "0"], "at least 1");
    fails_with(&["bench", "layers", "--context", "0"], "--context");
    fails_with(&["bench", "layers", "--reps", "0"], "at least 1");
}

/// `bench layers` on the sparse default: every layer's own rows from the held-out
/// speeches, a density per token count in (0, 1) with the layers' spread around it,
/// times for all three sides, and each layer's `Auto` side counted. The dense original
/// (SiLU) is refused: the TwELL path needs a ReLU gate.
#[test]
fn bench_layers_times_the_sparse_defaults_layers_on_their_own_rows() {
    if !sparse_default_installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("layers.json");
    let run = |extra: &[&str]| {
        let base = [
            "bench", "layers", "--tokens", "1,5", "--reps", "1", "--warmup", "0",
        ];
        twell_on_data(&[&base[..], extra].concat())
    };
    let (ok, text) = run(&["--json", json.to_str().unwrap()]);
    assert!(ok, "{text}");
    let report = read_json(&json);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{report}");
    for (row, m) in rows.iter().zip([1, 5]) {
        assert_eq!(row["tokens"], m);
        assert_eq!(row["layers"], 30);
        let (mean, lo, hi) = (
            row["mean_density"].as_f64().unwrap(),
            row["min_layer_density"].as_f64().unwrap(),
            row["max_layer_density"].as_f64().unwrap(),
        );
        assert!(0.0 < lo && lo <= mean && mean <= hi && hi < 1.0, "{row}");
        for key in ["dense_ms", "sparse_ms", "auto_ms"] {
            assert!(row[key].as_f64().unwrap() > 0.0, "{key}: {row}");
        }
        let sides: u64 = row["auto_sides"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s[1].as_u64().unwrap())
            .sum();
        assert_eq!(sides, 30, "{row}");
    }
    let (ok, text) = run(&["--dense"]);
    assert!(!ok && text.contains("ReLU-gated"), "{text}");
    // A text that is missing, or too short for the rows asked for, is named.
    let (ok, text) = run(&["--text", "/no/such/text"]);
    assert!(
        !ok && text.contains("opening --text /no/such/text"),
        "{text}"
    );
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "A few words, far fewer than a thousand tokens.").unwrap();
    let (ok, text) = run(&["--text", short.to_str().unwrap()]);
    assert!(!ok && text.contains("rows need"), "{text}");
}

#[test]
fn bench_shards_measures_the_sparse_defaults_parts_in_both_orders() {
    if !sparse_default_installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("shards.json");
    let run =
        |extra: &[&str]| twell_on_data(&[&["bench", "shards", "--rows", "1024"], extra].concat());
    let (ok, text) = run(&["--shards", "1,2,4", "--json", json.to_str().unwrap()]);
    assert!(ok, "{text}");
    let report = read_json(&json);
    assert_eq!(report["layers"], 30);
    assert_eq!(report["fit_rows"], 512);
    let density = report["mean_density"].as_f64().unwrap();
    assert!(0.0 < density && density < 0.5, "{report}");
    let rows = report["rows"].as_array().unwrap();
    for (row, shards) in rows.iter().zip([1.0, 2.0, 4.0]) {
        for key in [
            "contiguous_mean",
            "contiguous_p99",
            "balanced_mean",
            "balanced_p99",
        ] {
            let v = row[key].as_f64().unwrap();
            // One part is even by definition; no part holds more than all of them.
            assert!((1.0..=shards).contains(&v), "{key}: {row}");
            if shards == 1.0 {
                assert_eq!(v, 1.0, "{row}");
            }
        }
    }
    // Four parts of a token's few active neurons are less even than two.
    assert!(rows[2]["contiguous_mean"].as_f64() > rows[1]["contiguous_mean"].as_f64());
    let (ok, text) = run(&["--shards", "7"]);
    assert!(!ok && text.contains("does not split into 7"), "{text}");
    let (ok, text) = run(&["--shards", "0"]);
    assert!(!ok && text.contains("at least 1"), "{text}");
    let (ok, text) = run(&["--dense"]);
    assert!(!ok && text.contains("ReLU-gated"), "{text}");
}

#[test]
fn cuda_without_the_feature_is_explained() {
    if cfg!(feature = "cuda") {
        return;
    }
    fails_with(&["bench", "mlp", "--device", "cuda"], "--features cuda");
    fails_with(
        &["generate", "--prompt", "x", "--device", "cuda:1"],
        "--features cuda",
    );
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
    let report = bench_report(
        "mlp --shape 64x256 --tokens 1,8 --density 0.05 --reps 2 --warmup 1",
        true,
    );
    assert_eq!(report["rows"].as_array().unwrap().len(), 2);
    assert!(report["rows"][0]["speedup"].as_f64().unwrap() > 0.0);
}

#[test]
fn chained_mlp_bench_reports_its_chain() {
    let report = bench_report(
        "mlp --shape 64x256 --tokens 1 --density 0.05 --reps 2 --warmup 1 --chain 3 --weight-sets 3",
        false,
    );
    assert_eq!(report["chain"], 3);
    let row = &report["rows"][0];
    assert!(row["dense_ms"].as_f64().unwrap() > 0.0, "{row}");
    assert!(row["sparse_ms"].as_f64().unwrap() > 0.0, "{row}");
}

#[test]
fn tiny_mlp_train_bench_runs_and_writes_json() {
    let (report, text) = bench_run(
        "mlp-train --shape 64x256 --tokens 1,24 --density 0.05,0.2 --dtype f32 --reps 2 --warmup 1",
        true,
    );
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    for row in rows {
        assert!(row["dense_ms"].as_f64().unwrap() > 0.0);
        assert!(row["sparse_ms"].as_f64().unwrap() > 0.0);
        let density = row["measured_density"].as_f64().unwrap();
        assert!(density > 0.0 && density < 0.5, "{row}");
        // No GPU here: the backward ran on the host, and says so.
        assert_eq!(row["sparse_backward_on_device"], false);
    }
    // Peak memory is not measured on the host: the table says so, not NaN.
    assert!(!text.contains("NaN") && text.contains(" - "), "{text}");
}

#[test]
fn bad_mlp_train_bench_flags_are_rejected() {
    fails_with(&["bench", "mlp-train", "--shape", "64by256"], "HIDDENxFFN");
    fails_with(&["bench", "mlp-train", "--density", "0"], "(0, 1)");
    fails_with(&["bench", "mlp-train", "--tokens", "0"], "at least 1");
    fails_with(&["bench", "mlp-train", "--reps", "0"], "at least 1");
    fails_with(&["bench", "mlp-train", "--l1=-1"], "--l1");
    fails_with(&["bench", "mlp-train", "--dtype", "f64"], "--dtype");
    // A mistyped backward path is an error that names the flag, not the default measured.
    fails_with(&["bench", "mlp-train", "--backward", "gemm"], "--backward");
}

/// A model whose widths do not fill 32-wide blocks runs its f32 weights, with a note,
/// rather than failing under the default `--quantize all`.
#[test]
fn generate_falls_back_to_f32_weights_where_rows_do_not_fill_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint_of_width(dir.path(), 48);
    let (ok, out) = twell(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "x",
        "--max-tokens",
        "3",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("hidden size (48) is not a multiple of 32"),
        "{out}"
    );
}

/// `twell serve`'s bad flags and a port already taken fail with a clear message.
#[test]
fn bad_serve_flags_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let m = model.to_str().unwrap();
    fails_with(&["serve", "--model", m, "--port", "99999"], "--port");
    fails_with(
        &["serve", "--model", m, "--port", "0", "--max-sequences", "0"],
        "--max-sequences",
    );
    fails_with(
        &["serve", "--model", m, "--port", "0", "--queue", "0"],
        "--queue",
    );
    for bad in ["--prefix-cache=-1", "--prefix-cache=many"] {
        fails_with(
            &["serve", "--model", m, "--port", "0", bad],
            "--prefix-cache",
        );
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    fails_with(
        &["serve", "--model", m, "--port", &port],
        "binding 127.0.0.1",
    );
}

/// `--ignore-eos` decodes to `--max-tokens` whatever the model predicts.
#[test]
fn generate_ignores_end_of_sequence_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let json = dir.path().join("stats.json");
    let (ok, out) = twell(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "x",
        "--ignore-eos",
        "--max-tokens",
        "40",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(stats["generated_tokens"].as_u64(), Some(40), "{stats}");
    assert_eq!(stats["stopped_on_eos"].as_bool(), Some(false), "{stats}");
}

#[test]
fn generate_refuses_a_max_tokens_that_would_wrap() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let model = model.to_str().unwrap();
    for max in ["18446744073709551615", "18446744073709551610", "100000"] {
        fails_with(
            &[
                "generate",
                "--model",
                model,
                "--prompt",
                "x",
                "--max-tokens",
                max,
            ],
            "exceeds the model's",
        );
    }
}

#[test]
fn eval_reports_perplexity_and_per_layer_sparsity() {
    let dir = tempfile::tempdir().unwrap();
    let (model, text) = tiny_checkpoint(dir.path());
    let json = dir.path().join("eval.json");
    let svg = dir.path().join("eval.svg");
    let (m, t, j, s) = (
        model.to_str().unwrap(),
        text.to_str().unwrap(),
        json.to_str().unwrap(),
        svg.to_str().unwrap(),
    );
    let (ok, out) = twell(&[
        "eval",
        "--model",
        m,
        "--text",
        t,
        "--context",
        "64",
        "--ffn",
        "sparse",
        "--json",
        j,
        "--svg",
        s,
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("perplexity"));
    let report = read_json(&json);
    let ppl = report["perplexity"]["perplexity"].as_f64().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "{ppl}");
    let layers = report["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2);
    for l in layers {
        let density = l["density"].as_f64().unwrap();
        assert!(density > 0.0 && density < 1.0, "{l}");
        assert!(l["dead_neurons"].as_u64().is_some());
        assert!(l["tile_overflow_rate"].as_f64().is_some());
    }
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    // The same model generates, streaming, on both paths.
    for ffn in ["dense", "sparse"] {
        let (ok, out) = twell(&[
            "generate",
            "--model",
            m,
            "--ffn",
            ffn,
            "--prompt",
            "It is",
            "--max-tokens",
            "5",
        ]);
        assert!(ok, "{out}");
        assert!(out.contains("mean FFN density"), "{out}");
    }
}

#[test]
fn bad_eval_flags_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let (model, text) = tiny_checkpoint(dir.path());
    let (m, t) = (model.to_str().unwrap(), text.to_str().unwrap());
    fails_with(
        &["eval", "--model", m, "--text", t, "--last", "0"],
        "--last",
    );
    fails_with(
        &["eval", "--model", m, "--text", t, "--context", "1"],
        "--context",
    );
    fails_with(
        &["eval", "--model", m, "--text", "/no/such/dir"],
        "text corpus",
    );
    fails_with(
        &["eval", "--model", m, "--text", t, "--context", "100000"],
        "exceeds",
    );
}

/// `twell bench tensor-parallel` starts its processes, splits a random sparse model's
/// MLPs over them, and reports the whole and the split model's prefill with logits that
/// agree; bad splits and sizes fail with a clear message.
#[test]
fn bench_tensor_parallel_splits_the_mlps_over_processes() {
    let report = bench_report(
        "tensor-parallel --shape 64x192x2 --heads 4 --kv-heads 2 --vocab 300 \
         --prefill 1x16,3x8 --processes 3 --reps 2 --warmup 0 --density 0.1",
        false,
    );
    assert_eq!(report["processes"], 3);
    assert_eq!(report["all_reduce"], "TCP on loopback");
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert!(r["whole_tokens_per_sec"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["split_tokens_per_sec"].as_f64().unwrap() > 0.0, "{r}");
        let e = r["logits_relative_l2"].as_f64().unwrap();
        assert!(e < 1e-5, "split logits off the whole model's: {r}");
    }
    for (args, needle) in [
        ("--shape 64x192x2 --processes 0", "at least 1"),
        (
            "--shape 64x190x2 --processes 3",
            "does not split into 3 equal parts",
        ),
        ("--shape 64x192x2 --prefill 1x1", "sequence >= 2"),
        ("--shape 64x192x2 --reps 0", "--reps"),
        ("--shape 64x192x2 --density 1.5", "--density"),
        (
            "--shape 64x192x2 --peer-timeout inf",
            "a positive number of seconds, not inf",
        ),
    ] {
        let mut all = vec!["bench", "tensor-parallel", "--heads", "4", "--vocab", "300"];
        all.extend(args.split_whitespace());
        fails_with(&all, needle);
    }
}

/// An output path that cannot be written fails before the work that would fill it (the
/// model is not even loaded, so no result is computed and lost), naming its flag; an
/// existing report is left as it was.
#[test]
fn unwritable_outputs_fail_before_the_work() {
    let dir = tempfile::tempdir().unwrap();
    let (model, text) = tiny_checkpoint(dir.path());
    let (m, t) = (model.to_str().unwrap(), text.to_str().unwrap());
    let missing = dir.path().join("no-such-folder").join("report.json");
    let missing = missing.to_str().unwrap();
    let folder = dir.path().to_str().unwrap();
    let cases: [(&[&str], &str); 6] = [
        (
            &["eval", "--model", m, "--text", t, "--json", missing],
            "--json",
        ),
        (
            &["eval", "--model", m, "--text", t, "--svg", folder],
            "--svg",
        ),
        (
            &["generate", "--model", m, "--prompt", "x", "--json", missing],
            "--json",
        ),
        (
            &["bench", "mlp", "--shape", "64x128", "--json", missing],
            "--json",
        ),
        (&["bench", "model", "--svg", missing], "--svg"),
        (&["curves", "--svg", missing, t], "--svg"),
    ];
    for (args, flag) in cases {
        let (ok, out) = twell(args);
        assert!(!ok, "twell {args:?} should fail:\n{out}");
        assert!(out.contains(flag), "twell {args:?}: no '{flag}' in:\n{out}");
        // Nothing ran: no perplexity, no table, no generated text.
        assert!(
            !out.contains("perplexity") && !out.contains("tokens/s") && !out.contains("dense"),
            "twell {args:?} did work before failing:\n{out}"
        );
    }
    // A good run next to an old report replaces it whole.
    let report = dir.path().join("report.json");
    std::fs::write(&report, "old").unwrap();
    let (ok, out) = twell(&[
        "eval",
        "--model",
        m,
        "--text",
        t,
        "--json",
        report.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    assert!(
        read_json(&report)["perplexity"]["perplexity"]
            .as_f64()
            .unwrap()
            > 1.0
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

/// A JSON file the command wrote.
fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The steps of a fine-tune's `train_log.jsonl` in `out`, each a JSON object.
fn train_log(out: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn sampled_texts_train_as_extra_data() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let docs = tiny_corpus(dir.path());
    let samples = dir.path().join("samples");
    let (m, d, s) = (
        model.to_str().unwrap(),
        docs.to_str().unwrap(),
        samples.to_str().unwrap(),
    );
    let (ok, text) = twell(&[
        "sample",
        "--model",
        m,
        "--data",
        d,
        "--holdout",
        "1",
        "--count",
        "5",
        "--batch",
        "2",
        "--prompt-tokens",
        "8",
        "--max-tokens",
        "24",
        "--seed",
        "3",
        "--out",
        s,
    ]);
    assert!(ok, "{text}");
    let mut files: Vec<_> = std::fs::read_dir(&samples)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 5, "{files:?}");
    for f in &files {
        // The prompt (8 bytes of training text) and up to 24 new tokens of this
        // byte-level model.
        let t = std::fs::read_to_string(f).unwrap();
        assert!((8..=8 + 24 * 4).contains(&t.len()), "{f:?}: {t:?}");
    }
    // Every finetune below trains on the same documents, the last one held out.
    let finetune_on_docs = ["finetune", "--model", m, "--data", d, "--holdout", "1"];
    let finetune = |extra: Option<&str>| {
        let out = dir
            .path()
            .join(if extra.is_some() { "with" } else { "without" });
        let out = out.to_str().unwrap().to_string();
        let more = [
            "--seq-len",
            "32",
            "--batch",
            "2",
            "--steps",
            "1",
            "--out",
            &out,
        ];
        let mut args = [&finetune_on_docs[..], &more[..]].concat();
        if let Some(e) = extra {
            args.extend(["--extra-data", e]);
        }
        let (ok, text) = twell(&args);
        assert!(ok, "{text}");
        let sequences: usize = text
            .split("finetune: ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no sequence count in:\n{text}"));
        (sequences, text)
    };
    let (plain, _) = finetune(None);
    let (more, text) = finetune(Some(s));
    assert!(more > plain, "{plain} -> {more}:\n{text}");
    assert!(text.contains("5 of them --extra-data"), "{text}");
    // A held-out document given as extra data is refused.
    let held_out = docs.join("3.txt");
    let out = dir.path().join("leak");
    let more = [
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--extra-data",
        held_out.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    fails_with(
        &[&finetune_on_docs[..], &more[..]].concat(),
        "a held-out document",
    );
    let missing = dir.path().join("no-such-dir");
    let more = [
        "--steps",
        "1",
        "--extra-data",
        missing.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    fails_with(
        &[&finetune_on_docs[..], &more[..]].concat(),
        "opening --extra-data",
    );
    fails_with(
        &[
            "sample",
            "--model",
            m,
            "--data",
            d,
            "--holdout",
            "1",
            "--prompt-tokens",
            "100000",
            "--out",
            s,
        ],
        "too few for prompts",
    );
    fails_with(
        &["sample", "--model", m, "--count", "0", "--out", s],
        "at least 1",
    );
    fails_with(
        &["sample", "--model", m, "--temperature=-1", "--out", s],
        "--temperature",
    );
}

#[test]
fn finetune_stops_at_its_time_limit_with_a_checkpoint_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let docs = tiny_corpus(dir.path());
    let out = dir.path().join("run");
    let common = [
        "finetune",
        "--model",
        model.to_str().unwrap(),
        "--data",
        docs.to_str().unwrap(),
        "--holdout",
        "1",
        "--seq-len",
        "32",
        "--batch",
        "2",
        "--out",
        out.to_str().unwrap(),
    ];
    // Any step passes a limit of a microsecond: the run stops after its first.
    let mut args = common.to_vec();
    args.extend(["--steps", "50", "--time-limit", "1e-6"]);
    let (ok, text) = twell(&args);
    assert!(ok, "{text}");
    assert!(
        text.contains("--time-limit reached at step 1 of 50"),
        "{text}"
    );
    assert!(out.join("step-1/trainer_state.json").exists());
    assert!(!out.join("final").exists());
    let step1 = out.join("step-1");
    let step1 = step1.to_str().unwrap();
    // Resumed, and distilled from a teacher other than --model (the step-1 checkpoint).
    let mut args = common.to_vec();
    args.extend(["--steps", "2", "--resume", step1]);
    args.extend(["--distill", "1", "--teacher", step1]);
    let (ok, text) = twell(&args);
    assert!(ok, "{text}");
    assert!(
        text.contains("at step 1") && out.join("final").exists(),
        "{text}"
    );
    let lines = train_log(&out);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0]["kl"].is_null(), "{lines:?}");
    // The student starts as the teacher: its first distilled step is near KL 0.
    let kl = lines[1]["kl"].as_f64().expect("the distilled step logs kl");
    assert!((0.0..0.05).contains(&kl), "{lines:?}");
}

#[test]
fn finetune_runs_logs_and_checkpoints_then_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let docs = tiny_corpus(dir.path());
    let out = dir.path().join("run");
    let (m, d, o) = (
        model.to_str().unwrap(),
        docs.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let common = [
        "--model",
        m,
        "--data",
        d,
        "--holdout",
        "1",
        "--seq-len",
        "32",
        "--batch",
        "2",
        "--lr",
        "1e-3",
        "--warmup",
        "1",
        "--out",
        o,
    ];
    let mut args = vec![
        "finetune",
        "--steps",
        "4",
        "--save-every",
        "2",
        "--eval-every",
        "2",
    ];
    args.extend(common);
    let (ok, text) = twell(&args);
    assert!(ok, "{text}");
    let lines = train_log(&out);
    assert_eq!(lines.len(), 4);
    assert!(lines[1]["val_ce"].as_f64().is_some() && lines[3]["val_ce"].as_f64().is_some());
    // A validation step also logs the validation batches' L0; the others do not.
    assert!(
        lines[1]["val_l0"].as_f64().is_some_and(|l0| l0 > 0.0),
        "{:?}",
        lines[1]
    );
    assert!(lines[0].get("val_l0").is_none(), "{:?}", lines[0]);
    assert!(lines[0]["l0"].as_array().unwrap().len() == 2);
    let cfg = read_json(&out.join("final/config.json"));
    assert_eq!(cfg["hidden_act"], "relu");
    let curve = std::fs::read_to_string(out.join("train_curve.svg")).unwrap();
    assert!(curve.contains("validation perplexity") && curve.contains("mean L0"));
    // `twell curves` charts several logs; bad logs and labels are refused.
    let log_path = out.join("train_log.jsonl");
    let lp = log_path.to_str().unwrap();
    let svg = dir.path().join("curves.svg");
    let (ok, text) = twell(&[
        "curves",
        lp,
        lp,
        "--labels",
        "run a,run b",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(chart.contains("run a") && chart.contains("run b"));
    // The validation L0 of each run: one dot per validation (steps 2 and 4, two runs).
    assert_eq!(chart.matches("<circle").count(), 4, "{chart}");
    fails_with(
        &[
            "curves",
            lp,
            "--labels",
            "a,b",
            "--svg",
            svg.to_str().unwrap(),
        ],
        "2 labels for 1 logs",
    );
    // A log that is missing, empty or not JSON lines: an error that says which.
    let chart_of =
        |log: &str, msg: &str| fails_with(&["curves", log, "--svg", svg.to_str().unwrap()], msg);
    chart_of("/no/such/log.jsonl", "reading /no/such/log.jsonl");
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    chart_of(empty.to_str().unwrap(), "no training steps");
    let junk = dir.path().join("junk.jsonl");
    std::fs::write(&junk, "not json\n").unwrap();
    chart_of(junk.to_str().unwrap(), "not JSON");
    fails_with(&["curves", lp], "--svg");
    // The final checkpoint generates, and step-2 resumes to step 4.
    let fin = out.join("final");
    let (ok, text) = twell(&[
        "generate",
        "--model",
        fin.to_str().unwrap(),
        "--prompt",
        "the",
        "--max-tokens",
        "3",
    ]);
    assert!(ok, "{text}");
    let step2 = out.join("step-2");
    let mut args = vec![
        "finetune",
        "--steps",
        "4",
        "--resume",
        step2.to_str().unwrap(),
        // Resumed with distillation: the teacher is --model, the run's starting point.
        "--distill",
        "0.5",
    ];
    args.extend(common);
    let (ok, text) = twell(&args);
    assert!(ok, "{text}");
    assert!(
        text.contains("resumed") && text.contains("at step 2"),
        "{text}"
    );
    let resumed = train_log(&out).split_off(4);
    assert_eq!(resumed.len(), 2, "{resumed:?}");
    for line in &resumed {
        let kl = line["kl"].as_f64().expect("a distilling step logs kl");
        assert!(kl.is_finite() && kl > 0.0, "{line}");
    }
}

#[test]
fn bad_finetune_flags_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let (model, text) = tiny_checkpoint(dir.path());
    let (m, t, o) = (
        model.to_str().unwrap(),
        text.to_str().unwrap(),
        dir.path().join("o"),
    );
    let o = o.to_str().unwrap();
    // Each case: the flags after `finetune --model M --data T --out O`, and the words
    // its error must contain.
    let cases: &[(&[&str], &str)] = &[
        (&["--holdout", "0"], "--holdout"),
        (
            &["--distill", "1.5"],
            "distillation weight must be in [0, 1]",
        ),
        (&["--time-limit", "0"], "--time-limit must be a positive"),
        (&["--teacher", m], "only read with --distill"),
        (
            &["--distill", "0.5", "--teacher", "/no/such/teacher"],
            "neither a directory",
        ),
        (&["--steps", "0"], "invalid training setting"),
        (&["--lr=-1"], "invalid training setting"),
        (&["--lr", "0"], "--lr 0 would train nothing"),
        (&["--penalty", "l2"], "--penalty"),
        (&["--penalty", "down-norm"], "--penalty"),
        (&["--ffn", "fast"], "--ffn"),
        (&["--dtype", "f64"], "--dtype"),
        (&["--device", "gpu"], "--device"),
        (
            &["--l1", "1e-3", "--l1-target-density", "1.5"],
            "target density must be in (0, 1)",
        ),
        (
            &["--l1", "1e-3", "--l1-target-density", "nan"],
            "target density must be in (0, 1)",
        ),
        (
            &["--l1", "0", "--l1-target-density", "0.03"],
            "starting l1 > 0",
        ),
        (
            &["--l1-target-anneal", "500"],
            "annealing the target density needs a target density",
        ),
        (&["--l1-target-anneal", "many"], "--l1-target-anneal"),
        (&["--l1-target-text", "heldout"], "--l1-target-text"),
        (
            &["--l1-target-text", "validation"],
            "on validation text needs a target density",
        ),
        (
            &[
                "--l1",
                "1e-3",
                "--l1-target-density",
                "0.03",
                "--l1-target-text",
                "validation",
                "--eval-every",
                "0",
            ],
            "--eval-every > 0",
        ),
        (
            &["--penalty", "gate-l0", "--ffn", "sparse"],
            "add --ffn dense",
        ),
        (&["--l1-gate-eps", "0.03"], "--l1-gate-eps"),
        (&["--mlp-bias"], "--mlp-bias"),
        // One document cannot be split into training and held-out text.
        (&["--holdout", "1"], "cannot hold out"),
        (&["--resume", "/no/such/run"], "neither a directory"),
        (
            &["--lora-rank", "4"],
            "--lora-rank trains through the dense FFN",
        ),
        (
            &["--lora-rank", "4", "--ffn", "dense", "--resume", m],
            "cannot --resume",
        ),
        (
            &["--lora-rank", "0", "--ffn", "dense"],
            "LoRA rank must be at least 1",
        ),
        (
            &[
                "--lora-rank",
                "4",
                "--ffn",
                "dense",
                "--lora-targets",
                "lm_head",
            ],
            "LoRA target 'lm_head'",
        ),
        (
            &["--lora-rank", "4", "--ffn", "dense", "--lora-alpha=-1"],
            "alpha must be a positive",
        ),
        (&["--lora-alpha", "8"], "--lora-rank"),
    ];
    for (flags, needle) in cases {
        let mut args = vec!["finetune", "--model", m, "--data", t, "--out", o];
        args.extend_from_slice(flags);
        fails_with(&args, needle);
    }
    fails_with(&["finetune", "--model", m, "--data", t], "--out");
}

/// Perplexity from `twell eval ARGS --json`.
fn eval_perplexity(args: &[&str], json: &std::path::Path) -> f64 {
    let mut all = vec!["eval", "--json", json.to_str().unwrap()];
    all.extend_from_slice(args);
    let (ok, text) = twell(&all);
    assert!(ok, "twell {all:?}:\n{text}");
    read_json(json)["perplexity"]["perplexity"]
        .as_f64()
        .unwrap()
}

#[test]
fn a_lora_finetune_writes_an_adapter_that_merges_back() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let docs = tiny_corpus(dir.path());
    let (m, t) = (model.to_str().unwrap(), docs.to_str().unwrap());
    let out = dir.path().join("run");
    let (ok, log) = twell(&[
        "finetune",
        "--model",
        m,
        "--data",
        t,
        "--holdout",
        "1",
        "--out",
        out.to_str().unwrap(),
        "--ffn",
        "dense",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--steps",
        "6",
        "--lr",
        "1e-2",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--lora-rank",
        "4",
        "--lora-full",
        "gate_proj,up_proj",
    ]);
    assert!(ok, "{log}");
    let adapter = out.join("final/adapter");
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "full_deltas.gguf",
        "twell_adapter.json",
        "SHA256SUMS",
    ] {
        assert!(adapter.join(f).is_file(), "{f} missing");
    }
    let config = read_json(&adapter.join("adapter_config.json"));
    assert_eq!(config["r"], 4);
    assert_eq!(config["peft_type"], "LORA");
    // The base plus the adapter is the fine-tuned model: the same perplexity as its
    // merged checkpoint, within the Q4_0 rounding of the whole weights' deltas.
    let a = adapter.to_str().unwrap();
    let common = [
        "--text",
        t,
        "--last",
        "1",
        "--context",
        "16",
        "--ffn",
        "dense",
    ];
    let final_dir = out.join("final");
    let mut args = vec!["--model", final_dir.to_str().unwrap()];
    args.extend_from_slice(&common);
    let merged = eval_perplexity(&args, &dir.path().join("merged.json"));
    let mut args = vec!["--model", m, "--adapter", a];
    args.extend_from_slice(&common);
    let via_adapter = eval_perplexity(&args, &dir.path().join("adapter.json"));
    let base = {
        let mut args = vec!["--model", m];
        args.extend_from_slice(&common);
        eval_perplexity(&args, &dir.path().join("base.json"))
    };
    assert!(
        (via_adapter / merged - 1.0).abs() < 0.02,
        "merged {merged}, base + adapter {via_adapter}"
    );
    assert!(
        (base / merged - 1.0).abs() > 0.02,
        "training changed nothing: {base}"
    );
    // An adapter that declares an FFN path no one knows is named (a copy without its
    // checksum list, which is optional).
    let odd = dir.path().join("odd-adapter");
    std::fs::create_dir_all(&odd).unwrap();
    for entry in std::fs::read_dir(&adapter).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "SHA256SUMS" {
            std::fs::copy(entry.path(), odd.join(entry.file_name())).unwrap();
        }
    }
    let mut info = read_json(&odd.join("twell_adapter.json"));
    info["ffn_mode"] = "turbo".into();
    std::fs::write(odd.join("twell_adapter.json"), info.to_string()).unwrap();
    fails_with(
        &[
            "generate",
            "--model",
            m,
            "--adapter",
            odd.to_str().unwrap(),
            "--prompt",
            "x",
        ],
        "ffn_mode 'turbo'",
    );
    // A damaged adapter is named, not merged.
    let weights = adapter.join("adapter_model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() - 7]).unwrap();
    fails_with(
        &["generate", "--model", m, "--adapter", a, "--prompt", "x"],
        "checksum mismatch",
    );
    std::fs::remove_file(&weights).unwrap();
    fails_with(
        &["generate", "--model", m, "--adapter", a, "--prompt", "x"],
        "missing",
    );
    fails_with(&["generate", "--adapter", a, "--prompt", "x"], "--model");
    fails_with(
        &["generate", "--dense", "--model", m, "--prompt", "x"],
        "cannot be used with",
    );
}

#[test]
fn chat_sampling_needs_a_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let docs = tiny_corpus(dir.path());
    fails_with(
        &[
            "sample",
            "--chat",
            "--model",
            model.to_str().unwrap(),
            "--data",
            docs.to_str().unwrap(),
            "--holdout",
            "1",
            "--count",
            "1",
            "--out",
            dir.path().join("s").to_str().unwrap(),
        ],
        "no chat template",
    );
}

#[test]
fn the_sparse_default_without_its_adapter_says_how_to_install_it() {
    let dir = tempfile::tempdir().unwrap();
    // A data directory with the base model's name but no adapter beside it.
    std::fs::write(dir.path().join("SmolLM2-135M-Instruct.Q4_1.gguf"), b"GGUF").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_twell"))
        .args(["generate", "--prompt", "x"])
        .env("TWELL_DATA", dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.contains("adapter") && text.contains("run scripts/setup.sh"),
        "{text}"
    );
}

#[test]
fn model_bench_runs_one_ffn_path_alone() {
    let report = bench_report(
        "model --shape 64x256x2 --heads 4 --vocab 300 --prefill 1x16 --decode-batch 1 --context 8 --decode-steps 1 --train 1x8 --reps 1 --warmup 0 --ffn-paths sparse",
        false,
    );
    let rows = report["measurements"].as_array().unwrap();
    assert!(!rows.is_empty());
    assert!(rows.iter().all(|m| m["ffn"] == "sparse"), "{rows:?}");
}

#[test]
fn model_bench_runs_all_phases_on_a_random_shape() {
    let report = bench_report(
        "model --shape 64x256x2 --heads 4 --vocab 300 --density 0.02 --prefill 1x32 --decode-batch 2 --context 16 --decode-steps 2 --train 1x16 --reps 2 --warmup 1",
        true,
    );
    let phases: Vec<String> = report["measurements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            format!(
                "{}/{}",
                m["phase"].as_str().unwrap(),
                m["ffn"].as_str().unwrap()
            )
        })
        .collect();
    for want in [
        "prefill/dense",
        "prefill/sparse",
        "decode/dense",
        "decode/sparse",
        "train/dense",
        "train/sparse",
    ] {
        assert!(
            phases.iter().any(|p| p == want),
            "{want} missing from {phases:?}"
        );
    }
    let density = report["density_per_layer"].as_array().unwrap();
    assert_eq!(density.len(), 2);
    assert!(density
        .iter()
        .all(|d| d.as_f64().unwrap() > 0.0 && d.as_f64().unwrap() < 0.2));
    // The timed training steps keep the density the shape was built with (they train at
    // learning rate 0), and say so.
    let set = density.iter().map(|d| d.as_f64().unwrap()).sum::<f64>() / 2.0;
    for m in report["measurements"].as_array().unwrap() {
        if m["phase"] == "train" {
            let during = m["train_density"].as_f64().unwrap();
            assert!(
                during > 0.5 * set && during < 2.0 * set,
                "training ran at {during}, the model was set to {set}"
            );
        }
    }
}

#[test]
fn bad_model_bench_flags_are_rejected() {
    // `bench model` on a small random shape, then the flags under test.
    let model = |flags: &[&str], needle: &str| {
        let args = [&["bench", "model", "--shape", "64x256x2"], flags].concat();
        fails_with(&args, needle);
    };
    model(
        &["--ffn-paths", "moe"],
        "invalid value 'moe' for '--ffn-paths",
    );
    model(
        &["--ffn-paths", "sparse", "--svg", "x.svg"],
        "run both --ffn-paths",
    );
    fails_with(
        &["bench", "model", "--shape", "64x256"],
        "HIDDENxFFNxLAYERS",
    );
    model(&["--heads", "4", "--prefill", "1by32"], "BATCHxSEQ");
    model(&["--heads", "4", "--density", "2"], "density");
    model(&["--heads", "3"], "heads");
    model(&["--heads", "4", "--decode-batch", "0"], "at least 1");
    model(&["--heads", "4", "--energy-secs=-1"], "--energy-secs");
}

#[test]
fn tiny_loss_bench_runs_and_writes_json() {
    let report = bench_report(
        "loss --tokens 1,17 --vocab 50 --dtype f32 --reps 2 --warmup 1",
        false,
    );
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    let losses: Vec<&str> = rows.iter().map(|r| r["loss"].as_str().unwrap()).collect();
    assert_eq!(
        losses,
        [
            "cross_entropy",
            "kl_divergence",
            "cross_entropy",
            "kl_divergence"
        ]
    );
    for row in rows {
        assert!(row["candle_ms"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["fused_ms"].as_f64().unwrap() > 0.0, "{row}");
        // No GPU here: no device memory to measure, and the row says so.
        assert!(row["fused_peak_bytes"].is_null(), "{row}");
    }
}

#[test]
fn bad_loss_bench_flags_are_rejected() {
    fails_with(&["bench", "loss", "--tokens", "0"], "--tokens");
    fails_with(&["bench", "loss", "--vocab", "1"], "--vocab");
    fails_with(&["bench", "loss", "--reps", "0"], "--reps");
    fails_with(&["bench", "loss", "--dtype", "f64"], "--dtype");
}
