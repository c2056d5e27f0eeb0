//! 2 MB pages for the host buffers a one-token pass reads. That pass streams the int8
//! gate screen and picks scattered rows out of the weights; on 4 KB pages every 4 KB of
//! it costs a TLB miss and a page-table walk, which is a large part of a call that moves
//! only ~13 MB. Linux only; elsewhere, and after [`set_huge_pages`]`(false)`, nothing
//! changes. The kernel may refuse: the buffers then stay as they are.

use candle_core::{Storage, Tensor};

const HUGE: usize = 2 << 20;

static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether the buffers made from now on ask for 2 MB pages (on by default). Process-wide:
/// the `twell` binary turns it off with the rest of its host tuning (`--no-host-tuning`).
pub fn set_huge_pages(on: bool) {
    ENABLED.store(on, std::sync::atomic::Ordering::Relaxed);
}

#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn enabled() -> bool {
    ENABLED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The 2 MB-aligned part of `[start, start + bytes)`, if any.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn aligned_interior(start: usize, bytes: usize) -> Option<(usize, usize)> {
    let (a, b) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
    // Lazily: for a range inside one 2 MB page `b` lies below `a`.
    (b > a).then(|| (a, b - a))
}

#[cfg(target_os = "linux")]
fn madvise(range: (usize, usize), advice: libc::c_int) {
    // SAFETY: callers pass the interior of one live allocation; these advices change how
    // the kernel backs the pages, never their contents.
    unsafe { libc::madvise(range.0 as *mut libc::c_void, range.1, advice) };
}

/// For a vector not yet written: its pages will be 2 MB where the kernel can.
pub fn advise_vec<T>(v: &Vec<T>) {
    #[cfg(target_os = "linux")]
    if enabled() {
        let bytes = v.capacity() * std::mem::size_of::<T>();
        if let Some(range) = aligned_interior(v.as_ptr() as usize, bytes) {
            madvise(range, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

/// For a host tensor already written: its pages are collapsed into 2 MB ones now
/// (`MADV_COLLAPSE`, Linux 6.1+).
pub fn collapse(t: &Tensor) {
    #[cfg(target_os = "linux")]
    if enabled() {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            return;
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            return;
        };
        let (ptr, elem) = match cpu {
            candle_core::CpuStorage::F32(v) => (v.as_ptr() as usize, 4),
            candle_core::CpuStorage::BF16(v) => (v.as_ptr() as usize, 2),
            candle_core::CpuStorage::F16(v) => (v.as_ptr() as usize, 2),
            _ => return,
        };
        if let Some(range) = aligned_interior(ptr + start * elem, (end - start) * elem) {
            madvise(range, libc::MADV_HUGEPAGE);
            madvise(range, libc::MADV_COLLAPSE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = t;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interior_is_aligned_and_inside() {
        assert_eq!(aligned_interior(0, HUGE - 1), None);
        // Inside one page, not at its start: no interior (and no underflow).
        assert_eq!(aligned_interior(16, 4096), None);
        assert_eq!(aligned_interior(HUGE + 16, HUGE - 32), None);
        assert_eq!(aligned_interior(1, 2 * HUGE), Some((HUGE, HUGE)));
        assert_eq!(aligned_interior(HUGE, 3 * HUGE + 5), Some((HUGE, 3 * HUGE)));
    }

    #[test]
    fn advice_leaves_contents_alone() {
        let t = Tensor::arange(0f32, (3 * HUGE / 4) as f32, &candle_core::Device::Cpu).unwrap();
        collapse(&t);
        let v = t.to_vec1::<f32>().unwrap();
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
        let mut w: Vec<u8> = Vec::with_capacity(3 * HUGE);
        advise_vec(&w);
        w.extend((0..3 * HUGE).map(|i| i as u8));
        assert!(w.iter().enumerate().all(|(i, &x)| x == i as u8));
    }
}
