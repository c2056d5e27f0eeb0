//! The decode step over a slotted KV cache, for a step captured once as a CUDA graph and
//! replayed every token: each row's position and cache slot are read from device
//! buffers (`positions`, `slots`) instead of being launch arguments, and the split of
//! the cached positions over blocks is planned for the cache's capacity, so one launch
//! shape serves every step whatever the lengths. The kernel is `causal_attention_step`'s
//! (`kernels/src/causal_attention.cu`); positions past a row's length are skipped.

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

use crate::error::{err, OpError};

/// Most scores one block keeps in shared memory (f32): a split covers at most this many
/// cached positions.
const MAX_CHUNK: usize = 8192;

/// One decode step's attention for up to `rows` sequences, each in its own slot of a
/// `[slots, capacity, 2·kv_heads·hd]` cache, at its own position. Holds the scratch
/// of the split (partial sums and tickets), so a captured step allocates nothing and
/// its buffers live as long as the graph that uses them.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct SlotAttention {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    rows: usize,
    splits: usize,
    chunk: usize,
    part: Tensor,
    tickets: Tensor,
}

impl SlotAttention {
    /// The step for up to `rows` sequences of `heads` query and `kv_heads` KV heads of
    /// size `head_dim`, over caches of `capacity` positions. CUDA, bf16, head sizes in
    /// [`crate::CUDA_HEAD_DIMS`].
    pub fn new(
        device: &Device,
        rows: usize,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        capacity: usize,
    ) -> Result<Self> {
        if !device.is_cuda() {
            return err(OpError::Invalid(
                "SlotAttention runs on CUDA only (elsewhere: Llama::forward_decode_batch)".into(),
            ));
        }
        if !crate::CUDA_HEAD_DIMS.contains(&head_dim)
            || kv_heads == 0
            || heads % kv_heads != 0
            || rows == 0
            || capacity == 0
            || rows > 65535
            || heads > 65535
        {
            return err(OpError::Invalid(format!(
                "SlotAttention: {rows} rows, {heads} heads, {kv_heads} KV heads of size \
                 {head_dim}, capacity {capacity}: want head sizes {:?}, heads a multiple of \
                 the KV heads, and 1..=65535 rows",
                crate::CUDA_HEAD_DIMS
            )));
        }
        let sms = multiprocessors(device)?;
        let plan = super::split::plan(rows * heads, capacity, sms);
        // A split's scores sit in shared memory: cap its positions.
        let splits = plan.splits.max(capacity.div_ceil(MAX_CHUNK));
        let chunk = capacity.div_ceil(splits);
        let part = Tensor::zeros(rows * heads * splits * (2 + head_dim), DType::F32, device)?;
        let tickets = Tensor::zeros(rows * heads, DType::U32, device)?;
        Ok(Self {
            heads,
            kv_heads,
            head_dim,
            capacity,
            rows,
            splits,
            chunk,
            part,
            tickets,
        })
    }

    /// Rows this step was made for, at most.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// `qkv [n, (heads + 2·kv_heads)·hd]` (one token per row, not yet turned), the whole
    /// angle table `angles` (`cos_sin [positions, hd]`), the cache `[slots, capacity,
    /// 2·kv_heads·hd]` (written in place), and `positions`, `slots` (`[n]` u32 on the
    /// device): row `i` turns its query and key at `positions[i]`, writes its key and
    /// value into slot `slots[i]` at that position and attends positions `0 ..=
    /// positions[i]` of the slot. Returns `[n, heads·hd]`.
    ///
    /// The device values are not checked (that would cost a sync): each position must
    /// be below the capacity and each slot below the cache's slot count; the caller
    /// keeps them on the host and checks them there.
    pub fn forward(
        &self,
        qkv: &Tensor,
        angles: &crate::RopeTable,
        cache: &Tensor,
        positions: &Tensor,
        slots: &Tensor,
    ) -> Result<Tensor> {
        let n = qkv.dim(0)?;
        let ok = n <= self.rows
            && positions.dims() == [n]
            && slots.dims() == [n]
            && positions.dtype() == DType::U32
            && slots.dtype() == DType::U32
            && positions.is_contiguous()
            && slots.is_contiguous()
            && cache.is_contiguous();
        if !ok {
            return err(OpError::ShapeMismatch {
                what: "SlotAttention::forward",
                detail: format!(
                    "{n} rows (at most {}), positions {:?} {:?}, slots {:?} {:?}: want \
                     contiguous u32 [rows] and a contiguous cache",
                    self.rows,
                    positions.dims(),
                    positions.dtype(),
                    slots.dims(),
                    slots.dtype()
                ),
            });
        }
        let op = SlotStep {
            attention: self.clone(),
            positions: positions.clone(),
            slots: slots.clone(),
        };
        qkv.apply_op3_no_bwd(&angles.cos_sin, cache, &op)
    }
}

