//! The sparse MLP on the GPU: forward on every kernel path (TwELL slots and the gate's
//! bit mask, both gate GEMMs, the products path, `Auto`'s dense side), the residual add
//! and norms folded into its launches, and the backward on every path, each against a
//! dense f32 reference on the same bf16 numbers.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use twell::density::{synthetic_input, synthetic_mlp, MlpWeights};
use twell::{
    twell_mlp, up_down_matrix, FewRows, GateGemm, KernelPaths, RowWalk, StagedRows, TwellConfig,
};

use super::{gpu, rel_l2, TOLERANCE};

#[derive(Debug)]
struct CaseResult {
    path: ForwardPath,
    m: usize,
    d: usize,
    f: usize,
    tile: usize,
    compression: usize,
    target_density: f64,
    density: f64,
    overflow_tiles: usize,
    err_out: f64,
    err_l1: f64,
    nnz_gpu: usize,
    nnz_reference: usize,
    pass: bool,
}

/// One shape of the MLP checks: `(M, hidden, d_ff, target density, tile, compression)`.
type Case = (usize, usize, usize, f64, usize, usize);

/// The TwELL configuration, bf16 weights and bf16 input of a case.
fn case_inputs(
    dev: &Device,
    case: Case,
    paths: KernelPaths,
    seed: u64,
) -> Result<(TwellConfig, MlpWeights, Tensor)> {
    let (m, d, f, density, tile, cf) = case;
    let config = TwellConfig::new(tile, cf)?.with_paths(paths);
    let w = synthetic_mlp(d, f, density, DType::BF16, dev, seed)?;
    let x = synthetic_input(m, d, DType::BF16, dev, seed + 1)?;
    Ok((config, w, x))
}

/// Which forward of the MLP a case runs: the TwELL kernels, or the inference path of
/// cuBLAS GEMMs around one element-wise kernel (`twell_mlp_products`).
#[derive(Clone, Copy, Debug)]
enum ForwardPath {
    Pairs,
    Products,
}

fn check_case(
    dev: &Device,
    case: Case,
    path: ForwardPath,
    paths: KernelPaths,
    seed: u64,
) -> Result<CaseResult> {
    let (m, d, f, density, tile, cf) = case;
    let (config, w, x) = case_inputs(dev, case, paths, seed)?;
    let w_ud = up_down_matrix(&w.up, &w.down)?;
    let res = match path {
        ForwardPath::Pairs => twell_mlp(&x, &w.gate, &w_ud, config)?,
        ForwardPath::Products => twell::twell_mlp_products(&x, &w.gate, &w_ud, config)?,
    };
    // Dense f32 reference on the same bf16 numbers.
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let (x32, g32, u32_, d32) = (f32(&x)?, f32(&w.gate)?, f32(&w.up)?, f32(&w.down)?);
    let h = (x32.matmul(&g32.t()?)?.relu()? * x32.matmul(&u32_.t()?)?)?;
    let out_ref = h.matmul(&d32.t()?)?;
    let l1_ref = h.abs()?.sum(1)?;
    let nnz_reference = h
        .ne(0f32)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()? as usize;
    let err_out = rel_l2(&res.out, &out_ref)?;
    let err_l1 = rel_l2(&res.l1, &l1_ref)?;
    let nnz_gpu = res.nnz()?;
    let (overflow_tiles, _) = res.overflow()?;
    // The gate is rounded to bf16 on the GPU and kept in f32 by the reference: a few
    // near-zero gates may fall on different sides of zero.
    let nnz_close = nnz_gpu.abs_diff(nnz_reference) <= 16 + nnz_reference / 100;
    let pass = err_out < TOLERANCE && err_l1 < TOLERANCE && nnz_close;
    Ok(CaseResult {
        path,
        m,
        d,
        f,
        tile,
        compression: cf,
        target_density: density,
        density: nnz_gpu as f64 / (m * f) as f64,
        overflow_tiles,
        err_out,
        err_l1,
        nnz_gpu,
        nnz_reference,
        pass,
    })
}

/// `Auto` once its measured density is past the break-even, at inference: its second
/// call must take the products path (`twell_mlp_products`, which its statistics report
/// as not sparse) and agree with candle's dense MLP on the same weights. Returns the
/// relative error and whether the TwELL kernels ran instead.
fn check_auto_dense_side(dev: &Device) -> Result<(f64, bool)> {
    use candle_core::Module;
    let w = synthetic_mlp(2048, 5632, 0.3, DType::BF16, dev, 77)?;
    let x = synthetic_input(2048, 2048, DType::BF16, dev, 78)?;
    let auto = w.relu_mlp(twell::FfnMode::Auto)?.with_stats(true);
    // Auto measures 30% on its first call, then times its sides on calls like this one
    // until it has decided; at 30% a dense side wins by far.
    auto.calibrate(&x)?;
    let out = auto.forward(&x)?;
    let stats = auto.last_stats()?.context("auto kept no statistics")?;
    let reference = w.relu_mlp(twell::FfnMode::Dense)?.forward(&x)?;
    Ok((rel_l2(&out, &reference)?, stats.sparse))
}

