//! L1 fine-tuning on a tiny synthetic model: the loss falls, λ > 0 lowers L0, a
//! checkpoint round-trips, and a resumed run continues where it stopped.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{rel_l2, tiny_config, tiny_tokenizer, tiny_weights};
use sparse_llama::checkpoint::{Checkpoint, LoadOptions};
use sparse_llama::Cache;
use sparse_train::penalty::L1_TARGET_GAIN;
use sparse_train::{DensityText, L1Controller, PackedData, Penalty, TrainConfig, Trainer};
use twell::FfnMode;

fn corpus_tokens() -> Vec<u32> {
    let text =
        "the state of the union is strong. we the people are ready for the work ahead. ".repeat(40);
    tiny_tokenizer()
        .encode(text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec()
}

fn trainer(l1: f64, steps: usize) -> Trainer {
    trainer_with(l1, steps, FfnMode::Sparse, Penalty::L1)
}

/// The tiny ReLU model's trainer with the given FFN path and L1 term.
fn trainer_with(l1: f64, steps: usize, ffn: FfnMode, penalty: Penalty) -> Trainer {
    let mut cfg = tiny_config("silu", 256).into_config(false);
    cfg.ffn_mode = ffn;
    let w = tiny_weights(&cfg, 11);
    let tc = TrainConfig {
        seq_len: 32,
        batch_size: 4,
        grad_accum: 2,
        steps,
        lr: 3e-3,
        warmup_steps: 2,
        l1,
        penalty,
        dead_window_steps: 5,
        ..Default::default()
    };
    Trainer::new(cfg, w, tc, &Device::Cpu).unwrap()
}

#[test]
fn loss_falls_and_l1_lowers_l0() {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let run = |l1: f64| {
        let mut t = trainer(l1, 25);
        let logs: Vec<_> = (0..25).map(|_| t.train_step(&data).unwrap()).collect();
        (logs.first().unwrap().clone(), logs.last().unwrap().clone())
    };
    let (first0, last0) = run(0.0);
    let (first1, last1) = run(0.2);
    assert!(
        last0.ce < 0.5 * first0.ce,
        "ce {} -> {}",
        first0.ce,
        last0.ce
    );
    assert_eq!(last0.l0.len(), 2);
    assert!(
        last1.mean_l0 < 0.8 * last0.mean_l0,
        "L0 with λ {} vs without {}",
        last1.mean_l0,
        last0.mean_l0
    );
    assert!(
        last1.mean_l0 < first1.mean_l0,
        "L0 {} -> {}",
        first1.mean_l0,
        last1.mean_l0
    );
    assert!(last1.l1 < last0.l1);
    assert!((0.0..=1.0).contains(&last1.dead_fraction));
    assert!(last0.tokens_per_sec > 0.0 && last0.grad_norm.is_finite());
}

/// bf16 compute on f32 master weights: the model really runs in bf16, the loss
/// falls, validation runs, and the saved weights are the f32 masters.
#[test]
fn bf16_training_computes_in_bf16_on_f32_masters() {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let mut cfg = tiny_config("silu", 256).into_config(false);
    cfg.ffn_mode = FfnMode::Sparse;
    let tc = TrainConfig {
        seq_len: 32,
        batch_size: 4,
        steps: 20,
        lr: 3e-3,
        warmup_steps: 2,
        l1: 0.05,
        bf16: true,
        profile: true,
        ..Default::default()
    };
    let w = tiny_weights(&cfg, 11);
    let mut t = Trainer::new(cfg, w, tc, &Device::Cpu).unwrap();
    let probe = Tensor::new(&[[1u32]], &Device::Cpu).unwrap();
    assert_eq!(t.model().embed(&probe).unwrap().dtype(), DType::BF16);
    let logs: Vec<_> = (0..20).map(|_| t.train_step(&data).unwrap()).collect();
    let (first, last) = (&logs[0], &logs[19]);
    assert!(last.ce < 0.7 * first.ce, "ce {} -> {}", first.ce, last.ce);
    assert!(last.grad_norm.is_finite() && last.l1.is_finite());
    let p = last.phase_ms.as_ref().expect("profiled step");
    assert!(p.forward > 0.0 && p.backward > 0.0 && p.optimizer > 0.0);
    let val = t.validate(&data, 2).unwrap();
    assert!(
        val.ce.is_finite() && val.ce < first.ce,
        "val {} vs first {}",
        val.ce,
        first.ce
    );
    assert!(val.mean_l0.is_some_and(|l0| l0 > 0.0), "{val:?}");
    for (name, w) in t.weights().unwrap() {
        assert_eq!(w.dtype(), DType::F32, "{name}");
    }
}

/// A trainer on a checkpoint's weights, resumed from its optimizer and trainer state,
/// on the checkpoint's FFN path or on `ffn`.
fn resume_from(
    ck: &Checkpoint,
    dir: &std::path::Path,
    tc: &TrainConfig,
    ffn: Option<FfnMode>,
) -> Trainer {
    let mut cfg = ck.runtime_config(&LoadOptions::default()).unwrap();
    if let Some(ffn) = ffn {
        cfg.ffn_mode = ffn;
    }
    let weights = ck.tensors(DType::F32, &Device::Cpu).unwrap();
    let mut t = Trainer::new(cfg, weights, tc.clone(), &Device::Cpu).unwrap();
    t.resume(dir).unwrap();
    t
}

/// In f32 and in bf16 (where the optimizer's f32 masters are saved and restored).
#[test]
fn checkpoints_round_trip_and_resume_continues() {
    checkpoint_round_trip(false);
    checkpoint_round_trip(true);
}

fn checkpoint_round_trip(bf16: bool) {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dtype = if bf16 { DType::BF16 } else { DType::F32 };
    let run = || {
        let mut t = trainer(0.01, 6);
        if bf16 {
            t = Trainer::new(
                t.model_config().clone(),
                t.weights().unwrap(),
                TrainConfig {
                    bf16: true,
                    ..t.cfg.clone()
                },
                &Device::Cpu,
            )
            .unwrap();
        }
        t
    };

    let mut straight = run();
    for _ in 0..6 {
        straight.train_step(&data).unwrap();
    }

    let mut first = run();
    for _ in 0..3 {
        first.train_step(&data).unwrap();
    }
    first
        .save(dir.path(), &tiny_tokenizer(), None, DType::F32)
        .unwrap();

    // The checkpoint is a ReLU HF model with equal logits.
    let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
    assert_eq!(ck.config.hidden_act, "relu");
    assert_eq!(ck.config.twell.as_ref().unwrap().l1_coefficient, Some(0.01));
    // (In bf16 the model computes on the rounded masters, as a bf16 load of them does.)
    let loaded = ck
        .load_model(dtype, &Device::Cpu, &LoadOptions::default())
        .unwrap();
    let x = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6]], &Device::Cpu).unwrap();
    let logits = |m: &sparse_llama::Llama| {
        let mut c = Cache::new(false, dtype, m.config(), &Device::Cpu).unwrap();
        m.forward_all(&x, 0, &mut c).unwrap()
    };
    // bf16: a model on variables and one on loaded (frozen) weights take FFN paths that
    // round h at different points (about 6e-3 on this model, as dense against sparse).
    let e = rel_l2(&logits(&loaded), &logits(first.model()));
    assert!(
        e < if bf16 { 1e-2 } else { 1e-6 },
        "bf16 {bf16}: logits differ by {e}"
    );

    // Resume: weights from the checkpoint, optimizer and step from its state.
    let mut resumed = resume_from(&ck, dir.path(), &first.cfg, None);
    assert_eq!(resumed.step(), 3);
    for _ in 0..3 {
        resumed.train_step(&data).unwrap();
    }
    let (a, b) = (straight.weights().unwrap(), resumed.weights().unwrap());
    for (name, t) in &a {
        let e = rel_l2(&b[name], t);
        assert!(e < 1e-4, "{name} (bf16 {bf16}): resumed run differs by {e}");
    }
}

