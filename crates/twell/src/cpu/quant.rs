//! Quantized weight rows for inference on the CPU.
//!
//! A decode step reads every weight it uses once, so on the CPU its speed is the bytes
//! it reads. Rows are kept in 32-wide blocks with a scale `d` per block:
//! - [`QuantFormat::Q8`]: int8 `q`, `w = d·q`. What an f32 or bf16 weight (a fine-tuned
//!   checkpoint, the GGUF's Q8_0 embeddings) is quantized to: an error of at most half a
//!   step of `max|w| / 127` per block.
//! - [`QuantFormat::Q4_1`]: `u` in `0..16` (two per byte) and the block's minimum `m`,
//!   `w = d·u + m`: the GGUF's own Q4_1 blocks, read as they are. Kept as
//!   `w = d·(u − 8) + c` with `c = m + 8·d`: the offset term is then the block's middle,
//!   not its minimum, and cancels far less against the integer part in f32.
//!
//! The token is quantized per block to int8 (`x ≈ s·p`, with `Σp` kept), so a block's
//! product is one exact integer dot, the `vpdpbusd` instruction of AVX-512 VNNI
//! (unsigned by signed bytes: `|p|` against `q·sign(p)`, with `q` the int8 or `u − 8`),
//! then one multiply-add in f32: `Σ w·x ≈ s·d·Σ q·p`, plus `s·c·Σ p` for Q4_1. AVX2
//! CPUs get the same integer sums in two instructions a block; others take a portable
//! loop.

use rayon::prelude::*;

use crate::error::TwellError;
use candle_core::Result;

/// Weights per block (the GGUF's Q4_1 and Q8_0 block).
pub const BLOCK: usize = 32;

/// Rows a worker takes at a time: enough work to pay for the hand-off.
const ROWS_PER_TASK: usize = 64;

/// How a row's blocks are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    /// int8 per block with one scale (one byte a weight).
    Q8,
    /// 4-bit per block with a scale and a minimum (half a byte a weight).
    Q4_1,
}

/// A token (one row of activations) quantized per block to int8.
/// `v.round_ties_even()` for |v| ≤ 2²² (NaN stays NaN): adding and taking away 1.5·2²³
/// leaves the float's rounding to do it, ties to even. Without SSE4.1 in the baseline
/// target, `round_ties_even` is a call to libm's `rintf` per value, which took half the
/// sparse default's load (quantizing its merged weights) and kept these loops scalar.
#[inline(always)]
fn round_small(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// A Q8 block's scale (its largest magnitude maps to 127) and that scale's inverse (0
/// for a block of zeros): the weights' rows and the tokens quantize alike.
#[inline(always)]
fn q8_scale(block: &[f32]) -> (f32, f32) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

/// `v` as an int8 of a block whose scale has inverse `inv`.
#[inline(always)]
fn q8_value(v: f32, inv: f32) -> i8 {
    round_small(v * inv).clamp(-127.0, 127.0) as i8
}

/// Q8 blocks of `w` into `bytes` and `scale` (one per block of [`BLOCK`]).
fn quantize_q8_blocks(w: &[f32], bytes: &mut [u8], scale: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if fused_ops::simd::has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { quantize_q8_blocks_avx2(w, bytes, scale) };
    }
    quantize_q8_blocks_portable(w, bytes, scale)
}

/// The same loop compiled for AVX2, which vectorises the rounding and narrowing.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_q8_blocks_avx2(w: &[f32], bytes: &mut [u8], scale: &mut [f32]) {
    quantize_q8_blocks_portable(w, bytes, scale)
}

#[inline(always)]
fn quantize_q8_blocks_portable(w: &[f32], bytes: &mut [u8], scale: &mut [f32]) {
    for ((ws, out), s) in w
        .chunks_exact(BLOCK)
        .zip(bytes.chunks_exact_mut(BLOCK))
        .zip(scale.iter_mut())
    {
        let (d, inv) = q8_scale(ws);
        for (o, &v) in out.iter_mut().zip(ws) {
            *o = q8_value(v, inv) as u8;
        }
        *s = d;
    }
}

#[derive(Clone, Debug)]
pub struct QuantToken {
    q: Vec<i8>,
    /// Per block: the scale `s`.
    scale: Vec<f32>,
    /// Per block: `s·Σq`, what a block's offset `c` multiplies.
    scaled_sum: Vec<f32>,
}

