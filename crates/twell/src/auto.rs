//! `FfnMode::Auto`'s choice per call.
//!
//! At inference `Auto` times its candidates on the calls it serves and keeps the fastest
//! ([`choose`]): the TwELL kernels, and the dense side's two forms, candle's three matmuls
//! and, on a GPU, [`crate::twell_mlp_products`]. The times are kept per device, MLP shape,
//! rows and density (each bucketed, [`Cell`]), for the life of the process, so every layer
//! of a model and every model of that shape share them. A cell is decided after each
//! candidate has run [`CALIBRATION_WARMUP`] untimed-for-the-decision calls and
//! [`CALIBRATION_SAMPLES`] timed ones; from then on the calls are not timed. On a GPU the
//! times come from device events read when they have completed, so no call waits for one.
//!
//! Training, and a caller's own break-even ([`crate::SparseMlp::with_break_even`]), keep
//! the rule below: sparse while the measured density is at most a break-even for the
//! device and the number of tokens. Those break-evens are constants measured on the H200
//! at hidden 2048 / d_ff 5632 (docs/benchmarks.md).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// Density above which the sparse CPU path stops paying: at hidden 2048 / d_ff 5632
/// the sparse MLP is still faster than candle's dense one at 10% density for every
/// measured M (docs/benchmarks.md), and loses at 50%.
pub const DEFAULT_BREAK_EVEN_DENSITY: f64 = 0.15;

/// The same on CUDA (H200, hidden 2048 / d_ff 5632), against `Auto`'s dense side at
/// inference ([`crate::twell_mlp_products`], 1.15–1.38x of candle's dense MLP at
/// every density measured from 1.5% to 50%): at 2k / 16k / 65k tokens the TwELL kernels reach
/// 1.64x / 1.93x / 2.05x at 0.5%, 1.23x / 1.44x / 1.50x at 1% and 0.99x / 1.12x /
/// 1.16x at 1.5%, so the two cross at 0.95% / 1.13% / 1.18% (2026-12-03). Against
/// candle's dense MLP alone the crossing was 1.5–1.8%.
pub const CUDA_BREAK_EVEN_DENSITY: f64 = 0.011;

/// From 2 tokens up to this many the CUDA sparse path lost to dense (or tied, at 256
/// tokens and 0.5%) at every density measured, so `Auto` runs dense there (at
/// inference its dense side, 1.05–1.08x of candle's at 256 tokens).
pub const CUDA_AUTO_MIN_TOKENS: usize = 512;

/// Below this many tokens (and from [`CUDA_AUTO_MIN_TOKENS`]) the prefill kernels split
/// each row over four warps, and the sparse path wins by less: 1.16–1.26x at 0.5%,
/// 1.04–1.06x at 1%, 0.61–0.66x at 3% (512 and 1,024 tokens), so `Auto` takes
/// [`CUDA_FEW_TOKENS_BREAK_EVEN_DENSITY`] there. (`Auto`'s dense side at inference
/// reaches 1.06x at 512 tokens: level with the sparse path's 1% there.)
pub const CUDA_FEW_TOKENS: usize = 2048;

/// The break-even density for [`CUDA_AUTO_MIN_TOKENS`] ..  [`CUDA_FEW_TOKENS`] tokens.
pub const CUDA_FEW_TOKENS_BREAK_EVEN_DENSITY: f64 = 0.01;

/// Single-token decode on CUDA (the one-launch kernel): sparse won 2.1–2.3x up to 3%
/// density and 1.4x at 10%, and lost at 50% (0.52x); interpolating puts the break-even
/// near 19%, so this keeps a margin.
pub const CUDA_DECODE_BREAK_EVEN_DENSITY: f64 = 0.15;

/// In `Auto` mode the density is re-measured every this many calls
/// ([`crate::SparseMlp::with_density_recheck`]).
pub const AUTO_RECHECK_CALLS: usize = 32;

