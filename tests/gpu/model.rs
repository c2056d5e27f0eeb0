//! A 2-layer Llama on the GPU: inference (fused attention, the KV cache in chunks, fused
//! q, k, v, the MLP norms folded, TwELL MLPs) and a training step's gradients, against
//! the CPU's f32 training path on the same weights.

use std::collections::HashMap;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};

use super::{gpu, rel_l2, TOLERANCE};

/// A model of the checks with its weights as variables, by name.
type CheckModel = (sparse_llama::Llama, Vec<(String, Var)>);

/// The random Llama of the model checks (hd 64, grouped-query heads, 2 layers), in
/// bf16 on `dev` and in f32 on the CPU from the same weights, each with its weights as
/// variables (for the training check).
fn check_models(dev: &Device) -> Result<([CheckModel; 2], sparse_llama::Config)> {
    use sparse_llama::Llama;
    let (weights, cfg) = check_weights(dev)?;
    let build = |device: &Device, dtype: DType| -> Result<(Llama, Vec<(String, Var)>)> {
        let varmap = candle_nn::VarMap::new();
        let mut vars = Vec::new();
        {
            let mut data = varmap.data().lock().expect("a fresh varmap");
            for (name, w) in &weights {
                let var = Var::from_tensor(&w.to_device(device)?.to_dtype(dtype)?)?;
                vars.push((name.clone(), var.clone()));
                data.insert(name.clone(), var);
            }
        }
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, dtype, device);
        Ok((Llama::load(vb, &cfg)?, vars))
    };
    Ok((
        [build(dev, DType::BF16)?, build(&Device::Cpu, DType::F32)?],
        cfg,
    ))
}

/// The weights (bf16 on `dev`, HF names) and config of the model checks' random Llama.
fn check_weights(dev: &Device) -> Result<(HashMap<String, Tensor>, sparse_llama::Config)> {
    use sparse_llama::synthetic;
    let cfg = synthetic::config(512, 1024, 2, 8, 2, 1000)?;
    let mut weights = synthetic::weights(&cfg, 0.1, 11, DType::BF16, dev)?;
    // The random model's attention writes little into the residual stream; make it
    // count, so an attention error shows in the logits. On the CPU in bf16 this model's
    // two paths differ by 6e-3, and dropping the cached past changes the logits by 0.95.
    for (name, w) in weights.iter_mut() {
        if name.contains("o_proj") {
            *w = (&*w * 30.0)?;
        }
    }
    Ok((weights, cfg))
}

/// The tokens of the model checks: 2 sequences of 96.
fn check_tokens(device: &Device) -> Result<Tensor> {
    let ids: Vec<u32> = (0..2 * 96).map(|i| (i * 7919 % 1000) as u32).collect();
    Ok(Tensor::from_vec(ids, (2, 96), device)?)
}

/// The model's inference path on the GPU (fused attention, fused residual add + norm,
/// rope, and the KV cache: a 40-token prompt, 55 more written into its chunked buffer,
/// read in place by the attention with two sequences' batch stride, then a one-token
/// step on the decode kernel) against the CPU f32 training path (plain ops) on the same
/// tokens: relative L2 error of the logits, with the q, k, v projections split (as
/// loaded) and then fused (`fuse_qkv`: one product, the RoPE kernel's q | k | v form,
/// keys and values read from wider rows).
///
/// The third pass also folds each MLP's norm weight into its weights (`fold_mlp_norms`,
/// on the same weights as plain tensors, the MLPs on the TwELL path): the prefill
/// chunks then add the output projection into the residual (`residual_add_linear`) and
/// run `twell_mlp_norm_add_norm`.
///
/// Returns the three errors and the folded pass's distance from the fused one (zero
/// would mean the folded path did not run).
fn check_model_attention(dev: &Device) -> Result<([f64; 3], f64)> {
    use sparse_llama::Cache;
    let ([(mut gpu, _), (cpu, _)], cfg) = check_models(dev)?;
    let plain = cpu.forward_train(&check_tokens(&Device::Cpu)?)?.logits;
    let ids = check_tokens(dev)?;
    let mut errs = [0.0; 3];
    let mut logits = Vec::new();
    for (pass, err) in errs.iter_mut().enumerate() {
        if pass == 2 {
            gpu = check_model_weights_frozen(dev)?;
            gpu.fuse_qkv()?;
            gpu.set_ffn_mode(twell::FfnMode::Sparse)?;
            gpu.fold_mlp_norms()?;
        }
        let mut cache = Cache::new(true, DType::BF16, &cfg, dev)?;
        let first = gpu.forward_all(&ids.narrow(1, 0, 40)?, 0, &mut cache)?;
        let second = gpu.forward_all(&ids.narrow(1, 40, 55)?, 40, &mut cache)?;
        let third = gpu.forward_all(&ids.narrow(1, 95, 1)?, 95, &mut cache)?;
        let all = Tensor::cat(&[first, second, third], 1)?.to_device(&Device::Cpu)?;
        *err = rel_l2(&all, &plain)?;
        logits.push(all);
        gpu.fuse_qkv()?;
    }
    Ok((errs, rel_l2(&logits[2], &logits[1])?))
}

