//! The fused smooth gate count against the same term as candle ops, forward and
//! backward (gates, token norms, gate-row norms), and its bad-input errors.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use twell::{gate_l0, gate_l0_reference};

type Count = fn(&Tensor, &Tensor, &Tensor, f64, f64) -> candle_core::Result<Tensor>;

use common::uniform_unrelated as uniform;

/// Positive norms of `n` values around `mean`.
fn norms(n: usize, seed: u64, mean: f64) -> Tensor {
    (uniform(&[n], seed, 0.5) + mean).unwrap()
}

/// The counts and the gradients of `Σ_i w_i·count_i` (random weights `w`) in the gate and
/// both norms, through `count`.
fn count_and_grads(
    count: Count,
    gate: &Tensor,
    xn: &Tensor,
    wn: &Tensor,
    w: &Tensor,
) -> [Tensor; 4] {
    let vars = [gate, xn, wn].map(|t| Var::from_tensor(t).unwrap());
    let c = count(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
        8.0,
        0.1,
    )
    .unwrap();
    let grads = (&c * w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |v: &Var| {
        grads
            .get(v.as_tensor())
            .expect("a gradient")
            .to_dtype(DType::F32)
            .unwrap()
    };
    [
        c.to_dtype(DType::F32).unwrap(),
        g(&vars[0]),
        g(&vars[1]),
        g(&vars[2]),
    ]
}

#[test]
fn matches_the_candle_op_term_forward_and_backward() {
    // (N, f): one token, odd sizes, more rows than a chunk of the column sums, a width
    // past a block's threads.
    for (k, &(n, f)) in [(1, 5), (7, 33), (130, 300), (3, 1536)].iter().enumerate() {
        let seed = 40 + 4 * k as u64;
        // Gates around 0, so about half are positive, some barely.
        let gate = uniform(&[n, f], seed, 2.0);
        let (xn, wn) = (norms(n, seed + 1, 3.0), norms(f, seed + 2, 1.0));
        let w = uniform(&[n], seed + 3, 1.0);
        let want = count_and_grads(gate_l0_reference, &gate, &xn, &wn, &w);
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let g = gate.to_dtype(dtype).unwrap();
            let got = count_and_grads(gate_l0, &g, &xn, &wn, &w);
            // The reference on the rounded gates, so bf16 is judged on its arithmetic.
            let want_rounded = count_and_grads(gate_l0_reference, &g, &xn, &wn, &w);
            let names = [
                "count",
                "gate gradient",
                "x_norm gradient",
                "w_norm gradient",
            ];
            for (i, name) in names.iter().enumerate() {
                assert_eq!(got[i].dims(), want[i].dims(), "{name}");
                let err = common::rel_l2(&got[i], &want_rounded[i]).unwrap();
                assert!(err < tol, "({n}, {f}) {dtype:?}: {name} rel err {err}");
            }
            let err = common::rel_l2(&got[0], &want[0]).unwrap();
            assert!(
                err < tol,
                "({n}, {f}) {dtype:?}: count against f32 gates {err}"
            );
        }
    }
}

#[test]
fn counts_positive_gates_and_is_zero_without_them() {
    let dev = Device::Cpu;
    // Gates far above their spread count as 1, negative ones as 0.
    let gate = Tensor::new(&[[1e4f32, -3.0, 1e4, 0.0], [-1.0, -2.0, -3.0, -4.0]], &dev).unwrap();
    let ones = Tensor::ones(2, DType::F32, &dev).unwrap();
    let wn = Tensor::ones(4, DType::F32, &dev).unwrap();
    let var = Var::from_tensor(&gate).unwrap();
    let count = gate_l0(var.as_tensor(), &ones, &wn, 1.0, 0.1).unwrap();
    let c = count.to_vec1::<f32>().unwrap();
    assert!((c[0] - 2.0).abs() < 1e-3 && c[1] == 0.0, "{c:?}");
    // A gate at exactly 0 is off, and so is its gradient (the subgradient 0 of the kink,
    // where candle's relu would pass the right-hand slope); negative gates get none.
    let grads = count.sum_all().unwrap().backward().unwrap();
    let g = grads
        .get(var.as_tensor())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert!(g[0][0] > 0.0 && g[0][2] > 0.0, "{g:?}");
    assert!(
        g[0][1] == 0.0 && g[0][3] == 0.0 && g[1].iter().all(|v| *v == 0.0),
        "{g:?}"
    );
}

#[test]
fn bad_input_is_rejected() {
    let gate = common::uniform(&[4, 10], 1, 1.0);
    let (xn, wn) = (norms(4, 2, 2.0), norms(10, 3, 1.0));
    let msg = |r: candle_core::Result<Tensor>| r.expect_err("expected an error").to_string();
    assert!(msg(gate_l0(&gate, &norms(3, 2, 2.0), &wn, 1.0, 0.1)).contains("want [N, f]"));
    assert!(msg(gate_l0(&gate, &xn, &norms(9, 3, 1.0), 1.0, 0.1)).contains("want [N, f]"));
    let xn16 = xn.to_dtype(DType::BF16).unwrap();
    assert!(msg(gate_l0(&gate, &xn16, &wn, 1.0, 0.1)).contains("must be f32"));
    assert!(msg(gate_l0(&gate, &xn, &wn, 0.0, 0.1)).contains("positive"));
    assert!(msg(gate_l0(&gate, &xn, &wn, 1.0, f64::NAN)).contains("positive"));
    let cube = common::uniform(&[2, 2, 10], 4, 1.0);
    assert!(!msg(gate_l0(&cube, &xn, &wn, 1.0, 0.1)).is_empty());
}
