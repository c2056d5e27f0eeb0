//! The TwELL (tile-wise ELLPACK) format, lossless.
//!
//! An activation matrix `h [M, N]` (M tokens, N = d_ff neurons) is cut into tiles of
//! `T` columns. Each `(row, tile)` pair owns `C = T / CF` slots; a slot holds a
//! tile-local column index (`u8`, since `T <= 256`) and a value. The layout differs
//! from the reference release in three ways, each for a reason:
//!
//! * counts, indices and values are separate arrays: the value array alone is a
//!   candle `Tensor`, so autograd sees it and the L1 penalty is simply `Σ|values|`;
//! * indices are tile-local `u8` instead of 16-bit global ones: a third less memory
//!   per slot and no limit on N;
//! * a `(row, tile)` with more than `C` nonzeros is never truncated: the whole tile
//!   goes, densely, to an overflow block sized to fit exactly, and it is counted.
//!   Its slots stay empty, so every nonzero is stored exactly once.
//!
//! The value array is `[M · n_tiles · C]` slot values followed by `[n_overflow · T]`
//! dense overflow tiles (in row order). `docs/design.md` draws the layout.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;

use crate::error::{err, TwellError};
use fused_ops::host::{is_value_dtype, Float};

/// The default tile width: 256 columns, so a tile-local index fits a `u8`.
pub const DEFAULT_TILE: usize = 256;
/// The default compression factor: 32 slots per 256-column tile (12.5% tile density),
/// far above the 0.5–3% densities a sparsity-trained FFN runs at.
pub const DEFAULT_COMPRESSION: usize = 8;

/// Tile width `T` and compression factor `CF` of a TwELL matrix, and which CUDA kernels
/// the sparse MLP runs with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TwellConfig {
    tile: usize,
    compression: usize,
    paths: KernelPaths,
}

impl Default for TwellConfig {
    fn default() -> Self {
        Self {
            tile: DEFAULT_TILE,
            compression: DEFAULT_COMPRESSION,
            paths: KernelPaths::default(),
        }
    }
}

/// Which kernels the CUDA sparse MLP's forward runs where more than one computes the same
/// result. `Default` is the measured best for each size; the other choices exist so that
/// the tests check every path and `twell bench mlp` can time them side by side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KernelPaths {
    pub gate: GateGemm,
    pub walk: RowWalk,
    pub few_rows: FewRows,
    pub staged_rows: StagedRows,
}

/// Which staged kernels run a CUDA forward of 2 to 64 token rows at inference, where the
/// few-row kernel does not (a batched decode step past its bounds, a short prompt).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StagedRows {
    /// The measured best: the row kernels where the hidden size fits them (up to 4096),
    /// the slot kernels past it.
    #[default]
    Auto,
    /// The prefill row kernels, each row split over up to eight warps (their parts meet
    /// in shared memory in a fixed order) with the norms around the MLP folded in, where
    /// the hidden size fits them (the slot kernels otherwise).
    RowKernels,
    /// A warp per slot (up) and per tile of a 256-column chunk (down), whose partial sums
    /// meet in f32 atomics before a finish kernel writes the rows.
    SlotKernels,
    /// Spread over the card: up a warp per chunk of a row's neurons, down a block per
    /// 256-column slice of a row, its warps splitting the row's neurons and meeting in
    /// shared memory in a fixed order; no norm folded in. For hidden sizes up to 4096 and
    /// a d_ff that is a multiple of 8 (the slot kernels otherwise).
    SpreadKernels,
}

/// Which kernel runs a CUDA forward of 2 to 16 token rows at inference (a batched decode
/// step, a short prompt).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FewRows {
    /// The measured best: the CUDA-core few-row kernel within its gate bound, the staged
    /// kernels past it.
    #[default]
    Auto,
    /// The one-launch kernel with the rows' gates on the tensor cores, for a hidden size
    /// that is a multiple of 32 up to 8192 (the staged kernels otherwise).
    TensorCores,
    /// The one-launch kernel with the rows' gates on the CUDA cores, for a hidden size up
    /// to 2048 (the staged kernels otherwise), past its gate bound too.
    CudaCores,
    /// The staged kernels (gate GEMM, then the up and down kernels).
    Staged,
}