#[cfg(feature = "cuda")]
fn multiprocessors(device: &Device) -> Result<usize> {
    match device {
        Device::Cuda(dev) => crate::cuda::multiprocessors(dev),
        _ => Ok(1),
    }
}

#[cfg(not(feature = "cuda"))]
fn multiprocessors(_: &Device) -> Result<usize> {
    Ok(1)
}

/// The op of one [`SlotAttention::forward`] call.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct SlotStep {
    attention: SlotAttention,
    positions: Tensor,
    slots: Tensor,
}

impl SlotStep {
    /// Rows of a call, its shapes checked.
    fn dims(&self, qkv: &Layout, cs: &Layout, cache: &Layout) -> Result<usize> {
        let a = &self.attention;
        let hd = a.head_dim;
        let width = (a.heads + 2 * a.kv_heads) * hd;
        let ok = matches!(*qkv.dims(), [n, w] if w == width && n > 0)
            && matches!(*cs.dims(), [p, d] if d == hd && p >= a.capacity)
            && matches!(*cache.dims(), [s, cap, w] if s > 0 && cap == a.capacity && w == 2 * a.kv_heads * hd);
        if !ok {
            return err(OpError::ShapeMismatch {
                what: "SlotAttention::forward",
                detail: format!(
                    "qkv {:?}, cos_sin {:?}, cache {:?}: want qkv [n, {width}], cos_sin \
                     [positions >= {}, {hd}] and cache [slots, {}, {}]",
                    qkv.dims(),
                    cs.dims(),
                    cache.dims(),
                    a.capacity,
                    a.capacity,
                    2 * a.kv_heads * hd
                ),
            });
        }
        Ok(qkv.dims()[0])
    }
}

impl CustomOp3 for SlotStep {
    fn name(&self) -> &'static str {
        "slot-attention-step"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        ql: &Layout,
        _: &CpuStorage,
        cl: &Layout,
        _: &CpuStorage,
        kl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.dims(ql, cl, kl)?;
        err(OpError::Invalid("SlotAttention runs on CUDA only".into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        cs: &candle_core::CudaStorage,
        cl: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = self.dims(ql, cl, kl)?;
        let a = &self.attention;
        let (ps, pl) = self.positions.storage_and_layout();
        let (ss, sl) = self.slots.storage_and_layout();
        let (part, part_l) = a.part.storage_and_layout();
        let (tickets, tickets_l) = a.tickets.storage_and_layout();
        let out = super::cuda::causal_attention_slots(
            super::cuda::SlotStepArgs {
                qkv: (qs, ql),
                cos_sin: (cs, cl),
                cache: (ks, kl),
                positions: (on_gpu(&ps, "positions")?, pl),
                slots: (on_gpu(&ss, "slots")?, sl),
                part: (on_gpu(&part, "scratch")?, part_l),
                tickets: (on_gpu(&tickets, "tickets")?, tickets_l),
            },
            (n, a.heads, a.kv_heads, a.head_dim),
            (a.splits, a.chunk),
        )?;
        Ok((out, Shape::from((n, a.heads * a.head_dim))))
    }
}

/// The CUDA storage of an operand the op reads besides its three inputs.
#[cfg(feature = "cuda")]
fn on_gpu<'a>(s: &'a candle_core::Storage, what: &str) -> Result<&'a candle_core::CudaStorage> {
    match s {
        candle_core::Storage::Cuda(c) => Ok(c),
        _ => err(OpError::Invalid(format!(
            "SlotAttention: {what} must be on the GPU"
        ))),
    }
}
