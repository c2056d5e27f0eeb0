//! `twell check-gpu`: the CUDA TwELL path against a dense f32 reference on the same
//! GPU, over shapes, token counts (1, odd, past 65,536), densities and overflow, with
//! outputs poisoned before every launch. Exits non-zero on any failure.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use serde::Serialize;
use twell::density::{synthetic_input, synthetic_mlp, MlpWeights};
use twell::{twell_mlp, up_down_matrix, TwellConfig};

#[derive(clap::Args, Debug)]
pub struct CheckGpuArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub ordinal: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Only the sparse MLP's forward checks: the TwELL and products paths, `Auto`'s dense
    /// side, and the folded residual add and norms. A quick pass for a knob that changes
    /// only the forward kernels (`TWELL_OVERLAP`, `TWELL_MASK_ROWS`, `TWELL_GATE`, ...).
    #[arg(long)]
    pub mlp_only: bool,
}

/// bf16 inputs, f32 reference: the relative L2 error bf16 rounding allows.
const TOLERANCE: f64 = 2e-2;

#[derive(Serialize, Debug)]
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

fn rel_l2(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok(twell::compare::rel_l2(a, b)?)
}

/// One shape of the MLP checks: `(M, hidden, d_ff, target density, tile, compression)`.
type Case = (usize, usize, usize, f64, usize, usize);

/// The TwELL configuration, bf16 weights and bf16 input of a case.
fn case_inputs(dev: &Device, case: Case, seed: u64) -> Result<(TwellConfig, MlpWeights, Tensor)> {
    let (m, d, f, density, tile, cf) = case;
    let config = TwellConfig::new(tile, cf)?;
    let w = synthetic_mlp(d, f, density, DType::BF16, dev, seed)?;
    let x = synthetic_input(m, d, DType::BF16, dev, seed + 1)?;
    Ok((config, w, x))
}

/// Which forward of the MLP a case runs: the TwELL kernels, or the inference path of
/// cuBLAS GEMMs around one element-wise kernel (`twell_mlp_products`).
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(rename_all = "lowercase")]
enum ForwardPath {
    Pairs,
    Products,
}

fn check_case(dev: &Device, case: Case, path: ForwardPath, seed: u64) -> Result<CaseResult> {
    let (m, d, f, density, tile, cf) = case;
    let (config, w, x) = case_inputs(dev, case, seed)?;
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
    // The first call runs sparse (nothing measured yet) and measures 30%.
    auto.forward(&x)?;
    let out = auto.forward(&x)?;
    let stats = auto.last_stats()?.context("auto kept no statistics")?;
    let reference = w.relu_mlp(twell::FfnMode::Dense)?.forward(&x)?;
    Ok((rel_l2(&out, &reference)?, stats.sparse))
}

#[derive(Serialize, Debug)]
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
    let (config, w, x) = case_inputs(dev, case, seed)?;
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

#[derive(Serialize, Debug)]
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
    if !twell::ops::fused_on_device(&q) {
        bail!("causal attention {dims:?} would not run the CUDA kernel");
    }
    let kernel = twell::ops::causal_attention_kernel_name(&q, total)?
        .context("the attention check runs on a CUDA device")?;
    let out = twell::ops::causal_attention(&q, &k, &v)?;
    let err = rel_l2(&out, &twell::ops::causal_attention_reference(&q, &k, &v)?)?;
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
    let fused = gradients(twell::ops::causal_attention, DType::BF16)?;
    let plain = gradients(twell::ops::causal_attention_reference, DType::F32)?;
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

#[derive(Serialize, Debug)]
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
    let angles = twell::ops::RopeTable::new(&cos, &sin)?;
    let cache = bf(&[b, cap, 2 * w])?;
    let before = cache.force_contiguous()?;
    let (q, kv_rows) = twell::ops::rope_qkv(&qkv, &angles, heads, kv)?;
    let keys = Tensor::cat(
        &[cache.narrow(1, 0, len)?, kv_rows.reshape((b, 1, 2 * w))?],
        1,
    )?;
    let want = twell::ops::causal_attention_rows(
        &q,
        &keys.narrow(2, 0, w)?,
        &keys.narrow(2, w, w)?,
        b,
        hd,
    )?;
    let got = twell::ops::causal_attention_step(&qkv, &angles, &cache, len, heads, kv)?;
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

