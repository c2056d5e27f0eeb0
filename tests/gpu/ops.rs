//! The transformer ops around the MLP on the GPU: the residual add and RMS norm, the
//! residual GEMM, RoPE, the losses over the vocabulary, the smooth gate count, AdamW and
//! the embedding's backward, each against candle's ops or the CPU path.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};

use super::{gpu, rel_l2, TOLERANCE};

#[derive(Debug)]
struct NormResult {
    /// `(M, d)`.
    dims: (usize, usize),
    /// The sums against candle's add (bit-exact expected) and the normalised rows
    /// against candle's `rms_norm` of them.
    sum_err: f64,
    norm_err: f64,
    /// The backward kernel's dx, dy and dalpha against candle's autograd in f32.
    grad_err: [f64; 3],
    on_device: bool,
    pass: bool,
}

#[derive(Debug)]
struct ResidualLinearResult {
    /// `(m, n, k)`.
    dims: (usize, usize, usize),
    /// Against `residual + y · Wᵀ` in f32; and whether the residual tensor given holds
    /// the sum (written in place).
    err: f64,
    in_place: bool,
    pass: bool,
}

/// `residual_add_linear` (one cuBLAS GEMM with the residual as C) against f32 candle ops.
fn check_residual_add_linear(
    dev: &Device,
    (m, n, k): (usize, usize, usize),
    seed: u64,
) -> Result<ResidualLinearResult> {
    dev.set_seed(seed)?;
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    let residual = bf(Tensor::randn(0f32, 1.0, (m, n), dev)?)?;
    let y = bf(Tensor::randn(0f32, 1.0, (m, k), dev)?)?;
    let w = bf((Tensor::randn(0f32, 1.0, (n, k), dev)? / (k as f64).sqrt())?)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let want = (f32(&residual)? + f32(&y)?.matmul(&f32(&w)?.t()?)?)?;
    let alias = residual.clone();
    let got = fused_ops::residual_add_linear(residual, &y, &w)?;
    let err = rel_l2(&got, &want)?;
    let in_place = rel_l2(&alias, &got)? == 0.0;
    Ok(ResidualLinearResult {
        dims: (m, n, k),
        err,
        in_place,
        pass: err < 1e-2 && in_place,
    })
}

#[derive(Debug)]
struct LinearRowsResult {
    /// `(m, n, k)`.
    dims: (usize, usize, usize),
    /// Against `x · Wᵀ` in f32, and against candle's bf16 matmul (cuBLAS).
    err: f64,
    err_cublas: f64,
    finite: bool,
    pass: bool,
}

/// `linear_rows` (the few-row kernel) against f32 candle ops and cuBLAS in bf16.
fn check_linear_rows(
    dev: &Device,
    (m, n, k): (usize, usize, usize),
    seed: u64,
) -> Result<LinearRowsResult> {
    dev.set_seed(seed)?;
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    let x = bf(Tensor::randn(0f32, 1.0, (m, k), dev)?)?;
    let w = bf((Tensor::randn(0f32, 1.0, (n, k), dev)? / (k as f64).sqrt())?)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let want = f32(&x)?.matmul(&f32(&w)?.t()?)?;
    let got = fused_ops::linear_rows(&x, &w)?;
    let cublas = x.matmul(&w.t()?)?;
    let finite = f32(&got)?.sum_all()?.to_scalar::<f32>()?.is_finite();
    let (err, err_cublas) = (rel_l2(&got, &want)?, rel_l2(&got, &cublas)?);
    Ok(LinearRowsResult {
        dims: (m, n, k),
        err,
        err_cublas,
        finite,
        pass: got.dims() == [m, n] && finite && err < 1e-2 && err_cublas < 1e-2,
    })
}

