//! Bad input gets a clear error, never a panic or a silent wrong answer.

use candle_core::{DType, Device, Tensor};
use twell::{
    gate_pack, gated_t2d, twell_mlp, up_down_matrix, Activation, FfnMode, SparseMlp, Twell,
    TwellConfig,
};

fn t(shape: &[usize], dtype: DType) -> Tensor {
    Tensor::ones(shape, dtype, &Device::Cpu).unwrap()
}

fn msg<T: std::fmt::Debug>(r: candle_core::Result<T>) -> String {
    format!("{}", r.expect_err("expected an error"))
}

#[test]
fn config_rejects_bad_tile_and_compression() {
    assert!(msg(TwellConfig::new(100, 8)).contains("tile width"));
    assert!(msg(TwellConfig::new(512, 8)).contains("tile width"));
    assert!(msg(TwellConfig::new(256, 3)).contains("compression factor"));
}

#[test]
fn pack_rejects_bad_rank_and_dtype() {
    let cfg = TwellConfig::default();
    assert!(msg(Twell::pack(&t(&[4], DType::F32), cfg)).contains("rank-2"));
    assert!(msg(Twell::pack(&t(&[2, 3, 4], DType::F32), cfg)).contains("rank-2"));
    assert!(msg(Twell::pack(&t(&[2, 3], DType::U32), cfg)).contains("unsupported dtype"));
    assert!(msg(Twell::pack(&t(&[2, 3], DType::F64), cfg)).contains("unsupported dtype"));
}

#[test]
fn ops_reject_mismatched_shapes() {
    let cfg = TwellConfig::default();
    let x = t(&[3, 8], DType::F32);
    assert!(msg(gate_pack(&x, &t(&[16, 9], DType::F32), cfg)).contains("shape mismatch"));
    assert!(msg(twell_mlp(
        &x,
        &t(&[16, 8], DType::F32),
        &t(&[16, 8], DType::F32),
        cfg
    ))
    .contains("w_ud"));
    assert!(msg(twell_mlp(
        &x,
        &t(&[16, 8], DType::F32),
        &t(&[15, 16], DType::F32),
        cfg
    ))
    .contains("shape mismatch"));
    assert!(msg(up_down_matrix(
        &t(&[16, 8], DType::F32),
        &t(&[16, 8], DType::F32)
    ))
    .contains("down_proj"));
    let gate = gate_pack(&x, &t(&[16, 8], DType::F32), cfg).unwrap();
    assert!(msg(gated_t2d(
        &gate,
        &t(&[4, 8], DType::F32),
        &t(&[16, 16], DType::F32)
    ))
    .contains("rows"));
    assert!(msg(gated_t2d(&gate, &x, &t(&[17, 16], DType::F32))).contains("neurons"));
}

#[test]
fn ops_reject_mixed_dtypes_empty_and_bad_dtypes() {
    let cfg = TwellConfig::default();
    let x = t(&[3, 8], DType::F32);
    assert!(msg(gate_pack(&x, &t(&[16, 8], DType::BF16), cfg)).contains("dtypes differ"));
    assert!(msg(gate_pack(
        &t(&[0, 8], DType::F32),
        &t(&[16, 8], DType::F32),
        cfg
    ))
    .contains("empty"));
    assert!(msg(gate_pack(
        &t(&[3, 8], DType::U8),
        &t(&[16, 8], DType::U8),
        cfg
    ))
    .contains("unsupported dtype"));
    assert!(msg(twell_mlp(
        &t(&[3], DType::F32),
        &t(&[16, 8], DType::F32),
        &t(&[16, 16], DType::F32),
        cfg
    ))
    .contains("rank-2"));
}

#[test]
fn sparse_mlp_rejects_silu_sparse_and_wrong_shapes() {
    let (g, u, dn) = (
        t(&[16, 8], DType::F32),
        t(&[16, 8], DType::F32),
        t(&[8, 16], DType::F32),
    );
    let e = SparseMlp::new(
        g.clone(),
        u.clone(),
        dn.clone(),
        Activation::Silu,
        FfnMode::Sparse,
    )
    .unwrap_err();
    assert!(e.to_string().contains("ReLU"));
    let e = SparseMlp::new(
        g.clone(),
        u.clone(),
        t(&[16, 8], DType::F32),
        Activation::Relu,
        FfnMode::Sparse,
    )
    .unwrap_err();
    assert!(e.to_string().contains("down_proj"));
    let mlp = SparseMlp::new(g, u, dn, Activation::Relu, FfnMode::Sparse).unwrap();
    assert!(msg(candle_core::Module::forward(&mlp, &t(&[2, 9], DType::F32))).contains("expects 8"));
    assert!(Activation::from_hf("gelu").is_err());
    assert!("fast".parse::<FfnMode>().is_err());
}

#[test]
fn the_products_path_refuses_bad_shapes_and_gradients() {
    let cfg = TwellConfig::default();
    let x = t(&[3, 8], DType::F32);
    let e = msg(twell::twell_mlp_products(
        &x,
        &t(&[16, 8], DType::F32),
        &t(&[16, 8], DType::F32),
        cfg,
    ));
    assert!(
        e.contains("w_ud") && e.contains("twell_mlp_products"),
        "{e}"
    );
    let e = msg(twell::twell_mlp_products(
        &x,
        &t(&[16, 8], DType::F32),
        &t(&[16, 16], DType::BF16),
        cfg,
    ));
    assert!(e.contains("dtype"), "{e}");
    // It has no backward: a variable input is refused, not silently cut from the graph.
    let var = candle_core::Var::from_tensor(&x).unwrap();
    let e = msg(twell::twell_mlp_products(
        var.as_tensor(),
        &t(&[16, 8], DType::F32),
        &t(&[16, 16], DType::F32),
        cfg,
    ));
    assert!(e.contains("no backward"), "{e}");
}