#[derive(Debug)]
struct BackwardResult {
    m: usize,
    d: usize,
    f: usize,
    tile: usize,
    compression: usize,
    target_density: f64,
    /// The backward path (`twell::BackwardPath`) the case ran.
    path: String,
    overflow_tiles: usize,
    /// Relative L2 error of dx, d gate_proj, d up_proj, d down_proj.
    err: [f64; 4],
    /// Whether the device kernels ran the backward (not the host fallback).
    on_device: bool,
    pass: bool,
}

/// The backward pass of a CUDA forward against dense f32 autograd on the same bf16
/// numbers, under a random loss `Σ out ⊙ r + Σ l1 ⊙ s` (so every output gradient
/// differs).
fn check_backward(
    dev: &Device,
    case: Case,
    path: twell::BackwardPath,
    seed: u64,
) -> Result<BackwardResult> {
    let (m, d, f, density, tile, cf) = case;
    let (config, w, x) = case_inputs(dev, case, KernelPaths::default(), seed)?;
    let vars = [&x, &w.gate, &w.up, &w.down]
        .map(|t| Var::from_tensor(&t.to_dtype(DType::F32).unwrap()).unwrap());
    let r = Tensor::randn(0f32, 1.0, (m, d), dev)?;
    let s = Tensor::randn(0f32, 1.0, m, dev)?;
    let bf = |v: &Var| v.as_tensor().to_dtype(DType::BF16);
    let calls_before = twell::device_backward_calls();
    let res = twell::twell_mlp_with_backward_path(
        &bf(&vars[0])?,
        &bf(&vars[1])?,
        &up_down_matrix(&bf(&vars[2])?, &bf(&vars[3])?)?,
        config,
        path,
    )?;
    let (overflow_tiles, _) = res.overflow()?;
    let loss = ((res.out.to_dtype(DType::F32)? * &r)?.sum_all()?
        + (res.l1.to_dtype(DType::F32)? * &s)?.sum_all()?)?;
    let gs = loss.backward()?;
    let on_device = twell::device_backward_calls() > calls_before;
    let (xv, gv, uv, dv) = (
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
        vars[3].as_tensor(),
    );
    let h = (xv.matmul(&gv.t()?)?.relu()? * xv.matmul(&uv.t()?)?)?;
    let loss_ref =
        ((h.matmul(&dv.t()?)? * &r)?.sum_all()? + (h.abs()?.sum(1)? * &s)?.sum_all()?)?;
    let gr = loss_ref.backward()?;
    let mut err = [0.0; 4];
    for (e, v) in err.iter_mut().zip(&vars) {
        let a = gs
            .get(v.as_tensor())
            .context("no gradient from the TwELL path")?;
        let b = gr
            .get(v.as_tensor())
            .context("no gradient from the reference")?;
        *e = rel_l2(a, b)?;
    }
    let pass = on_device && err.iter().all(|&e| e < TOLERANCE);
    Ok(BackwardResult {
        m,
        d,
        f,
        tile,
        compression: cf,
        target_density: density,
        path: format!("{path:?}").to_lowercase(),
        overflow_tiles,
        err,
        on_device,
        pass,
    })
}

/// One token's MLP with the residual add and norm folded into its launch
/// (`twell_mlp_add_norm`) against the two launches it replaces (`twell_mlp`, then
/// `add_rms_norm`) on the same inputs, and with the add and norm before the MLP folded in
/// too against the three (`add_rms_norm`, `twell_mlp`, `add_rms_norm`): the same values
/// are expected, up to one bf16 step where the MLP's f32 atomic sums arrived in another
/// order.
#[derive(Debug)]
struct MlpAddNormResult {
    m: usize,
    d: usize,
    f: usize,
    target_density: f64,
    /// Largest absolute difference of the sums and of the normalised rows: the norm
    /// after the MLP folded in, then (one token) both norms.
    sum_diff: f64,
    norm_diff: f64,
    both_sum_diff: Option<f64>,
    both_norm_diff: Option<f64>,
    /// The largest of those differences in bf16 steps at the value's magnitude: the
    /// one-token kernel sums with f32 atomics in arrival order, so two launches may
    /// round a sum to neighbouring bf16 values; the prefill fold reduces the squares in
    /// another order.
    bf16_steps: f64,
    pass: bool,
}