/// The sparse trainer trains fused up/down matrices, yet its weights and checkpoints
/// are HF-named; a dense trainer resumes from its optimizer state (converted back to
/// separate up and down) and the two continue alike.
#[test]
fn fused_sparse_training_saves_hf_layout_and_resumes_on_either_path() {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut first = trainer(0.01, 6);
    for _ in 0..2 {
        first.train_step(&data).unwrap();
    }
    let names: Vec<String> = first.weights().unwrap().into_keys().collect();
    assert!(names.iter().any(|n| n.ends_with("mlp.up_proj.weight")));
    assert!(names.iter().any(|n| n.ends_with("mlp.down_proj.weight")));
    assert!(!names.iter().any(|n| n.contains("up_down")), "{names:?}");
    first
        .save(dir.path(), &tiny_tokenizer(), None, DType::F32)
        .unwrap();
    let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
    let mut after = Vec::new();
    for ffn in [FfnMode::Sparse, FfnMode::Dense] {
        let mut resumed = resume_from(&ck, dir.path(), &first.cfg, Some(ffn));
        assert_eq!(resumed.step(), 2);
        resumed.train_step(&data).unwrap();
        after.push(resumed.weights().unwrap());
    }
    // The same Adam state drives both steps; only the FFN path's rounding differs.
    for (name, t) in &after[0] {
        let e = rel_l2(&after[1][name], t);
        assert!(e < 1e-4, "{name}: sparse and dense resumes differ by {e}");
    }
}

