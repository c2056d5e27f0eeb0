"""How many neurons a certified gate screen of b bits lets through to the exact
recompute, on weights drawn like `twell::density::synthetic_mlp` (Gaussian, std 0.02,
column 0 a negative bias that sets the density; numpy's generator, not the bench's).

Per row: the 4 largest |w| kept exact, the rest as s * q with q in b-bit integers and
s = (largest remaining |w|) / (2^(b-1) - 1), E = ||w - s q||; a neuron is a candidate
unless estimate + ||x|| * E <= 0 (the f32 rounding terms of docs/format.md left out:
they are far smaller). Usage: python3 screen_bits_estimate.py"""
import numpy as np
from statistics import NormalDist

d, f, tokens, std = 2048, 5632, 16, 0.02
rng = np.random.default_rng(0)
for density in (0.005, 0.01, 0.03):
    w = rng.normal(0.0, std, (f, d)).astype(np.float32)
    w[:, 0] = -NormalDist().inv_cdf(1 - density) * std * np.sqrt(d - 1)
    x = rng.normal(0.0, 1.0, (tokens, d)).astype(np.float32)
    x[:, 0] = 1.0
    exact = x @ w.T
    fired = (exact > 0).mean()
    outlier_cols = np.argsort(-np.abs(w), axis=1)[:, :4]
    rest = w.copy()
    np.put_along_axis(rest, outlier_cols, 0.0, axis=1)
    row = [f"density {density:.3f}: fired {100 * fired:.2f}%"]
    for bits in (4, 5, 6, 8):
        top = 2 ** (bits - 1) - 1
        scale = np.abs(rest).max(axis=1, keepdims=True) / top
        approx = np.round(rest / scale) * scale
        margin = np.linalg.norm(rest - approx, axis=1)
        estimate = x @ (w - rest + approx).T
        bound = estimate + np.linalg.norm(x, axis=1, keepdims=True) * margin
        row.append(f"int{bits} {100 * (bound > 0).mean():.1f}%")
    print(" | ".join(row))
