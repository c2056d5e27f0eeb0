//! The fused attention on the GPU: prefill and decode kernels with their backward, the
//! one-launch decode step that writes the KV cache, and the attention that turns its
//! queries (RoPE) as it reads them, each against the plain ops.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};

use super::{gpu, rel_l2, TOLERANCE};

#[derive(Debug)]
struct AttentionResult {
    /// `(b, heads, t, kv_heads, T, hd)`.
    dims: (usize, usize, usize, usize, usize, usize),
    /// The forward kernel that ran.
    kernel: String,
    /// Standard deviation of the scaled scores `q·k / √hd`.
    logit_std: f64,
    err: f64,
    /// dq, dk, dv.
    grad_err: [f64; 3],
    pass: bool,
}

/// The fused causal attention (bf16) and its backward against the plain-op f32
/// reference on the GPU.
fn check_attention(
    dev: &Device,
    dims: (usize, usize, usize, usize, usize, usize),
    seed: u64,
) -> Result<AttentionResult> {
    let (b, heads, t, kv, total, hd) = dims;
    dev.set_seed(seed)?;
    // Odd seeds start each input one element into its buffer (a contiguous view that is
    // not 16-byte aligned), which the op must realign.
    let skew = (seed % 2) as usize;
    let input = |shape: (usize, usize, usize, usize)| -> Result<Tensor> {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        Ok(Tensor::randn(0f32, 1.0, n + skew, dev)?
            .to_dtype(DType::BF16)?
            .narrow(0, skew, n)?
            .reshape(shape)?)
    };
    // Every third case has sharp scores (standard deviation 4 instead of 1), where the
    // backward's bf16 scores round the most.
    let logit_std = if seed.is_multiple_of(3) { 4.0 } else { 1.0 };
    let (q, k, v) = (
        (input((b, heads, t, hd))? * logit_std)?,
        input((b, kv, total, hd))?,
        input((b, kv, total, hd))?,
    );
    if !fused_ops::fused_on_device(&q) {
        bail!("causal attention {dims:?} would not run the CUDA kernel");
    }
    let kernel = fused_ops::causal_attention_kernel_name(&q, total)?
        .context("the attention check runs on a CUDA device")?;
    let out = fused_ops::causal_attention(&q, &k, &v)?;
    let err = rel_l2(&out, &fused_ops::causal_attention_reference(&q, &k, &v)?)?;
    // The backward: gradients of `Σ out ⊙ probe` against the reference's in f32.
    let probe = Tensor::randn(0f32, 1.0, (b, heads, t, hd), dev)?;
    let gradients = |attention: fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
                     dtype: DType|
     -> Result<Vec<Tensor>> {
        let vars = [&q, &k, &v]
            .iter()
            .map(|x| Var::from_tensor(&x.to_dtype(dtype)?))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let out = attention(
            vars[0].as_tensor(),
            vars[1].as_tensor(),
            vars[2].as_tensor(),
        )?;
        let grads = (out.to_dtype(DType::F32)? * &probe)?
            .sum_all()?
            .backward()?;
        vars.iter()
            .map(|x| grads.get(x.as_tensor()).cloned().context("no gradient"))
            .collect()
    };
    let fused = gradients(fused_ops::causal_attention, DType::BF16)?;
    let plain = gradients(fused_ops::causal_attention_reference, DType::F32)?;
    let mut grad_err = [0f64; 3];
    for (e, (a, r)) in grad_err.iter_mut().zip(fused.iter().zip(&plain)) {
        *e = rel_l2(a, r)?;
    }
    Ok(AttentionResult {
        dims,
        kernel,
        logit_std,
        err,
        grad_err,
        pass: err < TOLERANCE && grad_err.iter().all(|&e| e < TOLERANCE),
    })
}

#[derive(Debug)]
struct AttentionStepResult {
    /// (batch, heads, kv_heads, cached positions, capacity)
    dims: (usize, usize, usize, usize, usize),
    /// The attention rows against RoPE, the cache append and the fused attention as
    /// separate ops.
    err: f64,
    /// The key and value row written into the cache against `rope_qkv`'s.
    row_err: f64,
    /// Whether the positions before the step and after it are untouched.
    rest_kept: bool,
    pass: bool,
}