/// How the gate GEMM runs on CUDA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GateGemm {
    /// cuBLASLt with the ReLU mask from 4,096 rows, cuBLAS below.
    #[default]
    Auto,
    /// cuBLASLt with its ReLU epilogue writing a bit mask of the positives (an error
    /// where cuBLASLt has no algorithm for the shape).
    Masked,
    /// cuBLAS's plain GEMM; the positives are found by reading the whole gate.
    Plain,
}

/// How the CUDA prefill row kernels find each row's active neurons at inference, where a
/// warp takes a whole token row. Elsewhere (a row split over several warps, or a pass
/// that keeps state for its backward) they walk the slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RowWalk {
    /// A bit mask of the gate's positives (cuBLASLt's, or one a sign kernel makes from
    /// the plain gate), with `h` left in the gate: no pack launch and no slots.
    #[default]
    Mask,
    /// The TwELL slots the pack writes.
    Slots,
}

impl TwellConfig {
    /// `tile` in {32, 64, 128, 256} (a `u8` local index), `compression` in {2, 4, 8}.
    pub fn new(tile: usize, compression: usize) -> Result<Self> {
        if !matches!(tile, 32 | 64 | 128 | 256) {
            return err(TwellError::BadTile(tile));
        }
        if !matches!(compression, 2 | 4 | 8) {
            return err(TwellError::BadCompression(compression));
        }
        Ok(Self {
            tile,
            compression,
            paths: KernelPaths::default(),
        })
    }

    /// The same format with the CUDA kernels chosen by `paths`.
    pub fn with_paths(mut self, paths: KernelPaths) -> Self {
        self.paths = paths;
        self
    }

    pub fn paths(&self) -> KernelPaths {
        self.paths
    }

    pub fn tile(&self) -> usize {
        self.tile
    }

    pub fn compression(&self) -> usize {
        self.compression
    }

    /// Slots per `(row, tile)`: nonzeros a tile can hold before it overflows.
    pub fn capacity(&self) -> usize {
        self.tile / self.compression
    }

    /// Tiles per row; the last one is partial when `cols` is not a multiple of `T`.
    pub fn n_tiles(&self, cols: usize) -> usize {
        cols.div_ceil(self.tile)
    }
}

/// Where the nonzeros of a TwELL matrix are: everything but the values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TwellPattern {
    rows: usize,
    cols: usize,
    config: TwellConfig,
    /// `[rows · n_tiles]`: the true nonzero count of each `(row, tile)`, which may
    /// exceed the capacity (then the tile lives in the overflow block).
    counts: Vec<u16>,
    /// `[rows · n_tiles · capacity]`: tile-local column of each occupied slot.
    indices: Vec<u8>,
    /// `[rows + 1]`: CSR offsets of each row's overflowing tiles in `overflow_tiles`.
    overflow_row_ptr: Vec<u32>,
    /// `[n_overflow]`: tile number of each overflowing `(row, tile)`.
    overflow_tiles: Vec<u32>,
}

/// One stored nonzero, as the kernels visit it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Global column (neuron) index.
    pub col: usize,
    /// Position of the value in the value array.
    pub pos: usize,
}

impl TwellPattern {
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn config(&self) -> TwellConfig {
        self.config
    }
    pub fn n_tiles(&self) -> usize {
        self.config.n_tiles(self.cols)
    }
    pub fn counts(&self) -> &[u16] {
        &self.counts
    }
    pub fn indices(&self) -> &[u8] {
        &self.indices
    }
    pub fn overflow_row_ptr(&self) -> &[u32] {
        &self.overflow_row_ptr
    }
    pub fn overflow_tiles(&self) -> &[u32] {
        &self.overflow_tiles
    }
    /// Number of slot values (`rows · n_tiles · capacity`).
    pub fn slot_len(&self) -> usize {
        self.rows * self.n_tiles() * self.config.capacity()
    }
    /// Number of overflowing `(row, tile)` pairs.
    pub fn n_overflow(&self) -> usize {
        self.overflow_tiles.len()
    }
    /// Length of the value array: slots, then the dense overflow tiles.
    pub fn values_len(&self) -> usize {
        self.slot_len() + self.n_overflow() * self.config.tile
    }