/// The largest difference of two bf16 tensors in units of the bf16 spacing at each
/// element's magnitude (0 where they are equal).
fn bf16_steps(a: &Tensor, b: &Tensor) -> Result<f64> {
    steps_between(a, b, None)
}

/// [`bf16_steps`] with the spacing taken at least at `scale`'s magnitude per element:
/// a sum that cancels to near zero carries the rounding of its terms, whose spacing is
/// that of the terms, not of the result.
fn bf16_steps_at(a: &Tensor, b: &Tensor, scale: &Tensor) -> Result<f64> {
    steps_between(a, b, Some(scale))
}

/// [`bf16_steps_at`], at each element's own magnitude where `scale` is `None`.
fn steps_between(a: &Tensor, b: &Tensor, scale: Option<&Tensor>) -> Result<f64> {
    let values = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (a, b) = (values(a)?, values(b)?);
    let scale = match scale {
        Some(scale) => values(scale)?,
        None => vec![0.0; a.len()],
    };
    Ok(a.iter()
        .zip(&b)
        .zip(&scale)
        .map(|((&x, &y), &z)| {
            let (x, y) = (x as f64, y as f64);
            let m = x.abs().max(y.abs()).max(z.abs() as f64);
            if x == y {
                0.0
            } else if m == 0.0 || !m.is_finite() {
                f64::INFINITY
            } else {
                // bf16 keeps 8 significant bits: the spacing in [2^e, 2^(e+1)) is 2^(e-7).
                (x - y).abs() / (m.log2().floor() - 7.0).exp2()
            }
        })
        .fold(0.0, f64::max))
}

fn check_mlp_add_norm(
    dev: &Device,
    (m, d, f, density): (usize, usize, usize, f64),
    paths: KernelPaths,
    seed: u64,
) -> Result<MlpAddNormResult> {
    let (config, w, x) = case_inputs(dev, (m, d, f, density, 256, 8), paths, seed)?;
    dev.set_seed(seed)?;
    let residual = Tensor::randn(0f32, 1.0, (m, d), dev)?.to_dtype(DType::BF16)?;
    let alpha = Tensor::randn(1f32, 0.1, d, dev)?.to_dtype(DType::BF16)?;
    let eps = 1e-5;
    let w_ud = up_down_matrix(&w.up, &w.down)?;
    if !twell::add_norm_fuses(&x, f, config) {
        bail!("mlp + add + norm ({m} rows, d {d}) would not fold on this device");
    }
    let diff = |a: &Tensor, b: &Tensor| -> Result<f64> {
        Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()? as f64)
    };
    let (sum, normed) =
        twell::twell_mlp_add_norm(&x, &w.gate, &w_ud, config, (&residual, &alpha, eps), None)?;
    let out = twell_mlp(&x, &w.gate, &w_ud, config)?.out;
    let (want_sum, want_normed) = fused_ops::add_rms_norm(&residual, &out, &alpha, eps)?;
    let (sum_diff, norm_diff) = (diff(&sum, &want_sum)?, diff(&normed, &want_normed)?);
    let plain_steps = bf16_steps(&sum, &want_sum)?.max(bf16_steps(&normed, &want_normed)?);
    if m > 1 {
        // Prefill rows: the norm before the MLP is not folded.
        return Ok(MlpAddNormResult {
            m,
            d,
            f,
            target_density: density,
            sum_diff,
            norm_diff,
            both_sum_diff: None,
            both_norm_diff: None,
            bf16_steps: plain_steps,
            pass: plain_steps <= 1.0,
        });
    }
    // Both norms: x stands for the attention's output y; the MLP's input is the norm of
    // residual + y, whose scale (about 1/√2 of x's) keeps the density near the target.
    let pre_alpha = Tensor::randn(1f32, 0.1, d, dev)?.to_dtype(DType::BF16)?;
    let (both_sum, both_normed) = twell::twell_mlp_add_norm(
        &x,
        &w.gate,
        &w_ud,
        config,
        (&residual, &alpha, eps),
        Some((&pre_alpha, eps)),
    )?;
    let (h, hm) = fused_ops::add_rms_norm(&residual, &x, &pre_alpha, eps)?;
    let out = twell_mlp(&hm, &w.gate, &w_ud, config)?.out;
    let (want_sum, want_normed) = fused_ops::add_rms_norm(&h, &out, &alpha, eps)?;
    let (both_sum_diff, both_norm_diff) = (
        diff(&both_sum, &want_sum)?,
        diff(&both_normed, &want_normed)?,
    );
    // The kernel's f32 sums of the MLP output arrive in another order than the separate
    // launch's: one bf16 step of the output, which the residual add can leave as many
    // steps of a sum near zero. So the sum is measured at the terms' magnitude, and the
    // normalised row at that magnitude through the norm's scale α / rms.
    let terms = (h.to_dtype(DType::F32)?.abs()? + out.to_dtype(DType::F32)?.abs()?)?;
    let want_sum32 = want_sum.to_dtype(DType::F32)?;
    let rms = (want_sum32.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
    let normed_terms = terms
        .broadcast_div(&rms)?
        .broadcast_mul(&alpha.to_dtype(DType::F32)?.abs()?)?;
    let steps = plain_steps
        .max(bf16_steps_at(&both_sum, &want_sum, &terms)?)
        .max(bf16_steps_at(&both_normed, &want_normed, &normed_terms)?);
    Ok(MlpAddNormResult {
        m,
        d,
        f,
        target_density: density,
        sum_diff,
        norm_diff,
        both_sum_diff: Some(both_sum_diff),
        both_norm_diff: Some(both_norm_diff),
        bf16_steps: steps,
        pass: steps <= 1.0,
    })
}