/// The model of [`check_models`] in bf16 on `dev`, its weights plain tensors (as a
/// checkpoint loads them), which `fold_mlp_norms` takes.
fn check_model_weights_frozen(dev: &Device) -> Result<sparse_llama::Llama> {
    let (weights, cfg) = check_weights(dev)?;
    let vb = candle_nn::VarBuilder::from_tensors(weights, DType::BF16, dev);
    Ok(sparse_llama::Llama::load(vb, &cfg)?)
}

#[derive(Debug)]
struct ModelTrainResult {
    /// Whether the GPU pass ran the fused attention (with its backward) and RoPE kernel.
    fused: bool,
    logits_err: f64,
    /// Over all parameters' gradients together, and the worst single one.
    grad_err: f64,
    worst_grad_err: f64,
    worst_param: String,
    pass: bool,
}

/// Model-level gradients: a training step's backward on the GPU in bf16 (fused
/// attention and RoPE with their backward passes) against the CPU's f32 plain ops, for
/// the loss `Σ logits ⊙ probe`.
fn check_model_training(dev: &Device) -> Result<ModelTrainResult> {
    let ([(gpu, gpu_vars), (cpu, cpu_vars)], cfg) = check_models(dev)?;
    let probe = Tensor::randn(0f32, 1.0, (2, 96, cfg.vocab_size), &Device::Cpu)?;
    let run = |model: &sparse_llama::Llama, device: &Device| -> Result<(Tensor, _)> {
        let logits = model.forward_train(&check_tokens(device)?)?.logits;
        let loss = (logits.to_dtype(DType::F32)? * probe.to_device(device)?)?.sum_all()?;
        Ok((logits.to_device(&Device::Cpu)?, loss.backward()?))
    };
    let (gpu_logits, gpu_grads) = run(&gpu, dev)?;
    let (cpu_logits, cpu_grads) = run(&cpu, &Device::Cpu)?;
    let logits_err = rel_l2(&gpu_logits, &cpu_logits)?;
    let (mut diff, mut norm) = (0f64, 0f64);
    let (mut worst_grad_err, mut worst_param) = (0f64, String::new());
    for ((name, gv), (_, cv)) in gpu_vars.iter().zip(&cpu_vars) {
        let get = |grads: &candle_core::backprop::GradStore, v: &Var| -> Result<Tensor> {
            let g = grads
                .get(v.as_tensor())
                .with_context(|| format!("no gradient for {name}"))?;
            Ok(g.to_device(&Device::Cpu)?.to_dtype(DType::F64)?)
        };
        let (g, c) = (get(&gpu_grads, gv)?, get(&cpu_grads, cv)?);
        let d = (&g - &c)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        let n = c.sqr()?.sum_all()?.to_scalar::<f64>()?;
        (diff, norm) = (diff + d, norm + n);
        let err = if n > 0.0 { (d / n).sqrt() } else { d.sqrt() };
        if err > worst_grad_err {
            (worst_grad_err, worst_param) = (err, name.clone());
        }
    }
    let grad_err = (diff / norm).sqrt();
    let probe_q = Tensor::zeros((1, 8, 2, 64), DType::BF16, dev)?;
    let fused = fused_ops::fused_on_device(&probe_q);
    Ok(ModelTrainResult {
        fused,
        logits_err,
        grad_err,
        worst_grad_err,
        worst_param,
        pass: fused && logits_err < TOLERANCE && grad_err < MODEL_GRAD_TOLERANCE,
    })
}

