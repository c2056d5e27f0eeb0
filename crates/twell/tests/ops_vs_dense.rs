//! Every sparse op, forward and backward, against dense candle autograd on the same
//! weights: random shapes and densities, f32 and bf16, M = 1, odd M, d_ff not a
//! multiple of the tile, overflow, and M past 65,536.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{dense_reglu, probe_loss, rel_l2, Vars};
use proptest::prelude::*;
use twell::density::{synthetic_input, synthetic_mlp};
use twell::gate_screen;
use twell::{gate_pack, gated_t2d, twell_mlp, twell_mlp_screened, up_down_matrix, TwellConfig};

struct Case {
    m: usize,
    d: usize,
    f: usize,
    density: f64,
    dtype: DType,
    config: TwellConfig,
    seed: u64,
}

/// Which sparse composition to check.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// `twell_mlp`: one fused op.
    Fused,
    /// `gate_pack` then `gated_t2d`: two ops, the TwELL gate in between.
    Composed,
    /// `twell_mlp_screened`: the fused op with the int8 gate screen.
    Screened,
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2e-5,
        _ => 2e-2,
    }
}

/// The smallest |x_i·w_j| relative to ‖x_i‖·‖w_j‖ (a gate, or an active neuron's up
/// value) the random-shape checks accept: f32 dot products in two summation orders
/// differ by about 2^-24·√d of that bound.
const GATE_MARGIN: f32 = 1e-6;