#[derive(Debug)]
struct MlpNormAddNormResult {
    m: usize,
    d: usize,
    f: usize,
    target_density: f64,
    /// The MLP's share of the sums (`sum − s`) against the f32 MLP of the f32 norm, for
    /// this launch and for the unfolded launches (rms_norm · alpha, `twell_mlp`,
    /// `add_rms_norm`): both carry the rounding of the bf16 sums, at the residual's
    /// magnitude, so the folded one is judged against the unfolded one.
    mlp_err: f64,
    unfolded_mlp_err: f64,
    /// The sums and the normalised rows against the unfolded launches'.
    sum_err: f64,
    norm_err: f64,
    pass: bool,
}

/// `twell_mlp_norm_add_norm` (the norm before the MLP folded into the weights and the
/// up kernel) against the unfolded launches: `rms_norm(s) · alpha_pre`, `twell_mlp`,
/// `add_rms_norm`. The residual sums `s` are the synthetic input at three times its
/// scale (the norm undoes it).
fn check_mlp_norm_add_norm(
    dev: &Device,
    (m, d, f, density): (usize, usize, usize, f64),
    paths: KernelPaths,
    seed: u64,
) -> Result<MlpNormAddNormResult> {
    let (config, w, x) = case_inputs(dev, (m, d, f, density, 256, 8), paths, seed)?;
    dev.set_seed(seed)?;
    let s = (x * 3.0)?;
    let pre_alpha = Tensor::randn(1f32, 0.1, d, dev)?.to_dtype(DType::BF16)?;
    let alpha = Tensor::randn(1f32, 0.1, d, dev)?.to_dtype(DType::BF16)?;
    let eps = 1e-5;
    if !twell::norm_add_norm_runs(&s, f, config) {
        bail!("mlp with both norms folded ({m} rows, d {d}) would not run on this device");
    }
    let fold = |t: &Tensor| -> Result<Tensor> {
        Ok(t.to_dtype(DType::F32)?
            .broadcast_mul(&pre_alpha.to_dtype(DType::F32)?)?
            .to_dtype(DType::BF16)?)
    };
    let folded_ud = up_down_matrix(&fold(&w.up)?, &w.down)?;
    let (sum, normed) = twell::twell_mlp_norm_add_norm(
        &s,
        &fold(&w.gate)?,
        &folded_ud,
        config,
        eps,
        (&alpha, eps),
    )?;
    let hm = candle_nn::ops::rms_norm(&s, &pre_alpha, eps as f32)?;
    let out = twell_mlp(&hm, &w.gate, &up_down_matrix(&w.up, &w.down)?, config)?.out;
    let (want_sum, want_normed) = fused_ops::add_rms_norm(&s, &out, &alpha, eps)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let s32 = f32(&s)?;
    let hm32 = candle_nn::ops::rms_norm_slow(&s32, &f32(&pre_alpha)?, eps as f32)?;
    let h32 = (hm32.matmul(&f32(&w.gate)?.t()?)?.relu()? * hm32.matmul(&f32(&w.up)?.t()?)?)?;
    let out32 = h32.matmul(&f32(&w.down)?.t()?)?;
    let mlp_err = rel_l2(&(f32(&sum)? - &s32)?, &out32)?;
    let unfolded_mlp_err = rel_l2(&(f32(&want_sum)? - &s32)?, &out32)?;
    let (sum_err, norm_err) = (rel_l2(&sum, &want_sum)?, rel_l2(&normed, &want_normed)?);
    Ok(MlpNormAddNormResult {
        m,
        d,
        f,
        target_density: density,
        mlp_err,
        unfolded_mlp_err,
        sum_err,
        norm_err,
        pass: mlp_err <= 1.25 * unfolded_mlp_err + 2e-3
            && sum_err < TOLERANCE
            && norm_err < TOLERANCE,
    })
}