#[test]
fn bad_training_settings_and_resume_dirs_are_rejected() {
    let cfg = tiny_config("relu", 256).into_config(false);
    let w = tiny_weights(&cfg, 1);
    for bad in [
        TrainConfig {
            steps: 0,
            ..Default::default()
        },
        TrainConfig {
            lr: -1.0,
            ..Default::default()
        },
        TrainConfig {
            seq_len: 1,
            ..Default::default()
        },
        TrainConfig {
            l1: f64::NAN,
            ..Default::default()
        },
        TrainConfig {
            l1_target_density: Some(1.5),
            ..Default::default()
        },
        TrainConfig {
            l1_target_density: Some(0.03),
            l1: 0.0,
            ..Default::default()
        },
        TrainConfig {
            l1_target_density: Some(0.03),
            no_activity_stats: true,
            ..Default::default()
        },
        TrainConfig {
            l1_target_anneal_steps: 100,
            ..Default::default()
        },
        TrainConfig {
            distill: 1.5,
            ..Default::default()
        },
        TrainConfig {
            distill: f64::NAN,
            ..Default::default()
        },
    ] {
        let e = Trainer::new(cfg.clone(), w.clone(), bad, &Device::Cpu)
            .err()
            .expect("invalid config accepted");
        assert!(e.to_string().contains("invalid training setting"), "{e}");
    }
    let mut t = Trainer::new(cfg, w, TrainConfig::default(), &Device::Cpu).unwrap();
    let empty = tempfile::tempdir().unwrap();
    assert!(t
        .resume(empty.path())
        .unwrap_err()
        .to_string()
        .contains("not a fine-tune checkpoint"));
    assert!(PackedData::new(&[1, 2, 3], 32).is_err());
}

/// 25 steps of the tiny model on the dense FFN at λ = 0 and at `l1` with `penalty`:
/// the penalty must train (finite CE) and take L0 below 0.8x of λ = 0's.
fn assert_penalty_lowers_l0(penalty: Penalty, l1: f64) {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let run = |l1: f64| {
        let mut t = trainer_with(l1, 25, FfnMode::Dense, penalty);
        let logs: Vec<_> = (0..25).map(|_| t.train_step(&data).unwrap()).collect();
        logs.last().unwrap().clone()
    };
    let (off, on) = (run(0.0), run(l1));
    assert!(on.ce.is_finite() && off.ce.is_finite());
    assert!(
        on.mean_l0 < 0.8 * off.mean_l0,
        "L0 with {penalty:?} at {l1}: {} vs {} without",
        on.mean_l0,
        off.mean_l0
    );
}

