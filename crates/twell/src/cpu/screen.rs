//! A certified int8 screen of the gate weights, for decoding on the CPU.
//!
//! With one token the sparse MLP is bound by the bytes of `Wg`: it must learn which
//! neurons fire before it can skip the rest. The screen reads an int8 copy of `Wg`
//! (a quarter of the f32 bytes) and multiplies it by a 13-bit integer copy of the
//! token, and for each neuron bounds how far that estimate can be from the f32 gate
//! value. A
//! neuron whose estimate plus its bound is still ≤ 0 is certified inactive; every
//! other one (a candidate) is recomputed exactly from the f32 row. No nonzero can be
//! lost: the bound covers both quantisation errors (Cauchy–Schwarz on the exact
//! residual norms) and the f32 rounding of the exact dot product, whatever its
//! summation order.
//!
//! Bound. The row is split into `k` exact outliers `o_j` and an int8 rest `s_j·q_j`
//! with residual `e_j` (`E_j = ‖e_j‖₂`); the token into `K` exact outliers `x_O` and an
//! integer rest `t·p` with residual `r` (`R = ‖r‖₂`). Then
//! `x·W_j = x·o_j + s_j·(x_O·q_j + t·(p·q_j)) + s_j·(r·q_j) + x·e_j`, the first part
//! computed (`p·q_j` exactly in integers, the rest in f64), the last two at most
//! `R·s_j‖q_j‖ + ‖x‖·E_j`, and `fl(x·W_j)` within `γ_d‖x‖‖W_j‖` of `x·W_j`
//! (`γ_n = n·u/(1 − n·u)`, `u = 2⁻²⁴`).

use rayon::prelude::*;

use super::gate::token_major;
use super::int8::{self, TOKEN_MAX};
use super::simd::dot;
use fused_ops::host::Rows;

/// Up to this many tokens the screen beats streaming the f32 rows: each token pays
/// for widening every row's bytes and for its own candidates, so with more tokens the
/// GEMV, which widens nothing, wins (measured by `twell bench mlp`,
/// docs/benchmarks.md).
pub const SCREEN_MAX_ROWS: usize = 2;

/// Weights per row kept exact, outside the int8 rows: one large weight (a bias folded
/// into a constant feature, an outlier channel) would otherwise set the row's scale
/// and blur every other weight.
pub const OUTLIERS_PER_ROW: usize = 4;

/// Token features kept exact, outside the int8 token, for the same reason: hidden
/// states carry a few features far larger than the rest.
pub const OUTLIERS_PER_TOKEN: usize = 8;

/// Relative slack for the f64 arithmetic of the estimate (a handful of roundings of
/// 2⁻⁵³ each), with a wide margin.
const F64_SLACK: f64 = 1e-12;

/// Above this measured density `SparseMlp` skips the screen: most neurons would be
/// candidates anyway (docs/benchmarks.md: at 50% the screened pass was 0.58x dense).
pub const SCREEN_MAX_DENSITY: f64 = 0.2;

/// The int8 gate rows, their scales, exact outliers and error bounds.
pub struct GateScreen {
    f: usize,
    d: usize,
    q: Vec<i8>,
    scale: Vec<f32>,
    /// `[f, k]` column index and exact value of each row's largest weights.
    outlier_col: Vec<u32>,
    outlier_val: Vec<f32>,
    k: usize,
    /// Per neuron: the margin per unit of `‖x‖` (`E_j + γ_d‖W_j‖`), rounded up.
    margin: Vec<f64>,
    /// Per neuron: `s_j‖q_j‖`, rounded up (the margin per unit of the token's residual).
    q_norm: Vec<f64>,
    /// Per neuron: `‖o_j‖`.
    o_norm: Vec<f64>,
}

/// Counts from one screened gate: how much exact work the screen let through.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScreenCounts {
    /// (token, neuron) pairs screened.
    pub pairs: usize,
    /// Pairs recomputed exactly (the estimate could not rule them out).
    pub candidates: usize,
    /// Candidates whose exact gate value was > 0.
    pub active: usize,
}

impl std::ops::Add for ScreenCounts {
    type Output = Self;
    fn add(self, b: Self) -> Self {
        Self {
            pairs: self.pairs + b.pairs,
            candidates: self.candidates + b.candidates,
            active: self.active + b.active,
        }
    }
}

fn gamma(n: usize) -> f64 {
    let nu = n as f64 * f64::from(f32::EPSILON) / 2.0;
    nu / (1.0 - nu)
}

/// One quantised row: int8 values, scale, outliers, and the norms of its bound.
struct QuantRow {
    q: Vec<i8>,
    scale: f32,
    cols: Vec<u32>,
    vals: Vec<f32>,
    margin: f64,
    q_norm: f64,
    o_norm: f64,
}