/// `Auto` decides a call of `tokens` rows by a density measured on at least
/// `min(tokens, AUTO_EVIDENCE_TOKENS)` rows; a call with no such measurement runs sparse
/// and measures. Why: one decode token's density is noise for the next prompt's prefill
/// (a benchmark that timed one token before 16k tokens saw `Auto` keep a single token's
/// 1.12% for its 1% prefill and take the slower dense side).
pub const AUTO_EVIDENCE_TOKENS: usize = 256;

/// `Auto` mode's choice for a call of `tokens` rows: sparse while the last measured
/// density is at most the break-even (`break_even`, else the measured default for the
/// device and size), and sparse before any measurement (which that call then takes). On
/// a GPU the sparse path pays for one token or for many, not for a few
/// (docs/benchmarks.md), so 2 to [`CUDA_AUTO_MIN_TOKENS`] - 1 rows run dense.
pub(crate) fn auto_runs_sparse(
    tokens: usize,
    cuda: bool,
    break_even: Option<f64>,
    last_density: Option<f64>,
) -> bool {
    if cuda && tokens > 1 && tokens < CUDA_AUTO_MIN_TOKENS {
        return false;
    }
    let break_even = match (break_even, cuda) {
        (Some(b), _) => b,
        (None, true) if tokens == 1 => CUDA_DECODE_BREAK_EVEN_DENSITY,
        (None, true) if tokens < CUDA_FEW_TOKENS => CUDA_FEW_TOKENS_BREAK_EVEN_DENSITY,
        (None, true) => CUDA_BREAK_EVEN_DENSITY,
        (None, false) => DEFAULT_BREAK_EVEN_DENSITY,
    };
    last_density.is_none_or(|density| density <= break_even)
}

/// Where a call of `FfnMode::Auto` ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The TwELL kernels.
    Sparse,
    /// [`crate::twell_mlp_products`]: cuBLAS GEMMs around one element-wise kernel.
    Products,
    /// candle's three matmuls.
    Dense,
}

impl Side {
    /// Its name in logs and benchmark reports.
    pub fn name(self) -> &'static str {
        match self {
            Side::Sparse => "sparse",
            Side::Products => "products",
            Side::Dense => "dense",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Untimed-for-the-decision calls of each candidate in a cell before its timed ones: the
/// first calls of a shape load kernels and make cuBLAS(Lt) plans.
pub const CALIBRATION_WARMUP: usize = 1;
/// Timed calls of each candidate in a cell; the median decides.
pub const CALIBRATION_SAMPLES: usize = 3;
/// Where the two fastest candidates' medians lie within [`CLOSE_RATIO`] of each other,
/// both are timed on up to this many calls, so that noise between calls (10% at tens
/// of microseconds) does not pick the slower one.
pub const CALIBRATION_MAX_SAMPLES: usize = 9;
/// See [`CALIBRATION_MAX_SAMPLES`].
pub const CLOSE_RATIO: f64 = 1.15;

/// Which entry point of [`crate::SparseMlp`] a call came through: each times different
/// work (the MLP alone, or with the norms around it), so each is timed apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Entry {
    /// `forward`, `forward_with_l1`.
    Mlp,
    /// `forward_add_norm`: the MLP, then the residual add and norm after it.
    AddNorm,
    /// `forward_sublayer`: the add and norm before the MLP too.
    Sublayer,
    /// `forward_sublayer_from_sum`: the norm before the MLP (folded into the weights),
    /// the MLP, the add and norm after it.
    SublayerFromSum,
}

/// The calls `Auto` times alike: one device, one MLP shape, one entry point, a power of
/// two of rows, and a density within a factor of [`DENSITY_BUCKET`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cell {
    /// The CUDA ordinal, or `usize::MAX` for the host.
    pub device: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub entry: Entry,
    /// `floor(log2(rows))`.
    pub rows_log2: u32,
    /// `floor(log(density) / log(DENSITY_BUCKET))`.
    pub density_bucket: i32,
}