/// `(M, hidden, d_ff, density, tile, compression)`: one token of several shapes (the
/// one-launch decode kernel, also a nearly dense FFN with overflowing tiles), 2–16 rows
/// (the few-row kernel at each of its row bounds and vector counts, rows not a power of
/// two, a d_ff no warp count divides, neuron lists that overflow, its gate bound), the
/// staged kernels' 2–64 rows (hidden past 2048, past the few-row kernel's gate bound,
/// 17–64 rows) and just past them, M not a multiple of any
/// tile, tiles of two and four mask words with overflow, a d_ff that ends inside a mask
/// word, a d_ff of one tile at 17–64 rows (whose staged down writes its rows itself), and
/// M past 65,536.
#[rustfmt::skip]
const FORWARD_CASES: &[Case] = &[
    (1, 2048, 5632, 0.01, 256, 8),
    (1, 576, 1536, 0.05, 256, 8),
    (1, 4096, 11008, 0.03, 256, 8),
    (1, 512, 24576, 0.9, 256, 8),
    (2, 2048, 5632, 0.005, 256, 8),
    (3, 576, 1536, 0.05, 256, 8),
    (4, 64, 250, 0.3, 256, 8),
    (5, 1024, 2816, 0.01, 256, 8),
    (4, 2048, 8192, 0.5, 256, 8),
    (4, 256, 65536, 0.5, 256, 8),
    (13, 896, 4864, 0.03, 128, 4),
    (16, 576, 1536, 0.5, 256, 8),
    (16, 8, 40, 0.3, 256, 8),
    (8, 2048, 5632, 0.01, 256, 8),
    (17, 2048, 5632, 0.01, 256, 8),
    (7, 4096, 11008, 0.005, 256, 8),
    (33, 576, 1000, 0.05, 256, 8),
    (20, 64, 200, 0.3, 256, 8),
    (40, 576, 256, 0.05, 256, 8),
    (64, 2048, 5632, 0.03, 256, 8),
    (65, 2048, 5632, 0.03, 256, 8),
    (513, 2048, 5632, 0.1, 32, 8),
    (300, 1024, 1000, 0.2, 64, 4),
    (777, 576, 1536, 0.08, 128, 2),
    (1000, 576, 1536, 0.001, 256, 8),
    (2048, 2048, 5632, 0.01, 256, 8),
    (2048, 2048, 5632, 0.5, 256, 8),
    (4096, 4096, 11008, 0.03, 256, 4),
    (16384, 2048, 5632, 0.3, 256, 8),
    (131072, 576, 1536, 0.02, 256, 8),
];

/// Every forward case on `path` with `paths`; fails with the cases that missed.
fn assert_forward_cases(path: ForwardPath, paths: KernelPaths) {
    assert_cases(FORWARD_CASES, path, [paths], 100);
}

/// `cases` on `path` with each of `paths` (case `k` seeded `seed + k`); fails with the
/// cases that missed.
fn assert_cases(
    cases: &[Case],
    path: ForwardPath,
    paths: impl IntoIterator<Item = KernelPaths>,
    seed: u64,
) {
    let dev = gpu();
    for paths in paths {
        eprintln!("{path:?} {paths:?}");
        assert_all_pass!(cases.iter().enumerate().map(|(k, &case)| check_case(
            &dev,
            case,
            path,
            paths,
            seed + k as u64
        )
        .unwrap()));
    }
}

#[test]
fn forward_matches_f32_on_the_default_kernels() {
    assert_forward_cases(ForwardPath::Pairs, KernelPaths::default());
}

#[test]
fn forward_matches_f32_with_the_row_kernels_on_slots() {
    let paths = KernelPaths {
        walk: RowWalk::Slots,
        ..Default::default()
    };
    assert_forward_cases(ForwardPath::Pairs, paths);
}

#[test]
fn forward_matches_f32_with_the_masked_gate_at_every_size() {
    for walk in [RowWalk::Mask, RowWalk::Slots] {
        let paths = KernelPaths {
            gate: GateGemm::Masked,
            walk,
            ..Default::default()
        };
        assert_forward_cases(ForwardPath::Pairs, paths);
    }
}

#[test]
fn forward_matches_f32_with_the_plain_gate_at_every_size() {
    let paths = KernelPaths {
        gate: GateGemm::Plain,
        ..Default::default()
    };
    assert_forward_cases(ForwardPath::Pairs, paths);
}

#[test]
fn products_forward_matches_f32() {
    assert_forward_cases(ForwardPath::Products, KernelPaths::default());
}

