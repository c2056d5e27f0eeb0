//! Dot product and axpy on f32 slices, the two inner loops of every sparse kernel.
//!
//! Rust compiles for baseline x86-64 (SSE2, no FMA) by default, which halves the
//! throughput of these loops. On x86-64 we detect AVX2+FMA once at run time and use
//! 256-bit fused multiply-adds; elsewhere a portable loop with independent accumulators
//! lets LLVM vectorise what the target allows.

#[cfg(target_arch = "x86_64")]
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
/// Whether this CPU runs the AVX2 + FMA loops (checked once).
pub fn has_avx2_fma() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// `Σ a[k]·b[k]` over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { avx2::dot(a, b) };
    }
    dot_portable(a, b)
}

/// `y[k] += alpha·x[k]` over the common length.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &mut y[..n]);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        unsafe { avx2::axpy(alpha, x, y) };
        return;
    }
    axpy_portable(alpha, x, y)
}

/// `x = e^x` for every value: eight at a time on AVX2 (Cephes' degree-6 polynomial on
/// the reduced argument, within 2 ulp of `f32::exp` on [-87, 88]; below, 2⁻¹²⁶ or so,
/// which a softmax weight rounds away), `f32::exp` elsewhere. The CPU attention calls it
/// for every score of a decode step: libm's scalar exp was a third of its time.
#[inline]
pub fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        unsafe { avx2::exp_in_place(xs) };
        return;
    }
    xs.iter_mut().for_each(|x| *x = x.exp());
}

/// Eight dot products at once: `out[2·t + n] = w[n] · x[t]` for 2 weight rows and 4
/// token rows of equal length. Each loaded vector feeds several FMAs, so a many-token
/// GEMV is bound by arithmetic rather than by loads.
#[inline]
pub fn dot_2x4(w: [&[f32]; 2], x: [&[f32]; 4]) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { avx2::dot_2x4(w, x) };
    }
    let mut out = [0f32; 8];
    for t in 0..4 {
        for n in 0..2 {
            out[2 * t + n] = dot_portable(w[n], x[t]);
        }
    }
    out
}

