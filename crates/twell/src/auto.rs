//! `FfnMode::Auto`'s choice per call: sparse while the measured density is at most the
//! break-even for the device and the number of tokens, dense above it. The break-evens
//! are constants measured on the H200 at hidden 2048 / d_ff 5632 (docs/benchmarks.md).

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

/// In `Auto` mode on a GPU, the density is re-measured every this many calls.
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

#[cfg(test)]
mod tests {
    use super::*;

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
