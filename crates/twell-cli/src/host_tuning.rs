//! The host tuning `twell` makes at start, all of it process-wide, so a binary's choice
//! rather than the library's; `--no-host-tuning` leaves each as the system has it:
//!
//! * glibc's malloc policy for candle's host tensors (below);
//! * 2 MB pages for the CPU gate screen and weights (`twell::cpu::huge_pages`);
//! * the rayon workers polling for work for 20 ms after a one-token host MLP call
//!   (`twell::cpu::warm`), so the next call does not wait on sleeping cores;
//! * `RAYON_NUM_THREADS` set to the cores available, where unset: candle 0.11 asks for
//!   its thread count on every parallel CPU op and, without that variable, reads
//!   `/proc/cpuinfo` each time (4–5% of a quantized decode's time, measured with perf).
//!
//! glibc's malloc policy. Candle allocates a new buffer for
//! every op's output and frees it when the tensor drops. glibc serves a block above its
//! mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh mapping that it unmaps on
//! free, and hands the top of its heap back to the kernel past the trim threshold; so each
//! training step faults in and zeroes its temporaries all over again (a CPU fine-tuning
//! step of the default model spent about 40% of its time in the kernel zeroing pages).
//! Serving blocks up to 1 GiB from the heap and never trimming it keeps those pages mapped
//! and reused. The price: the process keeps its peak heap instead of returning it.
//!
//! A CPU fine-tuning step of the default model runs 15–18% faster with it.

/// Largest block served from the heap rather than from a mapping of its own.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 1 << 30;

/// Applies the tuning above (`on`), or turns off what the library would do by default
/// (`!on`). Call before any tensor exists.
pub fn tune_host(on: bool) {
    twell::cpu::huge_pages::set_huge_pages(on);
    if on {
        keep_freed_host_memory();
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            // Called first thing in `main`, before any other thread exists.
            std::env::set_var("RAYON_NUM_THREADS", cores.to_string());
        }
    } else {
        twell::cpu::warm::set_warm_window(std::time::Duration::ZERO);
    }
}

/// Sets the malloc policy above for this process. Returns whether it is in force: `false`
/// off glibc, or where glibc refused a setting.
fn keep_freed_host_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes glibc's thresholds; it is called before the
        // threads that allocate are busy, and any value is memory-safe.
        let mmap = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) };
        // -1: never trim (mallopt(3)).
        let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, -1) };
        mmap == 1 && trim == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::keep_freed_host_memory;

    /// Minor page faults of the calling thread so far.
    fn thread_minor_faults() -> i64 {
        // SAFETY: getrusage writes the struct it is given.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
        assert_eq!(rc, 0, "getrusage");
        usage.ru_minflt
    }

    /// Allocates and writes `bytes`, then frees them; returns the page faults it took.
    fn faults_of_a_fresh_buffer(bytes: usize) -> i64 {
        let before = thread_minor_faults();
        let mut v = vec![0u8; bytes];
        // One write a page: each page not yet mapped faults once.
        for i in (0..bytes).step_by(4096) {
            v[i] = 1;
        }
        std::hint::black_box(&v);
        drop(v);
        thread_minor_faults() - before
    }

    #[test]
    fn a_freed_buffer_is_reused_without_faulting_its_pages_again() {
        assert!(keep_freed_host_memory(), "mallopt refused the policy");
        // 48 MiB: past glibc's largest adaptive mmap threshold (32 MiB), so by default
        // each buffer is a new mapping and faults all of its 12,288 pages.
        let bytes = 48 << 20;
        let pages = (bytes / 4096) as i64;
        let first = faults_of_a_fresh_buffer(bytes);
        let second = faults_of_a_fresh_buffer(bytes);
        assert!(first > 0, "the first buffer faulted no pages ({first})");
        assert!(
            second < pages / 10,
            "the second buffer faulted {second} of {pages} pages (first: {first})"
        );
    }
}
