//! # twell-dist: collective communication for data-parallel training
//!
//! The processes of a data-parallel run (one per GPU, or several on a CPU to test the
//! logic) each compute gradients on their shard of a batch; before the optimizer step
//! the gradients are summed over the processes, so that every one takes the same step.
//! This crate is that sum and the little else such a run needs:
//!
//! * [`Communicator`]: the rank of this process, the world size, an in-place sum
//!   all-reduce of f32 buffers, a broadcast from rank 0, a barrier;
//! * [`SingleProcess`]: a world of one, where every collective is a no-op;
//! * [`TcpCommunicator`]: processes on one host (loopback) or several, joined through a
//!   rendezvous at rank 0 and reducing around a ring of TCP connections, with timeouts;
//! * `NcclCommunicator` (feature `cuda`): NCCL through cudarc, on the GPU's own stream;
//!   its unique id travels over another communicator (a [`TcpCommunicator`]);
//! * [`all_reduce_mean`]: many tensors (a model's gradients) averaged over the ranks in
//!   a few flat buckets.

mod buckets;
#[cfg(feature = "nccl")]
mod nccl;
mod tcp;

use std::time::Duration;

use candle_core::{DType, Tensor};

pub use buckets::{all_reduce_mean, buckets, DEFAULT_BUCKET_BYTES};
#[cfg(feature = "nccl")]
pub use nccl::NcclCommunicator;
pub use tcp::{TcpCommunicator, TcpOptions};

/// The collectives, as named in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    Rendezvous,
    AllReduce,
    Broadcast,
    Barrier,
}

impl std::fmt::Display for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Rendezvous => "the rendezvous",
            Self::AllReduce => "an all-reduce",
            Self::Broadcast => "a broadcast",
            Self::Barrier => "a barrier",
        })
    }
}

/// What can go wrong between the processes of a run.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("invalid communicator options: {0}")]
    Options(String),
    #[error("rank {rank}: {message}")]
    Rendezvous { rank: usize, message: String },
    #[error("rank {rank} waited {after:?} for rank {peer} during {during}: is it still running?")]
    Timeout {
        rank: usize,
        peer: usize,
        after: Duration,
        during: Collective,
    },
    #[error("rank {rank}: rank {peer} closed its connection during {during} (did it exit?)")]
    PeerClosed {
        rank: usize,
        peer: usize,
        during: Collective,
    },
    #[error("rank {rank}: {during} of {ours} elements, but rank {peer} passed {theirs}: every rank must pass the same length")]
    LengthMismatch {
        rank: usize,
        peer: usize,
        during: Collective,
        ours: usize,
        theirs: usize,
    },
    #[error("rank {rank} is in {ours} (collective {our_seq}) while rank {peer} is in {theirs} (collective {their_seq}): the ranks called different collectives")]
    OutOfStep {
        rank: usize,
        peer: usize,
        ours: Collective,
        our_seq: u64,
        theirs: Collective,
        their_seq: u64,
    },
    #[error("rank {rank}: connection to rank {peer} during {during}: {source}")]
    Io {
        rank: usize,
        peer: usize,
        during: Collective,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {rank}: an earlier collective failed, so the ranks are out of step; this communicator cannot be used again")]
    Broken { rank: usize },
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl From<DistError> for candle_core::Error {
    fn from(e: DistError) -> Self {
        match e {
            DistError::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

pub type Result<T> = std::result::Result<T, DistError>;

/// The processes of a data-parallel run, seen from one of them.
///
/// Every rank must call the same collectives in the same order with buffers of the same
/// length; a rank that does not gets an error rather than a hang (how quickly depends on
/// the implementation's timeouts). After an error the communicator is unusable.
pub trait Communicator: Send {
    /// This process's rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of processes.
    fn world_size(&self) -> usize;

    /// Replaces `buf` on every rank by the element-wise sum of every rank's `buf`. Every
    /// rank ends with bit-identical values.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()>;

    /// Replaces `buf` on every rank by rank 0's.
    fn broadcast(&mut self, buf: &mut [u8]) -> Result<()>;

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()>;

    /// [`Communicator::broadcast`] of f32 values (copied bit for bit).
    fn broadcast_f32(&mut self, buf: &mut [f32]) -> Result<()> {
        self.broadcast(bytemuck::cast_slice_mut(buf))
    }

    /// The element-wise sum over the ranks of a tensor (any float dtype, any shape), as
    /// f32 on its device. By default through host memory; a communicator that reduces on
    /// the device (NCCL) does so there.
    fn all_reduce_sum_tensor(&mut self, t: &Tensor) -> Result<Tensor> {
        let mut host = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        self.all_reduce_sum(&mut host)?;
        Ok(Tensor::from_vec(host, t.shape(), t.device())?)
    }
}

/// A boxed communicator is one (the boxed one chosen at run time: TCP or NCCL).
impl<C: Communicator + ?Sized> Communicator for Box<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        (**self).all_reduce_sum(buf)
    }

    fn broadcast(&mut self, buf: &mut [u8]) -> Result<()> {
        (**self).broadcast(buf)
    }

    fn barrier(&mut self) -> Result<()> {
        (**self).barrier()
    }

    fn all_reduce_sum_tensor(&mut self, t: &Tensor) -> Result<Tensor> {
        (**self).all_reduce_sum_tensor(t)
    }
}

/// A world of one: every collective leaves its buffer as it is.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl Communicator for SingleProcess {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn broadcast(&mut self, _buf: &mut [u8]) -> Result<()> {
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }

    fn all_reduce_sum_tensor(&mut self, t: &Tensor) -> Result<Tensor> {
        Ok(t.to_dtype(DType::F32)?)
    }
}