    /// Calls `f` for every stored nonzero of `row`, in tile order. `values` is the
    /// value array, needed only to skip the zeros inside overflow tiles.
    #[inline]
    pub fn for_each_in_row<T: Float>(&self, row: usize, values: &[T], mut f: impl FnMut(Entry)) {
        let (tile, cap, n_tiles) = (self.config.tile, self.config.capacity(), self.n_tiles());
        let mut next_overflow = self.overflow_row_ptr[row] as usize;
        for t in 0..n_tiles {
            let count = self.counts[row * n_tiles + t] as usize;
            if count == 0 {
                continue;
            }
            if count <= cap {
                let base = (row * n_tiles + t) * cap;
                for s in 0..count {
                    let col = t * tile + self.indices[base + s] as usize;
                    f(Entry { col, pos: base + s });
                }
            } else {
                debug_assert_eq!(self.overflow_tiles[next_overflow] as usize, t);
                let base = self.slot_len() + next_overflow * tile;
                let width = tile.min(self.cols - t * tile);
                for c in 0..width {
                    if values[base + c].to_f32() > 0.0 {
                        f(Entry {
                            col: t * tile + c,
                            pos: base + c,
                        });
                    }
                }
                next_overflow += 1;
            }
        }
    }
}

/// Packs `src [rows, cols]` (row-major) into TwELL, keeping only values `> 0`
/// (the ReLU is fused). Values are converted from `S` to `T` on the way.
pub fn pack_rows<S: Float, T: Float>(
    src: &[S],
    rows: usize,
    cols: usize,
    config: TwellConfig,
) -> (TwellPattern, Vec<T>) {
    let mut builder = PackBuilder::new(cols, config);
    builder.push(src, rows);
    builder.finish()
}

/// Builds a TwELL matrix block of rows by block of rows, so producers (the gate GEMM)
/// never hold the whole dense matrix.
pub struct PackBuilder<T> {
    cols: usize,
    config: TwellConfig,
    rows: usize,
    counts: Vec<u16>,
    indices: Vec<u8>,
    slot_values: Vec<T>,
    overflow_values: Vec<T>,
    overflow_row_ptr: Vec<u32>,
    overflow_tiles: Vec<u32>,
}

impl<T: Float> PackBuilder<T> {
    pub fn new(cols: usize, config: TwellConfig) -> Self {
        Self {
            cols,
            config,
            rows: 0,
            counts: Vec::new(),
            indices: Vec::new(),
            slot_values: Vec::new(),
            overflow_values: Vec::new(),
            overflow_row_ptr: vec![0],
            overflow_tiles: Vec::new(),
        }
    }

    /// Appends `rows` rows of `src` (row-major, `cols` wide).
    pub fn push<S: Float>(&mut self, src: &[S], rows: usize) {
        let (cols, tile, cap) = (self.cols, self.config.tile, self.config.capacity());
        let n_tiles = self.config.n_tiles(cols);
        let row_slots = n_tiles * cap;
        let (c0, i0) = (self.counts.len(), self.indices.len());
        self.counts.resize(c0 + rows * n_tiles, 0);
        self.indices.resize(i0 + rows * row_slots, 0);
        self.slot_values
            .resize(i0 + rows * row_slots, T::from_f32(0.0));

        let overflow_per_row: Vec<Vec<(u32, Vec<T>)>> = self.counts[c0..]
            .par_chunks_mut(n_tiles.max(1))
            .zip(self.indices[i0..].par_chunks_mut(row_slots.max(1)))
            .zip(self.slot_values[i0..].par_chunks_mut(row_slots.max(1)))
            .enumerate()
            .map(|(r, ((row_counts, row_indices), row_values))| {
                let row = &src[r * cols..(r + 1) * cols];
                let mut overflow = Vec::new();
                for (t, count) in row_counts.iter_mut().enumerate() {
                    let lo = t * tile;
                    let seg = &row[lo..(lo + tile).min(cols)];
                    let nnz = seg.iter().filter(|v| v.to_f32() > 0.0).count();
                    *count = nnz as u16;
                    if nnz <= cap {
                        let mut s = t * cap;
                        for (c, v) in seg.iter().enumerate() {
                            if v.to_f32() > 0.0 {
                                row_indices[s] = c as u8;
                                row_values[s] = T::from_f32(v.to_f32());
                                s += 1;
                            }
                        }
                    } else {
                        let mut dense = vec![T::from_f32(0.0); tile];
                        for (c, v) in seg.iter().enumerate() {
                            dense[c] = T::from_f32(v.to_f32().max(0.0));
                        }
                        overflow.push((t as u32, dense));
                    }
                }
                overflow
            })
            .collect();

        for row_overflow in overflow_per_row {
            for (t, dense) in row_overflow {
                self.overflow_tiles.push(t);
                self.overflow_values.extend_from_slice(&dense);
            }
            self.overflow_row_ptr.push(self.overflow_tiles.len() as u32);
        }
        self.rows += rows;
    }