/// The fused residual add + RMS norm (bf16) and its backward against candle's ops on
/// the GPU.
fn check_add_rms_norm(dev: &Device, (m, d): (usize, usize), seed: u64) -> Result<NormResult> {
    dev.set_seed(seed)?;
    let x = Tensor::randn(0f32, 1.0, (m, d), dev)?.to_dtype(DType::BF16)?;
    let y = Tensor::randn(0f32, 1.0, (m, d), dev)?.to_dtype(DType::BF16)?;
    let alpha = Tensor::randn(1f32, 0.1, d, dev)?.to_dtype(DType::BF16)?;
    let eps = 1e-5;
    let both = x.apply_op3_no_bwd(&y, &alpha, &fused_ops::AddRmsNorm::new(eps))?;
    let on_device = both.device().is_cuda();
    let sum = (&x + &y)?;
    let normed = candle_nn::ops::rms_norm(&sum, &alpha, eps as f32)?;
    let sum_err = rel_l2(&both.narrow(0, 0, m)?, &sum)?;
    let norm_err = rel_l2(&both.narrow(0, m, m)?, &normed)?;
    // The backward kernel against candle's differentiable ops in f32, for the loss
    // `Σ sum ⊙ p0 + Σ normed ⊙ p1`.
    let probes = [
        Tensor::randn(0f32, 1.0, (m, d), dev)?,
        Tensor::randn(0f32, 1.0, (m, d), dev)?,
    ];
    let gradients = |fused: bool| -> Result<Vec<Tensor>> {
        let dtype = if fused { DType::BF16 } else { DType::F32 };
        let vars = [&x, &y, &alpha]
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(dtype)?))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let (a, b, c) = (
            vars[0].as_tensor(),
            vars[1].as_tensor(),
            vars[2].as_tensor(),
        );
        let (sum, normed) = if fused {
            fused_ops::add_rms_norm(a, b, c, eps)?
        } else {
            let sum = (a + b)?;
            let normed = candle_nn::ops::rms_norm_slow(&sum, c, eps as f32)?;
            (sum, normed)
        };
        let loss = ((sum.to_dtype(DType::F32)? * &probes[0])?.sum_all()?
            + (normed.to_dtype(DType::F32)? * &probes[1])?.sum_all()?)?;
        let grads = loss.backward()?;
        vars.iter()
            .map(|v| grads.get(v.as_tensor()).cloned().context("no gradient"))
            .collect()
    };
    let (fused, plain) = (gradients(true)?, gradients(false)?);
    let mut grad_err = [0f64; 3];
    for (e, (a, r)) in grad_err.iter_mut().zip(fused.iter().zip(&plain)) {
        *e = rel_l2(a, r)?;
    }
    Ok(NormResult {
        dims: (m, d),
        sum_err,
        norm_err,
        grad_err,
        on_device,
        pass: on_device
            && sum_err == 0.0
            && norm_err < TOLERANCE
            && grad_err.iter().all(|&e| e < TOLERANCE),
    })
}

#[derive(Debug)]
struct RopeResult {
    /// `(b, t, heads, hd)`.
    dims: (usize, usize, usize, usize),
    /// Against candle's `rope_thd` (bf16 arithmetic there, f32 here).
    err: f64,
    /// The gradient against candle's `rope_slow` autograd in f32.
    grad_err: f64,
    pass: bool,
}

