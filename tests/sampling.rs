//! Batched sampling (`sparse_llama::sample`): greedy rows are the arg-max of a full,
//! uncached forward over the text they produced; seeded rows are reproducible.

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use sparse_llama::{Cache, Llama};
use sparse_train::sample::{sample_batch, BatchSampling};

fn tiny_model() -> Llama {
    let cfg = common::tiny_config("relu", 128).into_config(false);
    let w = common::tiny_weights(&cfg, 11);
    Llama::load(
        candle_nn::VarBuilder::from_tensors(w, DType::F32, &Device::Cpu),
        &cfg,
    )
    .unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        b"The state of".iter().map(|&b| b as u32).collect(),
        b"Our economy ".iter().map(|&b| b as u32).collect(),
        b"I ask you to".iter().map(|&b| b as u32).collect(),
    ]
}

/// Twelve new tokens a row, greedy.
fn greedy() -> BatchSampling {
    BatchSampling {
        max_new_tokens: 12,
        temperature: 0.0,
        seed: 1,
        first_row: 0,
    }
}

#[test]
fn greedy_rows_are_the_argmax_of_an_uncached_forward() {
    let model = tiny_model();
    let cfg = greedy();
    let rows = sample_batch(&model, &prompts(), &[], &cfg, &Device::Cpu).unwrap();
    assert_eq!(rows.len(), 3);
    for (prompt, row) in prompts().iter().zip(&rows) {
        assert_eq!(row.len(), 12);
        let text: Vec<u32> = prompt.iter().chain(row).copied().collect();
        let n = text.len();
        let x = Tensor::from_vec(text, (1, n), &Device::Cpu).unwrap();
        let mut cache = Cache::new(false, DType::F32, model.config(), &Device::Cpu).unwrap();
        let logits = model.forward_all(&x, 0, &mut cache).unwrap().i(0).unwrap();
        for (k, &token) in row.iter().enumerate() {
            let at: Vec<f32> = logits.i(prompt.len() - 1 + k).unwrap().to_vec1().unwrap();
            let max = at.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert!(
                at[token as usize] >= max - 1e-4,
                "step {k}: token {token} has logit {} against the max {max}",
                at[token as usize]
            );
        }
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_seed_dependent() {
    let model = tiny_model();
    // A random model with tied embeddings mostly predicts its input token again, a
    // peaked distribution: a high temperature spreads it enough for seeds to matter.
    let run = |seed| {
        let cfg = BatchSampling {
            max_new_tokens: 16,
            temperature: 4.0,
            seed,
            first_row: 0,
        };
        sample_batch(&model, &prompts(), &[], &cfg, &Device::Cpu).unwrap()
    };
    let (a, b, c) = (run(5), run(5), run(6));
    assert_eq!(a, b);
    assert_ne!(a, c);
    // Rows of one batch draw their own streams: not three copies of one text.
    assert!(a[0] != a[1] || a[1] != a[2]);
}

#[test]
fn rows_stop_before_their_first_eos() {
    let model = tiny_model();
    let cfg = greedy();
    let full = sample_batch(&model, &prompts(), &[], &cfg, &Device::Cpu).unwrap();
    // Make the third token of row 0 an end of text: the row is cut there.
    let eos = full[0][2];
    let cut = sample_batch(&model, &prompts(), &[eos], &cfg, &Device::Cpu).unwrap();
    let expected = full[0].iter().position(|&t| t == eos).unwrap();
    assert_eq!(cut[0], full[0][..expected].to_vec());
}

#[test]
fn bad_batches_are_rejected() {
    let model = tiny_model();
    let cfg = BatchSampling {
        max_new_tokens: 4,
        temperature: 1.0,
        seed: 0,
        first_row: 0,
    };
    let err = |prompts: &[Vec<u32>], cfg: &BatchSampling| {
        sample_batch(&model, prompts, &[], cfg, &Device::Cpu)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&[], &cfg).contains("no prompts"));
    assert!(err(&[vec![1, 2], vec![3]], &cfg).contains("of one length"));
    assert!(err(&[vec![]], &cfg).contains("non-empty"));
    let hot = BatchSampling {
        temperature: f64::NAN,
        ..cfg.clone()
    };
    assert!(err(&[vec![1]], &hot).contains("temperature"));
    let long = BatchSampling {
        max_new_tokens: 200,
        ..cfg
    };
    assert!(err(&[vec![1]], &long).contains("positions"));
}