    /// The pattern and the value array `[slots | overflow tiles]`.
    pub fn finish(self) -> (TwellPattern, Vec<T>) {
        let mut values = self.slot_values;
        values.extend_from_slice(&self.overflow_values);
        let pattern = TwellPattern {
            rows: self.rows,
            cols: self.cols,
            config: self.config,
            counts: self.counts,
            indices: self.indices,
            overflow_row_ptr: self.overflow_row_ptr,
            overflow_tiles: self.overflow_tiles,
        };
        (pattern, values)
    }
}

/// Scatters TwELL values back to a dense row-major `[rows, cols]` f32 matrix.
pub fn unpack_rows<T: Float>(pattern: &TwellPattern, values: &[T]) -> Vec<f32> {
    let cols = pattern.cols;
    let mut dense = vec![0f32; pattern.rows * cols];
    dense
        .par_chunks_mut(cols.max(1))
        .enumerate()
        .for_each(|(r, out)| {
            pattern.for_each_in_row(r, values, |e| out[e.col] = values[e.pos].to_f32());
        });
    dense
}

/// Checks that `rows x cols` fits the 32-bit offsets the GPU kernels use.
pub(crate) fn check_size(
    what: &'static str,
    rows: usize,
    cols: usize,
    config: TwellConfig,
) -> Result<()> {
    let slots = rows
        .checked_mul(config.n_tiles(cols))
        .and_then(|v| v.checked_mul(config.capacity()));
    match slots {
        Some(s)
            if s < u32::MAX as usize && rows < u32::MAX as usize && cols < u32::MAX as usize =>
        {
            Ok(())
        }
        _ => err(TwellError::TooLarge { what, rows, cols }),
    }
}

/// A TwELL matrix: the pattern, shared, and the values as a candle tensor (so that
/// ops on the values stay in the autograd graph).
#[derive(Clone, Debug)]
pub struct Twell {
    pattern: Arc<TwellPattern>,
    values: Tensor,
}

/// What a TwELL matrix holds, for logs, density control and the Auto mode.
#[derive(Clone, Debug, PartialEq)]
pub struct TwellStats {
    pub rows: usize,
    pub cols: usize,
    pub nnz: usize,
    /// `nnz / (rows · cols)`.
    pub density: f64,
    /// Nonzeros of each row (the per-token L0).
    pub l0_per_row: Vec<u32>,
    /// The largest nonzero count of any `(row, tile)`.
    pub max_per_tile: usize,
    /// Slots per tile.
    pub capacity: usize,
    /// `(row, tile)` pairs that went to the dense overflow block.
    pub overflow_tiles: usize,
    /// Rows with at least one overflowing tile.
    pub overflow_rows: usize,
}

impl TwellStats {
    /// Mean nonzeros per row (L0).
    pub fn mean_l0(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.nnz as f64 / self.rows as f64
        }
    }
}

impl Twell {
    pub(crate) fn from_parts(pattern: Arc<TwellPattern>, values: Tensor) -> Self {
        Self { pattern, values }
    }

