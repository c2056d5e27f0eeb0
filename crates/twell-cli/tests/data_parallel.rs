//! `twell finetune --processes N` on the CPU: two processes train a tiny random model as
//! one process does at the same global batch and seed, a run resumed from a checkpoint
//! continues the same curve, and a process that cannot start stops the run with its exit
//! code.

use std::path::Path;

mod common;
use common::{tiny_checkpoint, tiny_corpus, twell};

/// The steps of a run's log.
fn train_log(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The curves of two logs agree step by step: the loss, its terms, the gradient norm, the
/// FFN activity and the validation.
fn assert_same_curve(a: &[serde_json::Value], b: &[serde_json::Value]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x["step"], y["step"]);
        for key in [
            "loss",
            "ce",
            "l1",
            "grad_norm",
            "mean_l0",
            "dead_fraction",
            "val_ce",
        ] {
            match (x[key].as_f64(), y[key].as_f64()) {
                (Some(p), Some(q)) => assert!(
                    (p - q).abs() <= 1e-5 * (1.0 + q.abs()),
                    "{key} at step {}: {p} against {q}",
                    x["step"]
                ),
                (p, q) => assert_eq!(p.is_some(), q.is_some(), "{key}: {x} against {y}"),
            }
        }
    }
}

#[test]
fn two_processes_follow_one_process_and_resume_on_the_same_curve() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let docs = tiny_corpus(dir.path());
    let run = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec![
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
            "4",
            "--accum",
            "2",
            "--lr",
            "2e-3",
            "--warmup",
            "1",
            "--l1",
            "1e-3",
            "--l1-target-density",
            "0.05",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--eval-batches",
            "3",
            "--save-every",
            "2",
            "--seed",
            "7",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let (ok, text) = twell(&args);
        assert!(ok, "twell {args:?}:\n{text}");
        (out, text)
    };
    let (one, _) = run("one", &[]);
    let (two, text) = run("two", &["--processes", "2"]);
    assert!(
        text.contains("2 processes, each on 2 of every 4 sequences"),
        "{text}"
    );
    // Written once: one log line a step, one checkpoint each.
    let (a, b) = (train_log(&one), train_log(&two));
    assert_eq!(b.len(), 4, "{b:?}");
    assert_same_curve(&b, &a);
    assert!(two.join("step-2/trainer_state.json").exists() && two.join("final").exists());

    // Resumed at step 2 by two processes, and by one from the two's checkpoint.
    let resumed = dir.path().join("two/step-2");
    let resume = ["--resume", resumed.to_str().unwrap()];
    let (again, text) = run("again", &[&resume[..], &["--processes", "2"]].concat());
    assert!(
        text.contains("resumed") && text.contains("at step 2"),
        "{text}"
    );
    assert_same_curve(&train_log(&again), &a[2..]);
    let (alone, _) = run("alone", &resume);
    assert_same_curve(&train_log(&alone), &a[2..]);
}

#[test]
fn bad_data_parallel_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (model, text) = tiny_checkpoint(dir.path());
    let out = dir.path().join("o");
    let base = [
        "finetune",
        "--model",
        model.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    let cases: &[(&[&str], &str)] = &[
        (
            &["--batch", "3", "--processes", "2"],
            "does not split evenly over 2",
        ),
        (&["--processes", "0"], "at least 1"),
        (
            &["--peer-timeout", "0"],
            "--peer-timeout <PEER_TIMEOUT>': must be a positive number of seconds",
        ),
        (&["--gpus", "2", "--processes", "2"], "cannot be used with"),
    ];
    for (flags, needle) in cases {
        let args = [&base[..], flags].concat();
        let (ok, text) = twell(&args);
        assert!(!ok && text.contains(needle), "twell {args:?}:\n{text}");
    }
}

/// Each process fails on its own (one document cannot be split into training and
/// held-out text): the launcher stops and exits with a process's code, not 0.
#[test]
fn a_failing_process_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let (model, text) = tiny_checkpoint(dir.path());
    let out = dir.path().join("o");
    let args = [
        "finetune",
        "--model",
        model.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--holdout",
        "1",
        "--processes",
        "2",
        "--out",
        out.to_str().unwrap(),
    ];
    let (ok, text) = twell(&args);
    assert!(!ok, "{text}");
    assert!(text.contains("cannot hold out"), "{text}");
    assert!(
        text.contains("failed") && text.contains("stopped the others"),
        "{text}"
    );
}