/// Our RoPE kernel and its backward against candle's on the GPU.
fn check_rope(dev: &Device, dims: (usize, usize, usize, usize), seed: u64) -> Result<RopeResult> {
    let (b, t, heads, hd) = dims;
    dev.set_seed(seed)?;
    let x = Tensor::randn(0f32, 1.0, (b, t, heads, hd), dev)?.to_dtype(DType::BF16)?;
    let angles = Tensor::rand(0f32, 6.3, (t, hd / 2), dev)?;
    let (cos, sin) = (
        angles.cos()?.to_dtype(DType::BF16)?,
        angles.sin()?.to_dtype(DType::BF16)?,
    );
    let table = fused_ops::RopeTable::new(&cos, &sin)?;
    let got = x.apply_op2_no_bwd(&table.cos_sin, &fused_ops::Rope)?;
    let err = rel_l2(&got, &candle_nn::rotary_emb::rope_thd(&x, &cos, &sin)?)?;
    // The backward (the transposed rotation) against candle's differentiable form.
    let probe = Tensor::randn(0f32, 1.0, (b, t, heads, hd), dev)?;
    let grad = |rotate: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>| -> Result<Tensor> {
        let var = Var::from_tensor(&x)?;
        let out = rotate(var.as_tensor())?.to_dtype(DType::F32)?;
        let grads = (out * &probe)?.sum_all()?.backward()?;
        grads.get(var.as_tensor()).cloned().context("no gradient")
    };
    let grad_err = rel_l2(
        &grad(&|x| fused_ops::rope(x, &table))?,
        &grad(&|x| {
            let heads_first = x.transpose(1, 2)?.contiguous()?.to_dtype(DType::F32)?;
            let (c, s) = (cos.to_dtype(DType::F32)?, sin.to_dtype(DType::F32)?);
            candle_nn::rotary_emb::rope_slow(&heads_first, &c, &s)?.transpose(1, 2)
        })?,
    )?;
    Ok(RopeResult {
        dims,
        err,
        grad_err,
        pass: got.device().is_cuda() && err < TOLERANCE && grad_err < TOLERANCE,
    })
}

/// The embedding's weight gradient on the GPU (bf16, the one-pass kernel) against
/// candle's `index_add` in f32 on the CPU, for `tokens` ids drawn from `vocab` (many
/// repeated, so the atomics meet). Relative error.
fn check_embedding(
    dev: &Device,
    (tokens, vocab, d): (usize, usize, usize),
    seed: u64,
) -> Result<f64> {
    dev.set_seed(seed)?;
    let w = Tensor::randn(0f32, 1.0, (vocab, d), dev)?;
    let ids = uniform_ids(tokens, vocab, dev)?;
    let probe = Tensor::randn(0f32, 1.0, (tokens, d), dev)?;
    let grad = |device: &Device, dtype: DType| -> Result<Tensor> {
        let var = Var::from_tensor(&w.to_device(device)?.to_dtype(dtype)?)?;
        let out = fused_ops::embedding(&ids.to_device(device)?, var.as_tensor())?;
        let loss = (out.to_dtype(DType::F32)? * probe.to_device(device)?)?.sum_all()?;
        let g = loss.backward()?;
        Ok(g.get(var.as_tensor())
            .context("no gradient")?
            .to_device(&Device::Cpu)?)
    };
    rel_l2(&grad(dev, DType::BF16)?, &grad(&Device::Cpu, DType::F32)?)
}

/// A fused loss over `[N, V]` logits against its reference, value and gradient.
#[derive(Debug)]
struct LossResult {
    /// `(N, V)`.
    dims: (usize, usize),
    loss_err: f64,
    grad_err: f64,
    pass: bool,
}

/// A loss of logits `[N, V]` and its gradient, fused in bf16 (`fused`) or the
/// reference in f32: the value and the logits' gradient.
type LossRun<'a> = dyn Fn(bool) -> Result<(f64, Tensor)> + 'a;

/// The value and the gradient in `var` of a scalar `loss`.
fn value_and_grad(loss: &Tensor, var: &Var) -> Result<(f64, Tensor)> {
    let value = loss.to_scalar::<f32>()? as f64;
    let grads = loss.backward()?;
    let grad = grads.get(var.as_tensor()).cloned().context("no gradient")?;
    Ok((value, grad))
}

/// The fused run of a loss against its reference.
fn compare_losses(dims: (usize, usize), run: &LossRun) -> Result<LossResult> {
    let ((got, g), (want, w)) = (run(true)?, run(false)?);
    let loss_err = ((got - want) / want).abs();
    let grad_err = rel_l2(&g, &w)?;
    Ok(LossResult {
        dims,
        loss_err,
        grad_err,
        pass: loss_err < TOLERANCE && grad_err < TOLERANCE,
    })
}