#[test]
fn auto_at_thirty_percent_density_settles_on_a_dense_side() {
    let (err, sparse) = check_auto_dense_side(&gpu()).unwrap();
    assert!(!sparse, "Auto ran the TwELL kernels at 30% density");
    assert!(
        err < TOLERANCE,
        "rel err {err:.2e} against candle's dense MLP"
    );
}

/// Both row walks, with the row kernels at 2 to 64 rows (where `StagedRows::Auto` may take
/// the slot kernels, which fold no norm), and the spread kernels at 2 to 64 rows.
const WALKS: [KernelPaths; 3] = [
    KernelPaths {
        gate: GateGemm::Auto,
        walk: RowWalk::Mask,
        few_rows: FewRows::Auto,
        staged_rows: StagedRows::RowKernels,
    },
    KernelPaths {
        gate: GateGemm::Auto,
        walk: RowWalk::Slots,
        few_rows: FewRows::Auto,
        staged_rows: StagedRows::RowKernels,
    },
    KernelPaths {
        gate: GateGemm::Auto,
        walk: RowWalk::Mask,
        few_rows: FewRows::Staged,
        staged_rows: StagedRows::SpreadKernels,
    },
];

/// 2 to 64 rows with each form of the staged kernels forced (and the few-row kernel off),
/// against f32: a row over eight warps (its parts' sums in shared memory past the default
/// 48 KB from hidden 2048), the spread kernels' chunks of 32-256 neurons a warp, hidden 64
/// to 8192 (past 4096 the slot kernels either way), rows not a power of two, a d_ff of one
/// tile, one that ends inside a tile and one that is not a multiple of 8 (the slot
/// kernels then), tiles of 128 neurons, overflowing tiles.
#[test]
fn forward_matches_f32_on_each_form_of_the_staged_kernels_at_decode_sizes() {
    #[rustfmt::skip]
    let cases: &[Case] = &[
        (2, 64, 250, 0.3, 256, 8),
        (3, 576, 1536, 0.05, 256, 8),
        (9, 2048, 5632, 0.005, 256, 8),
        (16, 3072, 8192, 0.01, 256, 8),
        (17, 2048, 5632, 0.03, 256, 8),
        (24, 4096, 14336, 0.005, 256, 8),
        (33, 576, 1000, 0.05, 128, 4),
        (40, 576, 256, 0.05, 256, 8),
        (64, 2048, 5632, 0.5, 256, 8),
        (64, 4096, 11008, 0.01, 256, 8),
        (50, 5120, 13824, 0.01, 256, 8),
        (8, 8192, 28672, 0.005, 256, 8),
        (32, 2048, 5632, 0.01, 256, 8),
        (20, 1024, 4096, 0.05, 64, 4),
        (6, 512, 2048, 0.1, 32, 2),
    ];
    let forms = [
        StagedRows::RowKernels,
        StagedRows::SlotKernels,
        StagedRows::SpreadKernels,
    ]
    .map(|staged_rows| KernelPaths {
        few_rows: FewRows::Staged,
        staged_rows,
        ..Default::default()
    });
    assert_cases(cases, ForwardPath::Pairs, forms, 1900);
}

/// Each kernel of 2 to 16 rows forced: the tensor-core gates, the CUDA-core gates, the
/// staged kernels.
const FEW_ROW_KERNELS: [FewRows; 3] = [FewRows::TensorCores, FewRows::CudaCores, FewRows::Staged];

/// 2-16 rows with each few-row kernel forced, against f32: one and two n-tiles of rows,
/// rows not a power of two, hidden 64 to 8192 (the CUDA-core kernel takes up to 2048, the
/// staged kernels the rest), hidden not a multiple of 32 (the tensor-core kernel's
/// fallback), a d_ff that no 16-neuron group divides, densities whose neuron lists
/// overflow and flush, and overflowing tiles.
#[test]
fn forward_matches_f32_on_each_few_row_kernel() {
    #[rustfmt::skip]
    let cases: &[Case] = &[
        (2, 64, 250, 0.3, 256, 8),
        (3, 576, 1536, 0.05, 256, 8),
        (8, 2048, 5632, 0.01, 256, 8),
        (9, 896, 4864, 0.03, 128, 4),
        (16, 2048, 5632, 0.5, 256, 8),
        (5, 1000, 3000, 0.3, 256, 8),
        (4, 256, 65536, 0.5, 256, 8),
        (7, 3072, 8200, 0.03, 256, 8),
        (16, 4096, 14336, 0.005, 256, 8),
        (16, 5120, 13824, 0.3, 256, 8),
        (12, 8192, 28672, 0.005, 256, 8),
    ];
    let kernels = FEW_ROW_KERNELS.map(|few_rows| KernelPaths {
        few_rows,
        ..Default::default()
    });
    assert_cases(cases, ForwardPath::Pairs, kernels, 1700);
}