/// bf16 against f32 through a 2-layer model's backward, for all gradients together
/// (single parameters are printed, not judged: a near-zero one has a large relative
/// error from rounding alone).
const MODEL_GRAD_TOLERANCE: f64 = 5e-2;

#[test]
fn inference_matches_the_cpu_f32_path() {
    let (errors, folded_moved) = check_model_attention(&gpu()).unwrap();
    assert!(folded_moved > 0.0, "the folded path did not run");
    for (err, projections) in
        errors
            .iter()
            .zip(["split", "fused", "fused, MLP norms folded, TwELL MLPs,"])
    {
        assert!(
            err < &TOLERANCE,
            "{projections} q, k, v: logits rel err {err:.2e}"
        );
    }
}

#[test]
fn a_training_step_matches_the_cpu_f32_gradients() {
    let r = check_model_training(&gpu()).unwrap();
    eprintln!("{r:?}");
    assert!(r.pass, "{r:?}");
}

/// `forward_decode_batch` on the GPU (bf16, fused attention's decode-step kernel per
/// sequence, TwELL MLPs over the rows): three sequences at different positions give
/// each one's own one-sequence step.
#[test]
fn a_batched_decode_step_matches_each_sequences_own() {
    use sparse_llama::{Cache, Llama};
    let dev = gpu();
    let (weights, cfg) = check_weights(&dev).unwrap();
    let vb = candle_nn::VarBuilder::from_tensors(weights, DType::BF16, &dev);
    let mut model = Llama::load(vb, &cfg).unwrap();
    model.fuse_qkv().unwrap();
    model.set_ffn_mode(twell::FfnMode::Sparse).unwrap();
    let prompts: [&[u32]; 3] = [&[5, 17, 99], &[3], &[250, 42, 7, 7, 1, 200, 11, 9, 900]];
    let next = [13u32, 14, 15];
    let prefill = |p: &[u32]| {
        let mut cache = Cache::new(true, DType::BF16, &cfg, &dev).unwrap();
        let x = Tensor::new(p, &dev).unwrap().unsqueeze(0).unwrap();
        model.forward(&x, 0, &mut cache).unwrap();
        cache
    };
    let mut caches: Vec<Cache> = prompts.iter().map(|p| prefill(p)).collect();
    let positions: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    let mut refs: Vec<&mut Cache> = caches.iter_mut().collect();
    let batched = model
        .forward_decode_batch(&next, &positions, &mut refs)
        .unwrap();
    for (i, (p, t)) in prompts.iter().zip(next).enumerate() {
        let mut cache = prefill(p);
        let x = Tensor::new(&[[t]], &dev).unwrap();
        let alone = model.forward(&x, p.len(), &mut cache).unwrap();
        let err = rel_l2(&batched.narrow(0, i, 1).unwrap(), &alone).unwrap();
        assert!(err < TOLERANCE, "sequence {i}: rel err {err:.2e}");
    }
}

/// The slot decoder (`SlotDecoder`): three sequences of different lengths in slots out
/// of order, decoded together for 40 greedy steps with each step replayed as a CUDA
/// graph, give the same logits as the same steps launched op by op (bit for bit: the
/// same kernels), and their first step matches each sequence's own `forward`. Both
/// fixed FFN paths, and `Auto` (which times one against the other per batch size).
#[test]
fn graph_replayed_decode_steps_match_op_by_op_steps() {
    use twell::FfnMode;
    check_slot_decoder(None, &[FfnMode::Sparse, FfnMode::Dense, FfnMode::Auto]);
}

/// The same with the spread kernels forced at 3 rows, both norms around the MLP folded
/// into them.
#[test]
fn graph_replayed_decode_steps_on_the_spread_kernels_match_op_by_op_steps() {
    let paths = twell::KernelPaths {
        few_rows: twell::FewRows::Staged,
        staged_rows: twell::StagedRows::SpreadKernels,
        ..Default::default()
    };
    check_slot_decoder(Some(paths), &[twell::FfnMode::Sparse]);
}

