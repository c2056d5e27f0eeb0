//! Kernel launches that may start before the kernel ahead of them on the stream ends
//! (programmatic dependent launch, sm_90 and newer).
//!
//! At 2,048 rows each of the prefill's pack, up and down kernels is about one wave of
//! the card, so every boundary between them leaves multiprocessors idle while the last
//! warps of one kernel finish and the next one's blocks are placed. With the launch
//! attribute, the next kernel's blocks are placed as the earlier one's drain and run
//! their prologue (the up kernel loads its row of x); they then wait in
//! `wait_for_previous_grid` (`twell_common.cuh`) until the earlier grid has finished
//! and its writes are visible. A kernel launched this way must call that wait before it
//! reads anything the earlier kernel writes or writes anything it reads.
//!
//! cudarc's launch builder has no launch attributes, so [`Args`] collects the same
//! arguments (through cudarc's [`PushKernelArg`], so launch code reads the same either
//! way) and launches through `cuLaunchKernelEx`.

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use crate::knobs;

/// One launch's arguments, each kept by value in an 8-byte slot: the driver reads as
/// many bytes of a slot as the kernel's parameter has (4 for an `int`, 8 for a pointer).
pub(super) struct Args<'s> {
    stream: &'s CudaStream,
    slots: Vec<u64>,
}

impl<'s> Args<'s> {
    /// Arguments for a launch on `stream`.
    pub fn new(stream: &'s CudaStream) -> Self {
        Self {
            stream,
            slots: Vec::with_capacity(16),
        }
    }

    fn push_pointer(&mut self, pointer: sys::CUdeviceptr) -> &mut Self {
        self.slots.push(pointer);
        self
    }

    /// Launches `func` with these arguments; with `overlap`, the launch may start before
    /// the kernel ahead of it ends (see the module doc; the kernel must wait for it).
    ///
    /// # Safety
    /// As for cudarc's `launch`: the arguments must match the kernel's parameters, and
    /// the kernel must stay inside the buffers it is given.
    pub unsafe fn launch(
        &mut self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        overlap: bool,
    ) -> Result<()> {
        let mut params: Vec<*mut std::ffi::c_void> = self
            .slots
            .iter_mut()
            .map(|slot| slot as *mut u64 as *mut std::ffi::c_void)
            .collect();
        // SAFETY: a zeroed attribute is a valid value of the C struct; its id and the one
        // union field read for that id are set below.
        let mut attribute: sys::CUlaunchAttribute = std::mem::zeroed();
        attribute.id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attribute.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if overlap {
                &mut attribute
            } else {
                std::ptr::null_mut()
            },
            numAttrs: u32::from(overlap),
        };
        self.stream.context().bind_to_thread().w()?;
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
        .w()
    }
}

// Device buffers: their address. Candle's devices run without cudarc's event tracking
// (`device::configure`), so `device_ptr` records nothing.
unsafe impl<'b, T> PushKernelArg<&'b CudaSlice<T>> for Args<'_> {
    fn arg(&mut self, arg: &'b CudaSlice<T>) -> &mut Self {
        let pointer = arg.device_ptr(self.stream).0;
        self.push_pointer(pointer)
    }
}

unsafe impl<'b, T> PushKernelArg<&'b mut CudaSlice<T>> for Args<'_> {
    fn arg(&mut self, arg: &'b mut CudaSlice<T>) -> &mut Self {
        let pointer = arg.device_ptr(self.stream).0;
        self.push_pointer(pointer)
    }
}

unsafe impl<'b, 'c, T> PushKernelArg<&'b CudaView<'c, T>> for Args<'_> {
    fn arg(&mut self, arg: &'b CudaView<'c, T>) -> &mut Self {
        let pointer = arg.device_ptr(self.stream).0;
        self.push_pointer(pointer)
    }
}

// Scalars: their bits, low bytes first (the driver reads the parameter's size).
unsafe impl<'b> PushKernelArg<&'b i32> for Args<'_> {
    fn arg(&mut self, arg: &'b i32) -> &mut Self {
        self.slots.push(u64::from(*arg as u32));
        self
    }
}

unsafe impl<'b> PushKernelArg<&'b f32> for Args<'_> {
    fn arg(&mut self, arg: &'b f32) -> &mut Self {
        self.slots.push(u64::from(arg.to_bits()));
        self
    }
}

unsafe impl<'b> PushKernelArg<&'b u64> for Args<'_> {
    fn arg(&mut self, arg: &'b u64) -> &mut Self {
        self.slots.push(*arg);
        self
    }
}

/// Whether the prefill's pack, up and down kernels overlap their predecessor's tail:
/// `TWELL_OVERLAP=on` on a card of compute capability 9.0 or newer; off by default until
/// measured (`off` is the same as unset, to name both in an A/B run).
pub(super) fn overlap_launches(dev: &CudaDevice) -> Result<bool> {
    static KNOB: knobs::Cell = knobs::Cell::new();
    let set = knobs::read_once(&KNOB, || knobs::env_choice("TWELL_OVERLAP", &["off", "on"]))?;
    Ok(set == Some(1) && super::compute_major(dev)? >= 9)
}