/// The smooth count of positive gates lowers L0 on the dense FFN, and is written into
/// the run's settings; the sparse FFN computes only the plain term and says so.
#[test]
fn gate_l0_penalty_lowers_l0_on_the_dense_ffn() {
    assert_penalty_lowers_l0(Penalty::GateL0, 0.1);
    assert_eq!(
        serde_json::to_value(Penalty::GateL0).unwrap(),
        serde_json::json!("gate-l0")
    );
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let mut t = trainer_with(0.01, 5, FfnMode::Sparse, Penalty::GateL0);
    let e = t.train_step(&data).unwrap_err().to_string();
    assert!(e.contains("dense path"), "{e}");
}

/// The plain L1 term lowers L0 on the dense FFN too (the sparse FFN is covered by
/// `loss_falls_and_l1_lowers_l0`), and a checkpoint written before the term had its
/// name still reads as it.
#[test]
fn the_plain_l1_penalty_lowers_l0_on_the_dense_ffn() {
    assert_penalty_lowers_l0(Penalty::L1, 0.5);
    let old: Penalty = serde_json::from_value(serde_json::json!("plain")).unwrap();
    assert_eq!(old, Penalty::L1);
}

/// The controller's step: capped at ±10%, still at the target, easing off when nothing
/// fires.
#[test]
fn the_l1_controller_moves_lambda_towards_the_target_density() {
    let step = |density: f64| {
        let mut c = L1Controller::default();
        c.observe(density, 0.03);
        c.scale
    };
    assert!((step(0.3) - 1.1).abs() < 1e-12, "capped rise");
    assert!((step(0.03) - 1.0).abs() < 1e-12, "at the target");
    assert!((step(0.015) - 0.5f64.powf(0.05)).abs() < 1e-12);
    assert!((step(0.0) - 0.9).abs() < 1e-12, "nothing fired");
    assert!((step(1e-9) - 0.9).abs() < 1e-12, "capped fall");
    let mut c = L1Controller::default();
    for _ in 0..10_000 {
        c.observe(0.5, 0.03);
    }
    assert_eq!(c.scale, sparse_train::penalty::L1_SCALE_RANGE.1, "bounded");
}

/// An annealed target starts at the density of the first steered step, falls
/// geometrically to the final target and stays there; later densities do not move its
/// start.
#[test]
fn an_annealed_target_falls_geometrically_from_the_first_density() {
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b;
    let mut c = L1Controller::default();
    assert!(close(c.annealed_target(0.32, 0.02, 1, 100), 0.32));
    assert_eq!(c.anneal_from, Some(0.32));
    // Halfway: the geometric mean of 0.32 and 0.02.
    assert!(close(c.annealed_target(0.9, 0.02, 51, 100), 0.08));
    assert!(close(c.annealed_target(0.01, 0.02, 101, 100), 0.02));
    assert!(close(c.annealed_target(0.5, 0.02, 5000, 100), 0.02));
    let mut sparse = L1Controller::default();
    assert!(close(sparse.annealed_target(0.01, 0.02, 1, 100), 0.02));
    let mut silent = L1Controller::default();
    assert!(close(silent.annealed_target(f64::NAN, 0.02, 1, 100), 0.02));
    let mut plain = L1Controller::default();
    assert_eq!(plain.annealed_target(0.32, 0.02, 1, 0), 0.02);
    assert_eq!(plain.anneal_from, None, "no anneal, nothing remembered");
}