/// `n` ids drawn uniformly from `0..classes` with the device's seeded rng, as u32.
fn uniform_ids(n: usize, classes: usize, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::rand(0f32, classes as f32, n, dev)?
        .floor()?
        .clamp(0f32, (classes - 1) as f32)?
        .to_dtype(DType::U32)?)
}

/// The fused cross-entropy (bf16 logits) and its backward against candle's
/// `loss::cross_entropy` on f32 logits, on the GPU.
fn check_cross_entropy(dev: &Device, (n, v): (usize, usize), seed: u64) -> Result<LossResult> {
    dev.set_seed(seed)?;
    let logits = (Tensor::randn(0f32, 1.0, (n, v), dev)? * 3.0)?;
    let targets = uniform_ids(n, v, dev)?;
    compare_losses((n, v), &|fused| {
        let var =
            Var::from_tensor(&logits.to_dtype(if fused { DType::BF16 } else { DType::F32 })?)?;
        let loss = if fused {
            fused_ops::cross_entropy(var.as_tensor(), &targets)?
        } else {
            candle_nn::loss::cross_entropy(var.as_tensor(), &targets)?
        };
        value_and_grad(&loss, &var)
    })
}

/// The fused distillation loss (bf16 student logits, a `teacher_dtype` teacher) and its
/// backward against the same loss as candle ops in f32, on the GPU. Both sides get the
/// same inputs: the student rounded to bf16, the teacher rounded to `teacher_dtype`
/// (rounding a peaked teacher moves its probabilities by a few percent, which is not
/// the kernel's error).
fn check_kl_divergence(
    dev: &Device,
    (n, v): (usize, usize),
    seed: u64,
    teacher_dtype: DType,
) -> Result<LossResult> {
    dev.set_seed(seed)?;
    let student = (Tensor::randn(0f32, 1.0, (n, v), dev)? * 3.0)?.to_dtype(DType::BF16)?;
    let teacher = (Tensor::randn(0f32, 1.0, (n, v), dev)? * 4.0)?.to_dtype(teacher_dtype)?;
    compare_losses((n, v), &|fused| {
        let (var, t) = if fused {
            (Var::from_tensor(&student)?, teacher.clone())
        } else {
            (
                Var::from_tensor(&student.to_dtype(DType::F32)?)?,
                teacher.to_dtype(DType::F32)?,
            )
        };
        let loss = if fused {
            fused_ops::kl_divergence_fused(var.as_tensor(), &t)?
        } else {
            fused_ops::kl_divergence_reference(var.as_tensor(), &t)?
        };
        value_and_grad(&loss, &var)
    })
}

#[derive(Debug)]
struct GateL0Result {
    /// `(N, f)`.
    dims: (usize, usize),
    /// Relative errors of the counts and of the gradients in the gates, the token norms
    /// and the gate-row norms.
    err: [f64; 4],
    pass: bool,
}