#[derive(Serialize, Debug)]
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
    let table = twell::ops::RopeTable::new(
        &(bf(&[past + t, hd / 2])? * 0.7)?,
        &(bf(&[past + t, hd / 2])? * 0.7)?,
    )?;
    let angles = table.narrow(past, t)?;
    let (q, kv_rows) = twell::ops::rope_qkv(&qkv, &angles, heads, kv)?;
    let new_rows = kv_rows.reshape((b, t, 2 * w))?;
    // No zero-sized random tensor for an empty cache: cuRAND rejects a count of 0.
    let keys = if past == 0 {
        new_rows
    } else {
        Tensor::cat(&[bf(&[b, past, 2 * w])?, new_rows], 1)?
    };
    let (k, v) = (keys.narrow(2, 0, w)?, keys.narrow(2, w, w)?);
    let want = twell::ops::causal_attention_rows(&q, &k, &v, b, hd)?;
    let q_raw = qkv.narrow(1, 0, heads * hd)?;
    let got = twell::ops::causal_attention_rows_turning_q(&q_raw, &angles, &k, &v, b, hd)?;
    let largest_diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
        Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?)
    };
    let max_diff = largest_diff(&got, &want)?;
    let kv_in_place = qkv.narrow(1, heads * hd, 2 * w)?.contiguous()?;
    twell::ops::rope_keys_in_place(&kv_in_place, &angles, kv)?;
    let keys_in_place_diff = largest_diff(&kv_in_place, &kv_rows)?;
    let kernel = (t > 1)
        .then(|| {
            twell::ops::causal_attention_kernel_name(
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

#[derive(Serialize, Debug)]
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
    let fused = twell::ops::fused_on_device(&probe_q)
        && std::env::var_os("TWELL_PLAIN_ATTENTION").is_none();
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

#[derive(Serialize, Debug)]
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

/// One token's MLP with the residual add and norm folded into its launch
/// (`twell_mlp_add_norm`) against the two launches it replaces (`twell_mlp`, then
/// `add_rms_norm`) on the same inputs, and with the add and norm before the MLP folded in
/// too against the three (`add_rms_norm`, `twell_mlp`, `add_rms_norm`): the same values
/// are expected, up to one bf16 step where the MLP's f32 atomic sums arrived in another
/// order.
#[derive(Serialize, Debug)]
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
    seed: u64,
) -> Result<MlpAddNormResult> {
    let (config, w, x) = case_inputs(dev, (m, d, f, density, 256, 8), seed)?;
    dev.set_seed(seed)?;
    let residual = Tensor::randn(0f32, 1.0, (m, d), dev)?.to_dtype(DType::BF16)?;
    let alpha = Tensor::randn(1f32, 0.1, d, dev)?.to_dtype(DType::BF16)?;
    let eps = 1e-5;
    let w_ud = up_down_matrix(&w.up, &w.down)?;
    if !twell::ops::add_norm_fuses(&x) {
        bail!("mlp + add + norm ({m} rows, d {d}) would not fold on this device");
    }
    let diff = |a: &Tensor, b: &Tensor| -> Result<f64> {
        Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()? as f64)
    };
    let (sum, normed) =
        twell::ops::twell_mlp_add_norm(&x, &w.gate, &w_ud, config, (&residual, &alpha, eps), None)?;
    let out = twell_mlp(&x, &w.gate, &w_ud, config)?.out;
    let (want_sum, want_normed) = twell::ops::add_rms_norm(&residual, &out, &alpha, eps)?;
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
    let (both_sum, both_normed) = twell::ops::twell_mlp_add_norm(
        &x,
        &w.gate,
        &w_ud,
        config,
        (&residual, &alpha, eps),
        Some((&pre_alpha, eps)),
    )?;
    let (h, hm) = twell::ops::add_rms_norm(&residual, &x, &pre_alpha, eps)?;
    let out = twell_mlp(&hm, &w.gate, &w_ud, config)?.out;
    let (want_sum, want_normed) = twell::ops::add_rms_norm(&h, &out, &alpha, eps)?;
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

#[derive(Serialize, Debug)]
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
    seed: u64,
) -> Result<MlpNormAddNormResult> {
    let (config, w, x) = case_inputs(dev, (m, d, f, density, 256, 8), seed)?;
    dev.set_seed(seed)?;
    let s = (x * 3.0)?;
    let pre_alpha = Tensor::randn(1f32, 0.1, d, dev)?.to_dtype(DType::BF16)?;
    let alpha = Tensor::randn(1f32, 0.1, d, dev)?.to_dtype(DType::BF16)?;
    let eps = 1e-5;
    if !twell::ops::norm_add_norm_runs(&s) {
        bail!("mlp with both norms folded ({m} rows, d {d}) would not run on this device");
    }
    let fold = |t: &Tensor| -> Result<Tensor> {
        Ok(t.to_dtype(DType::F32)?
            .broadcast_mul(&pre_alpha.to_dtype(DType::F32)?)?
            .to_dtype(DType::BF16)?)
    };
    let folded_ud = up_down_matrix(&fold(&w.up)?, &w.down)?;
    let (sum, normed) = twell::ops::twell_mlp_norm_add_norm(
        &s,
        &fold(&w.gate)?,
        &folded_ud,
        config,
        eps,
        (&alpha, eps),
    )?;
    let hm = candle_nn::ops::rms_norm(&s, &pre_alpha, eps as f32)?;
    let out = twell_mlp(&hm, &w.gate, &up_down_matrix(&w.up, &w.down)?, config)?.out;
    let (want_sum, want_normed) = twell::ops::add_rms_norm(&s, &out, &alpha, eps)?;
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

#[derive(Serialize, Debug)]
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
    let got = twell::ops::residual_add_linear(residual, &y, &w)?;
    let err = rel_l2(&got, &want)?;
    let in_place = rel_l2(&alias, &got)? == 0.0;
    Ok(ResidualLinearResult {
        dims: (m, n, k),
        err,
        in_place,
        pass: err < 1e-2 && in_place,
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
    let both = x.apply_op3_no_bwd(&y, &alpha, &twell::ops::AddRmsNorm::new(eps))?;
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
            twell::ops::add_rms_norm(a, b, c, eps)?
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

#[derive(Serialize, Debug)]
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
    let table = twell::ops::RopeTable::new(&cos, &sin)?;
    let got = x.apply_op2_no_bwd(&table.cos_sin, &twell::ops::Rope)?;
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
        &grad(&|x| twell::ops::rope(x, &table))?,
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
        let out = twell::ops::embedding(&ids.to_device(device)?, var.as_tensor())?;
        let loss = (out.to_dtype(DType::F32)? * probe.to_device(device)?)?.sum_all()?;
        let g = loss.backward()?;
        Ok(g.get(var.as_tensor())
            .context("no gradient")?
            .to_device(&Device::Cpu)?)
    };
    rel_l2(&grad(dev, DType::BF16)?, &grad(&Device::Cpu, DType::F32)?)
}

/// A fused loss over `[N, V]` logits against its reference, value and gradient.
#[derive(Serialize, Debug)]
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
            twell::ops::cross_entropy(var.as_tensor(), &targets)?
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
            twell::ops::kl_divergence_fused(var.as_tensor(), &t)?
        } else {
            twell::ops::kl_divergence_reference(var.as_tensor(), &t)?
        };
        value_and_grad(&loss, &var)
    })
}