/// The ratio between the densities a cell's bounds stand apart: the sparse kernels'
/// time grows with the density, so one cell must not span much of it.
pub const DENSITY_BUCKET: f64 = 1.25;

impl Cell {
    pub fn new(
        device: &candle_core::Device,
        (hidden, ffn): (usize, usize),
        entry: Entry,
        rows: usize,
        density: f64,
    ) -> Self {
        let density = density.clamp(1e-6, 1.0);
        Self {
            device: match device.location() {
                candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
                _ => usize::MAX,
            },
            hidden,
            ffn,
            entry,
            rows_log2: rows.max(1).ilog2(),
            density_bucket: (density.ln() / DENSITY_BUCKET.ln()).floor() as i32,
        }
    }
}

/// What one cell has seen of each side: calls started, and the times of the timed ones.
#[derive(Clone, Debug, Default)]
struct Record {
    started: [usize; 3],
    times_ms: [Vec<f64>; 3],
    /// The side once no more timings are wanted among a set of candidates (as a bit
    /// set of [`Side::index`]): a decided call reads it, not the medians.
    settled: Option<(u8, Side)>,
}

impl Record {
    /// The side to run: a candidate still short of calls (the one with the fewest), else
    /// the fastest by median, and whether to time the call.
    fn choose(&mut self, candidates: &[Side]) -> (Side, bool) {
        let set = candidate_set(candidates);
        if let Some((_, side)) = self.settled.filter(|&(s, _)| s == set) {
            return (side, false);
        }
        let wanted = CALIBRATION_WARMUP + CALIBRATION_SAMPLES;
        let short = candidates
            .iter()
            .copied()
            .filter(|s| self.started[s.index()] < wanted)
            .min_by_key(|s| self.started[s.index()]);
        if let Some(side) = short {
            self.started[side.index()] += 1;
            return (side, true);
        }
        let mut ranked: Vec<Side> = candidates
            .iter()
            .copied()
            .filter(|s| !self.times_ms[s.index()].is_empty())
            .collect();
        ranked.sort_by(|a, b| self.median(*a).total_cmp(&self.median(*b)));
        let Some(&fastest) = ranked.first() else {
            // Timings still in flight: the first candidate until they land.
            return (candidates[0], false);
        };
        // Two candidates close together: time both more, the less-run first.
        if let Some(&second) = ranked.get(1) {
            let close = self.median(second) < CLOSE_RATIO * self.median(fastest);
            let most = CALIBRATION_WARMUP + CALIBRATION_MAX_SAMPLES;
            let more = [fastest, second]
                .into_iter()
                .filter(|s| self.started[s.index()] < most)
                .min_by_key(|s| self.started[s.index()]);
            if let (true, Some(side)) = (close, more) {
                // Wait for the timings in flight before asking for more.
                if self.landed(&[fastest, second]) {
                    self.started[side.index()] += 1;
                    return (side, true);
                }
                return (fastest, false);
            }
        }
        // Every candidate timed, none close enough to want more: settled, once the
        // timings in flight have landed.
        if self.landed(candidates) && ranked.len() == candidates.len() {
            self.settled = Some((set, fastest));
        }
        (fastest, false)
    }

    /// Whether every started call of `sides` has its time filed (or was a warm-up).
    fn landed(&self, sides: &[Side]) -> bool {
        sides
            .iter()
            .all(|s| self.times_ms[s.index()].len() + CALIBRATION_WARMUP >= self.started[s.index()])
    }

    /// The median of a side's timed calls (warm-up excluded).
    fn median(&self, side: Side) -> f64 {
        let mut t = self.times_ms[side.index()].clone();
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied().unwrap_or(f64::INFINITY)
    }

    /// Files a timed call. The first [`CALIBRATION_WARMUP`] of a side only warm up.
    fn add(&mut self, side: Side, ms: f64, call: usize) {
        if call >= CALIBRATION_WARMUP && ms.is_finite() {
            self.times_ms[side.index()].push(ms);
        }
    }
}