/// With the target annealed over many steps λ barely moves at first, where the final
/// target at once drives it up; the log carries the target, and the anneal's start
/// survives resume.
#[test]
fn an_annealed_target_raises_lambda_slowly_and_survives_resume() {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let mut at_once = trainer(0.01, 25);
    at_once.cfg.l1_target_density = Some(0.05);
    let mut annealed = trainer(0.01, 25);
    annealed.cfg.l1_target_density = Some(0.05);
    annealed.cfg.l1_target_anneal_steps = 1000;
    let mut targets = Vec::new();
    for _ in 0..10 {
        at_once.train_step(&data).unwrap();
        targets.push(annealed.train_step(&data).unwrap().l1_target.unwrap());
    }
    assert!(
        annealed.l1_scale() < at_once.l1_scale(),
        "λ factor annealed {} vs at once {}",
        annealed.l1_scale(),
        at_once.l1_scale()
    );
    assert!(
        targets[0] > 0.05,
        "starts at the first density: {targets:?}"
    );
    assert!(targets.windows(2).all(|w| w[1] < w[0]), "{targets:?}");
    let dir = tempfile::tempdir().unwrap();
    annealed
        .save(dir.path(), &tiny_tokenizer(), None, DType::F32)
        .unwrap();
    let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
    let mut resumed = resume_from(&ck, dir.path(), &annealed.cfg, None);
    let (next, expected) = (
        resumed.train_step(&data).unwrap(),
        annealed.train_step(&data).unwrap(),
    );
    let (t, e) = (next.l1_target.unwrap(), expected.l1_target.unwrap());
    assert!((t - e).abs() <= 1e-9 * e, "resumed target {t} vs {e}");
    // The neurons' last firing steps are resumed too: the same dead fraction.
    assert_eq!(next.dead_fraction, expected.dead_fraction);
}

/// With a target density λ rises while the FFN is denser than the target, and the run
/// ends sparser than at a fixed λ; a resumed run continues from the same λ.
#[test]
fn a_target_density_steers_lambda_and_survives_resume() {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let target = |t: &mut Trainer| {
        t.cfg.l1_target_density = Some(0.05);
    };
    let mut fixed = trainer(0.01, 25);
    let mut steered = trainer(0.01, 25);
    target(&mut steered);
    let (mut a, mut b) = (None, None);
    for _ in 0..25 {
        a = Some(fixed.train_step(&data).unwrap());
        b = Some(steered.train_step(&data).unwrap());
    }
    let (a, b) = (a.unwrap(), b.unwrap());
    assert!(steered.l1_scale() > 2.0, "λ factor {}", steered.l1_scale());
    assert!(b.l1_coefficient > 2.0 * a.l1_coefficient);
    assert!(
        b.mean_l0 < a.mean_l0,
        "L0 steered {} vs fixed {}",
        b.mean_l0,
        a.mean_l0
    );
    let dir = tempfile::tempdir().unwrap();
    steered
        .save(dir.path(), &tiny_tokenizer(), None, DType::F32)
        .unwrap();
    let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
    let resumed = resume_from(&ck, dir.path(), &steered.cfg, None);
    // During λ's ramp the factor stays put.
    let mut ramping = trainer(0.01, 25);
    ramping.cfg.l1_target_density = Some(0.05);
    ramping.cfg.l1_warmup_steps = 10;
    for _ in 0..10 {
        ramping.train_step(&data).unwrap();
    }
    assert_eq!(ramping.l1_scale(), 1.0);
    // (JSON keeps it to the last bit or one off.)
    let (r, s) = (resumed.l1_scale(), steered.l1_scale());
    assert!((r - s).abs() <= 1e-12 * s, "resumed λ factor {r} vs {s}");
}

#[test]
fn activity_statistics_can_be_switched_off_and_on() {
    // The benchmark times steps without the per-step L0 and fired-neuron bookkeeping; the
    // steps themselves must be the same.
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let mut with = trainer(1e-2, 3);
    let mut without = trainer(1e-2, 3);
    without.set_activity_stats(false);
    for _ in 0..2 {
        let (a, b) = (
            with.train_step(&data).unwrap(),
            without.train_step(&data).unwrap(),
        );
        assert!(
            (a.ce - b.ce).abs() < 1e-6 * a.ce.abs().max(1.0),
            "{} vs {}",
            a.ce,
            b.ce
        );
        assert!(a.mean_l0 > 0.0);
        assert_eq!(b.mean_l0, 0.0);
    }
    without.set_activity_stats(true);
    assert!(without.train_step(&data).unwrap().mean_l0 > 0.0);
}