/// The plain attention of rows `q` over their cached keys and values `cached`
/// `[b, len, 2w]` with this step's rows `kv_rows` `[b, 2w]` appended: the reference the
/// decode steps are checked against.
fn attention_after_append(
    q: &Tensor,
    cached: &Tensor,
    kv_rows: &Tensor,
    hd: usize,
) -> Result<Tensor> {
    let (b, _, two_w) = cached.dims3()?;
    let w = two_w / 2;
    let keys = Tensor::cat(&[cached, &kv_rows.reshape((b, 1, two_w))?], 1)?;
    Ok(fused_ops::causal_attention_rows(
        q,
        &keys.narrow(2, 0, w)?,
        &keys.narrow(2, w, w)?,
        b,
        hd,
    )?)
}

/// The one-launch decode step (`causal_attention_step`, hd 64) against the three ops it
/// replaces, on the same random projections and cache.
fn check_attention_step(
    dev: &Device,
    dims: (usize, usize, usize, usize, usize),
    seed: u64,
) -> Result<AttentionStepResult> {
    let (b, heads, kv, len, cap) = dims;
    let hd = 64;
    let w = kv * hd;
    dev.set_seed(seed)?;
    let bf = |shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(DType::BF16)?)
    };
    let qkv = bf(&[b, (heads + 2 * w / hd) * hd])?;
    let (cos, sin) = ((bf(&[1, hd / 2])? * 0.7)?, (bf(&[1, hd / 2])? * 0.7)?);
    let angles = fused_ops::RopeTable::new(&cos, &sin)?;
    let cache = bf(&[b, cap, 2 * w])?;
    let before = cache.force_contiguous()?;
    let (q, kv_rows) = fused_ops::rope_qkv(&qkv, &angles, heads, kv)?;
    let want = attention_after_append(&q, &cache.narrow(1, 0, len)?, &kv_rows, hd)?;
    let got = fused_ops::causal_attention_step(&qkv, &angles, &cache, len, heads, kv)?;
    let err = rel_l2(&got, &want)?;
    let row_err = rel_l2(&cache.narrow(1, len, 1)?.reshape((b, 2 * w))?, &kv_rows)?;
    let same = |a: Tensor, c: Tensor| -> Result<bool> {
        let d = (a.to_dtype(DType::F32)? - c.to_dtype(DType::F32)?)?.abs()?;
        Ok(d.flatten_all()?.max(0)?.to_scalar::<f32>()? == 0.0)
    };
    let mut rest_kept = len == 0 || same(cache.narrow(1, 0, len)?, before.narrow(1, 0, len)?)?;
    if len + 1 < cap {
        let after = cap - len - 1;
        rest_kept &= same(
            cache.narrow(1, len + 1, after)?,
            before.narrow(1, len + 1, after)?,
        )?;
    }
    Ok(AttentionStepResult {
        dims,
        err,
        row_err,
        rest_kept,
        pass: err < TOLERANCE && row_err < TOLERANCE && rest_kept,
    })
}

#[derive(Debug)]
struct AttentionTurningQResult {
    /// (batch, heads, kv_heads, query positions, cached positions before them)
    dims: (usize, usize, usize, usize, usize),
    /// The forward kernel that ran (or none: RoPE then the attention).
    kernel: Option<String>,
    /// Largest difference from `rope_qkv` then the attention on the turned queries.
    max_diff: f32,
    /// Largest difference of the keys turned in place in `k | v` rows (as the two-product
    /// prefill has them) from `rope_qkv`'s keys, and of their values.
    keys_in_place_diff: f32,
    pass: bool,
}

