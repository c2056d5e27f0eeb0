//! NCCL through cudarc (candle-core's `nccl` feature), on the GPU's own candle stream:
//! a reduction is queued behind the backward pass that made the gradients, with no copy
//! through the host.
//!
//! Unlike [`crate::TcpCommunicator`], NCCL does not compare the ranks' lengths: ranks that
//! disagree hang or read garbage. The trainer calls the same collectives with the same
//! shapes on every rank, which the TCP communicator's checks test on the CPU.

use candle_core::backend::BackendDevice;
use candle_core::cuda::cudarc::driver::DriverError;
use candle_core::cuda::cudarc::nccl::result::NcclError;
use candle_core::cuda::cudarc::nccl::{Comm, Id, ReduceOp};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};

use crate::{Communicator, DistError, Result};

/// The bytes of an NCCL unique id.
const ID_BYTES: usize = 128;

fn nccl_error(e: NcclError) -> DistError {
    DistError::Nccl(format!("{e:?}"))
}

fn driver_error(e: DriverError) -> DistError {
    DistError::Nccl(format!("CUDA: {e:?}"))
}

/// One rank of an NCCL communicator, on one GPU.
pub struct NcclCommunicator {
    comm: Comm,
    device: CudaDevice,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; every
// collective takes `&mut self`, so no two run on it at once.
unsafe impl Send for NcclCommunicator {}

impl NcclCommunicator {
    /// Joins the NCCL communicator of `bootstrap`'s ranks on `device`, this rank's GPU:
    /// rank 0 makes the unique id and `bootstrap` (a [`crate::TcpCommunicator`] of the
    /// same ranks) broadcasts it. Blocks until every rank has joined.
    pub fn new(device: &CudaDevice, bootstrap: &mut dyn Communicator) -> Result<Self> {
        let mut id = [0u8; ID_BYTES];
        if bootstrap.rank() == 0 {
            let made = Id::new().map_err(nccl_error)?;
            for (byte, c) in id.iter_mut().zip(made.internal()) {
                *byte = *c as u8;
            }
        }
        bootstrap.broadcast(&mut id)?;
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(
            device.cuda_stream(),
            bootstrap.rank(),
            bootstrap.world_size(),
            id,
        )
        .map_err(nccl_error)?;
        Ok(Self {
            comm,
            device: device.clone(),
        })
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let stream = self.device.cuda_stream();
        let mut on_device = stream.clone_htod(&*buf).map_err(driver_error)?;
        self.comm
            .all_reduce_in_place(&mut on_device, &ReduceOp::Sum)
            .map_err(nccl_error)?;
        stream.memcpy_dtoh(&on_device, buf).map_err(driver_error)?;
        stream.synchronize().map_err(driver_error)
    }

    fn broadcast(&mut self, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let stream = self.device.cuda_stream();
        let mut on_device = stream.clone_htod(&*buf).map_err(driver_error)?;
        self.comm
            .broadcast_in_place(&mut on_device, 0)
            .map_err(nccl_error)?;
        stream.memcpy_dtoh(&on_device, buf).map_err(driver_error)?;
        stream.synchronize().map_err(driver_error)
    }

    fn barrier(&mut self) -> Result<()> {
        self.all_reduce_sum(&mut [0.0])
    }

    /// On the device, into a new buffer on the stream the tensor was made on.
    fn all_reduce_sum_tensor(&mut self, t: &Tensor) -> Result<Tensor> {
        let on_this_gpu = matches!(t.device(), Device::Cuda(d) if d.same_device(&self.device));
        if !on_this_gpu {
            return Err(DistError::Nccl(format!(
                "a tensor on {:?}, not on this rank's GPU",
                t.device().location()
            )));
        }
        let t = t.to_dtype(DType::F32)?.contiguous()?;
        let n = t.elem_count();
        if n == 0 {
            return Ok(t);
        }
        let summed = {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cuda(storage) = &*storage else {
                return Err(DistError::Nccl("a CUDA tensor without CUDA storage".into()));
            };
            let start = layout.start_offset();
            let src = storage.as_cuda_slice::<f32>()?.slice(start..start + n);
            // SAFETY: every element is written by the all-reduce before it is read.
            let mut dst =
                unsafe { self.device.cuda_stream().alloc::<f32>(n) }.map_err(driver_error)?;
            self.comm
                .all_reduce(&src, &mut dst, &ReduceOp::Sum)
                .map_err(nccl_error)?;
            CudaStorage::wrap_cuda_slice(dst, self.device.clone())
        };
        Ok(Tensor::from_storage(
            Storage::Cuda(summed),
            t.shape().clone(),
            BackpropOp::none(),
            false,
        ))
    }
}
