//! Which kernel the CUDA prefill forward's down projection takes. Kept outside the CUDA
//! module so that callers (checks, benchmarks) name it in any build; on the CPU it
//! changes nothing.

use std::sync::atomic::{AtomicU8, Ordering};

/// The prefill forward's down kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownKernel {
    /// `gated_t2d`'s row kernel: a warp per token, `Wd` rows read from L2.
    Rows,
    /// `gated_t2d_cols`: `Wd` in shared memory, a block per column slice.
    Columns,
}

/// 0: not forced; 1 + the kernel's place otherwise.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// Fixes the down kernel of every later prefill forward in this process (`None`: back
/// to `TWELL_DOWN` or the size rule), so that a check can run one case through both.
/// The column kernel still needs a shape it takes; elsewhere the row kernel runs.
pub fn force(kernel: Option<DownKernel>) {
    let v = match kernel {
        None => 0,
        Some(DownKernel::Rows) => 1,
        Some(DownKernel::Columns) => 2,
    };
    FORCED.store(v, Ordering::Relaxed);
}

/// The kernel [`force`] fixed, if any.
pub fn forced() -> Option<DownKernel> {
    match FORCED.load(Ordering::Relaxed) {
        1 => Some(DownKernel::Rows),
        2 => Some(DownKernel::Columns),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn force_sets_and_clears_the_kernel() {
        force(Some(DownKernel::Columns));
        assert_eq!(forced(), Some(DownKernel::Columns));
        force(Some(DownKernel::Rows));
        assert_eq!(forced(), Some(DownKernel::Rows));
        force(None);
        assert_eq!(forced(), None);
    }
}
