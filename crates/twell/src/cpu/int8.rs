//! Exact dot products of an int16 token with int8 weight rows, the inner loop of the
//! gate screen.
//!
//! The screen streams one byte per gate weight. Widening each byte to f32 for an FMA
//! (the screen's first form) costs three instructions per eight weights, enough to
//! keep one core from reading at memory speed; with the token in int16, one
//! sign-extension and one `vpmaddwd` take 16 or 32 weights. Integer sums are exact,
//! which keeps the screen's error bound simple, and 13 bits for the token make its
//! rounding negligible beside the weights' 8.

#[cfg(target_arch = "x86_64")]
use std::sync::OnceLock;

/// The largest token magnitude (13 bits): a `vpmaddwd` pair sum is then at most
/// `2 · 8191 · 127`, about 2²¹.
pub const TOKEN_MAX: i16 = 8191;

/// Columns summed in i32 lanes before the lanes are flushed to i64: 32 pair sums per
/// lane, and the 16–32 lanes' total, stay far below 2³¹.
const FLUSH_COLUMNS: usize = 2048;

/// `Σ x[k]·q[k]`, exactly, over the common length, for `x` within `±TOKEN_MAX` and
/// `q` within `±127`.
pub fn dot(x: &[i16], q: &[i8]) -> i64 {
    let n = x.len().min(q.len());
    let (x, q) = (&x[..n], &q[..n]);
    #[cfg(target_arch = "x86_64")]
    match x86_level() {
        // SAFETY: the CPU has the features of the level (detected at run time).
        X86Level::Avx512 => return unsafe { x86::dot_avx512(x, q) },
        X86Level::Avx2 => return unsafe { x86::dot_avx2(x, q) },
        X86Level::None => {}
    }
    dot_portable(x, q)
}

fn dot_portable(x: &[i16], q: &[i8]) -> i64 {
    x.iter()
        .zip(q)
        .map(|(&a, &b)| i64::from(i32::from(a) * i32::from(b)))
        .sum()
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
enum X86Level {
    Avx512,
    Avx2,
    None,
}

#[cfg(target_arch = "x86_64")]
fn x86_level() -> X86Level {
    static LEVEL: OnceLock<X86Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
            X86Level::Avx512
        } else if is_x86_feature_detected!("avx2") {
            X86Level::Avx2
        } else {
            X86Level::None
        }
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{dot_portable, FLUSH_COLUMNS};
    use std::arch::x86_64::*;

    /// 32 weights a step: `vpmovsxbw` to i16, `vpmaddwd` into 16 i32 lanes.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn dot_avx512(x: &[i16], q: &[i8]) -> i64 {
        let n = q.len();
        let (px, pq) = (x.as_ptr(), q.as_ptr());
        let mut total = 0i64;
        let mut k = 0;
        while k + 32 <= n {
            let end = (k + FLUSH_COLUMNS).min(n);
            let mut acc = [_mm512_setzero_si512(); 2];
            while k + 64 <= end {
                for (u, slot) in acc.iter_mut().enumerate() {
                    let w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                        pq.add(k + 32 * u) as *const __m256i
                    ));
                    let v = _mm512_loadu_si512(px.add(k + 32 * u) as *const _);
                    *slot = _mm512_add_epi32(*slot, _mm512_madd_epi16(v, w));
                }
                k += 64;
            }
            while k + 32 <= end {
                let w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(pq.add(k) as *const __m256i));
                let v = _mm512_loadu_si512(px.add(k) as *const _);
                acc[0] = _mm512_add_epi32(acc[0], _mm512_madd_epi16(v, w));
                k += 32;
            }
            total += i64::from(_mm512_reduce_add_epi32(acc[0]))
                + i64::from(_mm512_reduce_add_epi32(acc[1]));
        }
        total + dot_portable(&x[k..], &q[k..])
    }

    /// 16 weights a step: `vpmovsxbw` to i16, `vpmaddwd` into 8 i32 lanes.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_avx2(x: &[i16], q: &[i8]) -> i64 {
        let n = q.len();
        let (px, pq) = (x.as_ptr(), q.as_ptr());
        let mut total = 0i64;
        let mut k = 0;
        while k + 16 <= n {
            let end = (k + FLUSH_COLUMNS / 2).min(n);
            let mut acc = [_mm256_setzero_si256(); 2];
            while k + 32 <= end {
                for (u, slot) in acc.iter_mut().enumerate() {
                    let w =
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(pq.add(k + 16 * u) as *const __m128i));
                    let v = _mm256_loadu_si256(px.add(k + 16 * u) as *const __m256i);
                    *slot = _mm256_add_epi32(*slot, _mm256_madd_epi16(v, w));
                }
                k += 32;
            }
            while k + 16 <= end {
                let w = _mm256_cvtepi8_epi16(_mm_loadu_si128(pq.add(k) as *const __m128i));
                let v = _mm256_loadu_si256(px.add(k) as *const __m256i);
                acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(v, w));
                k += 16;
            }
            let mut lanes = [0i32; 16];
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, acc[0]);
            _mm256_storeu_si256(lanes.as_mut_ptr().add(8) as *mut __m256i, acc[1]);
            total += lanes.iter().map(|&v| i64::from(v)).sum::<i64>();
        }
        total + dot_portable(&x[k..], &q[k..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every path gives the exact integer sum, at the extremes of both ranges (where an
    /// i32 lane would overflow without the flushes) and at lengths around the vector
    /// widths.
    #[test]
    fn dot_is_exact() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for n in [
            0usize, 1, 15, 16, 31, 33, 63, 64, 65, 2048, 2051, 5000, 70_000,
        ] {
            for extreme in [false, true] {
                let (x, q): (Vec<i16>, Vec<i8>) = (0..n)
                    .map(|_| {
                        if extreme {
                            // Same signs everywhere: the largest sums.
                            (TOKEN_MAX, 127)
                        } else {
                            (
                                rng.random_range(-TOKEN_MAX..=TOKEN_MAX),
                                rng.random_range(-127..=127),
                            )
                        }
                    })
                    .unzip();
                let want: i64 = x
                    .iter()
                    .zip(&q)
                    .map(|(&a, &b)| i64::from(a) * i64::from(b))
                    .sum();
                assert_eq!(dot(&x, &q), want, "n={n} extreme={extreme}");
                assert_eq!(dot_portable(&x, &q), want);
                #[cfg(target_arch = "x86_64")]
                if is_x86_feature_detected!("avx2") {
                    // SAFETY: AVX2 is present (checked above).
                    assert_eq!(unsafe { x86::dot_avx2(&x, &q) }, want, "avx2 n={n}");
                }
            }
        }
    }
}