/// The attention that turns its queries (RoPE) as it stages them against `rope_qkv`
/// then the attention on the turned queries: the same rows, bit for bit; and the keys
/// of `k | v` rows turned in place against `rope_qkv`'s, bit for bit too. q is a view
/// of the fused projection rows, the angles a view into a longer table (positions past
/// a cache), the keys a cache's rows then the new ones.
fn check_attention_turning_q(
    dev: &Device,
    dims: (usize, usize, usize, usize, usize),
    seed: u64,
) -> Result<AttentionTurningQResult> {
    let (b, heads, kv, t, past) = dims;
    let hd = 64;
    let w = kv * hd;
    dev.set_seed(seed)?;
    let bf = |shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(DType::BF16)?)
    };
    let qkv = bf(&[b * t, (heads + 2 * kv) * hd])?;
    let table = fused_ops::RopeTable::new(
        &(bf(&[past + t, hd / 2])? * 0.7)?,
        &(bf(&[past + t, hd / 2])? * 0.7)?,
    )?;
    let angles = table.narrow(past, t)?;
    let (q, kv_rows) = fused_ops::rope_qkv(&qkv, &angles, heads, kv)?;
    let new_rows = kv_rows.reshape((b, t, 2 * w))?;
    // No zero-sized random tensor for an empty cache: cuRAND rejects a count of 0.
    let keys = if past == 0 {
        new_rows
    } else {
        Tensor::cat(&[bf(&[b, past, 2 * w])?, new_rows], 1)?
    };
    let (k, v) = (keys.narrow(2, 0, w)?, keys.narrow(2, w, w)?);
    let want = fused_ops::causal_attention_rows(&q, &k, &v, b, hd)?;
    let q_raw = qkv.narrow(1, 0, heads * hd)?;
    let got = fused_ops::causal_attention_rows_turning_q(&q_raw, &angles, &k, &v, b, hd)?;
    let largest_diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
        Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?)
    };
    let max_diff = largest_diff(&got, &want)?;
    let kv_in_place = qkv.narrow(1, heads * hd, 2 * w)?.contiguous()?;
    fused_ops::rope_keys_in_place(&kv_in_place, &angles, kv)?;
    let keys_in_place_diff = largest_diff(&kv_in_place, &kv_rows)?;
    let kernel = (t > 1)
        .then(|| {
            fused_ops::causal_attention_kernel_name(
                &q.reshape((b, t, heads, hd))?.transpose(1, 2)?,
                past + t,
            )
        })
        .transpose()?
        .flatten();
    Ok(AttentionTurningQResult {
        dims,
        kernel,
        max_diff,
        keys_in_place_diff,
        pass: max_diff == 0.0 && keys_in_place_diff == 0.0 && got.dims() == want.dims(),
    })
}

/// `(b, heads, t, kv_heads, T, hd)`: decode with a cache (the one-query kernel, and past
/// its key limit the prefill kernel), grouped heads, prefill.
#[rustfmt::skip]
const ATTENTION_CASES: [(usize, usize, usize, usize, usize, usize); 8] = [
    (1, 9, 1, 3, 17, 64), (2, 32, 1, 8, 2048, 64), (1, 4, 1, 4, 9000, 64),
    (1, 9, 100, 3, 612, 64), (4, 32, 333, 8, 333, 64), (2, 32, 2048, 32, 2048, 64),
    (3, 6, 17, 2, 81, 64), (1, 2, 1000, 1, 1000, 64),
];

fn assert_attention_cases() {
    let dev = gpu();
    assert_all_pass!(ATTENTION_CASES
        .iter()
        .enumerate()
        .map(|(k, &dims)| check_attention(&dev, dims, 900 + k as u64).unwrap()));
}

#[test]
fn attention_and_its_backward_match_the_plain_ops() {
    assert_attention_cases();
}

