//! How the one-step decode attention (`causal_attention_step` in
//! `kernels/src/causal_attention.cu`) spreads over the card: with few sequences, a block per
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
/// `sms` multiprocessors. Every split holds at least one cached position.
pub fn plan(pairs: usize, len: usize, sms: usize) -> StepSplit {
    let wanted = (BLOCKS_PER_SM * sms).div_ceil(pairs.max(1));
    let splits = wanted.min(len / MIN_KEYS_PER_SPLIT).max(1);
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

#[cfg(test)]
mod tests {
    use super::plan;

    /// (splits, chunk) of a plan.
    fn of(pairs: usize, len: usize) -> (usize, usize) {
        let p = plan(pairs, len, 132);
        (p.splits, p.chunk)
    }

    #[test]
    fn few_sequences_split_the_cache_and_many_do_not() {
        // One sequence of 32 heads on 132 multiprocessors: 9 splits would fill a wave,
        // 64 positions a split allow 7 of 511 positions, and all 9 of 2047.
        assert_eq!(of(32, 511), (7, 73));
        assert_eq!(of(32, 2047), (9, 228));
        // A short cache is not split below 64 positions a split.
        assert_eq!(of(32, 100), (1, 100));
        assert_eq!(of(8, 130), (2, 65));
        // Enough (head, sequence) blocks for the card: one block each.
        assert_eq!(of(512, 2047), (1, 2047));
        // An empty cache never splits.
        assert_eq!(of(4, 0), (1, 0));
        // Every split holds 64 positions at least; the last may hold fewer.
        for len in [64, 127, 128, 129, 700, 4095] {
            let (splits, chunk) = of(4, len);
            assert!(splits * chunk >= len && (splits - 1) * chunk < len, "{len}");
            assert!(splits == 1 || chunk >= 64, "{len}: {splits} x {chunk}");
        }
    }
}