/// The tiny SiLU model on other random weights, with its own output head: a teacher
/// whose distribution differs from every student's start. (A random model with tied
/// embeddings mostly predicts its input token again, as every student does at first.)
fn tiny_teacher() -> sparse_llama::Llama {
    let mut config = tiny_config("silu", 256);
    config.tie_word_embeddings = Some(false);
    let cfg = config.into_config(false);
    let mut weights = tiny_weights(&cfg, 29);
    // The head of another seed's weights, so that every call builds the same teacher.
    let head = tiny_weights(&cfg, 30)
        .remove("model.embed_tokens.weight")
        .unwrap();
    weights.insert("lm_head.weight".into(), head);
    let vb = candle_nn::VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    sparse_llama::Llama::load(vb, &cfg).unwrap()
}

/// The first validation-ordered batch's inputs: where the tests below measure how far a
/// student is from its teacher.
fn teacher_inputs(data: &PackedData) -> Tensor {
    let batch = data.ordered_batch(0, 4, &Device::Cpu).unwrap().unwrap();
    batch.narrow(1, 0, 32).unwrap()
}

/// Logits of an inference pass over `inputs`.
fn logits(m: &sparse_llama::Llama, inputs: &Tensor) -> Tensor {
    let mut cache = Cache::new(false, DType::F32, m.config(), &Device::Cpu).unwrap();
    m.forward_all(inputs, 0, &mut cache).unwrap()
}

/// KL(teacher ‖ student) over `inputs`.
fn kl_to_teacher(
    student: &sparse_llama::Llama,
    teacher: &sparse_llama::Llama,
    inputs: &Tensor,
) -> f64 {
    let (s, t) = (logits(student, inputs), logits(teacher, inputs));
    let kl = fused_ops::kl_divergence(&s, &t).unwrap();
    kl.to_scalar::<f32>().unwrap() as f64
}

/// A distilling student (`distill` sets its weights) trained 25 steps beside a CE-only
/// one on the same batches, both from the same start. `logged` reads the distilling
/// step's own measure from its log (and checks the log); `measure` then says how far each
/// student ended from a fresh copy of the teacher. Returns the distilling student, the
/// logged values and the two final distances (CE-only, distilled).
fn distill_beside_plain(
    distill: impl FnOnce(&mut TrainConfig),
    logged: impl Fn(&sparse_train::StepLog) -> f64,
    measure: fn(&sparse_llama::Llama, &sparse_llama::Llama, &Tensor) -> f64,
) -> (Trainer, Vec<f64>, f64, f64) {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let mut plain = trainer_with(0.0, 25, FfnMode::Dense, Penalty::L1);
    let mut distilled = trainer_with(0.0, 25, FfnMode::Dense, Penalty::L1);
    distill(&mut distilled.cfg);
    // Without a teacher a distilling step is refused, not run on CE alone.
    let e = distilled.train_step(&data).unwrap_err().to_string();
    assert!(e.contains("without a teacher"), "{e}");
    distilled.set_teacher(tiny_teacher()).unwrap();
    let mut values = Vec::new();
    for _ in 0..25 {
        let p = plain.train_step(&data).unwrap();
        assert!(p.kl.is_none(), "{p:?}");
        values.push(logged(&distilled.train_step(&data).unwrap()));
    }
    let (teacher, inputs) = (tiny_teacher(), teacher_inputs(&data));
    let to_plain = measure(plain.model(), &teacher, &inputs);
    let to_distilled = measure(distilled.model(), &teacher, &inputs);
    (distilled, values, to_plain, to_distilled)
}