/// Three sequences in slots out of order, 40 greedy steps, graph replay against op by op
/// (see above), with `paths` (and the MLP norms folded into the weights) where given.
fn check_slot_decoder(paths: Option<twell::KernelPaths>, modes: &[twell::FfnMode]) {
    use sparse_llama::{Cache, DecodeOptions, DecodeRow, Llama, SlotDecoder};
    use twell::FfnMode;
    let dev = gpu();
    let (weights, mut cfg) = check_weights(&dev).unwrap();
    if let Some(paths) = paths {
        cfg.twell = cfg.twell.with_paths(paths);
    }
    let vb = candle_nn::VarBuilder::from_tensors(weights, DType::BF16, &dev);
    let mut model = Llama::load(vb, &cfg).unwrap();
    model.fuse_qkv().unwrap();
    if paths.is_some() {
        model.fold_mlp_norms().unwrap();
    }
    let prompts: [&[u32]; 3] = [&[5, 17, 99], &[3], &[250, 42, 7, 7, 1, 200, 11, 9, 900]];
    let slots = [2usize, 0, 3];
    for &mode in modes {
        model.set_ffn_mode(mode).unwrap();
        let options = |graphs| DecodeOptions {
            slots: 4,
            context: 64,
            graphs,
        };
        let mut graph = SlotDecoder::new(&model, options(true)).unwrap();
        let mut eager = SlotDecoder::new(&model, options(false)).unwrap();
        let mut next = Vec::new();
        for (p, &slot) in prompts.iter().zip(&slots) {
            let logits = graph.prefill(&model, slot, p).unwrap();
            eager.prefill(&model, slot, p).unwrap();
            next.push(logits.argmax(0).unwrap().to_scalar::<u32>().unwrap());
        }
        let mut positions: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        for step in 0..40 {
            let rows: Vec<DecodeRow> = (0..3)
                .map(|i| DecodeRow {
                    slot: slots[i],
                    token: next[i],
                    position: positions[i],
                })
                .collect();
            graph.step(&mut model, &rows).unwrap();
            eager.step(&mut model, &rows).unwrap();
            let (g, e) = (graph.logits().unwrap(), eager.logits().unwrap());
            if mode != FfnMode::Auto {
                let diff = (&g - &e).unwrap().abs().unwrap().max_all().unwrap();
                let diff = diff.to_scalar::<f32>().unwrap();
                assert!(
                    diff == 0.0,
                    "{mode:?} step {step}: graph and op-by-op logits differ by {diff}"
                );
            } else {
                let err = rel_l2(&g, &e).unwrap();
                assert!(err < TOLERANCE, "Auto step {step}: rel err {err:.2e}");
            }
            if step == 0 {
                for (i, p) in prompts.iter().enumerate() {
                    let mut cache = Cache::new(true, DType::BF16, &cfg, &dev).unwrap();
                    let x = Tensor::new(*p, &dev).unwrap().unsqueeze(0).unwrap();
                    model.forward(&x, 0, &mut cache).unwrap();
                    let x = Tensor::new(&[[next[i]]], &dev).unwrap();
                    let alone = model.forward(&x, p.len(), &mut cache).unwrap();
                    let err = rel_l2(&g.narrow(0, i, 1).unwrap(), &alone).unwrap();
                    assert!(
                        err < TOLERANCE,
                        "{mode:?} sequence {i}: rel err {err:.2e} against forward"
                    );
                }
            }
            next = graph.greedy_tokens().unwrap();
            assert_eq!(next, eager.greedy_tokens().unwrap(), "{mode:?} step {step}");
            positions.iter_mut().for_each(|p| *p += 1);
        }
        assert!(
            graph.graph_failure().is_none(),
            "{:?}",
            graph.graph_failure()
        );
        eprintln!(
            "{mode:?}: 40 steps of 3 rows, graph = op by op; side {:?}",
            graph.side(3)
        );
    }
}