/// `candidates` as a bit set of [`Side::index`].
fn candidate_set(candidates: &[Side]) -> u8 {
    candidates.iter().fold(0, |set, s| set | 1 << s.index())
}

/// A started timing on a GPU: its events are read once the device has passed them.
#[cfg(feature = "cuda")]
struct PendingEvents {
    cell: Cell,
    side: Side,
    call: usize,
    start: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    end: candle_core::cuda_backend::cudarc::driver::CudaEvent,
}

/// Every cell's record, and the GPU timings not yet read.
#[derive(Default)]
struct Calibration {
    cells: HashMap<Cell, Record>,
    #[cfg(feature = "cuda")]
    pending: Vec<PendingEvents>,
}

static CALIBRATION: Mutex<Option<Calibration>> = Mutex::new(None);

fn with_calibration<R>(f: impl FnOnce(&mut Calibration) -> R) -> R {
    let mut guard = CALIBRATION.lock().expect("calibration lock");
    f(guard.get_or_insert_with(Calibration::default))
}

/// The side a call in `cell` runs among `candidates` (the first is the fallback while the
/// cell's timings are in flight), and, when the call should be timed, a timer to start
/// before it runs and finish after. A call that may not be timed (it does more than its
/// cell's usual work) asks [`decided`] instead.
pub fn choose(cell: Cell, candidates: &[Side]) -> (Side, Option<Timing>) {
    with_calibration(|c| {
        #[cfg(feature = "cuda")]
        c.read_completed_events();
        let record = c.cells.entry(cell).or_default();
        let (side, timed) = record.choose(candidates);
        let call = record.started[side.index()] - 1;
        let timing = timed.then_some(Timing { cell, side, call });
        (side, timing)
    })
}

/// The decision of a cell once calibrated: its fastest side by median, once every one of
/// `candidates` has its timed calls in and no more are wanted.
pub fn decided(cell: Cell, candidates: &[Side]) -> Option<Side> {
    with_calibration(|c| {
        #[cfg(feature = "cuda")]
        c.read_completed_events();
        let record = c.cells.get_mut(&cell)?;
        let set = candidate_set(candidates);
        if record.settled.is_none_or(|(s, _)| s != set) {
            // Ask a copy, so that a call that would be timed is not counted as started.
            let mut peek = record.clone();
            peek.choose(candidates);
            record.settled = peek.settled;
        }
        record.settled.map(|(_, side)| side)
    })
}

/// A call to time: which cell and side, and the side's call number in the cell.
pub struct Timing {
    cell: Cell,
    side: Side,
    call: usize,
}

/// A running timer of one call.
pub enum Timer {
    Host(Instant, Timing),
    #[cfg(feature = "cuda")]
    Cuda(candle_core::cuda_backend::cudarc::driver::CudaEvent, Timing),
}

impl Timing {
    /// Starts timing on `device`: a host clock, or an event on the GPU's stream.
    pub fn start(self, device: &candle_core::Device) -> candle_core::Result<Timer> {
        match device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(dev) => {
                use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
                use candle_core::cuda_backend::WrapErr;
                let event = dev
                    .cuda_stream()
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?;
                Ok(Timer::Cuda(event, self))
            }
            _ => Ok(Timer::Host(Instant::now(), self)),
        }
    }
}

