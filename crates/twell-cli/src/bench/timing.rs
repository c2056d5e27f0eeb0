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
    /// Also print every timed call of each variant (microseconds, in round order) to
    /// stderr: shows a variant whose calls are bimodal.
    #[arg(long)]
    pub print_times: bool,
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

/// The order in which round `round` runs `n` variants: rotated by one each round,
/// and reversed every other cycle of `n` rounds, so that over `2n` rounds each variant
/// runs first equally often and, for the two or three variants a bench times, follows
/// each other variant equally often (from four on, only its two cyclic neighbours). A plain
/// rotation always puts the same neighbour before a variant, and a long neighbour
/// (a sparse pass at 50% density) can leave the GPU slower for the call after it.
pub fn round_order(round: usize, n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).map(|i| (round + i) % n).collect();
    if (round / n.max(1)) % 2 == 1 {
        order.reverse();
    }
    order
}

/// Times each variant `reps` times, interleaved in [`round_order`] (so drift and
/// neighbours hit all alike), after `warmup` untimed rounds; returns each variant's
/// median in seconds.
pub fn interleaved_medians(
    device: &Device,
    Rounds {
        warmup,
        reps,
        print_times,
    }: Rounds,
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
        // No variant always runs right after the same neighbour (whose threads may
        // still be spinning, whose data may still be cached, or whose power draw may
        // still hold the clocks down).
        for k in round_order(round, n) {
            sync(device)?;
            let t0 = Instant::now();
            variants[k](round)?;
            sync(device)?;
            times[k].push(t0.elapsed().as_secs_f64());
        }
    }
    if print_times {
        for (k, t) in times.iter().enumerate() {
            let us: Vec<String> = t.iter().map(|s| format!("{:.0}", s * 1e6)).collect();
            eprintln!("variant {k} times (us): {}", us.join(" "));
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

#[cfg(test)]
mod tests {
    use super::round_order;
    use std::collections::HashMap;

    #[test]
    fn every_variant_leads_and_follows_each_other_equally_often() {
        for n in 1..=3 {
            let mut first = vec![0usize; n];
            let mut after: HashMap<(usize, usize), usize> = HashMap::new();
            for round in 0..2 * n {
                let order = round_order(round, n);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(
                    sorted,
                    (0..n).collect::<Vec<_>>(),
                    "round {round}: {order:?}"
                );
                first[order[0]] += 1;
                for w in order.windows(2) {
                    *after.entry((w[0], w[1])).or_default() += 1;
                }
            }
            assert!(first.iter().all(|&c| c == 2), "n {n}: firsts {first:?}");
            for a in 0..n {
                for b in (0..n).filter(|&b| b != a) {
                    let count = after.get(&(a, b)).copied().unwrap_or(0);
                    assert_eq!(count, 2, "n {n}: {a} before {b}");
                }
            }
        }
    }
}
