//! Launchers of `twell_mlp_union.cu`: the prefill MLP's up and down projections on tensor
//! cores over the union of the neurons each tile of 64 tokens has active, where the row
//! kernels of `gated_t2d.cu` read a weight row per active (token, neuron) pair.
//!
//! A development path until it is measured against the row kernels on the H200:
//! `TWELL_PREFILL=union` takes it (`rows`, the default, does not), for inference rows
//! above the decode sizes with hidden % 32 == 0 and d_ff % 8 == 0; elsewhere the row
//! kernels run as before. `TWELL_UNION_BLOCK` (128 or 256; default 256) sets how many
//! union members an up block, and output columns a down block, take.

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use half::bf16;

use super::{decode_max_tokens, per_context, PerContext};
use crate::format::TwellConfig;
use crate::knobs;

/// The module name candle keeps the kernels under.
const MODULE: &str = "twell_mlp_union";
const TWELL_MLP_UNION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/twell_mlp_union.ptx"));

/// Tokens a tile (`UNION_TOKENS` in the .cu).
const UNION_TOKENS: usize = 64;
/// The block widths the up and down kernels are built for (`NB` in the .cu): union
/// members an up block multiplies, output columns a down block writes.
const BLOCK_WIDTHS: [usize; 2] = [128, 256];
/// `K_STEP`, `STAGES` and `PAD` of the .cu, which set a block's shared memory.
const K_STEP: usize = 32;
const STAGES: usize = 3;
const PAD: usize = 8;
/// Columns a block of the bits kernel reads (`BITS_COLS`).
const BITS_COLS: usize = 256;
/// Threads of every union kernel's block.
const THREADS: u32 = 256;

/// Whether the forward of `m` rows of hidden `d` through `f` neurons takes the union
/// kernels: asked for with `TWELL_PREFILL=union`, and only where they apply (see the
/// module's notes).
pub(super) fn takes(m: usize, d: usize, f: usize, keep_for_backward: bool) -> Result<bool> {
    static CHOICE: knobs::Cell = knobs::Cell::new();
    let choice = knobs::read_once(&CHOICE, || {
        knobs::env_choice("TWELL_PREFILL", &["rows", "union"])
    })?;
    Ok(choice == Some(1)
        && !keep_for_backward
        && m > decode_max_tokens()?
        && d.is_multiple_of(32)
        && f.is_multiple_of(8)
        && f.div_ceil(BLOCK_WIDTHS[0]) <= u16::MAX as usize
        && d.div_ceil(BLOCK_WIDTHS[0]) <= u16::MAX as usize)
}

/// The union kernels' block width (`TWELL_UNION_BLOCK`, 128 or 256; default 256).
fn block_width() -> Result<usize> {
    static WIDTH: knobs::Cell = knobs::Cell::new();
    let set = knobs::read_once(&WIDTH, || {
        knobs::env_count("TWELL_UNION_BLOCK", "128 or 256", |w| {
            BLOCK_WIDTHS.contains(&w)
        })
    })?;
    Ok(set.unwrap_or(256))
}

/// Dynamic shared memory of the up (`up`) or down kernel for blocks of `nb`: STAGES
/// stages of the x (up) or h (down) tile's padded rows, then the weight tile's, as the
/// kernels lay them out.
fn shared_bytes(up: bool, nb: usize) -> usize {
    let x_or_h = UNION_TOKENS * (K_STEP + PAD);
    let w = if up {
        nb * (K_STEP + PAD)
    } else {
        K_STEP * (nb + PAD)
    };
    STAGES * (x_or_h + w) * std::mem::size_of::<bf16>()
}

/// Lets `func` (the up kernel when `up`, else down, of width `nb`) take `bytes` of
/// dynamic shared memory, past the 48 KB a block gets without asking: once per context
/// and kernel, not per call.
fn allow_shared(
    dev: &CudaDevice,
    func: &CudaFunction,
    (up, nb): (bool, usize),
    bytes: usize,
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
    static DONE: PerContext = std::sync::Mutex::new(None);
    per_context(&DONE, dev, 2 * nb + usize::from(up), || {
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .w()?;
        Ok(bytes)
    })?;
    Ok(())
}

/// The scratch of one forward through the union kernels.
pub(super) struct Union {
    m: usize,
    d: usize,
    f: usize,
    config: TwellConfig,
    /// The up and down kernels' block width.
    nb: usize,
    /// `[n_token_tiles]` union lengths, `[n_token_tiles, f]` union members.
    list_len: CudaSlice<i32>,
    list: CudaSlice<i32>,
    /// `[m, f]`: each token's h over its tile's union, in the union's order.
    h: CudaSlice<bf16>,
    /// `[m, ceil(f / nb)]`: each token's Σ|h| per up block.
    l1_parts: CudaSlice<f32>,
}

impl Union {
    pub(super) fn new(
        dev: &CudaDevice,
        m: usize,
        d: usize,
        f: usize,
        config: TwellConfig,
    ) -> Result<Self> {
        let tiles = m.div_ceil(UNION_TOKENS);
        let nb = block_width()?;
        // SAFETY: the list kernel writes every tile's length and its members up to it;
        // up writes every h column the down kernel reads (up to the length rounded to
        // 8) and every l1 part of a block that ran, the only ones summed.
        unsafe {
            Ok(Self {
                m,
                d,
                f,
                config,
                nb,
                list_len: dev.alloc::<i32>(tiles)?,
                list: dev.alloc::<i32>(tiles * f)?,
                h: dev.alloc::<bf16>(m * f)?,
                l1_parts: dev.alloc::<f32>(m * f.div_ceil(nb))?,
            })
        }
    }