/// The indices (sorted) of the `k` entries of `v` largest in magnitude, which are kept
/// exact, and the scale that puts the largest of the rest at `top` (0 when the rest is
/// all zero or not finite): one large entry would otherwise set the scale and blur
/// every other one.
fn outliers_and_scale(v: &[f32], k: usize, top: f32) -> (Vec<u32>, f32) {
    let d = v.len();
    let mut order: Vec<usize> = (0..d).collect();
    if k < d {
        // The k largest |v| first, the (k+1)-th at index k.
        order.select_nth_unstable_by(k, |&a, &b| v[b].abs().total_cmp(&v[a].abs()));
    }
    let mut outliers: Vec<u32> = order[..k.min(d)].iter().map(|&i| i as u32).collect();
    outliers.sort_unstable();
    let rest_max = order.get(k).map_or(0.0, |&i| v[i].abs());
    let scale = if rest_max > 0.0 && rest_max.is_finite() {
        rest_max / top
    } else {
        0.0
    };
    (outliers, scale)
}

/// `v / scale` rounded to whole steps within `±top`, 0 at the outliers (and everywhere
/// when the scale is 0).
fn round_to_steps(v: &[f32], scale: f32, top: f32, outliers: &[u32]) -> Vec<f32> {
    let mut steps: Vec<f32> = v
        .iter()
        .map(|x| {
            if scale > 0.0 {
                (x / scale).round().clamp(-top, top)
            } else {
                0.0
            }
        })
        .collect();
    for &c in outliers {
        steps[c as usize] = 0.0;
    }
    steps
}

fn quantise_row(w: &[f32], k: usize) -> QuantRow {
    let d = w.len();
    let (cols, scale) = outliers_and_scale(w, k, 127.0);
    let vals: Vec<f32> = cols.iter().map(|&c| w[c as usize]).collect();
    let q: Vec<i8> = round_to_steps(w, scale, 127.0, &cols)
        .into_iter()
        .map(|s| s as i8)
        .collect();
    let (mut err2, mut w2, mut q2, mut o2) = (0f64, 0f64, 0f64, 0f64);
    for (i, (v, qi)) in w.iter().zip(&q).enumerate() {
        let v = f64::from(*v);
        w2 += v * v;
        if cols.binary_search(&(i as u32)).is_ok() {
            o2 += v * v;
            continue;
        }
        let r = v - f64::from(scale) * f64::from(*qi);
        err2 += r * r;
        q2 += f64::from(*qi) * f64::from(*qi);
    }
    let margin = err2.sqrt() + gamma(d) * w2.sqrt();
    // A non-finite row makes the margin NaN or ∞: every token then takes the exact
    // path for it, which is what we want.
    QuantRow {
        q,
        scale,
        cols,
        vals,
        margin: margin * (1.0 + 1e-6),
        q_norm: f64::from(scale) * q2.sqrt() * (1.0 + 1e-6),
        o_norm: o2.sqrt() * (1.0 + 1e-6),
    }
}

/// One token, quantised for the screen: `x = x_O + t·p + r`.
struct ScreenToken {
    /// `p`, zero at the outlier features.
    p: Vec<i16>,
    /// `x_O`: the largest features, exact.
    outliers: Vec<(u32, f32)>,
    /// `t`.
    scale: f64,
    /// `‖x‖`, rounded up.
    norm: f64,
    /// `R = ‖r‖`, rounded up.
    residual: f64,
}

fn quantise_token(x: &[f32]) -> ScreenToken {
    let top = f32::from(TOKEN_MAX);
    let (cols, scale) = outliers_and_scale(x, OUTLIERS_PER_TOKEN, top);
    let outliers: Vec<(u32, f32)> = cols.iter().map(|&c| (c, x[c as usize])).collect();
    let p: Vec<i16> = round_to_steps(x, scale, top, &cols)
        .into_iter()
        .map(|s| s as i16)
        .collect();
    let (mut norm2, mut residual2) = (0f64, 0f64);
    for (i, (v, pi)) in x.iter().zip(&p).enumerate() {
        let v = f64::from(*v);
        norm2 += v * v;
        if cols.binary_search(&(i as u32)).is_ok() {
            continue;
        }
        let r = v - f64::from(scale) * f64::from(*pi);
        residual2 += r * r;
    }
    // A non-finite feature makes the norms NaN or ∞, so no bound rules anything out.
    ScreenToken {
        p,
        outliers,
        scale: f64::from(scale),
        norm: norm2.sqrt() * (1.0 + 1e-6),
        residual: residual2.sqrt() * (1.0 + 1e-6),
    }
}

