//! Keeps the host's worker threads awake between decode calls.
//!
//! A one-token MLP on the host takes a fraction of a millisecond, split over the rayon
//! workers. Between two such calls (attention, sampling, a dense neighbour in a
//! benchmark) the workers run out of work and sleep; on a virtual machine a sleeping
//! core halts, and for about a millisecond after it wakes it runs the next call at
//! about half speed (measured: a 0.47 ms call took 0.80 ms after 4 ms of idle
//! workers, and 0.50 ms when a thread kept the other core busy). This is the
//! "block time" of OpenMP runtimes: after a decode call every worker polls rayon for
//! new work, yielding the core to any other runnable thread, until a short window has
//! passed since the last call.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long the workers stay awake after a host decode call, unless
/// [`set_warm_window`] says otherwise.
pub const DEFAULT_WARM_WINDOW: Duration = Duration::from_millis(20);

/// The window in milliseconds ([`set_warm_window`]).
static WINDOW_MS: AtomicU64 = AtomicU64::new(DEFAULT_WARM_WINDOW.as_millis() as u64);

/// Nanoseconds since [`epoch`] until which the workers poll.
static WARM_UNTIL: AtomicU64 = AtomicU64::new(0);
/// Workers currently polling (or about to).
static POLLING: AtomicUsize = AtomicUsize::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// Sets how long the workers poll after a host decode call (whole milliseconds; zero
/// turns the polling off). Process-wide: the `twell` binary turns it off with the rest of
/// its host tuning (`--no-host-tuning`).
pub fn set_warm_window(window: Duration) {
    WINDOW_MS.store(window.as_millis() as u64, Ordering::Relaxed);
}

/// The window now in force.
pub fn warm_window() -> Duration {
    Duration::from_millis(WINDOW_MS.load(Ordering::Relaxed))
}

/// Workers polling now: for tests and diagnostics.
pub fn polling_workers() -> usize {
    POLLING.load(Ordering::Acquire)
}

/// Keeps every rayon worker polling for work until `window` from now. Cheap to call
/// after every decode call: it only moves the deadline while the workers poll.
pub fn keep_workers_warm(window: Duration) {
    if window.is_zero() {
        return;
    }
    let until = now_ns() + window.as_nanos() as u64;
    WARM_UNTIL.fetch_max(until, Ordering::Relaxed);
    let workers = rayon::current_num_threads();
    while POLLING.load(Ordering::Acquire) < workers {
        POLLING.fetch_add(1, Ordering::AcqRel);
        rayon::spawn(poll_until_deadline);
    }
}

/// Runs on a worker: executes any rayon work that arrives, else yields the core,
/// until the deadline passes.
fn poll_until_deadline() {
    while now_ns() < WARM_UNTIL.load(Ordering::Relaxed) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::thread::yield_now();
        }
    }
    POLLING.fetch_sub(1, Ordering::AcqRel);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// Work handed to the pool while its workers poll still runs (they take it), and
    /// the workers stop polling once the window has passed.
    #[test]
    fn polling_workers_take_work_and_stop() {
        keep_workers_warm(Duration::from_millis(30));
        assert!(polling_workers() >= rayon::current_num_threads());
        for _ in 0..50 {
            let sum: u64 = (0..10_000u64).into_par_iter().map(|v| v * 2).sum();
            assert_eq!(sum, 9_999 * 10_000);
        }
        let start = Instant::now();
        while polling_workers() > 0 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "workers still polling"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
