//! Property tests of the TwELL format: pack/unpack is `relu` exactly, at any shape,
//! tile, compression, dtype and density, overflow included.

use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use twell::{Twell, TwellConfig};

/// A dense matrix where each entry is positive with probability `density`.
fn matrix(rows: usize, cols: usize, density: f64, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..rows * cols)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            let mag = 0.01 + ((state >> 3) % 1000) as f32 / 100.0;
            if u < density {
                mag
            } else if u < density + (1.0 - density) / 2.0 {
                -mag
            } else {
                0.0
            }
        })
        .collect()
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn pack_unpack_is_relu(
        rows in 1usize..40,
        cols in 1usize..600,
        tile in prop_oneof![Just(32usize), Just(64), Just(128), Just(256)],
        cf in prop_oneof![Just(2usize), Just(4), Just(8)],
        density in prop_oneof![Just(0.0), Just(1.0), 0.0f64..1.0, 0.0f64..0.05],
        dtype in dtype_strategy(),
        seed in any::<u64>(),
    ) {
        let config = TwellConfig::new(tile, cf).unwrap();
        let src = matrix(rows, cols, density, seed);
        let h = Tensor::from_vec(src.clone(), (rows, cols), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let packed = Twell::pack(&h, config).unwrap();
        let back = packed.to_dense().unwrap();
        prop_assert_eq!(back.dtype(), dtype);
        let want = h.relu().unwrap().to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        let got = back.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        prop_assert_eq!(&got, &want);

        // Stats agree with a direct count, and overflow is exactly the tiles past capacity.
        let stats = packed.stats().unwrap();
        let nnz = want.iter().flatten().filter(|v| **v > 0.0).count();
        prop_assert_eq!(stats.nnz, nnz);
        let cap = tile / cf;
        let mut overflow_tiles = 0;
        let mut overflow_rows = 0;
        let mut max_per_tile = 0;
        for row in &want {
            let mut row_over = false;
            for t in row.chunks(tile) {
                let c = t.iter().filter(|v| **v > 0.0).count();
                max_per_tile = max_per_tile.max(c);
                if c > cap { overflow_tiles += 1; row_over = true; }
            }
            overflow_rows += row_over as usize;
            prop_assert_eq!(stats.l0_per_row.iter().map(|&v| v as usize).sum::<usize>(), nnz);
        }
        prop_assert_eq!(stats.overflow_tiles, overflow_tiles);
        prop_assert_eq!(stats.overflow_rows, overflow_rows);
        prop_assert_eq!(stats.max_per_tile, max_per_tile);
        prop_assert_eq!(packed.pattern().values_len(), packed.values().elem_count());

        // L1 of the packed values is the L1 of relu(h): every nonzero stored once.
        let l1_packed = packed.values().to_dtype(DType::F64).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        let l1_dense: f64 = want.iter().flatten().map(|v| *v as f64).sum();
        prop_assert!((l1_packed - l1_dense).abs() <= 1e-9 * (1.0 + l1_dense));
    }
}

#[test]
fn a_full_tile_overflows_into_the_fallback_and_is_kept() {
    let config = TwellConfig::new(32, 8).unwrap(); // 4 slots per tile
    let h = Tensor::ones((3, 70), DType::F32, &Device::Cpu).unwrap();
    let packed = Twell::pack(&h, config).unwrap();
    let stats = packed.stats().unwrap();
    assert_eq!(stats.overflow_tiles, 9); // 3 rows x 3 tiles (32 + 32 + 6 columns)
    assert_eq!(stats.overflow_rows, 3);
    assert_eq!(stats.nnz, 210);
    assert_eq!(
        packed.to_dense().unwrap().to_vec2::<f32>().unwrap(),
        h.to_vec2::<f32>().unwrap()
    );
}

#[test]
fn an_empty_matrix_packs_to_nothing() {
    let h = Tensor::zeros((5, 300), DType::BF16, &Device::Cpu).unwrap();
    let packed = Twell::pack(&h, TwellConfig::default()).unwrap();
    let s = packed.stats().unwrap();
    assert_eq!((s.nnz, s.overflow_tiles, s.max_per_tile), (0, 0, 0));
    assert_eq!(s.density, 0.0);
}