/// The slot decoder refuses what its preallocated buffers cannot hold, with an error.
#[test]
fn the_slot_decoder_refuses_steps_past_its_buffers() {
    use sparse_llama::{DecodeOptions, DecodeRow, Llama, SlotDecoder};
    let dev = gpu();
    let (weights, cfg) = check_weights(&dev).unwrap();
    let vb = candle_nn::VarBuilder::from_tensors(weights, DType::BF16, &dev);
    let mut model = Llama::load(vb, &cfg).unwrap();
    let options = DecodeOptions {
        slots: 2,
        context: 8,
        graphs: true,
    };
    let unfused = SlotDecoder::new(&model, options)
        .err()
        .expect("unfused q, k, v");
    assert!(unfused.to_string().contains("fuse_qkv"), "{unfused}");
    model.fuse_qkv().unwrap();
    let mut decoder = SlotDecoder::new(&model, options).unwrap();
    let row = |slot, position| DecodeRow {
        slot,
        token: 1,
        position,
    };
    let cases: [(Vec<DecodeRow>, &str); 5] = [
        (vec![row(0, 8)], "context"),
        (vec![row(2, 0)], "slot"),
        (vec![row(0, 0), row(0, 1)], "slot"),
        (vec![row(0, 0), row(1, 0), row(1, 1)], "1 to 2"),
        (vec![], "1 to 2"),
    ];
    for (rows, want) in cases {
        let e = decoder.step(&mut model, &rows).expect_err("refused");
        assert!(e.to_string().contains(want), "{rows:?}: {e}");
    }
    let long = vec![1u32; 8];
    let e = decoder
        .prefill(&model, 0, &long)
        .expect_err("prompt past the context");
    assert!(e.to_string().contains("context"), "{e}");
}

/// The sparse default model (SmolLM2-135M-Instruct with the shipped adapter), where
/// `TWELL_DATA` (or `data/`) holds it: `None`, with a note, elsewhere.
fn sparse_default(dev: &Device) -> Option<sparse_llama::Llama> {
    use sparse_llama::adapter::LoraAdapter;
    use sparse_llama::checkpoint::{Checkpoint, LoadOptions};
    let data = std::env::var_os("TWELL_DATA")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data"));
    let gguf = data.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let adapter = [
        data.join("smollm2-135m-sparse"),
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-sparse"),
    ]
    .into_iter()
    .find(|p| p.exists());
    let (true, Some(adapter)) = (gguf.exists(), adapter) else {
        eprintln!("skipping: no sparse default model under {}", data.display());
        return None;
    };
    let adapter = LoraAdapter::load(&adapter).unwrap();
    let ck = Checkpoint::open(gguf.to_str().unwrap())
        .unwrap()
        .with_adapter(&adapter)
        .unwrap();
    let options = LoadOptions {
        activation: None,
        ffn_mode: Some(twell::FfnMode::Sparse),
    };
    let mut model = ck.load_model(DType::BF16, dev, &options).unwrap();
    model.fuse_qkv().unwrap();
    Some(model)
}

