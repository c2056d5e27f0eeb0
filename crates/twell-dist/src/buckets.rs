//! A model's gradients averaged over the ranks: hundreds of tensors flattened into a few
//! f32 buckets, each one all-reduce, so that the per-call cost of a collective is paid a
//! few times a step rather than once per tensor.

use std::ops::Range;

use candle_core::{DType, Tensor};

use crate::{Communicator, Result};

/// A bucket's size: large enough that a collective's fixed cost is small against its
/// transfer, small enough that the flat copy stays a fraction of the gradients' memory.
pub const DEFAULT_BUCKET_BYTES: usize = 4 << 20;

/// Consecutive runs of `sizes` (element counts) of about `bucket_bytes` of f32 each: a
/// bucket closes once it reaches the size, so a tensor larger than it has a bucket of
/// its own. Every index is in exactly one bucket, in order.
pub fn buckets(sizes: &[usize], bucket_bytes: usize) -> Vec<Range<usize>> {
    let limit = (bucket_bytes / std::mem::size_of::<f32>()).max(1);
    let mut out = Vec::new();
    let (mut start, mut filled) = (0, 0);
    for (k, &n) in sizes.iter().enumerate() {
        filled += n;
        if filled >= limit {
            out.push(start..k + 1);
            (start, filled) = (k + 1, 0);
        }
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// Each of `tensors` summed over the ranks and divided by the world size, in f32 and in
/// its own shape, through flat buckets of about `bucket_bytes`. In a world of one the
/// tensors come back as they are.
pub fn all_reduce_mean(
    comm: &mut dyn Communicator,
    tensors: &[Tensor],
    bucket_bytes: usize,
) -> Result<Vec<Tensor>> {
    let world = comm.world_size();
    if world == 1 {
        return Ok(tensors.to_vec());
    }
    let sizes: Vec<usize> = tensors.iter().map(Tensor::elem_count).collect();
    let mut out = Vec::with_capacity(tensors.len());
    for range in buckets(&sizes, bucket_bytes) {
        let part = &tensors[range];
        let flat = part
            .iter()
            .map(|t| t.to_dtype(DType::F32)?.flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let summed = comm.all_reduce_sum_tensor(&Tensor::cat(&flat, 0)?)?;
        let mean = (summed / world as f64)?;
        let mut offset = 0;
        for t in part {
            let n = t.elem_count();
            out.push(mean.narrow(0, offset, n)?.reshape(t.shape())?);
            offset += n;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_tensor_once_in_order() {
        // 4-byte elements: a limit of 16 bytes is 4 elements.
        assert_eq!(buckets(&[1, 2, 1, 5, 3], 16), vec![0..3, 3..4, 4..5]);
        assert_eq!(buckets(&[10], 16), vec![0..1]);
        assert_eq!(buckets(&[], 16), Vec::<Range<usize>>::new());
        assert_eq!(buckets(&[0, 0, 1], 16), vec![0..3]);
        // Below one element, every tensor is its own bucket.
        assert_eq!(buckets(&[1, 1], 1), vec![0..1, 1..2]);
    }
}