/// The fused smooth gate count (bf16 gates) and its backward against the same term as
/// candle ops in f32, on the GPU: the counts, weighted by a random vector, are
/// differentiated in all three inputs.
fn check_gate_l0(dev: &Device, (n, f): (usize, usize), seed: u64) -> Result<GateL0Result> {
    dev.set_seed(seed)?;
    // In bf16, for both sides. A gate of exactly 0 sits on the kink, where the op takes
    // the subgradient 0 and candle's relu the right-hand slope (one such gate among
    // millions moves the relative error by about 1e-2): those are moved to 1.
    let gate = Tensor::randn(0f32, 1.0, (n, f), dev)?.to_dtype(DType::BF16)?;
    let on_kink = gate.eq(0f64)?;
    let gate = on_kink.where_cond(&gate.ones_like()?, &gate)?;
    let x_norm = (Tensor::rand(0f32, 1.0, n, dev)? + 2.0)?;
    let w_norm = (Tensor::rand(0f32, 1.0, f, dev)? + 0.5)?;
    let weights = Tensor::randn(0f32, 1.0, n, dev)?;
    let scale = (f as f64).sqrt();
    let run = |fused: bool| -> Result<Vec<Tensor>> {
        let dtype = if fused { DType::BF16 } else { DType::F32 };
        let g = Var::from_tensor(&gate.to_dtype(dtype)?)?;
        let (xn, wn) = (Var::from_tensor(&x_norm)?, Var::from_tensor(&w_norm)?);
        let count = if fused {
            twell::gate_l0(g.as_tensor(), xn.as_tensor(), wn.as_tensor(), scale, 0.1)?
        } else {
            twell::gate_l0_reference(g.as_tensor(), xn.as_tensor(), wn.as_tensor(), scale, 0.1)?
        };
        let grads = (&count * &weights)?.sum_all()?.backward()?;
        let mut out = vec![count];
        for v in [&g, &xn, &wn] {
            out.push(
                grads
                    .get(v.as_tensor())
                    .context("no gradient")?
                    .to_dtype(DType::F32)?,
            );
        }
        Ok(out)
    };
    let (got, want) = (run(true)?, run(false)?);
    let mut err = [0f64; 4];
    for (e, (a, b)) in err.iter_mut().zip(got.iter().zip(&want)) {
        *e = rel_l2(a, b)?;
    }
    Ok(GateL0Result {
        dims: (n, f),
        err,
        pass: err.iter().all(|&e| e < TOLERANCE),
    })
}

/// The AdamW checks' hyper-parameters at `step`.
fn adamw_hp(step: usize) -> fused_ops::AdamwStep {
    fused_ops::AdamwStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step,
        grad_scale: 0.7,
    }
}

/// The in-place AdamW kernels against the same op on the CPU: three steps on one
/// parameter of `n` elements (odd, past one grid of blocks); relative error of the
/// parameter and both moments.
fn check_adamw(dev: &Device, n: usize, seed: u64) -> Result<[f64; 3]> {
    dev.set_seed(seed)?;
    let init = Tensor::randn(0f32, 1.0, n, dev)?;
    let grads = (0..3)
        .map(|_| Tensor::randn(0f32, 1.0, n, dev))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let run = |device: &Device| -> Result<Vec<Tensor>> {
        let p = Var::from_tensor(&init.to_device(device)?)?;
        let (m, v) = (p.zeros_like()?, p.zeros_like()?);
        for (k, g) in grads.iter().enumerate() {
            fused_ops::adamw_step(
                p.as_tensor(),
                &g.to_device(device)?,
                &m,
                &v,
                adamw_hp(k + 1),
            )?;
        }
        [p.as_tensor(), &m, &v]
            .iter()
            .map(|t| Ok(t.to_device(&Device::Cpu)?))
            .collect()
    };
    let (gpu, cpu) = (run(dev)?, run(&Device::Cpu)?);
    let mut err = [0f64; 3];
    for (e, (a, b)) in err.iter_mut().zip(gpu.iter().zip(&cpu)) {
        *e = rel_l2(a, b)?;
    }
    Ok(err)
}

/// The mixed-precision AdamW kernels (bf16 variable, `[3, n]` f32 master and moments,
/// a bf16 gradient) against the same op on the CPU: relative error of the master, m, v
/// and the bf16 variable after three steps, and of the gradient's sum of squares.
fn check_adamw_mixed(dev: &Device, n: usize, seed: u64) -> Result<[f64; 5]> {
    dev.set_seed(seed)?;
    let init = Tensor::randn(0f32, 1.0, n, dev)?;
    let grads = (0..3)
        .map(|_| Tensor::randn(0f32, 1.0, n, dev)?.to_dtype(DType::BF16))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let run = |device: &Device| -> Result<Vec<Tensor>> {
        let init = init.to_device(device)?;
        let p = Var::from_tensor(&init.to_dtype(DType::BF16)?)?;
        let zeros = init.zeros_like()?;
        let state = Tensor::stack(&[&init, &zeros, &zeros], 0)?;
        for (k, g) in grads.iter().enumerate() {
            fused_ops::adamw_step_mixed(
                p.as_tensor(),
                &g.to_device(device)?,
                &state,
                adamw_hp(k + 1),
            )?;
        }
        let mut out = (0..3)
            .map(|r| Ok(state.get(r)?.to_device(&Device::Cpu)?))
            .collect::<Result<Vec<_>>>()?;
        out.push(
            p.as_tensor()
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?,
        );
        Ok(out)
    };
    let (mut gpu, mut cpu) = (run(dev)?, run(&Device::Cpu)?);
    // The gradient norm's sum of squares, on one bf16 gradient.
    gpu.push(fused_ops::sum_squares(&grads[0])?.to_device(&Device::Cpu)?);
    cpu.push(fused_ops::sum_squares(&grads[0].to_device(&Device::Cpu)?)?);
    let mut err = [0f64; 5];
    for (e, (a, b)) in err.iter_mut().zip(gpu.iter().zip(&cpu)) {
        *e = rel_l2(a, b)?;
    }
    Ok(err)
}

