//! Timing that can be trusted: warm-up, interleaved variants, medians, device sync.

use std::time::Instant;

use candle_core::{Device, Result};

/// `--warmup` and `--reps` of the benchmarks that time variants side by side.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct Rounds {
    /// Untimed rounds before timing.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed rounds; the median is reported.
    #[arg(long, default_value_t = 11)]
    pub reps: usize,
}

impl Rounds {
    /// A median needs at least one timed round.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.reps == 0 {
            anyhow::bail!("--reps must be at least 1");
        }
        Ok(())
    }
}

/// Waits for queued device work, so a host clock brackets it exactly.
pub fn sync(device: &Device) -> Result<()> {
    device.synchronize()
}

/// Times each variant `reps` times, round-robin (so drift hits all alike), after
/// `warmup` untimed rounds; returns each variant's median in seconds.
pub fn interleaved_medians(
    device: &Device,
    Rounds { warmup, reps }: Rounds,
    variants: &mut [&mut dyn FnMut(usize) -> Result<()>],
) -> Result<Vec<f64>> {
    for round in 0..warmup {
        for v in variants.iter_mut() {
            v(round)?;
        }
    }
    sync(device)?;
    let mut times = vec![Vec::with_capacity(reps); variants.len()];
    let n = variants.len();
    for round in 0..reps {
        // Each round starts with a different variant, so none always runs right after
        // the same neighbour (whose threads may still be spinning, or whose data may
        // still be cached).
        for i in 0..n {
            let k = (round + i) % n;
            sync(device)?;
            let t0 = Instant::now();
            variants[k](round)?;
            sync(device)?;
            times[k].push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(times.into_iter().map(median).collect())
}

pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// This machine's host memory read bandwidth in bytes/s: all threads summing a
/// buffer far larger than any cache.
pub fn host_read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let buf = vec![1u32; 128 << 20]; // 512 MiB
    let bytes = (buf.len() * 4) as f64;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t0 = Instant::now();
        // Integer sums vectorise, so the loop is bound by memory, not by adds.
        let s: u32 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u32, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u32::wrapping_add);
        std::hint::black_box(s);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    bytes / best
}