impl GateScreen {
    /// Quantises `wg [f, d]` row by row: the [`OUTLIERS_PER_ROW`] largest weights kept
    /// exact, the rest in int8 with scale = (largest remaining |w|) / 127.
    pub fn new(wg: Rows<'_>, f: usize, d: usize) -> Self {
        let k = OUTLIERS_PER_ROW.min(d);
        let rows: Vec<QuantRow> = (0..f)
            .into_par_iter()
            .map_init(Vec::new, |scratch, j| {
                quantise_row(wg.f32_range(j * d, d, scratch), k)
            })
            .collect();
        let q = Vec::with_capacity(f * d);
        super::huge_pages::advise_vec(&q);
        let mut screen = Self {
            f,
            d,
            q,
            scale: Vec::with_capacity(f),
            outlier_col: Vec::with_capacity(f * k),
            outlier_val: Vec::with_capacity(f * k),
            k,
            margin: Vec::with_capacity(f),
            q_norm: Vec::with_capacity(f),
            o_norm: Vec::with_capacity(f),
        };
        for r in rows {
            screen.q.extend_from_slice(&r.q);
            screen.scale.push(r.scale);
            screen.outlier_col.extend_from_slice(&r.cols);
            screen.outlier_val.extend_from_slice(&r.vals);
            screen.margin.push(r.margin);
            screen.q_norm.push(r.q_norm);
            screen.o_norm.push(r.o_norm);
        }
        screen
    }

    /// An upper bound on the f32 gate value `fl(x · W_j)`, in any summation order.
    #[inline]
    fn upper_bound(&self, x: &[f32], token: &ScreenToken, j: usize) -> f64 {
        let d = self.d;
        let row = &self.q[j * d..(j + 1) * d];
        let pq = int8::dot(&token.p, row) as f64;
        let mut outlier_features = 0f64;
        for &(c, v) in &token.outliers {
            outlier_features += f64::from(v) * f64::from(row[c as usize]);
        }
        let mut outlier_weights = 0f64;
        for t in j * self.k..(j + 1) * self.k {
            outlier_weights +=
                f64::from(x[self.outlier_col[t] as usize]) * f64::from(self.outlier_val[t]);
        }
        let scale = f64::from(self.scale[j]);
        let estimate = scale * (token.scale * pq + outlier_features) + outlier_weights;
        let (norm, residual) = (token.norm, token.residual);
        let margin = norm * self.margin[j]
            + residual * self.q_norm[j]
            + F64_SLACK * (self.q_norm[j] * (2.0 * norm + residual) + norm * self.o_norm[j]);
        estimate + margin
    }

    pub fn dims(&self) -> (usize, usize) {
        (self.f, self.d)
    }