#[derive(Serialize, Debug)]
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
            twell::ops::gate_l0(g.as_tensor(), xn.as_tensor(), wn.as_tensor(), scale, 0.1)?
        } else {
            twell::ops::gate_l0_reference(
                g.as_tensor(),
                xn.as_tensor(),
                wn.as_tensor(),
                scale,
                0.1,
            )?
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
fn adamw_hp(step: usize) -> twell::ops::AdamwStep {
    twell::ops::AdamwStep {
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
            twell::ops::adamw_step(
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
            twell::ops::adamw_step_mixed(
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
    gpu.push(twell::ops::sum_squares(&grads[0])?.to_device(&Device::Cpu)?);
    cpu.push(twell::ops::sum_squares(&grads[0].to_device(&Device::Cpu)?)?);
    let mut err = [0f64; 5];
    for (e, (a, b)) in err.iter_mut().zip(gpu.iter().zip(&cpu)) {
        *e = rel_l2(a, b)?;
    }
    Ok(err)
}

/// The report of `--mlp-only`: the sparse MLP's forward checks.
#[derive(Serialize, Debug)]
struct MlpReport {
    forward: Vec<CaseResult>,
    mlp_add_norm: Vec<MlpAddNormResult>,
    mlp_norm_add_norm: Vec<MlpNormAddNormResult>,
}

#[derive(Serialize, Debug)]
struct Report {
    forward: Vec<CaseResult>,
    backward: Vec<BackwardResult>,
    attention: Vec<AttentionResult>,
    add_rms_norm: Vec<NormResult>,
    mlp_add_norm: Vec<MlpAddNormResult>,
    mlp_norm_add_norm: Vec<MlpNormAddNormResult>,
    residual_linear: Vec<ResidualLinearResult>,
    /// `ops::rms_norm` against candle's, three shapes.
    rms_norm_err: Vec<f64>,
    rope: Vec<RopeResult>,
    cross_entropy: Vec<LossResult>,
    kl_divergence_f32_teacher: Vec<LossResult>,
    kl_divergence_bf16_teacher: Vec<LossResult>,
    gate_l0: Vec<GateL0Result>,
    /// Parameter, m and v after three steps, GPU against CPU.
    adamw_err: [f64; 3],
    /// Master, m, v and the bf16 variable after three mixed-precision steps, and a
    /// gradient's sum of squares.
    adamw_mixed_err: [f64; 5],
    /// The embedding's weight gradient, GPU bf16 against CPU f32.
    embedding_grad_err: f64,
    attention_step: Vec<AttentionStepResult>,
    attention_turning_q: Vec<AttentionTurningQResult>,
    /// Split, then fused q, k, v projections, then fused with the MLP norms folded.
    model_attention_err: [f64; 3],
    model_training: ModelTrainResult,
}

/// How many checks ran and how many failed, counted where each prints its verdict.
#[derive(Default)]
struct Tally {
    total: usize,
    failed: usize,
}

impl Tally {
    /// The run's verdict: an error naming how many checks failed, or the count passed.
    fn finish(&self) -> Result<()> {
        if self.failed > 0 {
            bail!("{} of {} GPU checks failed", self.failed, self.total);
        }
        println!("all {} GPU checks passed", self.total);
        Ok(())
    }

    /// Counts one check and returns its verdict for the report line.
    fn record(&mut self, pass: bool) -> &'static str {
        self.total += 1;
        if pass {
            "ok"
        } else {
            self.failed += 1;
            "FAIL"
        }
    }
}

/// A fused loss's checks at each `(N, V)` of `cases` (seeded `seed`, `seed + 1`, …),
/// each printed as a line of the report.
fn run_loss_checks(
    name: &str,
    cases: &[(usize, usize)],
    seed: u64,
    tally: &mut Tally,
    check: impl Fn((usize, usize), u64) -> Result<LossResult>,
) -> Result<Vec<LossResult>> {
    let mut results = Vec::new();
    for (k, &dims) in cases.iter().enumerate() {
        let r = check(dims, seed + k as u64)?;
        println!(
            "{name} (N, V) = {:?}: loss rel err {:.2e}, gradient rel err {:.2e} {}",
            r.dims,
            r.loss_err,
            r.grad_err,
            tally.record(r.pass)
        );
        results.push(r);
    }
    Ok(results)
}

pub fn run(args: &CheckGpuArgs) -> Result<()> {
    if !candle_core::utils::cuda_is_available() {
        bail!("check-gpu needs a build with --features cuda");
    }
    let dev = crate::device::parse_device(&format!("cuda:{}", args.ordinal))?;
    std::env::set_var("TWELL_POISON", "1");
    let mut tally = Tally::default();
    #[rustfmt::skip]
    let cases: &[Case] = &[
        (1, 2048, 5632, 0.01, 256, 8),
        (1, 576, 1536, 0.05, 256, 8),
        // One row of the widest FFN, and one of a wide, nearly dense FFN (overflowing
        // tiles, dozens of active neurons per block in the one-launch decode kernel).
        (1, 4096, 11008, 0.03, 256, 8),
        (1, 512, 24576, 0.9, 256, 8),
        (7, 4096, 11008, 0.005, 256, 8),
        (33, 576, 1000, 0.05, 256, 8),
        (64, 2048, 5632, 0.03, 256, 8),
        (65, 2048, 5632, 0.03, 256, 8),
        (513, 2048, 5632, 0.1, 32, 8),
        // Tiles of two and four mask words (the mask pack's per-tile prefix sums), one
        // of them overflowing often, and a d_ff that ends inside a mask word.
        (300, 1024, 1000, 0.2, 64, 4),
        (777, 576, 1536, 0.08, 128, 2),
        (1000, 576, 1536, 0.001, 256, 8),
        (2048, 2048, 5632, 0.01, 256, 8),
        (2048, 2048, 5632, 0.5, 256, 8),
        (4096, 4096, 11008, 0.03, 256, 4),
        (16384, 2048, 5632, 0.3, 256, 8),
        (131072, 576, 1536, 0.02, 256, 8),
    ];
    let mut results = Vec::new();
    println!(
        "{:>8} {:>7} {:>5} {:>6} {:>5} {:>3} {:>8} {:>8} {:>9} {:>9} {:>9} {:>10} {:>10} pass",
        "path",
        "M",
        "d",
        "d_ff",
        "tile",
        "cf",
        "target",
        "density",
        "overflow",
        "err out",
        "err l1",
        "nnz gpu",
        "nnz ref"
    );
    let runs = cases
        .iter()
        .enumerate()
        .flat_map(|(k, &case)| [ForwardPath::Pairs, ForwardPath::Products].map(|p| (k, case, p)));
    for (k, case, path) in runs {
        let r = check_case(&dev, case, path, 100 + k as u64)?;
        println!(
            "{:>8} {:>7} {:>5} {:>6} {:>5} {:>3} {:>7.2}% {:>7.2}% {:>9} {:>9.2e} {:>9.2e} {:>10} {:>10} {}",
            format!("{:?}", r.path).to_lowercase(), r.m, r.d, r.f, r.tile, r.compression, 100.0 * r.target_density, 100.0 * r.density,
            r.overflow_tiles, r.err_out, r.err_l1, r.nnz_gpu, r.nnz_reference, tally.record(r.pass)
        );
        results.push(r);
    }
    let (auto_err, auto_sparse) = check_auto_dense_side(&dev)?;
    println!(
        "auto above the break-even (M 2048, 30%): {} against candle's dense MLP, rel err \
         {auto_err:.2e} {}",
        if auto_sparse {
            "the TwELL kernels"
        } else {
            "the products path"
        },
        tally.record(!auto_sparse && auto_err < TOLERANCE)
    );
    let mut mlp_add_norm = Vec::new();
    // (m, d, d_ff, density): one token (the one-launch decode kernel, also with the norm
    // before the MLP), then prefill rows (the down row kernel's epilogue): four warps a
    // row, a warp a row, past 65,536 rows, d up to 4096, overflowing tiles.
    #[rustfmt::skip]
    let add_norm_cases = [
        (1, 2048, 5632, 0.01),
        (1, 576, 1536, 0.05),
        (1, 4096, 11008, 0.03),
        (1, 2048, 5632, 0.5),
        (65, 2048, 5632, 0.01),
        (333, 576, 1536, 0.05),
        (8192, 2048, 5632, 0.005),
        (70_000, 2048, 5632, 0.01),
        (300, 4096, 11008, 0.03),
        (1000, 2048, 5632, 0.5),
    ];
    for (k, &dims) in add_norm_cases.iter().enumerate() {
        let r = check_mlp_add_norm(&dev, dims, 960 + k as u64)?;
        let with_pre = match (r.both_sum_diff, r.both_norm_diff) {
            (Some(s), Some(n)) => {
                format!("; with the norm before it: sums {s:.2e}, normalised {n:.2e}")
            }
            _ => String::new(),
        };
        println!(
            "mlp + add + norm folded (m, d, d_ff, density) = ({}, {}, {}, {}): largest \
             difference to twell_mlp then add_rms_norm: sums {:.2e}, normalised {:.2e}{}; \
             at most {} bf16 step(s) {}",
            r.m,
            r.d,
            r.f,
            r.target_density,
            r.sum_diff,
            r.norm_diff,
            with_pre,
            r.bf16_steps,
            tally.record(r.pass)
        );
        mlp_add_norm.push(r);
    }
    let mut mlp_norm_add_norm = Vec::new();
    // (m, d, d_ff, density): four warps a row and one, past 65,536 rows, d 4096,
    // overflowing tiles.
    #[rustfmt::skip]
    let norm_cases = [
        (333, 576, 1536, 0.05),
        (8192, 2048, 5632, 0.005),
        (70_000, 2048, 5632, 0.01),
        (300, 4096, 11008, 0.03),
        (1000, 2048, 5632, 0.5),
    ];
    for (k, &dims) in norm_cases.iter().enumerate() {
        let r = check_mlp_norm_add_norm(&dev, dims, 1400 + k as u64)?;
        println!(
            "mlp with the norm before it folded (m, d, d_ff, density) = ({}, {}, {}, {}): the \
             mlp's share of the sums vs f32 {:.2e} (unfolded launches {:.2e}); vs rms_norm, \
             twell_mlp, add_rms_norm: sums {:.2e}, normalised {:.2e} {}",
            r.m,
            r.d,
            r.f,
            r.target_density,
            r.mlp_err,
            r.unfolded_mlp_err,
            r.sum_err,
            r.norm_err,
            tally.record(r.pass)
        );
        mlp_norm_add_norm.push(r);
    }
    if args.mlp_only {
        if let Some(path) = &args.json {
            let report = MlpReport {
                forward: results,
                mlp_add_norm,
                mlp_norm_add_norm,
            };
            std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        }
        return tally.finish();
    }
    #[rustfmt::skip]
    let bwd_cases: &[Case] = &[
        (1, 2048, 5632, 0.01, 256, 8),
        (96, 256, 1024, 0.05, 256, 8),
        (33, 576, 1000, 0.05, 256, 8),
        (513, 2048, 5632, 0.1, 32, 8),
        (4096, 4096, 11008, 0.03, 256, 4),
        (16384, 2048, 5632, 0.005, 256, 8),
        (131072, 576, 1536, 0.02, 256, 8),
    ];
    println!(
        "backward: {:>7} {:>5} {:>6} {:>5} {:>3} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} device pass",
        "M",
        "d",
        "d_ff",
        "tile",
        "cf",
        "target",
        "path",
        "overflow",
        "err dx",
        "err dWg",
        "err dWu",
        "err dWd"
    );
    let mut backward = Vec::new();
    // Every case on each backward path.
    let paths = [
        twell::BackwardPath::Sparse,
        twell::BackwardPath::DenseDx,
        twell::BackwardPath::Dense,
    ];
    for (k, &case) in bwd_cases.iter().enumerate() {
        for path in paths {
            let r = check_backward(&dev, case, path, 500 + k as u64)?;
            println!(
                "backward: {:>7} {:>5} {:>6} {:>5} {:>3} {:>7.2}% {:>8} {:>9} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.2e} {:>6} {}",
                r.m, r.d, r.f, r.tile, r.compression, 100.0 * r.target_density, r.path,
                r.overflow_tiles, r.err[0], r.err[1], r.err[2], r.err[3], r.on_device,
                tally.record(r.pass)
            );
            backward.push(r);
        }
    }
    // (b, heads, t, kv_heads, T, hd): decode with a cache (the one-query kernel, and past
    // its key limit the prefill kernel), grouped heads, prefill.
    #[rustfmt::skip]
    let attention_cases = [
        (1, 9, 1, 3, 17, 64),
        (2, 32, 1, 8, 2048, 64),
        (1, 4, 1, 4, 9000, 64),
        (1, 9, 100, 3, 612, 64),
        (4, 32, 333, 8, 333, 64),
        (2, 32, 2048, 32, 2048, 64),
        (3, 6, 17, 2, 81, 64),
        (1, 2, 1000, 1, 1000, 64),
    ];
    let mut attention = Vec::new();
    for (k, &dims) in attention_cases.iter().enumerate() {
        let r = check_attention(&dev, dims, 900 + k as u64)?;
        println!(
            "attention (b, heads, t, kv_heads, T, hd) = {:?} ({}), scores' std {}: rel err \
             {:.2e}, backward dq {:.2e} dk {:.2e} dv {:.2e} {}",
            r.dims,
            r.kernel,
            r.logit_std,
            r.err,
            r.grad_err[0],
            r.grad_err[1],
            r.grad_err[2],
            tally.record(r.pass)
        );
        attention.push(r);
    }
    let mut add_rms_norm = Vec::new();
    for (k, &dims) in [(1, 576), (7, 2048), (4096, 2048), (5, 4096), (3, 8192)]
        .iter()
        .enumerate()
    {
        let r = check_add_rms_norm(&dev, dims, 950 + k as u64)?;
        println!(
            "add_rms_norm (M, d) = {:?}: sum rel err {:.2e}, norm rel err {:.2e}, backward dx \
             {:.2e} dy {:.2e} dalpha {:.2e} {}",
            r.dims,
            r.sum_err,
            r.norm_err,
            r.grad_err[0],
            r.grad_err[1],
            r.grad_err[2],
            tally.record(r.pass)
        );
        add_rms_norm.push(r);
    }
    let mut residual_linear = Vec::new();
    for (k, &dims) in [
        (1, 576, 576),
        (333, 576, 1536),
        (32_768, 2048, 2048),
        (70_000, 576, 576),
    ]
    .iter()
    .enumerate()
    {
        let r = check_residual_add_linear(&dev, dims, 1410 + k as u64)?;
        println!(
            "residual + y · Wᵀ in place (m, n, k) = {:?}: rel err {:.2e}, in place {} {}",
            r.dims,
            r.err,
            r.in_place,
            tally.record(r.pass)
        );
        residual_linear.push(r);
    }
    let mut rms_norm_err = Vec::new();
    for (k, &(m, d)) in [(1, 576), (333, 2048), (32_768, 2048)].iter().enumerate() {
        dev.set_seed(1420 + k as u64)?;
        let x = (Tensor::randn(0f32, 2.0, (m, d), &dev)?).to_dtype(DType::BF16)?;
        let alpha = Tensor::randn(1f32, 0.1, d, &dev)?.to_dtype(DType::BF16)?;
        let got = twell::ops::rms_norm(&x, &alpha, 1e-5)?;
        let err = rel_l2(&got, &candle_nn::ops::rms_norm(&x, &alpha, 1e-5)?)?;
        println!(
            "rms_norm (the add + norm kernel without the add) [{m}, {d}]: rel err vs candle's \
             {err:.2e} {}",
            tally.record(err < 1e-2)
        );
        rms_norm_err.push(err);
    }
    let mut rope = Vec::new();
    for (k, &dims) in [(1, 1, 9, 64), (2, 333, 8, 64), (4, 2048, 32, 64)]
        .iter()
        .enumerate()
    {
        let r = check_rope(&dev, dims, 970 + k as u64)?;
        println!(
            "rope (b, t, heads, hd) = {:?}: rel err {:.2e}, backward {:.2e} {}",
            r.dims,
            r.err,
            r.grad_err,
            tally.record(r.pass)
        );
        rope.push(r);
    }
    let loss_cases = [(1, 49152), (333, 1000), (8192, 49152)];
    let cross_entropy = run_loss_checks("cross_entropy", &loss_cases, 990, &mut tally, |d, s| {
        check_cross_entropy(&dev, d, s)
    })?;
    // V = 1001 reads one element at a time; the others 8 at a time.
    let kl_cases = [(1, 49152), (333, 1000), (7, 1001), (4096, 49152)];
    let kl_checks = |teacher: DType, seed: u64, tally: &mut Tally| {
        let name = format!("kl_divergence ({teacher:?} teacher)");
        run_loss_checks(&name, &kl_cases, seed, tally, |d, s| {
            check_kl_divergence(&dev, d, s, teacher)
        })
    };
    let kl_divergence_f32_teacher = kl_checks(DType::F32, 1200, &mut tally)?;
    let kl_divergence_bf16_teacher = kl_checks(DType::BF16, 1210, &mut tally)?;
    let mut gate_l0 = Vec::new();
    for (k, &dims) in [(1, 1536), (333, 1000), (4096, 5632)].iter().enumerate() {
        let r = check_gate_l0(&dev, dims, 1100 + k as u64)?;
        println!(
            "gate_l0 (N, f) = {:?}: count rel err {:.2e}, gradients: gates {:.2e}, token \
             norms {:.2e}, gate-row norms {:.2e} {}",
            r.dims,
            r.err[0],
            r.err[1],
            r.err[2],
            r.err[3],
            tally.record(r.pass)
        );
        gate_l0.push(r);
    }
    let adamw_err = check_adamw(&dev, 5_000_001, 995)?;
    let adamw_ok = adamw_err.iter().all(|&e| e < 1e-5);
    println!(
        "adamw (5,000,001 parameters, 3 steps) GPU vs CPU: param {:.2e}, m {:.2e}, v {:.2e} {}",
        adamw_err[0],
        adamw_err[1],
        adamw_err[2],
        tally.record(adamw_ok)
    );
    let adamw_mixed_err = check_adamw_mixed(&dev, 5_000_001, 996)?;
    // The bf16 variable may round a master that differs in its last f32 bits to the
    // neighbouring bf16 value; the f32 rows must agree as the f32 step's do.
    let adamw_mixed_ok = adamw_mixed_err[..3].iter().all(|&e| e < 1e-5)
        && adamw_mixed_err[3] < 1e-3
        && adamw_mixed_err[4] < 1e-5;
    println!(
        "adamw mixed precision (5,000,001 parameters, 3 steps) GPU vs CPU: master {:.2e}, m \
         {:.2e}, v {:.2e}, bf16 variable {:.2e}; sum of squares {:.2e} {}",
        adamw_mixed_err[0],
        adamw_mixed_err[1],
        adamw_mixed_err[2],
        adamw_mixed_err[3],
        adamw_mixed_err[4],
        tally.record(adamw_mixed_ok)
    );
    let embedding_grad_err = check_embedding(&dev, (8192, 1000, 2048), 997)?;
    let embedding_ok = embedding_grad_err < TOLERANCE;
    println!(
        "embedding backward (8,192 ids over a vocabulary of 1,000, width 2,048) GPU bf16 vs \
         CPU f32: weight gradient rel err {embedding_grad_err:.2e} {}",
        tally.record(embedding_ok)
    );
    let mut attention_step = Vec::new();
    // (batch, heads, kv_heads, cached positions, capacity): one sequence and several,
    // grouped and plain heads, an empty cache, the last free position, the longest step;
    // all but the empty cache split the positions over 2-9 blocks a head.
    for (k, dims) in [
        (1, 32, 32, 511, 768),
        (3, 9, 3, 0, 256),
        (2, 32, 8, 255, 256),
        (4, 16, 4, 1000, 1024),
        (1, 8, 2, 130, 256),
        (
            1,
            32,
            32,
            twell::ops::CUDA_DECODE_MAX_KEYS - 1,
            twell::ops::CUDA_DECODE_MAX_KEYS,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let r = check_attention_step(&dev, dims, 1300 + k as u64)?;
        println!(
            "attention step (b, heads, kv_heads, cached, capacity) = {dims:?}: rel err {:.2e}, \
             written row {:.2e}, other positions kept {} {}",
            r.err,
            r.row_err,
            r.rest_kept,
            tally.record(r.pass)
        );
        attention_step.push(r);
    }
    let mut attention_turning_q = Vec::new();
    // (batch, heads, kv_heads, queries, cached before them): prefill sizes on either
    // kernel, grouped heads, a chunk after a cache, a block's worth of rows and a ragged
    // one, and one query (RoPE then the decode kernel).
    for (k, dims) in [
        (1, 9, 3, 100, 0),
        (2, 32, 8, 333, 64),
        (4, 32, 32, 2048, 0),
        (3, 6, 2, 17, 81),
        (1, 2, 1, 128, 1000),
        (2, 4, 4, 1, 30),
    ]
    .into_iter()
    .enumerate()
    {
        let r = check_attention_turning_q(&dev, dims, 1400 + k as u64)?;
        println!(
            "attention turning q (b, heads, kv_heads, t, cached) = {dims:?} ({}): largest \
             difference from RoPE then the attention {:.2e}, keys turned in place {:.2e} {}",
            r.kernel
                .as_deref()
                .unwrap_or("RoPE, then the one-query kernel"),
            r.max_diff,
            r.keys_in_place_diff,
            tally.record(r.pass)
        );
        attention_turning_q.push(r);
    }
    let (model_attention_err, folded_moved) = check_model_attention(&dev)?;
    println!(
        "model with its MLP norms folded: logits {folded_moved:.2e} (rel L2) from the \
         unfolded model's, the folded path ran {}",
        tally.record(folded_moved > 0.0)
    );
    for (err, projections) in
        model_attention_err
            .iter()
            .zip(["split", "fused", "fused, MLP norms folded, TwELL MLPs,"])
    {
        println!(
            "model (2 layers, hd 64, GQA 8/2, 2 x 96 tokens in two cached chunks, {projections} \
             q, k, v): inference vs the CPU's f32 training path, logits rel err {err:.2e} {}",
            tally.record(*err < TOLERANCE)
        );
    }
    let model_training = check_model_training(&dev)?;
    println!(
        "model training (same model, bf16 on the GPU vs f32 on the CPU, fused attention {}): \
         logits rel err {:.2e}, gradients rel err {:.2e} (worst {:.2e}, {}) {}",
        model_training.fused,
        model_training.logits_err,
        model_training.grad_err,
        model_training.worst_grad_err,
        model_training.worst_param,
        tally.record(model_training.pass)
    );
    if let Some(path) = &args.json {
        let report = Report {
            forward: results,
            backward,
            attention,
            add_rms_norm,
            mlp_add_norm,
            mlp_norm_add_norm,
            residual_linear,
            rms_norm_err,
            rope,
            cross_entropy,
            kl_divergence_f32_teacher,
            kl_divergence_bf16_teacher,
            gate_l0,
            adamw_err,
            adamw_mixed_err,
            embedding_grad_err,
            attention_step,
            attention_turning_q,
            model_attention_err,
            model_training,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    tally.finish()
}

#[cfg(test)]
mod tests {
    use super::{bf16_steps, bf16_steps_at};
    use candle_core::{DType, Device, Tensor};

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
}