#[test]
fn the_add_and_norm_folded_into_the_tensor_core_few_row_kernel_match_the_separate_launches() {
    // (m, d, d_ff, density): each finishing width (hidden up to 2048, 4096, 8192), one and
    // two n-tiles of rows, lists that flush.
    #[rustfmt::skip]
    let cases = [
        (2, 576, 1536, 0.05), (8, 2048, 5632, 0.01), (11, 4096, 14336, 0.005),
        (16, 8192, 28672, 0.005), (16, 2048, 5632, 0.5),
    ];
    let paths = KernelPaths {
        few_rows: FewRows::TensorCores,
        ..Default::default()
    };
    let dev = gpu();
    assert_all_pass!(cases
        .iter()
        .enumerate()
        .map(|(k, &dims)| check_mlp_add_norm(&dev, dims, paths, 1800 + k as u64).unwrap()));
}

#[test]
fn the_add_and_norm_folded_into_the_mlp_match_the_separate_launches() {
    // (m, d, d_ff, density): one token (the one-launch decode kernel, also with the norm
    // before the MLP), 2-16 rows (the few-row kernel, lists overflowing), then prefill rows (the down row kernel's epilogue): four warps a
    // row, a warp a row, past 65,536 rows, d up to 4096, overflowing tiles.
    #[rustfmt::skip]
    let cases = [
        (1, 2048, 5632, 0.01), (1, 576, 1536, 0.05), (1, 4096, 11008, 0.03),
        (1, 2048, 5632, 0.5), (2, 2048, 5632, 0.01), (7, 576, 1536, 0.05),
        (16, 576, 1536, 0.5), (4, 256, 65536, 0.5), (17, 2048, 5632, 0.01), (5, 3072, 8192, 0.03),
        (64, 4096, 11008, 0.005), (40, 576, 1536, 0.3), (65, 2048, 5632, 0.01), (333, 576, 1536, 0.05),
        (8192, 2048, 5632, 0.005), (70_000, 2048, 5632, 0.01), (300, 4096, 11008, 0.03),
        (1000, 2048, 5632, 0.5),
    ];
    let dev = gpu();
    for paths in WALKS {
        eprintln!("{paths:?}");
        assert_all_pass!(cases
            .iter()
            .enumerate()
            .map(|(k, &dims)| check_mlp_add_norm(&dev, dims, paths, 960 + k as u64).unwrap()));
    }
}

#[test]
fn the_norm_before_the_mlp_folded_into_its_weights_matches_the_separate_launches() {
    // (m, d, d_ff, density): 2-64 rows (a row over eight warps; the few-row
    // kernel's sizes past its bound), four warps a row and one, past 65,536 rows, d 4096,
    // overflowing tiles.
    #[rustfmt::skip]
    let cases = [
        (17, 2048, 5632, 0.01), (5, 3072, 8192, 0.03), (64, 4096, 11008, 0.005),
        (40, 576, 1536, 0.3), (16, 2048, 8192, 0.01), (333, 576, 1536, 0.05), (8192, 2048, 5632, 0.005), (70_000, 2048, 5632, 0.01),
        (300, 4096, 11008, 0.03), (1000, 2048, 5632, 0.5),
    ];
    let dev = gpu();
    for paths in WALKS {
        eprintln!("{paths:?}");
        assert_all_pass!(cases.iter().enumerate().map(|(k, &dims)| {
            check_mlp_norm_add_norm(&dev, dims, paths, 1400 + k as u64).unwrap()
        }));
    }
}

#[test]
fn backward_matches_f32_autograd_on_every_path() {
    #[rustfmt::skip]
    let cases: &[Case] = &[
        (1, 2048, 5632, 0.01, 256, 8),
        (96, 256, 1024, 0.05, 256, 8),
        (33, 576, 1000, 0.05, 256, 8),
        (513, 2048, 5632, 0.1, 32, 8),
        (4096, 4096, 11008, 0.03, 256, 4),
        (16384, 2048, 5632, 0.005, 256, 8),
        (131072, 576, 1536, 0.02, 256, 8),
    ];
    let paths = [
        twell::BackwardPath::Sparse,
        twell::BackwardPath::DenseDx,
        twell::BackwardPath::Dense,
    ];
    let dev = gpu();
    assert_all_pass!(cases.iter().enumerate().flat_map(|(k, &case)| {
        let dev = &dev;
        paths.map(move |path| check_backward(dev, case, path, 500 + k as u64).unwrap())
    }));
}

