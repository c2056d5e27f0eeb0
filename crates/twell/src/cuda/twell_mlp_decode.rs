//! The one-launch decode MLP (`kernels/twell_mlp_decode.cu`): up to
//! [`DECODE_FUSED_MAX_ROWS`] token rows, gate, ReLU, up and down in one kernel, for
//! inference. Its f32 sums live in a scratch buffer kept per stream, that every launch
//! leaves zeroed: a decode step then costs one launch and two output allocations.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use half::bf16;

use crate::ops::L1_COLUMNS;

const TWELL_MLP_DECODE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/twell_mlp_decode.ptx"));

/// Rows one launch takes (`DECODE_MAX_ROWS` in the .cu).
pub const DECODE_FUSED_MAX_ROWS: usize = 8;
const BLOCK_THREADS: u32 = 256;
/// Enough blocks to fill an H200 several times over; warps loop over the neurons.
const MAX_BLOCKS: usize = 4096;

/// Whether a forward of `m` rows takes the fused kernel: inference only (it keeps
/// nothing for a backward pass), and up to `TWELL_DECODE_FUSED_ROWS` rows (default 1,
/// 0 turns it off). Each active neuron adds `m · d` f32 atomics, so beyond one row, or
/// past ~2% density, the staged kernels win (docs/benchmarks.md).
pub fn use_fused_decode(m: usize, keep_for_backward: bool) -> bool {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let rows = *ROWS.get_or_init(|| {
        std::env::var("TWELL_DECODE_FUSED_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
            .min(DECODE_FUSED_MAX_ROWS)
    });
    !keep_for_backward && m >= 1 && m <= rows
}

/// The zeroed sums, L1 terms, tile counts and ticket of one stream, grown to the
/// largest hidden size and tile count seen.
struct Scratch {
    acc: CudaSlice<f32>,
    l1: CudaSlice<f32>,
    tile_counts: CudaSlice<u32>,
    ticket: CudaSlice<u32>,
}

impl Scratch {
    fn new(dev: &CudaDevice, d: usize, n_tiles: usize) -> Result<Self> {
        Ok(Self {
            acc: dev.alloc_zeros::<f32>(DECODE_FUSED_MAX_ROWS * d)?,
            l1: dev.alloc_zeros::<f32>(DECODE_FUSED_MAX_ROWS)?,
            tile_counts: dev.alloc_zeros::<u32>(DECODE_FUSED_MAX_ROWS * n_tiles)?,
            ticket: dev.alloc_zeros::<u32>(1)?,
        })
    }

    fn fits(&self, d: usize, n_tiles: usize) -> bool {
        self.acc.len() >= DECODE_FUSED_MAX_ROWS * d
            && self.tile_counts.len() >= DECODE_FUSED_MAX_ROWS * n_tiles
    }
}

/// Keyed by the stream, so two candle devices never share one.
static SCRATCH: Mutex<Option<HashMap<usize, Scratch>>> = Mutex::new(None);

/// Sizes of one fused launch.
pub struct DecodeDims {
    pub m: usize,
    pub d: usize,
    pub f: usize,
    pub tile: usize,
    pub n_tiles: usize,
}

/// Runs the fused MLP into `out [m, d + L1_COLUMNS]` and returns the `[m, n_tiles]`
/// true nonzero counts.
pub fn twell_mlp_decode(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    wg: &CudaView<bf16>,
    w_ud: &CudaView<bf16>,
    out: &mut CudaSlice<bf16>,
    dims: &DecodeDims,
) -> Result<CudaSlice<u32>> {
    let DecodeDims {
        m,
        d,
        f,
        tile,
        n_tiles,
    } = *dims;
    debug_assert!(out.len() == m * (d + L1_COLUMNS) && m <= DECODE_FUSED_MAX_ROWS);
    // SAFETY: the kernel's last block writes every count.
    let mut counts = unsafe { dev.alloc::<u32>(m * n_tiles)? };
    let key = dev.cuda_stream().cu_stream() as usize;
    let mut guard = SCRATCH.lock().expect("decode scratch lock");
    let map = guard.get_or_insert_with(HashMap::new);
    if !map.get(&key).is_some_and(|s| s.fits(d, n_tiles)) {
        // A replaced buffer is freed in stream order, after the launches that use it.
        map.insert(key, Scratch::new(dev, d, n_tiles)?);
    }
    let s = map.get_mut(&key).expect("inserted above");
    let func = dev.get_or_load_custom_func(
        "twell_mlp_decode_bf16",
        "twell_mlp_decode",
        TWELL_MLP_DECODE_PTX,
    )?;
    let (m_i, d_i, f_i, tile_i, nt_i) = (m as i32, d as i32, f as i32, tile as i32, n_tiles as i32);
    let mut b = func.builder();
    b.arg(x)
        .arg(wg)
        .arg(w_ud)
        .arg(&mut s.acc)
        .arg(&mut s.l1)
        .arg(&mut s.tile_counts)
        .arg(&mut s.ticket)
        .arg(out)
        .arg(&mut counts);
    b.arg(&m_i).arg(&d_i).arg(&f_i).arg(&tile_i).arg(&nt_i);
    let warps_per_block = (BLOCK_THREADS / 32) as usize;
    let cfg = LaunchConfig {
        grid_dim: (
            f.div_ceil(warps_per_block).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: a warp per neuron (grid-stride), rows below DECODE_MAX_ROWS, every index
    // bounded by m, d, f and n_tiles; the scratch is at least as large as they need.
    unsafe { b.launch(cfg) }.w()?;
    Ok(counts)
}