/// A teacher like [`tiny_teacher`]'s shape but for `edit`.
fn teacher_shaped(edit: impl FnOnce(&mut sparse_llama::LlamaConfig)) -> sparse_llama::Llama {
    let mut config = tiny_config("silu", 256);
    edit(&mut config);
    let cfg = config.into_config(false);
    let vb = candle_nn::VarBuilder::from_tensors(tiny_weights(&cfg, 3), DType::F32, &Device::Cpu);
    sparse_llama::Llama::load(vb, &cfg).unwrap()
}

#[test]
fn distillation_pulls_the_student_towards_the_teacher() {
    let (mut distilled, kls, to_plain, to_distilled) = distill_beside_plain(
        |cfg| cfg.distill = 1.0,
        |log| {
            let kl = log.kl.expect("a distilling step logs its KL");
            assert!(
                kl.is_finite() && kl >= 0.0 && (log.loss - kl).abs() < 1e-9,
                "{log:?}"
            );
            kl
        },
        kl_to_teacher,
    );
    assert!(kls[24] < 0.5 * kls[0], "KL {} -> {}", kls[0], kls[24]);
    assert!(
        to_distilled < 0.5 * to_plain,
        "KL distilled {to_distilled} vs CE-only {to_plain}"
    );
    // A teacher must share the vocabulary.
    let e = distilled
        .set_teacher(teacher_shaped(|c| c.vocab_size = 100))
        .unwrap_err()
        .to_string();
    assert!(e.contains("vocabulary"), "{e}");
}

/// A target density read on validation text: a validation measures the validation
/// split's L0 and its ratio to the training batches' mean density since the start, and
/// the next step steers λ by the training density times that ratio.
#[test]
fn a_target_read_on_validation_text_steers_by_the_calibrated_density() {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    // Other text than the training text, so the two densities differ.
    let other: Vec<u32> = tiny_tokenizer()
        .encode(
            "numbers 12 34 56 and more numbers 78 90 then words again. "
                .repeat(30)
                .as_str(),
            false,
        )
        .unwrap()
        .get_ids()
        .to_vec();
    let val_data = PackedData::new(&other, 32).unwrap();
    let mut cfg = tiny_config("silu", 256).into_config(false);
    cfg.ffn_mode = FfnMode::Sparse;
    let target = 0.2;
    let tc = TrainConfig {
        seq_len: 32,
        batch_size: 4,
        steps: 20,
        lr: 3e-3,
        warmup_steps: 2,
        l1: 0.05,
        l1_target_density: Some(target),
        l1_target_text: DensityText::Validation,
        ..Default::default()
    };
    let d_ff = cfg.intermediate_size as f64;
    let mut t = Trainer::new(cfg.clone(), tiny_weights(&cfg, 11), tc, &Device::Cpu).unwrap();
    let logs: Vec<_> = (0..4).map(|_| t.train_step(&data).unwrap()).collect();
    let train_mean = logs.iter().map(|l| l.mean_l0 / d_ff).sum::<f64>() / logs.len() as f64;
    let val = t.validate(&val_data, 2).unwrap();
    let val_density = val.mean_l0.expect("activity statistics are on") / d_ff;
    let calibration = val_density / train_mean;
    assert!(
        (calibration - 1.0).abs() > 1e-3,
        "the two texts should differ in density: {calibration}"
    );
    let before = t.l1_scale();
    let step = t.train_step(&data).unwrap();
    let steered = step.mean_l0 / d_ff * calibration;
    let want = (steered / target).powf(L1_TARGET_GAIN).clamp(0.9, 1.1);
    let got = t.l1_scale() / before;
    assert!((got - want).abs() < 1e-9, "λ factor {got}, want {want}");
    // A target read on validation text without a target density is refused.
    let bad = TrainConfig {
        l1_target_text: DensityText::Validation,
        ..Default::default()
    };
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("validation text"), "{err}");
}