#[test]
fn add_rms_norm_and_its_backward_match_candle() {
    let dev = gpu();
    let results: Vec<_> = [(1, 576), (7, 2048), (4096, 2048), (5, 4096), (3, 8192)]
        .iter()
        .enumerate()
        .map(|(k, &dims)| check_add_rms_norm(&dev, dims, 950 + k as u64).unwrap())
        .collect();
    assert_all_pass!(results);
}

#[test]
fn rms_norm_alone_matches_candle() {
    let dev = gpu();
    for (k, &(m, d)) in [(1, 576), (333, 2048), (32_768, 2048)].iter().enumerate() {
        dev.set_seed(1420 + k as u64).unwrap();
        let x = Tensor::randn(0f32, 2.0, (m, d), &dev)
            .and_then(|t| t.to_dtype(DType::BF16))
            .unwrap();
        let alpha = Tensor::randn(1f32, 0.1, d, &dev)
            .and_then(|t| t.to_dtype(DType::BF16))
            .unwrap();
        let got = fused_ops::rms_norm(&x, &alpha, 1e-5).unwrap();
        let want = candle_nn::ops::rms_norm(&x, &alpha, 1e-5).unwrap();
        let err = rel_l2(&got, &want).unwrap();
        assert!(err < 1e-2, "[{m}, {d}]: rel err {err:.2e}");
    }
}

#[test]
fn residual_add_linear_matches_candle_in_place() {
    let dev = gpu();
    let cases = [
        (1, 576, 576),
        (333, 576, 1536),
        (32_768, 2048, 2048),
        (70_000, 576, 576),
    ];
    let results: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(k, &dims)| check_residual_add_linear(&dev, dims, 1410 + k as u64).unwrap())
        .collect();
    assert_all_pass!(results);
}

#[test]
fn linear_rows_matches_f32_and_cublas_at_one_to_eight_rows() {
    let dev = gpu();
    // Rows 1..=8 (odd counts skip part of a kernel built for more), widths below one
    // chunk, of one chunk and of several (k past 2,048 loops), row counts that are not a
    // multiple of a block's 16, the head of a 49k vocabulary.
    let cases = [
        (1, 960, 576),
        (3, 1536, 576),
        (8, 576, 1536),
        (1, 6144, 2048),
        (5, 2048, 2048),
        (2, 4096, 11008),
        (7, 1001, 8),
        (4, 333, 1032),
        (1, 49152, 576),
    ];
    let results: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(k, &dims)| check_linear_rows(&dev, dims, 1510 + k as u64).unwrap())
        .collect();
    assert_all_pass!(results);
}

