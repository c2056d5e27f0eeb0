//! Random-weight models of any shape reach the FFN density they were made for.

use candle_core::{DType, Device, Tensor};
use sparse_llama::Cache;

#[test]
fn synthetic_models_hit_their_target_density() {
    use sparse_llama::synthetic;
    let cfg = synthetic::config(128, 512, 4, 4, 2, 300).unwrap();
    for target in [0.01, 0.05] {
        let w = synthetic::weights(&cfg, target, 3, DType::F32, &Device::Cpu).unwrap();
        let mut model = sparse_llama::Llama::load(
            candle_nn::VarBuilder::from_tensors(w, DType::F32, &Device::Cpu),
            &cfg,
        )
        .unwrap();
        model.record_ffn_stats(true);
        let ids: Vec<u32> = (0..256u32).map(|i| (i * 7) % 300).collect();
        let x = Tensor::from_vec(ids, (2, 128), &Device::Cpu).unwrap();
        let mut cache = Cache::new(false, DType::F32, &cfg, &Device::Cpu).unwrap();
        model.forward_all(&x, 0, &mut cache).unwrap();
        for s in model.ffn_stats().unwrap().into_iter().flatten() {
            assert!(
                s.density > 0.5 * target && s.density < 2.0 * target,
                "target {target}: layer density {}",
                s.density
            );
        }
    }
}
