//! Each layer's MLP up and down projections as one trainable `[d_ff, 2·hidden]` matrix,
//! the neuron-major layout the TwELL kernels read (row j: `up_proj` row j, then
//! `down_proj` column j; see `twell::up_down_matrix`).
//!
//! A sparse fine-tune trains this matrix itself, which saves per layer and step the
//! copy that builds it from the two HF weights and the strided adds that split its
//! gradient back. Checkpoints stay in HF layout: the matrix is split on save, and
//! optimizer state saved in either layout is converted on resume.

use std::collections::HashMap;

use candle_core::{Result, Tensor};

/// Name suffixes of a layer's HF up and down weights and of their fused matrix.
pub const UP: &str = "mlp.up_proj.weight";
pub const DOWN: &str = "mlp.down_proj.weight";
pub const UP_DOWN: &str = "mlp.up_down.weight";

/// `up [f, d]` and `down [d, f]` as one `[f, 2d]` matrix.
pub fn fuse(up: &Tensor, down: &Tensor) -> Result<Tensor> {
    twell::up_down_matrix(up, down)
}

/// `[f, 2d]` back into contiguous `(up [f, d], down [d, f])`.
pub fn split(up_down: &Tensor) -> Result<(Tensor, Tensor)> {
    let (_, two_d) = up_down.dims2()?;
    if two_d % 2 != 0 {
        candle_core::bail!("an up/down matrix has an even number of columns, got {two_d}");
    }
    let d = two_d / 2;
    Ok((
        up_down.narrow(1, 0, d)?.contiguous()?,
        up_down.narrow(1, d, d)?.t()?.contiguous()?,
    ))
}

/// `map` with every `<prefix>mlp.up_proj.weight` / `<prefix>mlp.down_proj.weight` pair
/// replaced by `<prefix>mlp.up_down.weight`. Any prefix works (parameter names, or the
/// optimizer's `m.` / `v.` / `master.` state of them). An up without its down is an error.
pub fn fuse_map(mut map: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let prefixes: Vec<String> = map
        .keys()
        .filter_map(|k| k.strip_suffix(UP).map(str::to_string))
        .collect();
    for prefix in prefixes {
        let up = map.remove(&format!("{prefix}{UP}")).expect("listed above");
        let Some(down) = map.remove(&format!("{prefix}{DOWN}")) else {
            candle_core::bail!("'{prefix}{UP}' has no '{prefix}{DOWN}' to fuse with");
        };
        map.insert(format!("{prefix}{UP_DOWN}"), fuse(&up, &down)?);
    }
    Ok(map)
}

/// The inverse of [`fuse_map`].
pub fn split_map(mut map: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let prefixes: Vec<String> = map
        .keys()
        .filter_map(|k| k.strip_suffix(UP_DOWN).map(str::to_string))
        .collect();
    for prefix in prefixes {
        let (up, down) = split(&map.remove(&format!("{prefix}{UP_DOWN}")).expect("listed"))?;
        map.insert(format!("{prefix}{UP}"), up);
        map.insert(format!("{prefix}{DOWN}"), down);
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn fuse_and_split_round_trip_any_prefix() -> Result<()> {
        let dev = Device::Cpu;
        let up = Tensor::randn(0f32, 1.0, (6, 4), &dev)?;
        let down = Tensor::randn(0f32, 1.0, (4, 6), &dev)?;
        let other = Tensor::randn(0f32, 1.0, 3, &dev)?;
        let mut map = HashMap::new();
        for p in ["model.layers.0.", "m.model.layers.1."] {
            map.insert(format!("{p}{UP}"), up.clone());
            map.insert(format!("{p}{DOWN}"), down.clone());
        }
        map.insert("model.norm.weight".to_string(), other.clone());
        let fused = fuse_map(map)?;
        assert_eq!(fused.len(), 3);
        let w = &fused[&format!("model.layers.0.{UP_DOWN}")];
        assert_eq!(w.dims(), &[6, 8]);
        // Row j holds up row j, then down column j.
        let row: Vec<f32> = w.get(2)?.to_vec1()?;
        assert_eq!(&row[..4], &up.get(2)?.to_vec1::<f32>()?[..]);
        assert_eq!(&row[4..], &down.t()?.get(2)?.to_vec1::<f32>()?[..]);
        let back = split_map(fused)?;
        assert_eq!(back.len(), 5);
        for p in ["model.layers.0.", "m.model.layers.1."] {
            let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
                (a - b)?.abs()?.max_all()?.to_scalar::<f32>()
            };
            assert_eq!(diff(&back[&format!("{p}{UP}")], &up)?, 0.0);
            assert_eq!(diff(&back[&format!("{p}{DOWN}")], &down)?, 0.0);
        }
        Ok(())
    }

    #[test]
    fn an_up_without_its_down_is_an_error() {
        let up = Tensor::zeros((6, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let map = HashMap::from([(format!("model.layers.0.{UP}"), up)]);
        let e = fuse_map(map).unwrap_err().to_string();
        assert!(e.contains("down_proj"), "{e}");
    }
}