    fn grid(&self, y: usize, shared_bytes: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.m.div_ceil(UNION_TOKENS) as u32, y as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared_bytes as u32,
        }
    }

    /// Each token tile's union of active neurons from the dense gate `[m, f]`, and the
    /// counts of positive gates per (token, TwELL tile) it returns, as the pack's.
    pub(super) fn list(
        &mut self,
        dev: &CudaDevice,
        gate: &CudaSlice<bf16>,
    ) -> Result<CudaSlice<u32>> {
        let n_tiles = self.config.n_tiles(self.f);
        // SAFETY: the bits kernel writes every (row, tile) count and every word.
        let mut counts = unsafe { dev.alloc::<u32>(self.m * n_tiles)? };
        let mut words =
            unsafe { dev.alloc::<u32>(self.m.div_ceil(UNION_TOKENS) * self.f.div_ceil(32))? };
        let (m, f, tile, n_tiles_i) = (
            self.m as i32,
            self.f as i32,
            self.config.tile() as i32,
            n_tiles as i32,
        );
        let bits =
            dev.get_or_load_custom_func("twell_union_bits_bf16", MODULE, TWELL_MLP_UNION_PTX)?;
        let mut b = bits.builder();
        b.arg(gate)
            .arg(&mut counts)
            .arg(&mut words)
            .arg(&m)
            .arg(&f)
            .arg(&tile)
            .arg(&n_tiles_i);
        // SAFETY: a block per (token tile, 256 columns), rows and columns bounded in the
        // kernel; the tile width divides 256 (TwellConfig).
        unsafe { b.launch(self.grid(self.f.div_ceil(BITS_COLS), 0)) }.w()?;
        let one_per_tile = self.grid(1, 0);
        let list = dev.get_or_load_custom_func("twell_union_list", MODULE, TWELL_MLP_UNION_PTX)?;
        let mut b = list.builder();
        b.arg(&words)
            .arg(&mut self.list)
            .arg(&mut self.list_len)
            .arg(&f);
        // SAFETY: a block per token tile, its list at most f long.
        unsafe { b.launch(one_per_tile) }.w()?;
        Ok(counts)
    }

    /// The up projection over the unions (after [`Union::list`]).
    pub(super) fn up(
        &mut self,
        dev: &CudaDevice,
        x: &CudaView<'_, bf16>,
        w_ud: &CudaView<'_, bf16>,
        gate: &CudaSlice<bf16>,
    ) -> Result<()> {
        let (m, d, f) = (self.m as i32, self.d as i32, self.f as i32);
        let bytes = shared_bytes(true, self.nb);
        let grid = self.grid(self.f.div_ceil(self.nb), bytes);
        let up = dev.get_or_load_custom_func(
            &format!("twell_union_up_bf16_n{}", self.nb),
            MODULE,
            TWELL_MLP_UNION_PTX,
        )?;
        allow_shared(dev, &up, (true, self.nb), bytes)?;
        let mut b = up.builder();
        b.arg(x)
            .arg(w_ud)
            .arg(gate)
            .arg(&self.list)
            .arg(&self.list_len)
            .arg(&mut self.h)
            .arg(&mut self.l1_parts)
            .arg(&m)
            .arg(&d)
            .arg(&f);
        // SAFETY: a block per (token tile, union block); blocks past the union return,
        // rows past m are neither read nor written, d % 32 == 0 (`takes`); the dynamic
        // shared memory as the kernel lays it out.
        unsafe { b.launch(grid) }.w()?;
        Ok(())
    }

    /// The down projection over the unions (after [`Union::up`]) into `out`, the `[m, d]`
    /// rows then the m L1 terms.
    pub(super) fn down(
        &self,
        dev: &CudaDevice,
        w_ud: &CudaView<'_, bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let (m, d, f, nb) = (self.m as i32, self.d as i32, self.f as i32, self.nb as i32);
        let bytes = shared_bytes(false, self.nb);
        let down = dev.get_or_load_custom_func(
            &format!("twell_union_down_bf16_n{}", self.nb),
            MODULE,
            TWELL_MLP_UNION_PTX,
        )?;
        allow_shared(dev, &down, (false, self.nb), bytes)?;
        let mut b = down.builder();
        b.arg(w_ud)
            .arg(&self.list)
            .arg(&self.list_len)
            .arg(&self.h)
            .arg(&self.l1_parts)
            .arg(out)
            .arg(&m)
            .arg(&d)
            .arg(&f)
            .arg(&nb);
        // SAFETY: a block per (token tile, nb output columns), covering every row and
        // column of `out` and, in the first column's blocks, every L1 term; the dynamic
        // shared memory as the kernel lays it out.
        unsafe { b.launch(self.grid(self.d.div_ceil(self.nb), bytes)) }.w()?;
        Ok(())
    }
}