#[test]
fn bf16_steps_counts_spacings_at_each_magnitude() -> anyhow::Result<()> {
    let t = |v: &[f32]| Tensor::new(v, &Device::Cpu)?.to_dtype(DType::BF16);
    // 4.0 and its bf16 neighbour above (spacing 2^-5 in [4, 8)); 1.0 against 1.0.
    let a = t(&[4.0, 1.0, -3.0])?;
    assert_eq!(bf16_steps(&a, &a)?, 0.0);
    assert_eq!(bf16_steps(&a, &t(&[4.03125, 1.0, -3.0])?)?, 1.0);
    // Two steps below -3.0 (spacing 2^-6 in [2, 4)).
    assert_eq!(bf16_steps(&a, &t(&[4.0, 1.0, -3.03125])?)?, 2.0);
    // A value against zero is never within a step.
    assert!(bf16_steps(&t(&[0.0])?, &t(&[1.0])?)? >= 1.0);
    // Near zero, a step of terms of magnitude 4 is one step, not hundreds.
    let near_zero = (t(&[0.03125])?, t(&[0.0])?);
    assert!(bf16_steps(&near_zero.0, &near_zero.1)? > 100.0);
    assert_eq!(bf16_steps_at(&near_zero.0, &near_zero.1, &t(&[4.0])?)?, 1.0);
    Ok(())
}

/// The decode kernels add their neurons with atomics from every block: their sums are
/// fixed point so that the order does not show. The row kernels at decode sizes add a
/// row's parts in a fixed order. Twenty launches of each form (plain, with the add and
/// norm after it, for one row also with the norm before it folded in) give the same bits,
/// for one row and for a few, at a density whose neuron lists overflow.
#[test]
fn the_decode_kernels_give_the_same_bits_every_launch() {
    let dev = gpu();
    let paths = |few_rows, staged_rows| KernelPaths {
        few_rows,
        staged_rows,
        ..Default::default()
    };
    let (cuda_cores, tensor_cores, staged) =
        (FewRows::CudaCores, FewRows::TensorCores, FewRows::Staged);
    let auto = paths(FewRows::Auto, StagedRows::Auto);
    let rows = StagedRows::RowKernels;
    let cases = [
        (1, 2048, 5632, 0.01, auto),
        (1, 576, 1536, 0.05, auto),
        (1, 2048, 5632, 0.5, auto),
        (4, 2048, 5632, 0.01, paths(cuda_cores, rows)),
        (16, 576, 1536, 0.05, paths(cuda_cores, rows)),
        (3, 256, 65536, 0.5, paths(cuda_cores, rows)),
        (4, 2048, 5632, 0.01, paths(tensor_cores, rows)),
        (16, 4096, 14336, 0.3, paths(tensor_cores, rows)),
        (24, 2048, 5632, 0.01, paths(staged, rows)),
        (6, 4096, 11008, 0.3, paths(staged, rows)),
    ];
    for (k, &(m, d, f, density, paths)) in cases.iter().enumerate() {
        let seed = 1200 + k as u64;
        let (config, w, x) = case_inputs(&dev, (m, d, f, density, 256, 8), paths, seed).unwrap();
        dev.set_seed(seed).unwrap();
        let residual = Tensor::randn(0f32, 1.0, (m, d), &dev)
            .and_then(|t| t.to_dtype(DType::BF16))
            .unwrap();
        let alpha = Tensor::randn(1f32, 0.1, d, &dev)
            .and_then(|t| t.to_dtype(DType::BF16))
            .unwrap();
        let w_ud = up_down_matrix(&w.up, &w.down).unwrap();
        let launch = || -> Result<Vec<Tensor>> {
            let out = twell_mlp(&x, &w.gate, &w_ud, config)?.out;
            let norm = (&residual, &alpha, 1e-5);
            let (s1, n1) = twell::twell_mlp_add_norm(&x, &w.gate, &w_ud, config, norm, None)?;
            let mut all = vec![out, s1, n1];
            if m == 1 {
                let pre = Some((&alpha, 1e-5));
                let (s2, n2) = twell::twell_mlp_add_norm(&x, &w.gate, &w_ud, config, norm, pre)?;
                all.extend([s2, n2]);
            }
            Ok(all)
        };
        let bits = |t: &Tensor| -> Vec<u16> {
            t.flatten_all()
                .and_then(|t| t.to_dtype(DType::BF16))
                .and_then(|t| t.to_vec1::<half::bf16>())
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        let first = launch().unwrap();
        for run in 1..20 {
            for (i, (a, b)) in first.iter().zip(launch().unwrap()).enumerate() {
                assert_eq!(
                    bits(a),
                    bits(&b),
                    "{m} rows, d {d}, d_ff {f}, density {density}, {paths:?}: output {i} of run \
                     {run} differs"
                );
            }
        }
        eprintln!(
            "{m} rows, d {d}, d_ff {f}, density {density}, {paths:?}: 20 launches, the same bits"
        );
    }
}