/// On the sparse default model, three sequences at different positions decode 256
/// steps together: the graph replays give the same logits as the same steps op by op
/// (bit for bit), and stay within bf16 noise of the model's own forward over a KV cache
/// for each sequence alone (relative L2 ≤ 1e-2), each step fed the token that forward
/// chose (so the paths never part on a near tie). Both FFN modes run, the dense one as
/// the measure of the checkpoint's bf16 noise; each prints its error's spread first.
#[test]
fn graph_decode_follows_the_models_forward_for_256_steps_on_the_sparse_default() {
    use sparse_llama::{Cache, DecodeOptions, DecodeRow, SlotDecoder};
    let dev = gpu();
    let Some(mut model) = sparse_default(&dev) else {
        return;
    };
    let cfg = model.config().clone();
    let prompts: [&[u32]; 3] = [
        &[504, 3575, 282, 4649, 314],
        &[1, 9690, 198],
        &[
            504, 2869, 282, 253, 1345, 30, 2688, 314, 3575, 282, 260, 1795,
        ],
    ];
    let slots = [1usize, 2, 0];
    let options = |graphs| DecodeOptions {
        slots: 3,
        context: 300,
        graphs,
    };
    let mut worst = Vec::new();
    for mode in [twell::FfnMode::Sparse, twell::FfnMode::Dense] {
        model.set_ffn_mode(mode).unwrap();
        let mut graph = SlotDecoder::new(&model, options(true)).unwrap();
        let mut eager = SlotDecoder::new(&model, options(false)).unwrap();
        let mut caches = Vec::new();
        let mut next = Vec::new();
        for (p, &slot) in prompts.iter().zip(&slots) {
            graph.prefill(&model, slot, p).unwrap();
            eager.prefill(&model, slot, p).unwrap();
            let mut cache = Cache::new(true, DType::BF16, &cfg, &dev).unwrap();
            let x = Tensor::new(*p, &dev).unwrap().unsqueeze(0).unwrap();
            let logits = model.forward(&x, 0, &mut cache).unwrap();
            next.push(logits.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0]);
            caches.push(cache);
        }
        let mut errs = Vec::new();
        for step in 0..256 {
            let rows: Vec<DecodeRow> = (0..3)
                .map(|i| DecodeRow {
                    slot: slots[i],
                    token: next[i],
                    position: prompts[i].len() + step,
                })
                .collect();
            graph.step(&mut model, &rows).unwrap();
            eager.step(&mut model, &rows).unwrap();
            let (g, e) = (graph.logits().unwrap(), eager.logits().unwrap());
            let diff = (&g - &e).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(
                diff.to_scalar::<f32>().unwrap(),
                0.0,
                "{mode:?}, step {step}: graph != op by op"
            );
            for i in 0..3 {
                let x = Tensor::new(&[[next[i]]], &dev).unwrap();
                let alone = model.forward(&x, rows[i].position, &mut caches[i]).unwrap();
                errs.push((
                    rel_l2(&g.narrow(0, i, 1).unwrap(), &alone).unwrap(),
                    step,
                    i,
                ));
                next[i] = alone.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
            }
        }
        assert!(
            graph.graph_failure().is_none(),
            "{:?}",
            graph.graph_failure()
        );
        errs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (max, step, seq) = errs[errs.len() - 1];
        eprintln!(
            "{mode:?}: 256 steps × 3 sequences, graph = op by op; rel err against forward: \
             median {:.2e}, 99th percentile {:.2e}, max {max:.2e} (step {step}, sequence {seq}), \
             {} of {} above 1e-2",
            errs[errs.len() / 2].0,
            errs[errs.len() * 99 / 100].0,
            errs.iter().filter(|e| e.0 > 1e-2).count(),
            errs.len()
        );
        worst.push((mode, max));
    }
    for (mode, max) in worst {
        assert!(max <= 1e-2, "{mode:?}: rel err {max:.2e} against forward");
    }
}

/// On the sparse default model, one sequence alone (the one-row MLP kernel, whose
/// atomics from every block add in any order) decodes 256 greedy steps: graph replay and
/// the same steps op by op give the same logits, bit for bit, at every step.
#[test]
fn one_row_graph_decode_equals_op_by_op_for_256_steps_on_the_sparse_default() {
    use sparse_llama::{DecodeOptions, DecodeRow, SlotDecoder};
    let dev = gpu();
    let Some(mut model) = sparse_default(&dev) else {
        return;
    };
    let prompt: &[u32] = &[
        504, 2869, 282, 253, 1345, 30, 2688, 314, 3575, 282, 260, 1795,
    ];
    let options = |graphs| DecodeOptions {
        slots: 1,
        context: 300,
        graphs,
    };
    let mut graph = SlotDecoder::new(&model, options(true)).unwrap();
    let mut eager = SlotDecoder::new(&model, options(false)).unwrap();
    let first = graph.prefill(&model, 0, prompt).unwrap();
    eager.prefill(&model, 0, prompt).unwrap();
    let mut token = first.argmax(0).unwrap().to_scalar::<u32>().unwrap();
    for step in 0..256 {
        let rows = [DecodeRow {
            slot: 0,
            token,
            position: prompt.len() + step,
        }];
        graph.step(&mut model, &rows).unwrap();
        eager.step(&mut model, &rows).unwrap();
        let (g, e) = (graph.logits().unwrap(), eager.logits().unwrap());
        let diff = (&g - &e).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(
            diff.to_scalar::<f32>().unwrap(),
            0.0,
            "step {step}: graph != op by op"
        );
        token = graph.greedy_tokens().unwrap()[0];
        assert_eq!(token, eager.greedy_tokens().unwrap()[0], "step {step}");
    }
    assert!(
        graph.graph_failure().is_none(),
        "{:?}",
        graph.graph_failure()
    );
    eprintln!("one row, 256 greedy steps: graph = op by op, bit for bit");
}