impl QuantToken {
    /// Quantizes `x` (whose length is a multiple of [`BLOCK`]) to int8 per block.
    pub fn new(x: &[f32]) -> Self {
        let blocks = x.len() / BLOCK;
        let mut q = vec![0i8; blocks * BLOCK];
        let mut scale = vec![0f32; blocks];
        let mut scaled_sum = vec![0f32; blocks];
        for b in 0..blocks {
            let xs = &x[b * BLOCK..(b + 1) * BLOCK];
            let (s, inv) = q8_scale(xs);
            let mut sum = 0i32;
            for (o, &v) in q[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(xs) {
                let r = q8_value(v, inv);
                *o = r;
                sum += i32::from(r);
            }
            scale[b] = s;
            scaled_sum[b] = s * sum as f32;
        }
        Self {
            q,
            scale,
            scaled_sum,
        }
    }

    /// Features (a multiple of [`BLOCK`]).
    pub fn len(&self) -> usize {
        self.q.len()
    }

    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}

/// `[rows, cols]` weights in quantized blocks, row-major.
#[derive(Clone, Debug)]
pub struct QuantRows {
    rows: usize,
    cols: usize,
    format: QuantFormat,
    /// Q8: one int8 a weight; Q4_1: two weights a byte, the GGUF's order (byte `j` of a
    /// block holds weight `j` in its low nibble and weight `j + 16` in its high one).
    bytes: Vec<u8>,
    /// Per block: `d`.
    scale: Vec<f32>,
    /// Per block: `c = m + 8·d` (Q4_1 only).
    offset: Vec<f32>,
}

/// A Q4_1 weight byte's centred value, `u − 8`.
fn nibble(u: u8) -> f32 {
    f32::from(u) - 8.0
}

fn bad(detail: String) -> candle_core::Error {
    candle_core::Error::wrap(TwellError::Invalid(detail))
}

impl QuantRows {
    fn check_dims(rows: usize, cols: usize, len: usize) -> Result<()> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(bad(format!(
                "quantized rows need a width that is a multiple of {BLOCK}, got {cols}"
            )));
        }
        if len != rows * cols {
            return Err(bad(format!(
                "{len} weights do not fill {rows} rows of {cols}"
            )));
        }
        Ok(())
    }

    /// Quantizes row-major `[rows, cols]` weights.
    pub fn quantize(w: &[f32], rows: usize, cols: usize, format: QuantFormat) -> Result<Self> {
        Self::check_dims(rows, cols, w.len())?;
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(bad(format!(
                "weight {i} (row {}) is not finite: {}",
                i / cols,
                w[i]
            )));
        }
        let blocks = w.len() / BLOCK;
        let mut scale = vec![0f32; blocks];
        let mut offset = Vec::new();
        let bytes = match format {
            QuantFormat::Q8 => {
                let mut bytes = vec![0u8; w.len()];
                // Loading the sparse default quantizes 53 M merged weights: spread over the
                // threads, 256 blocks a task.
                const TASK: usize = 256;
                bytes
                    .par_chunks_mut(BLOCK * TASK)
                    .zip(scale.par_chunks_mut(TASK))
                    .zip(w.par_chunks(BLOCK * TASK))
                    .for_each(|((bytes, scale), w)| quantize_q8_blocks(w, bytes, scale));
                bytes
            }
            QuantFormat::Q4_1 => {
                offset = vec![0f32; blocks];
                let mut bytes = vec![0u8; w.len() / 2];
                for b in 0..blocks {
                    let ws = &w[b * BLOCK..(b + 1) * BLOCK];
                    let lo = ws.iter().copied().fold(f32::INFINITY, f32::min);
                    let hi = ws.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let d = (hi - lo) / 15.0;
                    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                    let nib = |v: f32| round_small((v - lo) * inv).clamp(0.0, 15.0) as u8;
                    for j in 0..BLOCK / 2 {
                        bytes[b * BLOCK / 2 + j] = nib(ws[j]) | (nib(ws[j + BLOCK / 2]) << 4);
                    }
                    scale[b] = d;
                    offset[b] = lo + 8.0 * d;
                }
                bytes
            }
        };
        Ok(Self {
            rows,
            cols,
            format,
            bytes,
            scale,
            offset,
        })
    }

    /// From the raw bytes of a GGUF tensor of `rows` rows of `cols` weights, in its
    /// Q4_1 (`f16 d, f16 m, 16 bytes`) or Q8_0 (`f16 d, 32 int8`) blocks, without
    /// passing through f32: Q4_1 stays 4-bit and Q8_0 becomes [`QuantFormat::Q8`] with
    /// the same values.
    pub fn from_gguf_blocks(
        raw: &[u8],
        dtype: candle_core::quantized::GgmlDType,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        use candle_core::quantized::GgmlDType;
        Self::check_dims(rows, cols, rows * cols)?;
        let blocks = rows * cols / BLOCK;
        let block_bytes = match dtype {
            GgmlDType::Q4_1 => 20,
            GgmlDType::Q8_0 => 34,
            other => {
                return Err(bad(format!(
                    "the quantized CPU path reads Q4_1 and Q8_0 blocks, not {other:?}"
                )))
            }
        };
        if raw.len() != blocks * block_bytes {
            return Err(bad(format!(
                "{} bytes for {rows}x{cols} {dtype:?} weights, expected {}",
                raw.len(),
                blocks * block_bytes
            )));
        }
        let half = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let mut scale = Vec::with_capacity(blocks);
        let (format, bytes, offset) = if dtype == GgmlDType::Q4_1 {
            let mut offset = Vec::with_capacity(blocks);
            let mut bytes = Vec::with_capacity(blocks * BLOCK / 2);
            for blk in raw.chunks_exact(block_bytes) {
                scale.push(half(&blk[0..2]));
                offset.push(half(&blk[2..4]) + 8.0 * scale[scale.len() - 1]);
                bytes.extend_from_slice(&blk[4..]);
            }
            (QuantFormat::Q4_1, bytes, offset)
        } else {
            let mut bytes = Vec::with_capacity(blocks * BLOCK);
            for blk in raw.chunks_exact(block_bytes) {
                scale.push(half(&blk[0..2]));
                // −128 (never written by llama.cpp's quantizer) becomes −127, so that
                // `q·sign(p)` stays an int8.
                bytes.extend(blk[2..].iter().map(|&q| (q as i8).max(-127) as u8));
            }
            (QuantFormat::Q8, bytes, Vec::new())
        };
        if let Some(b) = scale.iter().chain(&offset).position(|v| !v.is_finite()) {
            return Err(bad(format!(
                "block {} has a scale that is not finite",
                b % blocks
            )));
        }
        Ok(Self {
            rows,
            cols,
            format,
            bytes,
            scale,
            offset,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// Bytes held (weights, scales and offsets).
    pub fn bytes(&self) -> usize {
        self.bytes.len() + 4 * (self.scale.len() + self.offset.len())
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// The offset `c` of block `b`.
    fn offset(&self, b: usize) -> f32 {
        match self.format {
            QuantFormat::Q8 => 0.0,
            QuantFormat::Q4_1 => self.offset[b],
        }
    }

    /// Row `r`'s weights as f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let nb = self.blocks_per_row();
        for k in 0..nb {
            let b = r * nb + k;
            let (d, c) = (self.scale[b], self.offset(b));
            let o = &mut out[k * BLOCK..(k + 1) * BLOCK];
            match self.format {
                QuantFormat::Q8 => {
                    for (o, &u) in o.iter_mut().zip(&self.bytes[b * BLOCK..(b + 1) * BLOCK]) {
                        *o = d * f32::from(u as i8) + c;
                    }
                }
                QuantFormat::Q4_1 => {
                    let bytes = &self.bytes[b * BLOCK / 2..(b + 1) * BLOCK / 2];
                    for (j, &u) in bytes.iter().enumerate() {
                        o[j] = d * nibble(u & 15) + c;
                        o[j + BLOCK / 2] = d * nibble(u >> 4) + c;
                    }
                }
            }
        }
    }

    /// All weights as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }

    /// Row `r`'s weight bytes, scales and (Q4_1) offsets.
    fn row_parts(&self, r: usize) -> (&[u8], &[f32], &[f32]) {
        let nb = self.blocks_per_row();
        let bytes_per_block = match self.format {
            QuantFormat::Q8 => BLOCK,
            QuantFormat::Q4_1 => BLOCK / 2,
        };
        let blocks = r * nb..(r + 1) * nb;
        let offset = match self.format {
            QuantFormat::Q8 => &[][..],
            QuantFormat::Q4_1 => &self.offset[blocks.clone()],
        };
        (
            &self.bytes[blocks.start * bytes_per_block..blocks.end * bytes_per_block],
            &self.scale[blocks],
            offset,
        )
    }

    /// `w_r · x` for row `r` and a quantized token of the same width.
    pub fn dot(&self, r: usize, x: &QuantToken) -> f32 {
        debug_assert_eq!(x.len(), self.cols);
        #[cfg(target_arch = "x86_64")]
        {
            let (bytes, scale, offset) = self.row_parts(r);
            // SAFETY: the CPU has the level's features (detected at run time); the
            // slices are the row's blocks, as many as the token's.
            unsafe {
                match (simd(), self.format) {
                    (Simd::Vnni, QuantFormat::Q8) => return x86::vnni::dot_q8(bytes, scale, x),
                    (Simd::Vnni, QuantFormat::Q4_1) => {
                        return x86::vnni::dot_q4_1(bytes, scale, offset, x)
                    }
                    (Simd::Avx2, QuantFormat::Q8) => return x86::avx2::dot_q8(bytes, scale, x),
                    (Simd::Avx2, QuantFormat::Q4_1) => {
                        return x86::avx2::dot_q4_1(bytes, scale, offset, x)
                    }
                    (Simd::Portable, _) => {}
                }
            }
        }
        self.dot_portable(r, x)
    }

    /// [`QuantRows::dot`] of row `r` with four tokens: each weight block is read (and a
    /// Q4_1 block unpacked) once for the four, as a prefill's rows are.
    pub fn dot4(&self, r: usize, x: [&QuantToken; 4]) -> [f32; 4] {
        #[cfg(target_arch = "x86_64")]
        {
            let (bytes, scale, offset) = self.row_parts(r);
            // SAFETY: as in `dot`.
            unsafe {
                match (simd(), self.format) {
                    (Simd::Vnni, QuantFormat::Q8) => return x86::vnni::dot4_q8(bytes, scale, x),
                    (Simd::Vnni, QuantFormat::Q4_1) => {
                        return x86::vnni::dot4_q4_1(bytes, scale, offset, x)
                    }
                    (Simd::Avx2, QuantFormat::Q8) => return x86::avx2::dot4_q8(bytes, scale, x),
                    (Simd::Avx2, QuantFormat::Q4_1) => {
                        return x86::avx2::dot4_q4_1(bytes, scale, offset, x)
                    }
                    (Simd::Portable, _) => {}
                }
            }
        }
        x.map(|t| self.dot_portable(r, t))
    }

    /// [`QuantRows::dot`] without SIMD: the reference the fast loops are tested against.
    pub fn dot_portable(&self, r: usize, x: &QuantToken) -> f32 {
        let nb = self.blocks_per_row();
        let mut sum = 0f32;
        for k in 0..nb {
            let b = r * nb + k;
            let xq = &x.q[k * BLOCK..(k + 1) * BLOCK];
            let dot: i32 = match self.format {
                QuantFormat::Q8 => self.bytes[b * BLOCK..(b + 1) * BLOCK]
                    .iter()
                    .zip(xq)
                    .map(|(&u, &q)| i32::from(u as i8) * i32::from(q))
                    .sum(),
                QuantFormat::Q4_1 => {
                    let bytes = &self.bytes[b * BLOCK / 2..(b + 1) * BLOCK / 2];
                    bytes
                        .iter()
                        .enumerate()
                        .map(|(j, &u)| {
                            (i32::from(u & 15) - 8) * i32::from(xq[j])
                                + (i32::from(u >> 4) - 8) * i32::from(xq[j + BLOCK / 2])
                        })
                        .sum()
                }
            };
            sum += x.scale[k] * self.scale[b] * dot as f32 + self.offset(b) * x.scaled_sum[k];
        }
        sum
    }

    /// `y += alpha · w_r`.
    pub fn axpy(&self, r: usize, alpha: f32, y: &mut [f32]) {
        debug_assert_eq!(y.len(), self.cols);
        let nb = self.blocks_per_row();
        #[cfg(target_arch = "x86_64")]
        if self.format == QuantFormat::Q8 {
            let (u, d) = (
                &self.bytes[r * self.cols..(r + 1) * self.cols],
                &self.scale[r * nb..(r + 1) * nb],
            );
            // SAFETY: the CPU has the level's features; the slices are row `r`'s.
            match simd() {
                Simd::Vnni => return unsafe { x86::vnni::axpy_q8(alpha, u, d, y) },
                Simd::Avx2 => return unsafe { x86::avx2::axpy_q8(alpha, u, d, y) },
                Simd::Portable => {}
            }
        }
        let mut row = [0f32; BLOCK];
        for k in 0..nb {
            let b = r * nb + k;
            let (d, c) = (alpha * self.scale[b], alpha * self.offset(b));
            match self.format {
                QuantFormat::Q8 => {
                    for (j, &u) in self.bytes[b * BLOCK..(b + 1) * BLOCK].iter().enumerate() {
                        row[j] = d * f32::from(u as i8) + c;
                    }
                }
                QuantFormat::Q4_1 => {
                    for (j, &u) in self.bytes[b * BLOCK / 2..(b + 1) * BLOCK / 2]
                        .iter()
                        .enumerate()
                    {
                        row[j] = d * nibble(u & 15) + c;
                        row[j + BLOCK / 2] = d * nibble(u >> 4) + c;
                    }
                }
            }
            for (y, v) in y[k * BLOCK..(k + 1) * BLOCK].iter_mut().zip(&row) {
                *y += v;
            }
        }
    }

    /// `out[t, r] = w_r · x_t` for every row and token (`out` is `[tokens, rows]`),
    /// rows split over the rayon workers. Each worker reads a row once for all tokens.
    pub fn matmul(&self, tokens: &[QuantToken], out: &mut [f32]) -> Result<()> {
        let n = self.rows;
        if out.len() != tokens.len() * n {
            return Err(bad(format!(
                "output of {} values for {} tokens of {n} rows",
                out.len(),
                tokens.len()
            )));
        }
        if let Some(t) = tokens.iter().find(|t| t.len() != self.cols) {
            return Err(bad(format!(
                "a token of {} features for rows of {}",
                t.len(),
                self.cols
            )));
        }
        let m = tokens.len();
        if m == 1 {
            out.par_chunks_mut(ROWS_PER_TASK)
                .enumerate()
                .for_each(|(c, o)| {
                    for (i, o) in o.iter_mut().enumerate() {
                        *o = self.dot(c * ROWS_PER_TASK + i, &tokens[0]);
                    }
                });
            return Ok(());
        }
        // Row-major partial results per task, then scattered into `[tokens, rows]`.
        let parts: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(ROWS_PER_TASK))
            .into_par_iter()
            .map(|c| {
                let rows = c * ROWS_PER_TASK..((c + 1) * ROWS_PER_TASK).min(n);
                let mut part = Vec::with_capacity(rows.len() * m);
                for r in rows {
                    let mut quads = tokens.chunks_exact(4);
                    for q in &mut quads {
                        part.extend(self.dot4(r, [&q[0], &q[1], &q[2], &q[3]]));
                    }
                    part.extend(quads.remainder().iter().map(|t| self.dot(r, t)));
                }
                (c * ROWS_PER_TASK, part)
            })
            .collect();
        for (start, part) in parts {
            for (i, vals) in part.chunks_exact(m).enumerate() {
                for (t, &v) in vals.iter().enumerate() {
                    out[t * n + start + i] = v;
                }
            }
        }
        Ok(())
    }
}

/// Tokens from which [`QuantRows::apply`] widens the rows to f32, a block of rows at a
/// time, for an f32 GEMM: a prefill's many tokens then share each widened row, where the
/// int8 dots redo their per-block work for every token (held-out perplexity over 8,192
/// tokens in windows of 512: 66 s through the dots, 40 s with f32 weights).
pub const GEMM_MIN_TOKENS: usize = 32;

/// Rows widened at a time by the GEMM path (9 MB of f32 at a width of 576).
const GEMM_BLOCK_ROWS: usize = 4096;

impl QuantRows {
    /// `x · Wᵀ` for an f32 tensor `[.., cols]` on the CPU: `[.., rows]`.
    pub fn forward(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        let flat = f32_rows(x, self.cols, "QuantRows::forward")?;
        let out = self.apply(&flat)?;
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("checked rank") = self.rows;
        candle_core::Tensor::from_vec(out, dims, x.device())
    }

    /// `x · Wᵀ` for row-major f32 tokens `x` (`[m, cols]`): `[m, rows]`. Up to
    /// [`GEMM_MIN_TOKENS`] tokens, int8 dots against the rows; from there, the rows
    /// widened to f32 and a GEMM.
    pub fn apply(&self, x: &[f32]) -> Result<Vec<f32>> {
        let m = x.len() / self.cols;
        if m < GEMM_MIN_TOKENS {
            let tokens: Vec<QuantToken> = x.chunks_exact(self.cols).map(QuantToken::new).collect();
            let mut out = vec![0f32; m * self.rows];
            self.matmul(&tokens, &mut out)?;
            return Ok(out);
        }
        use candle_core::{Device, Tensor};
        let (n, k) = (self.rows, self.cols);
        let xt = Tensor::from_slice(x, (m, k), &Device::Cpu)?;
        let mut out = vec![0f32; m * n];
        let mut w = vec![0f32; GEMM_BLOCK_ROWS.min(n) * k];
        for start in (0..n).step_by(GEMM_BLOCK_ROWS) {
            let rows = GEMM_BLOCK_ROWS.min(n - start);
            w[..rows * k]
                .par_chunks_mut(k)
                .enumerate()
                .for_each(|(i, row)| self.dequantize_row(start + i, row));
            let wt = Tensor::from_slice(&w[..rows * k], (rows, k), &Device::Cpu)?;
            let y = xt.matmul(&wt.t()?)?.flatten_all()?.to_vec1::<f32>()?;
            for (t, ys) in y.chunks_exact(rows).enumerate() {
                out[t * n + start..t * n + start + rows].copy_from_slice(ys);
            }
        }
        Ok(out)
    }
}

/// The values of an f32 CPU tensor `[.., width]`, row-major.
pub fn f32_rows(x: &candle_core::Tensor, width: usize, what: &str) -> Result<Vec<f32>> {
    if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 {
        return Err(bad(format!(
            "{what}: the quantized path takes f32 on the CPU, got {:?} on {:?}",
            x.dtype(),
            x.device()
        )));
    }
    if x.dims().last() != Some(&width) {
        return Err(bad(format!(
            "{what}: input {:?} does not end in {width} features",
            x.dims()
        )));
    }
    x.flatten_all()?.to_vec1::<f32>()
}

/// The SIMD level of the quantized dots: AVX-512 VNNI (`vpdpbusd`, one instruction per
/// block), or AVX2 (`vpmaddubsw` then `vpmaddwd`: the same exact integer sums, since no
/// pair of products reaches `i16::MAX`), or neither (the portable loops).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
enum Simd {
    Vnni,
    Avx2,
    Portable,
}

#[cfg(target_arch = "x86_64")]
fn simd() -> Simd {
    use std::sync::OnceLock;
    static SIMD: OnceLock<Simd> = OnceLock::new();
    *SIMD.get_or_init(|| {
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
        {
            Simd::Vnni
        } else if fused_ops::simd::has_avx2_fma() {
            Simd::Avx2
        } else {
            Simd::Portable
        }
    })
}

/// The quantized dots for one SIMD level: `$features` enabled, `$idot` the exact integer
/// dot of a block (unsigned `|p|` bytes against signed `q·sign(p)` bytes, summed in i32
/// lanes), `$axpy` the Q8 row update.
#[cfg(target_arch = "x86_64")]
macro_rules! quant_kernels {
    ($module:ident, $features:literal, $idot:path, $axpy:path) => {
        pub mod $module {
            use super::super::{QuantToken, BLOCK};
            use super::offsets;
            use std::arch::x86_64::*;

            pub use $axpy as axpy_q8;

            #[target_feature(enable = $features)]
            unsafe fn hsum(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
                _mm_cvtss_f32(s)
            }

            /// The exact integer dot of int8 weight block `w` with the token's block `k`
            /// (`|p|`, unsigned, against `q·sign(p)`: the same sum), scaled into f32 lanes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn block_i8(
                w: __m256i,
                x: &QuantToken,
                d: f32,
                k: usize,
                acc: __m256,
            ) -> __m256 {
                let q = _mm256_loadu_si256(x.q.as_ptr().add(k * BLOCK) as *const __m256i);
                let p = $idot(_mm256_abs_epi8(q), _mm256_sign_epi8(w, q));
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x.scale[k]), acc)
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load_q8(u: &[u8], k: usize) -> __m256i {
                _mm256_loadu_si256(u.as_ptr().add(k * BLOCK) as *const __m256i)
            }

            /// Block `k`'s 32 nibbles as centred int8 (`u − 8`), in the GGUF's order (low
            /// nibbles first).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load_q4_1(nib: &[u8], k: usize) -> __m256i {
                let mask = _mm_set1_epi8(15);
                let b = _mm_loadu_si128(nib.as_ptr().add(k * BLOCK / 2) as *const __m128i);
                let lo = _mm_and_si128(b, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
                _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8))
            }

            /// The blocks of one row against one token. Four accumulators, so the
            /// multiply-adds of neighbouring blocks overlap.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dot_blocks(
                load: impl Fn(usize) -> __m256i,
                d: &[f32],
                x: &QuantToken,
            ) -> f32 {
                let mut acc = [_mm256_setzero_ps(); 4];
                let nb = d.len();
                let mut k = 0;
                while k + 4 <= nb {
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a = block_i8(load(k + j), x, d[k + j], k + j, *a);
                    }
                    k += 4;
                }
                while k < nb {
                    acc[0] = block_i8(load(k), x, d[k], k, acc[0]);
                    k += 1;
                }
                hsum(_mm256_add_ps(
                    _mm256_add_ps(acc[0], acc[1]),
                    _mm256_add_ps(acc[2], acc[3]),
                ))
            }

            /// Q8 rows: int8 bytes and scales `d`.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q8(u: &[u8], d: &[f32], x: &QuantToken) -> f32 {
                dot_blocks(|k| load_q8(u, k), d, x)
            }

            /// Q4_1 rows: nibbles, scales `d`, offsets `c`.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q4_1(nib: &[u8], d: &[f32], c: &[f32], x: &QuantToken) -> f32 {
                dot_blocks(|k| load_q4_1(nib, k), d, x) + offsets(c, &x.scaled_sum)
            }

            /// Four tokens' blocks against each weight block, read (and unpacked) once.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dot4_blocks(
                load: impl Fn(usize) -> __m256i,
                d: &[f32],
                x: [&QuantToken; 4],
            ) -> [f32; 4] {
                let mut acc = [_mm256_setzero_ps(); 4];
                for (k, &dk) in d.iter().enumerate() {
                    let w = load(k);
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a = block_i8(w, x[j], dk, k, *a);
                    }
                }
                acc.map(|a| hsum(a))
            }

            #[target_feature(enable = $features)]
            pub unsafe fn dot4_q8(u: &[u8], d: &[f32], x: [&QuantToken; 4]) -> [f32; 4] {
                dot4_blocks(|k| load_q8(u, k), d, x)
            }

            #[target_feature(enable = $features)]
            pub unsafe fn dot4_q4_1(
                nib: &[u8],
                d: &[f32],
                c: &[f32],
                x: [&QuantToken; 4],
            ) -> [f32; 4] {
                let sums = dot4_blocks(|k| load_q4_1(nib, k), d, x);
                let mut out = [0f32; 4];
                for j in 0..4 {
                    out[j] = sums[j] + offsets(c, &x[j].scaled_sum);
                }
                out
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::BLOCK;

    /// `Σ_k a[k]·b[k]`, the blocks' offset terms (independent of the integer dots).
    #[inline(always)]
    fn offsets(a: &[f32], b: &[f32]) -> f32 {
        let mut s = [0f32; 4];
        let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
        let tail: f32 = ca
            .remainder()
            .iter()
            .zip(cb.remainder())
            .map(|(x, y)| x * y)
            .sum();
        for (x, y) in ca.zip(cb) {
            for j in 0..4 {
                s[j] += x[j] * y[j];
            }
        }
        s[0] + s[1] + s[2] + s[3] + tail
    }

    /// `Σ u·s` over each 4-byte group, in one instruction.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn idot_vnni(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }

    /// The same sums in two: byte pairs into i16 (`|u·s| ≤ 127·127`, so a pair stays
    /// below `i16::MAX` and nothing saturates), then i16 pairs into i32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn idot_avx2(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// `y += alpha · d·q` over a Q8 row, 16 weights an instruction.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn axpy_q8_avx512(alpha: f32, u: &[u8], d: &[f32], y: &mut [f32]) {
        for (k, &dk) in d.iter().enumerate() {
            let a = _mm512_set1_ps(alpha * dk);
            for h in 0..2 {
                let off = k * BLOCK + h * 16;
                let b = _mm_loadu_si128(u.as_ptr().add(off) as *const __m128i);
                let v = _mm512_cvtepi8_epi32(b);
                let yp = y.as_mut_ptr().add(off);
                let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), a, _mm512_loadu_ps(yp));
                _mm512_storeu_ps(yp, acc);
            }
        }
    }

    /// The same, 8 weights an instruction.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_q8_avx2(alpha: f32, u: &[u8], d: &[f32], y: &mut [f32]) {
        for (k, &dk) in d.iter().enumerate() {
            let a = _mm256_set1_ps(alpha * dk);
            for h in 0..4 {
                let off = k * BLOCK + h * 8;
                let b = _mm_loadl_epi64(u.as_ptr().add(off) as *const __m128i);
                let v = _mm256_cvtepi8_epi32(b);
                let yp = y.as_mut_ptr().add(off);
                let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), a, _mm256_loadu_ps(yp));
                _mm256_storeu_ps(yp, acc);
            }
        }
    }

    quant_kernels!(
        vnni,
        "avx512f,avx512bw,avx512vl,avx512vnni",
        super::idot_vnni,
        super::axpy_q8_avx512
    );
    quant_kernels!(avx2, "avx2,fma", super::idot_avx2, super::axpy_q8_avx2);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_small_rounds_ties_to_even_as_round_ties_even() {
        // Every quarter from -200 to 200 (ties at the halves), values near ties, the
        // quantizers' bounds, signed zeros and NaN.
        let mut vs: Vec<f32> = (-800..=800).map(|i| i as f32 / 4.0).collect();
        vs.extend([
            0.499_999_97,
            -0.499_999_97,
            126.5,
            -126.5,
            127.000_01,
            15.5,
            -0.0,
            0.0,
        ]);
        for v in vs {
            assert_eq!(round_small(v), v.round_ties_even(), "{v}");
        }
        assert!(round_small(f32::NAN).is_nan());
    }

    fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    fn exact_dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
    }

    #[test]
    fn quantized_rows_stay_within_half_a_step() -> Result<()> {
        let (rows, cols) = (7, 96);
        let w = random(rows * cols, 1, 0.3);
        for format in [QuantFormat::Q8, QuantFormat::Q4_1] {
            let q = QuantRows::quantize(&w, rows, cols, format)?;
            let back = q.dequantize();
            for (b, (ws, bs)) in w.chunks(BLOCK).zip(back.chunks(BLOCK)).enumerate() {
                let step = q.scale[b];
                for (a, c) in ws.iter().zip(bs) {
                    assert!(
                        (a - c).abs() <= 0.5 * step * 1.001 + 1e-7,
                        "{format:?} {a} {c}"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn simd_and_portable_dots_agree_and_track_f32() -> Result<()> {
        let (rows, cols) = (33, 576);
        let w = random(rows * cols, 2, 0.1);
        let x = random(cols, 3, 2.0);
        let token = QuantToken::new(&x);
        for format in [QuantFormat::Q8, QuantFormat::Q4_1] {
            let q = QuantRows::quantize(&w, rows, cols, format)?;
            let deq = q.dequantize();
            for r in 0..rows {
                let (fast, slow) = (q.dot(r, &token), q.dot_portable(r, &token));
                assert!(
                    (fast - slow).abs() <= 1e-4 * (1.0 + slow.abs()),
                    "{fast} {slow}"
                );
                // Against the dequantized row and the exact token: the token's int8
                // rounding only (half a step of max|x|/127 per feature).
                let exact = exact_dot(&deq[r * cols..(r + 1) * cols], &x);
                let row_norm1: f64 = deq[r * cols..(r + 1) * cols]
                    .iter()
                    .map(|v| v.abs() as f64)
                    .sum();
                let bound = row_norm1 * (2.0 / 127.0) * 0.5 + 1e-4;
                assert!(
                    (fast as f64 - exact).abs() <= bound,
                    "{format:?} r{r}: {fast} vs {exact}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn matmul_matches_row_dots_for_one_and_many_tokens() -> Result<()> {
        let (rows, cols) = (200, 64);
        let w = random(rows * cols, 4, 1.0);
        for (format, m) in [QuantFormat::Q8, QuantFormat::Q4_1]
            .into_iter()
            .flat_map(|f| [(f, 1), (f, 5), (f, 8)])
        {
            let q = QuantRows::quantize(&w, rows, cols, format)?;
            let tokens: Vec<QuantToken> = (0..m)
                .map(|t| QuantToken::new(&random(cols, 10 + t as u64, 1.0)))
                .collect();
            let mut out = vec![0f32; m * rows];
            q.matmul(&tokens, &mut out)?;
            for t in 0..m {
                for r in 0..rows {
                    let (got, want) = (out[t * rows + r], q.dot(r, &tokens[t]));
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{got} {want}"
                    );
                }
            }
        }
        let q = QuantRows::quantize(&w, rows, cols, QuantFormat::Q8)?;
        assert!(q
            .matmul(&[QuantToken::new(&[0.0; 32])], &mut [0.0; 200])
            .is_err());
        Ok(())
    }

    #[test]
    fn apply_widens_to_a_gemm_for_many_tokens_with_the_same_result() -> Result<()> {
        // More rows than one widened block, and token counts on both sides of the switch.
        let (rows, cols) = (GEMM_BLOCK_ROWS + 300, 64);
        let w = random(rows * cols, 8, 1.0);
        for format in [QuantFormat::Q8, QuantFormat::Q4_1] {
            let q = QuantRows::quantize(&w, rows, cols, format)?;
            let deq = q.dequantize();
            for m in [GEMM_MIN_TOKENS - 1, GEMM_MIN_TOKENS + 3] {
                let x = random(m * cols, 9, 1.0);
                let out = q.apply(&x)?;
                for t in (0..m).step_by(7) {
                    for r in (0..rows).step_by(97) {
                        let row = &deq[r * cols..(r + 1) * cols];
                        let exact = exact_dot(row, &x[t * cols..(t + 1) * cols]);
                        let norm1: f64 = row.iter().map(|v| v.abs() as f64).sum();
                        // The dots round the token to int8; the GEMM only sums in f32.
                        let bound = if m < GEMM_MIN_TOKENS {
                            norm1 / 127.0
                        } else {
                            1e-4 * (1.0 + norm1)
                        };
                        let got = out[t * rows + r] as f64;
                        assert!(
                            (got - exact).abs() <= bound,
                            "{format:?} m {m}: {got} vs {exact}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Every SIMD level this CPU has, called directly (so a machine with VNNI checks the
    /// AVX2 loops too), against the portable loops: one and four tokens, block counts
    /// that four does not divide, full-scale weights and tokens (the largest products,
    /// where an i16 pair sum could saturate), and the Q8 row update. The integer sums are
    /// exact, so the levels agree bit for bit.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_simd_level_matches_the_portable_loops() -> Result<()> {
        type Dot = unsafe fn(&[u8], &[f32], &[f32], &QuantToken) -> f32;
        type Dot4 = unsafe fn(&[u8], &[f32], &[f32], [&QuantToken; 4]) -> [f32; 4];
        type Axpy = unsafe fn(f32, &[u8], &[f32], &mut [f32]);
        #[allow(clippy::type_complexity)]
        let mut levels: Vec<(&str, [Dot; 2], [Dot4; 2], Axpy)> = Vec::new();
        if fused_ops::simd::has_avx2_fma() {
            levels.push((
                "avx2",
                [
                    |u, d, _, x| unsafe { x86::avx2::dot_q8(u, d, x) },
                    x86::avx2::dot_q4_1,
                ],
                [
                    |u, d, _, x| unsafe { x86::avx2::dot4_q8(u, d, x) },
                    x86::avx2::dot4_q4_1,
                ],
                x86::avx2::axpy_q8,
            ));
        }
        if simd() == Simd::Vnni {
            levels.push((
                "vnni",
                [
                    |u, d, _, x| unsafe { x86::vnni::dot_q8(u, d, x) },
                    x86::vnni::dot_q4_1,
                ],
                [
                    |u, d, _, x| unsafe { x86::vnni::dot4_q8(u, d, x) },
                    x86::vnni::dot4_q4_1,
                ],
                x86::vnni::axpy_q8,
            ));
        }
        let mut seen: Vec<Vec<u32>> = Vec::new();
        for (name, dot, dot4, axpy) in levels {
            let mut bits = Vec::new();
            for (cols, scale) in [(160, 0.1), (576, 1.0), (32 * 7, 3.0)] {
                let rows = 5;
                let mut w = random(rows * cols, 11, scale);
                // Row 0 at full scale in every block: ±127 weights against ±127 tokens.
                for (j, v) in w[..cols].iter_mut().enumerate() {
                    *v = if j % 3 == 0 { -scale } else { scale };
                }
                let xs: Vec<Vec<f32>> = (0..4)
                    .map(|t| match t {
                        0 => (0..cols)
                            .map(|j| if j % 2 == 0 { 2.0 } else { -2.0 })
                            .collect(),
                        _ => random(cols, 20 + t, 2.0),
                    })
                    .collect();
                let tokens: Vec<QuantToken> = xs.iter().map(|x| QuantToken::new(x)).collect();
                for (f, format) in [QuantFormat::Q8, QuantFormat::Q4_1].into_iter().enumerate() {
                    let q = QuantRows::quantize(&w, rows, cols, format)?;
                    for r in 0..rows {
                        let (u, d, c) = q.row_parts(r);
                        let four = [&tokens[0], &tokens[1], &tokens[2], &tokens[3]];
                        // SAFETY: the CPU has the level's features (checked above).
                        let (one, many) =
                            unsafe { (dot[f](u, d, c, &tokens[0]), dot4[f](u, d, c, four)) };
                        for (t, &got) in std::iter::once(&one).chain(&many).enumerate() {
                            let want = q.dot_portable(r, &tokens[t.saturating_sub(1)]);
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{name} {format:?} cols {cols} row {r} token {t}: {got} against {want}"
                            );
                            bits.push(got.to_bits());
                        }
                    }
                    if format == QuantFormat::Q8 {
                        let nb = cols / BLOCK;
                        let mut y = random(cols, 30, 1.0);
                        let mut want = y.clone();
                        // SAFETY: as above; row 2's bytes and scales.
                        unsafe {
                            axpy(
                                0.5,
                                &q.bytes[2 * cols..3 * cols],
                                &q.scale[2 * nb..3 * nb],
                                &mut y,
                            )
                        };
                        let deq = q.dequantize();
                        for (j, v) in want.iter_mut().enumerate() {
                            *v += 0.5 * deq[2 * cols + j];
                        }
                        for (j, (a, b)) in y.iter().zip(&want).enumerate() {
                            assert!(
                                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                                "{name} axpy {j}: {a} {b}"
                            );
                        }
                    }
                }
            }
            seen.push(bits);
        }
        if let [a, b] = &seen[..] {
            assert_eq!(a, b, "AVX2 and VNNI dots differ");
        }
        Ok(())
    }

    #[test]
    fn axpy_adds_the_dequantized_row() -> Result<()> {
        let (rows, cols) = (3, 96);
        let w = random(rows * cols, 5, 1.0);
        for format in [QuantFormat::Q8, QuantFormat::Q4_1] {
            let q = QuantRows::quantize(&w, rows, cols, format)?;
            let deq = q.dequantize();
            let mut y = random(cols, 6, 1.0);
            let y0 = y.clone();
            q.axpy(1, -0.75, &mut y);
            for j in 0..cols {
                let want = y0[j] - 0.75 * deq[cols + j];
                assert!((y[j] - want).abs() <= 1e-5, "{format:?} {j}");
            }
        }
        Ok(())
    }

    #[test]
    fn gguf_blocks_read_as_the_values_they_encode() -> Result<()> {
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        let (rows, cols) = (4, 64);
        let w = random(rows * cols, 7, 1.0);
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let t = Tensor::from_vec(w.clone(), (rows, cols), &Device::Cpu)?;
            let qt = QTensor::quantize(&t, dtype)?;
            let want = qt
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let raw = qt.data()?;
            let q = QuantRows::from_gguf_blocks(&raw, dtype, rows, cols)?;
            for (a, b) in q.dequantize().iter().zip(&want) {
                assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{dtype:?} {a} {b}");
            }
            assert!(QuantRows::from_gguf_blocks(&raw[1..], dtype, rows, cols).is_err());
        }
        let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu)?;
        let q4k = QTensor::quantize(&Tensor::cat(&[&t, &t, &t, &t], 1)?, GgmlDType::Q4K)?;
        let e = QuantRows::from_gguf_blocks(&q4k.data()?, GgmlDType::Q4K, rows, 256)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Q4K"), "{e}");
        Ok(())
    }

    #[test]
    fn bad_shapes_and_values_are_refused() {
        assert!(QuantRows::quantize(&[0.0; 40], 1, 40, QuantFormat::Q8).is_err());
        assert!(QuantRows::quantize(&[0.0; 64], 3, 32, QuantFormat::Q8).is_err());
        let mut w = vec![0.5f32; 64];
        w[40] = f32::NAN;
        let e = QuantRows::quantize(&w, 2, 32, QuantFormat::Q4_1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("row 1"), "{e}");
    }
}