impl Timer {
    /// Ends the timing after the call was enqueued: a host call is filed now, a GPU
    /// call once the device has run it (read at a later [`choose`]).
    pub fn finish(self, device: &candle_core::Device) -> candle_core::Result<()> {
        match self {
            Timer::Host(start, t) => {
                let _ = device;
                let ms = start.elapsed().as_secs_f64() * 1e3;
                with_calibration(|c| c.cells.entry(t.cell).or_default().add(t.side, ms, t.call));
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Timer::Cuda(start, t) => {
                use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
                use candle_core::cuda_backend::WrapErr;
                let candle_core::Device::Cuda(dev) = device else {
                    candle_core::bail!("a GPU timing finished on {device:?}");
                };
                let end = dev
                    .cuda_stream()
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?;
                with_calibration(|c| {
                    c.pending.push(PendingEvents {
                        cell: t.cell,
                        side: t.side,
                        call: t.call,
                        start,
                        end,
                    })
                });
                Ok(())
            }
        }
    }
}

#[cfg(feature = "cuda")]
impl Calibration {
    /// Files the GPU timings whose events the device has passed.
    fn read_completed_events(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        for p in pending {
            match p.end.try_is_complete() {
                Ok(true) => {
                    if let Ok(ms) = p.start.elapsed_ms(&p.end) {
                        self.cells
                            .entry(p.cell)
                            .or_default()
                            .add(p.side, ms as f64, p.call);
                    }
                }
                Ok(false) => self.pending.push(p),
                // A failed launch is reported by the op that made it; drop its timing.
                Err(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(rows: usize, density: f64) -> Cell {
        Cell::new(
            &candle_core::Device::Cpu,
            (64, 256),
            Entry::Mlp,
            rows,
            density,
        )
    }

    #[test]
    fn cells_bucket_rows_by_powers_of_two_and_density_by_a_factor() {
        assert_eq!(cell(1, 0.01).rows_log2, 0);
        assert_eq!(cell(3, 0.01).rows_log2, 1);
        assert_eq!(cell(4, 0.01).rows_log2, 2);
        assert_eq!(cell(16384, 0.01), cell(32767, 0.01));
        assert_ne!(cell(16384, 0.01), cell(32768, 0.01));
        // Within a factor of 1.25 at most one boundary lies between two densities.
        assert_eq!(
            cell(64, 0.0101).density_bucket,
            cell(64, 0.0102).density_bucket
        );
        assert!(cell(64, 0.01).density_bucket < cell(64, 0.013).density_bucket);
        // Zero and out-of-range densities still bucket.
        assert!(cell(64, 0.0).density_bucket < cell(64, 0.001).density_bucket);
        assert_eq!(cell(64, 2.0).density_bucket, cell(64, 1.0).density_bucket);
    }

    #[test]
    fn a_record_tries_every_candidate_then_keeps_the_fastest_median() {
        let candidates = [Side::Sparse, Side::Products, Side::Dense];
        let mut r = Record::default();
        // Each candidate runs warm-up + samples calls, the least-run first.
        let mut runs = Vec::new();
        for _ in 0..(CALIBRATION_WARMUP + CALIBRATION_SAMPLES) * 3 {
            let (side, timed) = r.choose(&candidates);
            assert!(timed);
            let call = r.started[side.index()] - 1;
            // Sparse is slow on its warm-up call only; products is the fastest.
            let ms = match (side, call) {
                (Side::Sparse, 0) => 100.0,
                (Side::Sparse, _) => 2.0,
                (Side::Products, _) => 1.5,
                (Side::Dense, _) => 3.0,
            };
            r.add(side, ms, call);
            runs.push(side);
        }
        for s in candidates {
            assert_eq!(runs.iter().filter(|&&x| x == s).count(), 4, "{runs:?}");
        }
        // Decided: the fastest median, untimed from now on.
        assert_eq!(r.choose(&candidates), (Side::Products, false));
        assert_eq!(r.choose(&candidates[..1]), (Side::Sparse, false));
        // One outlier among three samples does not move the median.
        let mut noisy = r.clone();
        noisy.times_ms[Side::Products.index()][0] = 50.0;
        assert_eq!(noisy.choose(&candidates), (Side::Products, false));
    }

    #[test]
    fn close_candidates_are_timed_more_before_the_faster_is_kept() {
        let candidates = [Side::Sparse, Side::Dense];
        let mut r = Record::default();
        let mut calls = 0;
        // Sparse 1.00 ms and dense 1.05 ms: within CLOSE_RATIO, so both take the most
        // samples; the faster median wins.
        loop {
            let (side, timed) = r.choose(&candidates);
            if !timed {
                assert_eq!(side, Side::Sparse);
                break;
            }
            let call = r.started[side.index()] - 1;
            let ms = if side == Side::Sparse { 1.0 } else { 1.05 };
            r.add(side, ms, call);
            calls += 1;
        }
        assert_eq!(calls, 2 * (CALIBRATION_WARMUP + CALIBRATION_MAX_SAMPLES));
    }

    #[test]
    fn timed_host_calls_decide_a_cell() -> candle_core::Result<()> {
        let cell = Cell::new(&candle_core::Device::Cpu, (7, 11), Entry::Mlp, 5, 0.3);
        let candidates = [Side::Sparse, Side::Dense];
        let dev = candle_core::Device::Cpu;
        let mut ran = Vec::new();
        for _ in 0..(CALIBRATION_WARMUP + CALIBRATION_MAX_SAMPLES) * 2 {
            if decided(cell, &candidates).is_some() {
                break;
            }
            let (side, timing) = choose(cell, &candidates);
            let timer = timing.expect("calibrating calls are timed").start(&dev)?;
            // The dense side is the slow one here.
            if side == Side::Dense {
                std::thread::sleep(std::time::Duration::from_millis(3));
            }
            timer.finish(&dev)?;
            ran.push(side);
        }
        assert_eq!(decided(cell, &candidates), Some(Side::Sparse), "{ran:?}");
        let (side, timing) = choose(cell, &candidates);
        assert_eq!(side, Side::Sparse);
        assert!(timing.is_none(), "a decided cell is not timed");
        // Another entry point is a cell of its own, undecided.
        let fresh = Cell::new(&dev, (7, 11), Entry::AddNorm, 5, 0.3);
        assert_eq!(decided(fresh, &candidates), None);
        Ok(())
    }

    #[test]
    fn auto_picks_by_device_size_and_density() {
        let sparse = |tokens, cuda, density| auto_runs_sparse(tokens, cuda, None, Some(density));
        // Host: one break-even at every size.
        assert!(sparse(1, false, DEFAULT_BREAK_EVEN_DENSITY));
        assert!(sparse(300, false, 0.1));
        assert!(!sparse(300, false, 0.2));
        // GPU, one token: the decode kernel's break-even.
        assert!(sparse(1, true, 0.1));
        assert!(!sparse(1, true, 0.2));
        // GPU, 2 to 511 tokens: dense at any density.
        assert!(!sparse(2, true, 0.001));
        assert!(!sparse(CUDA_AUTO_MIN_TOKENS - 1, true, 0.001));
        // GPU, 512 to 2,047 tokens: 1%.
        assert!(sparse(CUDA_AUTO_MIN_TOKENS, true, 0.01));
        assert!(!sparse(CUDA_AUTO_MIN_TOKENS, true, 0.011));
        assert!(!sparse(CUDA_FEW_TOKENS - 1, true, 0.011));
        // GPU, 2,048 tokens and more: 1.1%.
        assert!(sparse(CUDA_FEW_TOKENS, true, 0.011));
        assert!(!sparse(CUDA_FEW_TOKENS, true, 0.012));
    }

    #[test]
    fn auto_starts_sparse_and_honours_a_set_break_even() {
        // No density yet: the first call runs sparse and measures it.
        assert!(auto_runs_sparse(4096, true, None, None));
        assert!(auto_runs_sparse(1, false, None, None));
        // A set break-even replaces the default, but not the GPU's few-token rule.
        assert!(auto_runs_sparse(4096, true, Some(0.5), Some(0.4)));
        assert!(!auto_runs_sparse(4096, true, Some(0.01), Some(0.012)));
        assert!(!auto_runs_sparse(100, true, Some(0.5), Some(0.001)));
    }
}
