//! `scripts/stage-device.sh`: the parts it stages rejoin to the model's bytes, and bad
//! arguments or a missing input give a clear error (the script is run as it is, on a
//! small stand-in for the data folder).

use std::path::Path;
use std::process::{Command, Output};

fn stage(args: &[&str], data: &Path, target: &Path) -> Output {
    Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/stage-device.sh"))
        .args(args)
        .env("TWELL_DATA", data)
        .env("CARGO_TARGET_DIR", target)
        .output()
        .expect("bash runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn assets_split_into_three_parts_that_rejoin_to_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir_all(data.join("sotu")).unwrap();
    // 1,000 bytes that differ from place to place: a part out of order would show.
    let model: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(data.join("SmolLM2-135M-Instruct.Q4_1.gguf"), &model).unwrap();
    std::fs::write(
        data.join("sotu/1790_george_washington_n.txt"),
        "Fellow-Citizens",
    )
    .unwrap();
    let staged = tmp.path().join("staged");
    let out = stage(&["assets", staged.to_str().unwrap()], &data, tmp.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let mut joined = Vec::new();
    for part in ["a", "b", "c"] {
        let bytes = std::fs::read(staged.join(part).join(format!("gguf.part-{part}"))).unwrap();
        // Three parts of 333, 333 and 334 bytes.
        assert!(
            (333..=334).contains(&bytes.len()),
            "part {part}: {}",
            bytes.len()
        );
        joined.extend(bytes);
    }
    assert_eq!(joined, model);
    let listing = Command::new("tar")
        .arg("tJf")
        .arg(staged.join("c/sotu.tar.xz"))
        .output()
        .unwrap();
    let names = String::from_utf8_lossy(&listing.stdout);
    assert!(
        names.contains("sotu/1790_george_washington_n.txt"),
        "{names}"
    );
}

#[test]
fn bad_arguments_and_missing_inputs_are_refused_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    let out_arg = out_dir.to_str().unwrap();
    // An unknown action, or a missing folder: the usage line, exit code 2.
    for args in [vec!["upload", out_arg], vec!["assets"]] {
        let out = stage(&args, tmp.path(), tmp.path());
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            stderr(&out).contains("usage: scripts/stage-device.sh"),
            "{args:?}"
        );
    }
    // No model in the data folder: says so and what to run.
    let out = stage(
        &["assets", out_arg],
        &tmp.path().join("nothing"),
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("run scripts/setup.sh first"),
        "{}",
        stderr(&out)
    );
    // No CUDA build where CARGO_TARGET_DIR points: says where it looked.
    let out = stage(&["build", out_arg], tmp.path(), tmp.path());
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no CUDA build at"),
        "{}",
        stderr(&out)
    );
    assert!(!out_dir.exists(), "nothing staged on an error");
}