/// The first of `seed`, `seed + 1000`, … whose inputs for this shape put every
/// reference gate g = x·Wg_j, and every up value u = x·Wu_j of an active neuron, clear
/// of zero. ReLU's gradient jumps at g = 0 (dx moves by u·Wg_j) and the L1 term |g·u|'s
/// jumps at u = 0 (by 2·g·Wu_j). A value within rounding of zero may fall on either side
/// in the op's summation order, and no tolerance tells that apart from a fault. The
/// random-shape property draws its seed through this; the fixed cases were chosen clear.
fn seed_with_clear_gates(case: &Case) -> u64 {
    let dev = Device::Cpu;
    // x·wᵀ and |x_i · w_j| / (‖x_i‖·‖w_j‖), both [m, f].
    let relative = |x: &Tensor, w: &Tensor| -> (Tensor, Tensor) {
        let norm = |t: &Tensor| t.sqr().unwrap().sum_keepdim(1).unwrap().sqrt().unwrap();
        let bound = norm(x).matmul(&norm(w).t().unwrap()).unwrap();
        let product = x.matmul(&w.t().unwrap()).unwrap();
        let ratio = (product.abs().unwrap() / (bound + 1e-30).unwrap()).unwrap();
        (product, ratio)
    };
    let smallest = |t: Tensor| {
        t.flatten_all()
            .unwrap()
            .min(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    (0..64)
        .map(|k| case.seed + 1000 * k)
        .find(|&seed| {
            let w = synthetic_mlp(case.d, case.f, case.density, case.dtype, &dev, seed).unwrap();
            let x = synthetic_input(case.m, case.d, case.dtype, &dev, seed + 7).unwrap();
            let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let x32 = f32(&x);
            let (gate, gate_ratio) = relative(&x32, &f32(&w.gate));
            let gates_clear = smallest(gate_ratio) >= GATE_MARGIN;
            // Up values only where the gate is positive (elsewhere h is 0 either way).
            let active = gate.gt(0f32).unwrap();
            let (_, u) = relative(&x32, &f32(&w.up));
            let u_active = active
                .where_cond(&u, &Tensor::ones_like(&u).unwrap())
                .unwrap();
            gates_clear && smallest(u_active) >= GATE_MARGIN
        })
        .unwrap_or_else(|| panic!("no seed from {} gives gates clear of zero", case.seed))
}

/// Runs forward + backward through the sparse path and through dense candle, and
/// compares outputs, L1 terms and all four gradients.
fn check(case: &Case, path: Path) {
    let dev = Device::Cpu;
    let w = synthetic_mlp(case.d, case.f, case.density, case.dtype, &dev, case.seed).unwrap();
    let x = synthetic_input(case.m, case.d, case.dtype, &dev, case.seed + 7).unwrap();

    // The reference runs in f32 on the same (possibly bf16-rounded) numbers.
    let up32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let dense = Vars::new(&up32(&x), &up32(&w.gate), &up32(&w.up), &up32(&w.down)).unwrap();
    let (out_d, l1_d) = dense_reglu(&dense.x, &dense.wg, &dense.wu, &dense.wd).unwrap();
    let grads_d = dense
        .grads(&probe_loss(&out_d, &l1_d, case.seed + 11).unwrap())
        .unwrap();

    let sparse = Vars::new(&x, &w.gate, &w.up, &w.down).unwrap();
    let w_ud = up_down_matrix(&sparse.wu, &sparse.wd).unwrap();
    let res = match path {
        Path::Fused => twell_mlp(&sparse.x, &sparse.wg, &w_ud, case.config).unwrap(),
        Path::Screened => {
            let screen = std::sync::Arc::new(gate_screen(&sparse.wg).unwrap());
            twell_mlp_screened(&sparse.x, &sparse.wg, &w_ud, case.config, screen).unwrap()
        }
        Path::Composed => {
            let gate = gate_pack(&sparse.x, &sparse.wg, case.config).unwrap();
            gated_t2d(&gate, &sparse.x, &w_ud).unwrap()
        }
    };
    assert_eq!(res.out.dims(), &[case.m, case.d]);
    assert_eq!(res.out.dtype(), case.dtype);
    let grads_s = sparse
        .grads(&probe_loss(&res.out, &res.l1, case.seed + 11).unwrap())
        .unwrap();

    let tol = tolerance(case.dtype);
    let ctx = format!(
        "{path:?} m={} d={} f={} density={} {:?} {:?} seed={}",
        case.m, case.d, case.f, case.density, case.dtype, case.config, case.seed
    );
    let e_out = rel_l2(&res.out, &out_d).unwrap();
    assert!(e_out < tol, "{ctx}: out rel err {e_out}");
    let e_l1 = rel_l2(&res.l1, &l1_d).unwrap();
    assert!(e_l1 < tol, "{ctx}: l1 rel err {e_l1}");
    for (name, (gs, gd)) in ["dx", "dWg", "dWu", "dWd"]
        .iter()
        .zip(grads_s.iter().zip(&grads_d))
    {
        assert_eq!(gs.dims(), gd.dims(), "{ctx}: {name} shape");
        let e = rel_l2(gs, gd).unwrap();
        assert!(e < tol * 2.0, "{ctx}: {name} rel err {e}");
    }
}

#[test]
fn single_token_f32_and_bf16() {
    for dtype in [DType::F32, DType::BF16] {
        for path in [Path::Fused, Path::Composed] {
            check(
                &Case {
                    m: 1,
                    d: 64,
                    f: 300,
                    density: 0.05,
                    dtype,
                    config: TwellConfig::default(),
                    seed: 1,
                },
                path,
            );
        }
    }
}

#[test]
fn odd_token_counts_and_partial_tiles() {
    for (m, f) in [(7, 257), (33, 1000), (301, 600)] {
        for path in [Path::Fused, Path::Composed] {
            let case = Case {
                m,
                d: 48,
                f,
                density: 0.03,
                dtype: DType::F32,
                config: TwellConfig::default(),
                seed: m as u64,
            };
            check(&case, path);
        }
    }
}

#[test]
fn overflow_is_lossless_in_forward_and_backward() {
    // 4 slots per 32-column tile at 40% density: most tiles overflow.
    let config = TwellConfig::new(32, 8).unwrap();
    for path in [Path::Fused, Path::Composed] {
        check(
            &Case {
                m: 50,
                d: 32,
                f: 100,
                density: 0.4,
                dtype: DType::F32,
                config,
                seed: 3,
            },
            path,
        );
    }
    // And the fallback is reported.
    let w = synthetic_mlp(32, 100, 0.4, DType::F32, &Device::Cpu, 3).unwrap();
    let x = synthetic_input(50, 32, DType::F32, &Device::Cpu, 4).unwrap();
    let gate = gate_pack(&x, &w.gate, config).unwrap();
    let stats = gate.stats().unwrap();
    assert!(
        stats.overflow_tiles > 0 && stats.overflow_rows > 0,
        "{stats:?}"
    );
}

#[test]
fn many_tokens_past_65536() {
    let case = Case {
        m: 70_001,
        d: 16,
        f: 96,
        density: 0.05,
        dtype: DType::F32,
        config: TwellConfig::new(32, 8).unwrap(),
        seed: 5,
    };
    check(&case, Path::Fused);
}

#[test]
fn half_precision_dense_and_fused_agree() {
    let case = Case {
        m: 40,
        d: 64,
        f: 512,
        density: 0.1,
        dtype: DType::F16,
        config: TwellConfig::default(),
        seed: 9,
    };
    check(&case, Path::Fused);
}

#[test]
fn screened_gate_matches_dense_for_one_and_two_tokens() {
    for (m, density, dtype, seed) in [
        (1, 0.01, DType::F32, 21),
        (2, 0.03, DType::F32, 22),
        (1, 0.2, DType::BF16, 23),
        (5, 0.01, DType::F32, 24), // past SCREEN_MAX_ROWS: the unscreened gate
    ] {
        let case = Case {
            m,
            d: 256,
            f: 1300,
            density,
            dtype,
            config: TwellConfig::default(),
            seed,
        };
        check(&case, Path::Screened);
    }
}

#[test]
fn screened_gate_output_equals_the_unscreened_one() {
    let w = synthetic_mlp(512, 2048, 0.01, DType::F32, &Device::Cpu, 31).unwrap();
    let w_ud = up_down_matrix(&w.up, &w.down).unwrap();
    let screen = std::sync::Arc::new(gate_screen(&w.gate).unwrap());
    for seed in 0..4 {
        let x = synthetic_input(1, 512, DType::F32, &Device::Cpu, 40 + seed).unwrap();
        let plain = twell_mlp(&x, &w.gate, &w_ud, TwellConfig::default()).unwrap();
        let screened =
            twell_mlp_screened(&x, &w.gate, &w_ud, TwellConfig::default(), screen.clone()).unwrap();
        assert_eq!(plain.nnz().unwrap(), screened.nnz().unwrap());
        assert!(rel_l2(&plain.out, &screened.out).unwrap() < 1e-6);
    }
}

#[test]
fn a_screen_for_other_weights_is_refused() {
    let w = synthetic_mlp(64, 300, 0.05, DType::F32, &Device::Cpu, 5).unwrap();
    let other = synthetic_mlp(64, 200, 0.05, DType::F32, &Device::Cpu, 6).unwrap();
    let screen = std::sync::Arc::new(gate_screen(&other.gate).unwrap());
    let x = synthetic_input(1, 64, DType::F32, &Device::Cpu, 7).unwrap();
    let w_ud = up_down_matrix(&w.up, &w.down).unwrap();
    let e = match twell_mlp_screened(&x, &w.gate, &w_ud, TwellConfig::default(), screen) {
        Ok(_) => panic!("a screen of other weights must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("screen"), "{e}");
}

#[test]
fn l1_equals_sum_of_packed_h() {
    // The fused op's L1 column is Σ|h| of the dense h.
    let w = synthetic_mlp(24, 200, 0.08, DType::F32, &Device::Cpu, 2).unwrap();
    let x = synthetic_input(19, 24, DType::F32, &Device::Cpu, 3).unwrap();
    let res = twell_mlp(
        &x,
        &w.gate,
        &up_down_matrix(&w.up, &w.down).unwrap(),
        TwellConfig::default(),
    )
    .unwrap();
    let h = (x.matmul(&w.gate.t().unwrap()).unwrap().relu().unwrap()
        * x.matmul(&w.up.t().unwrap()).unwrap())
    .unwrap();
    let want = h.abs().unwrap().sum(1).unwrap();
    assert!(rel_l2(&res.l1, &want).unwrap() < 1e-5);
    let nnz = h
        .ne(0f32)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as usize;
    let counted = res.nnz().unwrap();
    assert_eq!(counted, nnz);
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::BF16)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn random_shapes_and_densities(
        m in 1usize..90,
        d in 2usize..80,
        f in 1usize..700,
        density in prop_oneof![0.002f64..0.05, 0.05f64..0.6],
        dtype in dtype_strategy(),
        tile in prop_oneof![Just(32usize), Just(256)],
        cf in prop_oneof![Just(2usize), Just(8)],
        fused in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let config = TwellConfig::new(tile, cf).unwrap();
        let path = if fused { Path::Fused } else { Path::Composed };
        let mut case = Case { m, d, f, density, dtype, config, seed };
        case.seed = seed_with_clear_gates(&case);
        check(&case, path);
    }
}

/// The fused op's output rows and L1 terms are two graph nodes that hand each other
/// their gradients: a loss on either one alone must still give the dense gradients.
#[test]
fn output_rows_and_l1_terms_differentiate_alone() {
    let dev = Device::Cpu;
    let (m, d, f) = (7, 64, 512);
    let w = synthetic_mlp(d, f, 0.05, DType::F32, &dev, 41).unwrap();
    let x = synthetic_input(m, d, DType::F32, &dev, 42).unwrap();
    let probe = |t: &Tensor, seed: u64| {
        let r = common::uniform(t.dims(), seed, 1.0);
        (t * r).unwrap().sum_all().unwrap()
    };
    for (name, on_out, on_l1) in [("out only", true, false), ("l1 only", false, true)] {
        let loss = |out: &Tensor, l1: &Tensor| match (on_out, on_l1) {
            (true, false) => probe(out, 43),
            _ => probe(l1, 44),
        };
        let dense = Vars::new(&x, &w.gate, &w.up, &w.down).unwrap();
        let (out_d, l1_d) = dense_reglu(&dense.x, &dense.wg, &dense.wu, &dense.wd).unwrap();
        let grads_d = dense.grads(&loss(&out_d, &l1_d)).unwrap();
        let sparse = Vars::new(&x, &w.gate, &w.up, &w.down).unwrap();
        let w_ud = up_down_matrix(&sparse.wu, &sparse.wd).unwrap();
        let res = twell_mlp(&sparse.x, &sparse.wg, &w_ud, TwellConfig::default()).unwrap();
        let grads_s = sparse.grads(&loss(&res.out, &res.l1)).unwrap();
        for (g, (gs, gd)) in ["dx", "dWg", "dWu", "dWd"]
            .iter()
            .zip(grads_s.iter().zip(&grads_d))
        {
            let e = rel_l2(gs, gd).unwrap();
            assert!(e < 1e-4, "{name}: {g} rel err {e}");
        }
    }
}

#[test]
fn products_entry_is_the_twell_mlp_on_the_host() {
    // On the host `twell_mlp_products` hands over to `twell_mlp` (its GPU path is
    // checked by the GPU tests, `tests/gpu`): the same rows, L1 terms and counts.
    let w = synthetic_mlp(64, 512, 0.2, DType::F32, &Device::Cpu, 8).unwrap();
    let x = synthetic_input(9, 64, DType::F32, &Device::Cpu, 9).unwrap();
    let w_ud = up_down_matrix(&w.up, &w.down).unwrap();
    let cfg = TwellConfig::default();
    let want = twell_mlp(&x, &w.gate, &w_ud, cfg).unwrap();
    let got = twell::twell_mlp_products(&x, &w.gate, &w_ud, cfg).unwrap();
    assert!(rel_l2(&got.out, &want.out).unwrap() < 1e-6);
    assert!(rel_l2(&got.l1, &want.l1).unwrap() < 1e-6);
    assert_eq!(got.host_counts().unwrap(), want.host_counts().unwrap());
    assert!(got.nnz().unwrap() > 0);
}

/// A draw like the one the random-shape property failed on in CI (dx off by 4e-3 in
/// f32): seed 263 of this shape has an active neuron whose up value lies within rounding
/// of zero, where the L1 term's gradient jumps. The seed filter must skip it, and the
/// seed it picks instead must match the reference on both paths.
#[test]
fn a_seed_with_an_up_value_at_zero_is_skipped() {
    let mut case = Case {
        m: 53,
        d: 49,
        f: 519,
        density: 0.55,
        dtype: DType::F32,
        config: TwellConfig::default(),
        seed: 263,
    };
    case.seed = seed_with_clear_gates(&case);
    assert_ne!(case.seed, 263);
    for path in [Path::Fused, Path::Composed] {
        check(&case, path);
    }
}