/// `y[k] += x[k]`.
#[inline]
pub fn add_assign(y: &mut [f32], x: &[f32]) {
    for (a, b) in y.iter_mut().zip(x) {
        *a += *b;
    }
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (ca, cb) = (&a[c * LANES..][..LANES], &b[c * LANES..][..LANES]);
        for k in 0..LANES {
            acc[k] += ca[k] * cb[k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for k in chunks * LANES..a.len() {
        sum += a[k] * b[k];
    }
    sum
}

fn axpy_portable(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yk, xk) in y.iter_mut().zip(x) {
        *yk += alpha * *xk;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        // Four independent accumulators hide the FMA latency.
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut k = 0;
        while k + 32 <= n {
            for (u, slot) in acc.iter_mut().enumerate() {
                let va = _mm256_loadu_ps(pa.add(k + 8 * u));
                let vb = _mm256_loadu_ps(pb.add(k + 8 * u));
                *slot = _mm256_fmadd_ps(va, vb, *slot);
            }
            k += 32;
        }
        while k + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(k)),
                _mm256_loadu_ps(pb.add(k)),
                acc[0],
            );
            k += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let hi = _mm256_extractf128_ps(s, 1);
        let lo = _mm256_castps256_ps128(s);
        let s4 = _mm_add_ps(hi, lo);
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        let mut sum = _mm_cvtss_f32(s1);
        while k < n {
            sum += *pa.add(k) * *pb.add(k);
            k += 1;
        }
        sum
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_in_place(xs: &mut [f32]) {
        let n = xs.len() / 8 * 8;
        let p = xs.as_mut_ptr();
        let mut k = 0;
        while k < n {
            _mm256_storeu_ps(p.add(k), exp8(_mm256_loadu_ps(p.add(k))));
            k += 8;
        }
        for x in &mut xs[n..] {
            *x = x.exp();
        }
    }

    /// e^x = 2^n · e^r with n = round(x·log2 e), r = x − n·ln 2 (ln 2 in two parts, so r
    /// is exact), e^r by Cephes' polynomial.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
            _mm256_set1_ps(88.0),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(
            p,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(p, _mm256_castsi256_ps(two_n))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_2x4(w: [&[f32]; 2], x: [&[f32]; 4]) -> [f32; 8] {
        let n = w.iter().chain(x.iter()).map(|s| s.len()).min().unwrap_or(0);
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut k = 0;
        while k + 8 <= n {
            let w0 = _mm256_loadu_ps(w[0].as_ptr().add(k));
            let w1 = _mm256_loadu_ps(w[1].as_ptr().add(k));
            for t in 0..4 {
                let xv = _mm256_loadu_ps(x[t].as_ptr().add(k));
                acc[2 * t] = _mm256_fmadd_ps(w0, xv, acc[2 * t]);
                acc[2 * t + 1] = _mm256_fmadd_ps(w1, xv, acc[2 * t + 1]);
            }
            k += 8;
        }
        let mut out = [0f32; 8];
        for (o, a) in out.iter_mut().zip(acc.iter()) {
            let hi = _mm256_extractf128_ps(*a, 1);
            let s4 = _mm_add_ps(hi, _mm256_castps256_ps128(*a));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            *o = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
        }
        while k < n {
            for t in 0..4 {
                for c in 0..2 {
                    out[2 * t + c] += w[c][k] * x[t][k];
                }
            }
            k += 1;
        }
        out
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let va = _mm256_set1_ps(alpha);
        let mut k = 0;
        while k + 8 <= n {
            let vy = _mm256_loadu_ps(py.add(k));
            let vx = _mm256_loadu_ps(px.add(k));
            _mm256_storeu_ps(py.add(k), _mm256_fmadd_ps(va, vx, vy));
            k += 8;
        }
        while k < n {
            *py.add(k) += alpha * *px.add(k);
            k += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_2x4_matches_dot() {
        for n in [1usize, 9, 64, 2051] {
            let rows: Vec<Vec<f32>> = (0..6)
                .map(|r| {
                    (0..n)
                        .map(|i| ((i * 7 + r * 13) as f32 * 0.01).sin())
                        .collect()
                })
                .collect();
            let out = dot_2x4(
                [&rows[0], &rows[1]],
                [&rows[2], &rows[3], &rows[4], &rows[5]],
            );
            for t in 0..4 {
                for c in 0..2 {
                    let want = dot(&rows[c], &rows[2 + t]);
                    assert!(
                        (out[2 * t + c] - want).abs() < 1e-3 * (1.0 + want.abs()),
                        "n={n}"
                    );
                }
            }
        }
    }

    #[test]
    fn exp_in_place_is_within_two_ulp_of_exp_over_the_softmax_range() {
        // Every 1/64 from -100 to 88 (odd length: the scalar tail runs too), plus the ends.
        let mut xs: Vec<f32> = (-6400..=5632).map(|i| i as f32 / 64.0).collect();
        xs.extend([0.0, -0.0, -1e-30, 88.0, -87.0, -1000.0, f32::NEG_INFINITY]);
        let mut ys = xs.clone();
        exp_in_place(&mut ys);
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = (x as f64).exp();
            if x < -87.0 {
                assert!((0.0..1e-37).contains(&y), "e^{x} = {y}");
                continue;
            }
            let ulp = f32::EPSILON as f64 * want;
            assert!(
                (y as f64 - want).abs() <= 2.0 * ulp,
                "e^{x}: {y} against {want}"
            );
        }
    }

    #[test]
    fn dot_and_axpy_match_scalar_loops_at_odd_lengths() {
        for n in [0usize, 1, 7, 8, 31, 33, 100, 2048] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!(
                (dot(&a, &b) as f64 - want).abs() < 1e-3 * (1.0 + want.abs()),
                "n={n}"
            );
            let mut y = b.clone();
            axpy(0.5, &a, &mut y);
            for k in 0..n {
                assert!((y[k] - (b[k] + 0.5 * a[k])).abs() < 1e-6);
            }
        }
    }
}