#[test]
fn argmax_rows_matches_the_cpu_argmax_with_ties_and_nan() {
    let dev = gpu();
    for (k, &(rows, n)) in [(1, 49_152), (3, 1000), (64, 49_152), (2, 7), (5, 1025)]
        .iter()
        .enumerate()
    {
        let mut x: Vec<f32> = Tensor::randn(0f32, 1.0, (rows, n), &Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // Row 0: its maximum twice (the first wins); row 1: NaN among its values.
        let top = x[..n].iter().cloned().fold(f32::MIN, f32::max) + 1.0;
        x[n / 2] = top;
        x[n - 1] = top;
        if rows > 1 {
            x[n + n / 3] = f32::NAN;
        }
        let cpu = Tensor::from_vec(x, (rows, n), &Device::Cpu).unwrap();
        let want: Vec<u32> = cpu
            .argmax(candle_core::D::Minus1)
            .unwrap()
            .to_vec1()
            .unwrap();
        let got: Vec<u32> = fused_ops::argmax_rows(&cpu.to_device(&dev).unwrap())
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(want[0], (n / 2) as u32, "case {k}: the CPU's tie");
        if rows > 1 {
            let row1 = &cpu.get(1).unwrap().to_vec1::<f32>().unwrap();
            let best = row1
                .iter()
                .cloned()
                .filter(|v| !v.is_nan())
                .fold(f32::MIN, f32::max);
            assert_eq!(row1[got[1] as usize], best, "case {k}: row 1 past its NaN");
        }
        // Past the NaN row, every row as the CPU picks it.
        for r in (0..rows).filter(|&r| r != 1) {
            assert_eq!(got[r], want[r], "case {k} ({rows}x{n}), row {r}");
        }
    }
}

#[test]
fn rope_and_its_backward_match_candle() {
    let dev = gpu();
    let results: Vec<_> = [(1, 1, 9, 64), (2, 333, 8, 64), (4, 2048, 32, 64)]
        .iter()
        .enumerate()
        .map(|(k, &dims)| check_rope(&dev, dims, 970 + k as u64).unwrap())
        .collect();
    assert_all_pass!(results);
}

#[test]
fn cross_entropy_and_its_backward_match_candle() {
    let dev = gpu();
    let results: Vec<_> = [(1, 49152), (333, 1000), (8192, 49152)]
        .iter()
        .enumerate()
        .map(|(k, &dims)| check_cross_entropy(&dev, dims, 990 + k as u64).unwrap())
        .collect();
    assert_all_pass!(results);
}

#[test]
fn kl_divergence_and_its_backward_match_candle_ops() {
    let dev = gpu();
    // V = 1001 reads one element at a time; the others 8 at a time.
    let cases = [(1, 49152), (333, 1000), (7, 1001), (4096, 49152)];
    for (teacher, seed) in [(DType::F32, 1200), (DType::BF16, 1210)] {
        eprintln!("{teacher:?} teacher");
        let results: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(k, &dims)| check_kl_divergence(&dev, dims, seed + k as u64, teacher).unwrap())
            .collect();
        assert_all_pass!(results);
    }
}

#[test]
fn the_smooth_gate_count_and_its_backward_match_candle_ops() {
    let dev = gpu();
    let results: Vec<_> = [(1, 1536), (333, 1000), (4096, 5632)]
        .iter()
        .enumerate()
        .map(|(k, &dims)| check_gate_l0(&dev, dims, 1100 + k as u64).unwrap())
        .collect();
    assert_all_pass!(results);
}

#[test]
fn adamw_matches_the_cpu() {
    let dev = gpu();
    let err = check_adamw(&dev, 5_000_001, 995).unwrap();
    assert!(err.iter().all(|&e| e < 1e-5), "param, m, v: {err:?}");
    let err = check_adamw_mixed(&dev, 5_000_001, 996).unwrap();
    // The bf16 variable may round a master that differs in its last f32 bits to the
    // neighbouring bf16 value; the f32 rows must agree as the f32 step's do.
    let ok = err[..3].iter().all(|&e| e < 1e-5) && err[3] < 1e-3 && err[4] < 1e-5;
    assert!(ok, "master, m, v, bf16 variable, sum of squares: {err:?}");
}

#[test]
fn the_embedding_backward_matches_the_cpu() {
    let err = check_embedding(&gpu(), (8192, 1000, 2048), 997).unwrap();
    assert!(err < TOLERANCE, "weight gradient rel err {err:.2e}");
}
