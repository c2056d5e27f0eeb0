//! `Llama::forward_decode_batch`: one decode step of sequences at different positions,
//! each with its own cache, gives each the logits of its own one-sequence step; bad
//! batches are refused; the CUDA slot decoder refuses the CPU.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::{rel_l2, tiny_config, tiny_weights};
use sparse_llama::{Cache, Llama};

fn prefill(model: &Llama, prompt: &[u32], cfg: &sparse_llama::Config) -> Cache {
    let dev = Device::Cpu;
    let mut cache = Cache::new(true, DType::F32, cfg, &dev).unwrap();
    let x = Tensor::new(prompt, &dev).unwrap().unsqueeze(0).unwrap();
    model.forward(&x, 0, &mut cache).unwrap();
    cache
}

#[test]
fn a_batched_step_equals_each_sequences_own_step() {
    let dev = Device::Cpu;
    for (act, mode) in [
        ("silu", twell::FfnMode::Dense),
        ("relu", twell::FfnMode::Sparse),
    ] {
        let cfg = tiny_config(act, 256).into_config(false);
        let w = tiny_weights(&cfg, 5);
        let mut model =
            Llama::load(VarBuilder::from_tensors(w.clone(), DType::F32, &dev), &cfg).unwrap();
        model.set_ffn_mode(mode).unwrap();
        model.fuse_qkv().unwrap();
        let prompts: [&[u32]; 3] = [&[5, 17, 99], &[3], &[250, 42, 7, 7, 1, 200, 11]];
        let next = [13u32, 14, 15];
        // Each sequence alone.
        let alone: Vec<Tensor> = prompts
            .iter()
            .zip(next)
            .map(|(p, t)| {
                let mut cache = prefill(&model, p, &cfg);
                let x = Tensor::new(&[[t]], &dev).unwrap();
                model.forward(&x, p.len(), &mut cache).unwrap()
            })
            .collect();
        // The three in one step, then a second step, against the same done alone.
        let mut caches: Vec<Cache> = prompts.iter().map(|p| prefill(&model, p, &cfg)).collect();
        let positions: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let mut refs: Vec<&mut Cache> = caches.iter_mut().collect();
        let batched = model
            .forward_decode_batch(&next, &positions, &mut refs)
            .unwrap();
        assert_eq!(batched.dims(), &[3, cfg.vocab_size]);
        for (i, a) in alone.iter().enumerate() {
            let b = batched.narrow(0, i, 1).unwrap();
            let err = rel_l2(&b, a);
            assert!(err < 1e-5, "{act} sequence {i}: {err}");
        }
        let again: Vec<usize> = positions.iter().map(|p| p + 1).collect();
        let second = model
            .forward_decode_batch(&[1, 2, 3], &again, &mut refs)
            .unwrap();
        for (i, (p, t)) in prompts.iter().zip(next).enumerate() {
            let mut cache = prefill(&model, p, &cfg);
            let x = Tensor::new(&[[t]], &dev).unwrap();
            model.forward(&x, p.len(), &mut cache).unwrap();
            let x = Tensor::new(&[[[1u32, 2, 3][i]]], &dev).unwrap();
            let want = model.forward(&x, p.len() + 1, &mut cache).unwrap();
            let err = rel_l2(&second.narrow(0, i, 1).unwrap(), &want);
            assert!(err < 1e-5, "{act} second step, sequence {i}: {err}");
        }
        // Bad batches: mismatched lengths, a position that does not continue the cache,
        // an empty batch.
        let e = model
            .forward_decode_batch(&[1, 2], &again, &mut refs)
            .unwrap_err()
            .to_string();
        assert!(e.contains("positions"), "{e}");
        let e = model
            .forward_decode_batch(&[1, 2, 3], &positions, &mut refs)
            .unwrap_err()
            .to_string();
        assert!(e.contains("continues its cache"), "{e}");
        let mut none: Vec<&mut Cache> = Vec::new();
        assert!(model.forward_decode_batch(&[], &[], &mut none).is_err());
    }
}

/// The slot decoder (CUDA graphs over a preallocated cache) says so on the CPU, where
/// `forward_decode_batch` is the batched decode.
#[test]
fn the_slot_decoder_refuses_the_cpu_with_a_clear_error() {
    let dev = Device::Cpu;
    let cfg = tiny_config("relu", 256).into_config(false);
    let model = Llama::load(
        VarBuilder::from_tensors(tiny_weights(&cfg, 5), DType::F32, &dev),
        &cfg,
    )
    .unwrap();
    let options = sparse_llama::DecodeOptions {
        slots: 2,
        context: 16,
        graphs: true,
    };
    let e = sparse_llama::SlotDecoder::new(&model, options)
        .err()
        .expect("refused on the CPU");
    assert!(e.to_string().contains("forward_decode_batch"), "{e}");
}

/// A cloned cache (a shared prompt prefix that several sequences go on from) and its
/// original go on with their own tokens, a step each in turn: each gives the logits of a
/// cache that was never cloned, also once the original outgrows its buffer's chunk.
#[test]
fn a_cloned_cache_and_its_original_go_on_apart() {
    let dev = Device::Cpu;
    let mut cfg = tiny_config("relu", 256).into_config(false);
    cfg.max_position_embeddings = 600;
    let w = tiny_weights(&cfg, 9);
    let mut model = Llama::load(VarBuilder::from_tensors(w, DType::F32, &dev), &cfg).unwrap();
    model.set_ffn_mode(twell::FfnMode::Sparse).unwrap();
    let prefix: &[u32] = &[5, 17, 99, 3, 250, 42];
    let step = |cache: &mut Cache, pos: usize, t: u32| -> Tensor {
        let x = Tensor::new(&[[t]], &dev).unwrap();
        model.forward(&x, pos, cache).unwrap()
    };
    // A never-cloned cache through the prefix and `tokens`: the last logits.
    let fresh = |tokens: &[u32]| -> Tensor {
        let mut cache = prefill(&model, prefix, &cfg);
        let mut last = None;
        for (k, &t) in tokens.iter().enumerate() {
            last = Some(step(&mut cache, prefix.len() + k, t));
        }
        last.unwrap()
    };
    let a: Vec<u32> = (0..300).map(|i| (i * 7 % 250) as u32).collect();
    let b: Vec<u32> = (0..40).map(|i| (i * 11 % 250 + 1) as u32).collect();
    // One step after the prompt: the original now holds a chunked buffer with room.
    let mut original = prefill(&model, prefix, &cfg);
    step(&mut original, prefix.len(), a[0]);
    let mut clone = original.clone();
    let (mut got_a, mut got_b) = (None, None);
    for k in 0..b.len() {
        got_b = Some(step(&mut clone, prefix.len() + 1 + k, b[k]));
        got_a = Some(step(&mut original, prefix.len() + 1 + k, a[1 + k]));
    }
    let mut b_path = vec![a[0]];
    b_path.extend(&b);
    assert!(rel_l2(&got_b.unwrap(), &fresh(&b_path)) < 1e-5, "the clone");
    assert!(
        rel_l2(got_a.as_ref().unwrap(), &fresh(&a[..=b.len()])) < 1e-5,
        "the original"
    );
    // The original past its buffer's first chunk (256 positions).
    for (k, &t) in a.iter().enumerate().skip(b.len() + 1) {
        got_a = Some(step(&mut original, prefix.len() + k, t));
    }
    assert!(
        rel_l2(&got_a.unwrap(), &fresh(&a)) < 1e-5,
        "the original, grown"
    );
}