/// The portable mma.sync kernel, which cards other than Hopper run, checked on this one.
#[test]
fn the_portable_attention_kernel_matches_the_plain_ops() {
    fused_ops::cuda::set_portable_attention(true);
    let outcome = std::panic::catch_unwind(assert_attention_cases);
    fused_ops::cuda::set_portable_attention(false);
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn the_decode_step_matches_rope_the_cache_append_and_the_attention() {
    // (batch, heads, kv_heads, cached positions, capacity): one sequence and several,
    // grouped and plain heads, an empty cache, the last free position, the longest step;
    // all but the empty cache split the positions over 2-9 blocks a head.
    let max = fused_ops::CUDA_DECODE_MAX_KEYS;
    let cases = [
        (1, 32, 32, 511, 768),
        (3, 9, 3, 0, 256),
        (2, 32, 8, 255, 256),
        (4, 16, 4, 1000, 1024),
        (1, 8, 2, 130, 256),
        (1, 32, 32, max - 1, max),
    ];
    let dev = gpu();
    assert_all_pass!(cases
        .into_iter()
        .enumerate()
        .map(|(k, dims)| check_attention_step(&dev, dims, 1300 + k as u64).unwrap()));
}

#[derive(Debug)]
struct SlotStepResult {
    /// (heads, kv_heads, rows, capacity)
    dims: (usize, usize, usize, usize),
    /// Each row's position and slot.
    rows: Vec<(usize, usize)>,
    /// Worst relative L2 error of a row's attention, and of the key and value row it wrote.
    err: f64,
    row_err: f64,
    pass: bool,
}

/// The slot decoder's step (`SlotAttention`, hd 64) for rows at their own positions in
/// slots out of order, each row against RoPE, its cache slot's positions with the new
/// row appended, and the attention over them.
fn check_slot_step(
    dev: &Device,
    dims: (usize, usize, usize, usize),
    seed: u64,
) -> Result<SlotStepResult> {
    let (heads, kv, n, cap) = dims;
    let hd = 64;
    let w = kv * hd;
    let slots_total = n + 2;
    dev.set_seed(seed)?;
    let bf = |shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(DType::BF16)?)
    };
    let qkv = bf(&[n, (heads + 2 * kv) * hd])?;
    let (cos, sin) = ((bf(&[cap, hd / 2])? * 0.7)?, (bf(&[cap, hd / 2])? * 0.7)?);
    let cache = bf(&[slots_total, cap, 2 * w])?;
    let before = cache.force_contiguous()?;
    // Row i at its own position (the first at 0, the last at the last free one) in slot
    // slots_total - 1 - i.
    let rows: Vec<(usize, usize)> = (0..n)
        .map(|i| {
            let pos = match i {
                0 => 0,
                i if i + 1 == n => cap - 1,
                i => (cap * (2 * i + 1) / (2 * n)).min(cap - 1),
            };
            (pos, slots_total - 1 - i)
        })
        .collect();
    let u32s = |v: Vec<u32>| Tensor::new(v, dev);
    let positions = u32s(rows.iter().map(|r| r.0 as u32).collect())?;
    let slots = u32s(rows.iter().map(|r| r.1 as u32).collect())?;
    let step = fused_ops::SlotAttention::new(dev, n, (heads, kv, hd), cap)?;
    let got = step.forward(
        &qkv,
        &fused_ops::RopeTable::new(&cos, &sin)?,
        &cache,
        &positions,
        &slots,
    )?;
    let (mut err, mut row_err) = (0f64, 0f64);
    for (i, &(pos, slot)) in rows.iter().enumerate() {
        let angles = fused_ops::RopeTable::new(&cos.narrow(0, pos, 1)?, &sin.narrow(0, pos, 1)?)?;
        let (q, kv_row) = fused_ops::rope_qkv(&qkv.narrow(0, i, 1)?, &angles, heads, kv)?;
        let cached = before.narrow(0, slot, 1)?.narrow(1, 0, pos)?;
        let want = attention_after_append(&q, &cached, &kv_row, hd)?;
        err = err.max(rel_l2(&got.narrow(0, i, 1)?, &want)?);
        let written = cache
            .narrow(0, slot, 1)?
            .narrow(1, pos, 1)?
            .reshape((1, 2 * w))?;
        row_err = row_err.max(rel_l2(&written, &kv_row)?);
    }
    Ok(SlotStepResult {
        dims,
        rows,
        err,
        row_err,
        pass: err < TOLERANCE && row_err < TOLERANCE,
    })
}

#[test]
fn the_slot_step_matches_rope_the_cache_append_and_the_attention() {
    // (heads, kv_heads, rows, capacity): plain heads and 2-16 query heads a KV head
    // (SmolLM2, Llama 3, Qwen2.5 and wider groups), one row and 64, the positions split
    // over one block a head and over several.
    let cases = [
        (32, 32, 1, 768),
        (32, 32, 5, 64),
        (32, 2, 3, 512),
        (2, 1, 1, 256),
        (9, 3, 1, 512),
        (9, 3, 4, 64),
        (9, 3, 64, 512),
        (32, 8, 2, 1024),
        (12, 2, 3, 700),
        (28, 4, 1, 2048),
        (64, 8, 6, 300),
    ];
    let dev = gpu();
    assert_all_pass!(cases
        .into_iter()
        .enumerate()
        .map(|(k, dims)| check_slot_step(&dev, dims, 1400 + k as u64).unwrap()));
}

#[test]
fn the_attention_turning_its_queries_matches_rope_then_the_attention_bit_for_bit() {
    // (batch, heads, kv_heads, queries, cached before them): prefill sizes on either
    // kernel, grouped heads, a chunk after a cache, a block's worth of rows and a ragged
    // one, and one query (RoPE then the decode kernel).
    let cases = [
        (1, 9, 3, 100, 0),
        (2, 32, 8, 333, 64),
        (4, 32, 32, 2048, 0),
        (3, 6, 2, 17, 81),
        (1, 2, 1, 128, 1000),
        (2, 4, 4, 1, 30),
    ];
    let dev = gpu();
    assert_all_pass!(cases
        .into_iter()
        .enumerate()
        .map(|(k, dims)| check_attention_turning_q(&dev, dims, 1400 + k as u64).unwrap()));
}