    /// Packs `relu(h)` for a 2-D `h [M, N]` of dtype f32, bf16 or f16. Values `<= 0`
    /// are dropped (the ReLU is fused); nothing else ever is.
    pub fn pack(h: &Tensor, config: TwellConfig) -> Result<Self> {
        let (rows, cols) = match h.dims() {
            &[r, c] => (r, c),
            d => {
                return err(TwellError::BadRank {
                    what: "Twell::pack",
                    expected: 2,
                    got: d.to_vec(),
                })
            }
        };
        if !is_value_dtype(h.dtype()) {
            return err(TwellError::BadDtype {
                what: "Twell::pack",
                dtype: h.dtype(),
            });
        }
        check_size("Twell::pack", rows, cols, config)?;
        let host = h.to_device(&Device::Cpu)?.contiguous()?;
        let (pattern, values) = match h.dtype() {
            DType::F32 => pack_tensor::<f32>(&host, rows, cols, config)?,
            DType::BF16 => pack_tensor::<half::bf16>(&host, rows, cols, config)?,
            _ => pack_tensor::<half::f16>(&host, rows, cols, config)?,
        };
        let values = values.to_device(h.device())?;
        Ok(Self {
            pattern: Arc::new(pattern),
            values,
        })
    }

    /// The dense `[M, N]` matrix, in the values' dtype and device.
    pub fn to_dense(&self) -> Result<Tensor> {
        let host = self.values.to_device(&Device::Cpu)?;
        let dense = match host.dtype() {
            DType::F32 => unpack_rows(&self.pattern, &host.to_vec1::<f32>()?),
            DType::BF16 => unpack_rows(&self.pattern, &host.to_vec1::<half::bf16>()?),
            _ => unpack_rows(&self.pattern, &host.to_vec1::<half::f16>()?),
        };
        Tensor::from_vec(dense, (self.pattern.rows, self.pattern.cols), &Device::Cpu)?
            .to_dtype(self.values.dtype())?
            .to_device(self.values.device())
    }

    pub fn pattern(&self) -> &Arc<TwellPattern> {
        &self.pattern
    }

    /// The value array: `[slot values | overflow tiles]`, see the module doc.
    pub fn values(&self) -> &Tensor {
        &self.values
    }

    pub fn rows(&self) -> usize {
        self.pattern.rows
    }

    pub fn cols(&self) -> usize {
        self.pattern.cols
    }

    pub fn config(&self) -> TwellConfig {
        self.pattern.config
    }

    pub fn stats(&self) -> Result<TwellStats> {
        let host = self.values.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        Ok(stats_of(&self.pattern, &host.to_vec1::<f32>()?))
    }
}

fn pack_tensor<T: Float>(
    host: &Tensor,
    rows: usize,
    cols: usize,
    config: TwellConfig,
) -> Result<(TwellPattern, Tensor)> {
    let src = host.flatten_all()?.to_vec1::<T>()?;
    let (pattern, values) = pack_rows::<T, T>(&src, rows, cols, config);
    let n = values.len();
    Ok((pattern, Tensor::from_vec(values, n, &Device::Cpu)?))
}

/// Statistics of a pattern, given its values (needed for the zeros of overflow tiles).
pub fn stats_of<T: Float>(pattern: &TwellPattern, values: &[T]) -> TwellStats {
    let l0_per_row: Vec<u32> = (0..pattern.rows)
        .into_par_iter()
        .map(|r| {
            let mut n = 0u32;
            pattern.for_each_in_row(r, values, |_| n += 1);
            n
        })
        .collect();
    let nnz: usize = l0_per_row.iter().map(|&v| v as usize).sum();
    let overflow_rows = pattern
        .overflow_row_ptr
        .windows(2)
        .filter(|w| w[1] > w[0])
        .count();
    let total = pattern.rows * pattern.cols;
    TwellStats {
        rows: pattern.rows,
        cols: pattern.cols,
        nnz,
        density: if total == 0 {
            0.0
        } else {
            nnz as f64 / total as f64
        },
        l0_per_row,
        max_per_tile: pattern.counts.iter().copied().max().unwrap_or(0) as usize,
        capacity: pattern.config.capacity(),
        overflow_tiles: pattern.n_overflow(),
        overflow_rows,
    }
}
