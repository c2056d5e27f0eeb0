//! How the one-step decode attention (`causal_attention_step` in
//! `kernels/causal_attention.cu`) spreads over the card: with few sequences, a block per
//! (head, sequence) leaves most multiprocessors idle while each block reads its whole
//! share of the KV cache, so the cached positions are split over several blocks whose
//! partial softmax sums the last of them merges. The plan is plain arithmetic, kept
//! apart from the launch so the host's tests hold it.

/// Fewest cached positions a split is worth: below this its fixed cost (the query's
/// RoPE, two block reductions) outweighs the keys it reads.
const MIN_KEYS_PER_SPLIT: usize = 64;
/// Blocks the splits aim for per multiprocessor: one wave of two 256-thread blocks.
const BLOCKS_PER_SM: usize = 2;

/// The splits of a step: `splits` blocks per (head, sequence), `chunk` cached positions
/// each (the last may hold fewer, and also takes the step's own key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSplit {
    pub splits: usize,
    pub chunk: usize,
}

/// The split for `pairs` (head, sequence) blocks over `len` cached positions on a card of
/// `sms` multiprocessors; `forced` (from `TWELL_ATTENTION_SPLITS`) asks for a count,
/// still bounded by the positions. Every split holds at least one cached position.
pub fn plan(pairs: usize, len: usize, sms: usize, forced: Option<usize>) -> StepSplit {
    let wanted = forced.unwrap_or_else(|| (BLOCKS_PER_SM * sms).div_ceil(pairs.max(1)));
    let by_keys = match forced {
        Some(_) => len,
        None => len / MIN_KEYS_PER_SPLIT,
    };
    let splits = wanted.min(by_keys).max(1);
    if splits == 1 {
        return StepSplit {
            splits: 1,
            chunk: len,
        };
    }
    let chunk = len.div_ceil(splits);
    StepSplit {
        splits: len.div_ceil(chunk),
        chunk,
    }
}

/// `TWELL_ATTENTION_SPLITS=n` fixes the split count (1: one block per head, as before the
/// splits), to measure them on one build.
pub fn forced_splits() -> candle_core::Result<Option<usize>> {
    static FORCED: crate::knobs::Cell = std::sync::OnceLock::new();
    crate::knobs::read_once(&FORCED, || {
        crate::knobs::env_count(
            "TWELL_ATTENTION_SPLITS",
            "a split count of 1 or more",
            |n| n >= 1,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::plan;

    /// (splits, chunk) of a plan.
    fn of(pairs: usize, len: usize, forced: Option<usize>) -> (usize, usize) {
        let p = plan(pairs, len, 132, forced);
        (p.splits, p.chunk)
    }

    #[test]
    fn few_sequences_split_the_cache_and_many_do_not() {
        // One sequence of 32 heads on 132 multiprocessors: 9 splits would fill a wave,
        // 64 positions a split allow 7 of 511 positions, and all 9 of 2047.
        assert_eq!(of(32, 511, None), (7, 73));
        assert_eq!(of(32, 2047, None), (9, 228));
        // A short cache is not split below 64 positions a split.
        assert_eq!(of(32, 100, None), (1, 100));
        assert_eq!(of(8, 130, None), (2, 65));
        // Enough (head, sequence) blocks for the card: one block each.
        assert_eq!(of(512, 2047, None), (1, 2047));
        // An empty cache never splits, even when asked to.
        assert_eq!(of(4, 0, Some(8)), (1, 0));
        // Asked for, within the positions; every split holds one at least.
        assert_eq!(of(32, 3, Some(8)), (3, 1));
        assert_eq!(of(32, 10, Some(4)), (4, 3));
        assert_eq!(of(32, 511, Some(1)), (1, 511));
    }
}