    /// The gate `g [m, f]` (row-major) for `x [m, d]`: the exact f32 value `x·W_j`
    /// wherever it may be positive, 0 where the screen proves it is ≤ 0. `relu(g)` is
    /// therefore exactly what the unscreened gate gives, up to f32 summation order.
    pub fn gate(&self, x: &[f32], m: usize, wg: Rows<'_>) -> (Vec<f32>, ScreenCounts) {
        const NEURONS_PER_TASK: usize = 64;
        let (f, d) = (self.f, self.d);
        let tokens: Vec<ScreenToken> = (0..m)
            .map(|i| quantise_token(&x[i * d..(i + 1) * d]))
            .collect();
        let mut gt = vec![0f32; f * m];
        let counts = gt
            .par_chunks_mut(NEURONS_PER_TASK * m)
            .enumerate()
            .map_init(Vec::new, |scratch, (chunk, out)| {
                let mut c = ScreenCounts::default();
                for jj in 0..out.len() / m {
                    let j = chunk * NEURONS_PER_TASK + jj;
                    for i in 0..m {
                        let xi = &x[i * d..(i + 1) * d];
                        c.pairs += 1;
                        // Only a bound that is a number and ≤ 0 rules a neuron out: a
                        // NaN anywhere means "recompute".
                        let bound = self.upper_bound(xi, &tokens[i], j);
                        let ruled_out = bound.partial_cmp(&0.0).is_some_and(|o| o.is_le());
                        if !ruled_out {
                            let g = dot(xi, wg.f32_range(j * d, d, scratch));
                            c.candidates += 1;
                            c.active += usize::from(g > 0.0);
                            out[jj * m + i] = g;
                        }
                    }
                }
                c
            })
            .reduce(ScreenCounts::default, |a, b| a + b);
        (token_major(gt, m, f), counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    /// Every positive gate value survives the screen, with its exact value, at gate
    /// biases that put the density anywhere from ~0% to ~100%.
    #[test]
    fn screen_never_loses_a_positive_gate() {
        let (f, d) = (300, 200);
        let mut wg = random(f * d, 1, 0.1);
        for (seed, m) in [(2u64, 1usize), (3, 2), (4, 5)] {
            let mut x = random(m * d, seed, 1.0);
            for bias in [-3.0f32, -1.0, 0.0, 1.0] {
                // Feature 0 is a constant 1 whose weight sets each neuron's bias.
                for i in 0..m {
                    x[i * d] = 1.0;
                }
                for j in 0..f {
                    wg[j * d] = bias;
                }
                let screen = GateScreen::new(Rows::F32(&wg), f, d);
                let (g, c) = screen.gate(&x, m, Rows::F32(&wg));
                let mut positives = 0;
                for i in 0..m {
                    for j in 0..f {
                        let exact = dot(&x[i * d..(i + 1) * d], &wg[j * d..(j + 1) * d]);
                        let got = g[i * f + j];
                        if exact > 0.0 {
                            positives += 1;
                            assert_eq!(got, exact, "token {i} neuron {j} bias {bias}");
                        } else {
                            assert!(got <= 0.0, "token {i} neuron {j}: {got} vs {exact}");
                        }
                    }
                }
                assert_eq!(c.pairs, m * f);
                assert_eq!(c.active, positives);
                assert!(c.candidates >= c.active);
            }
        }
    }

    /// Gates a hair either side of zero, tokens with many large features (more than
    /// the screen keeps exact) and a wide spread of magnitudes: every positive gate
    /// still survives with its exact value.
    #[test]
    fn screen_keeps_gates_just_above_zero() {
        let (f, d) = (256, 300);
        let mut wg = random(f * d, 21, 0.1);
        let mut x = random(d, 22, 1.0);
        // Twenty features far above the rest, and a few far below.
        for k in 0..20 {
            x[10 + 7 * k] = 40.0 * if k % 2 == 0 { 1.0 } else { -1.0 };
        }
        for k in 0..5 {
            x[200 + k] = 1e-6;
        }
        x[0] = 1.0;
        // Feature 0's weight puts each neuron's gate at a chosen offset from zero.
        let offsets = [1e-6f32, -1e-6, 1e-4, -1e-4, 1e-2, 0.0];
        for j in 0..f {
            wg[j * d] = 0.0;
            let rest = dot(&x, &wg[j * d..(j + 1) * d]);
            wg[j * d] = -rest + offsets[j % offsets.len()];
        }
        let screen = GateScreen::new(Rows::F32(&wg), f, d);
        let (g, c) = screen.gate(&x, 1, Rows::F32(&wg));
        let mut positives = 0;
        for j in 0..f {
            let exact = dot(&x, &wg[j * d..(j + 1) * d]);
            if exact > 0.0 {
                positives += 1;
                assert_eq!(g[j], exact, "neuron {j}");
            } else {
                assert!(g[j] <= 0.0, "neuron {j}: {} vs {exact}", g[j]);
            }
        }
        assert!(positives > f / 4, "{positives} positive gates");
        assert_eq!(c.active, positives);
    }

    /// The screen must actually screen: at low density few pairs are recomputed.
    #[test]
    fn screen_recomputes_few_pairs_at_low_density() {
        let (f, d) = (512, 1024);
        let mut wg = random(f * d, 7, 0.05);
        let mut x = random(d, 8, 1.0);
        x[0] = 1.0;
        for j in 0..f {
            wg[j * d] = -1.8; // ≈ 1% of neurons fire
        }
        let screen = GateScreen::new(Rows::F32(&wg), f, d);
        let (_, c) = screen.gate(&x, 1, Rows::F32(&wg));
        assert!(c.candidates < f / 10, "{c:?}");
    }

    /// A NaN input or weight row can never be certified inactive.
    #[test]
    fn non_finite_values_take_the_exact_path() {
        let (f, d) = (4, 64);
        let mut wg = random(f * d, 9, 0.1);
        wg[3] = f32::NAN;
        let screen = GateScreen::new(Rows::F32(&wg), f, d);
        let x = random(d, 10, 1.0);
        let (_, c) = screen.gate(&x, 1, Rows::F32(&wg));
        assert!(c.candidates >= 1);
        let mut xn = x.clone();
        xn[5] = f32::INFINITY;
        let (_, c) = screen.gate(&xn, 1, Rows::F32(&wg));
        assert_eq!(c.candidates, f);
    }

    #[test]
    fn bf16_weights_are_screened_against_their_own_values() {
        let (f, d) = (128, 96);
        let w32 = random(f * d, 11, 0.2);
        let wb: Vec<half::bf16> = w32.iter().map(|v| half::bf16::from_f32(*v)).collect();
        let screen = GateScreen::new(Rows::Bf16(&wb), f, d);
        let x = random(2 * d, 12, 1.0);
        let (g, _) = screen.gate(&x, 2, Rows::Bf16(&wb));
        let wf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        for i in 0..2 {
            for j in 0..f {
                let exact = dot(&x[i * d..(i + 1) * d], &wf[j * d..(j + 1) * d]);
                if exact > 0.0 {
                    assert_eq!(g[i * f + j], exact);
                }
            }
        }
    }
}