/// A checkpoint with HF `mlp_bias`: the trainer trains its biases (the gate bias with
/// the `gate-l0` term, without weight decay), lowers L0, and saves an HF checkpoint with
/// `mlp_bias: true` that loads with equal logits, runs the dense FFN under `auto`,
/// refuses `--ffn sparse` with a clear error, and resumes.
#[test]
fn mlp_biases_train_save_and_load() {
    let data = PackedData::new(&corpus_tokens(), 32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let with_bias = |l1: f64| {
        let base = trainer_with(l1, 25, FfnMode::Dense, Penalty::GateL0);
        let mut model_cfg = base.model_config().clone();
        model_cfg.mlp_bias = true;
        let mut weights = base.weights().unwrap();
        let (d, f) = (model_cfg.hidden_size, model_cfg.intermediate_size);
        for layer in 0..model_cfg.num_hidden_layers {
            for (name, n) in [("gate_proj", f), ("up_proj", f), ("down_proj", d)] {
                let zeros = Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap();
                weights.insert(format!("model.layers.{layer}.mlp.{name}.bias"), zeros);
            }
        }
        let tc = TrainConfig {
            weight_decay: 0.5,
            ..base.cfg.clone()
        };
        Trainer::new(model_cfg, weights, tc, &Device::Cpu).unwrap()
    };
    let mut off = with_bias(0.0);
    let mut on = with_bias(0.5);
    assert!(on.model_config().mlp_bias);
    let (mut l0_off, mut l0_on) = (0.0, 0.0);
    for _ in 0..25 {
        l0_off = off.train_step(&data).unwrap().mean_l0;
        l0_on = on.train_step(&data).unwrap().mean_l0;
    }
    assert!(
        l0_on < 0.8 * l0_off,
        "L0 {l0_on} with λ vs {l0_off} without"
    );
    let weights = on.weights().unwrap();
    let gate_bias = &weights["model.layers.0.mlp.gate_proj.bias"];
    assert_eq!(gate_bias.dims(), [on.model_config().intermediate_size]);
    assert_eq!(
        weights["model.layers.1.mlp.down_proj.bias"].dims(),
        [on.model_config().hidden_size]
    );
    // Trained away from zero, and, as the term pulls the gates down, mostly downwards.
    let mean_gate_bias = gate_bias.mean_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(mean_gate_bias < 0.0, "mean gate bias {mean_gate_bias}");

    on.save(dir.path(), &tiny_tokenizer(), None, DType::F32)
        .unwrap();
    let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
    assert_eq!(ck.config.mlp_bias, Some(true));
    let auto = LoadOptions {
        activation: None,
        ffn_mode: Some(FfnMode::Auto),
    };
    assert_eq!(ck.runtime_config(&auto).unwrap().ffn_mode, FfnMode::Dense);
    let loaded = ck.load_model(DType::F32, &Device::Cpu, &auto).unwrap();
    let x = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6]], &Device::Cpu).unwrap();
    let logits = |m: &sparse_llama::Llama| {
        let mut c = Cache::new(false, DType::F32, m.config(), &Device::Cpu).unwrap();
        m.forward_all(&x, 0, &mut c).unwrap()
    };
    let e = rel_l2(&logits(&loaded), &logits(on.model()));
    assert!(e < 1e-6, "logits differ by {e}");
    let sparse = LoadOptions {
        activation: None,
        ffn_mode: Some(FfnMode::Sparse),
    };
    let msg = ck.runtime_config(&sparse).unwrap_err().to_string();
    assert!(msg.contains("mlp_bias"), "{msg}");

    // Resumed from its own checkpoint: the biases come from the file, not zeros.
    let resumed = resume_from(&ck, dir.path(), &on.cfg, None);
    let e = rel_l2(
        &resumed.weights().unwrap()["model.layers.0.mlp.gate_proj.bias"],
        gate_bias,
    );
    assert!(e < 1e-6, "resumed gate bias differs by {e}");
}
