//! Programmatic dependent launches of the decode step's kernels.
//!
//! A decode step is a chain of short kernels, each bound by a memory round trip or two
//! and by its launch. On compute capability 9.0 and later, a kernel launched with the
//! programmatic-stream-serialization attribute starts while the kernel before it on the
//! stream finishes: it streams the weights it owns, then waits for its inputs
//! (`griddepcontrol.wait`, `wait_for_inputs` in `kernels/src/common.cuh`). Only kernels
//! built with that wait (their compute_90 PTX) may be launched so; [`DependentLaunch`]
//! takes their arguments as cudarc's builder does and launches them through
//! `cuLaunchKernelEx`. Captured into a CUDA graph, the dependency stays programmatic.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

static DEPENDENT_LAUNCHES: AtomicBool = AtomicBool::new(true);

/// Turns programmatic dependent launches off (each decode kernel then runs its portable
/// build, launched after the kernel before has finished) or back on. Process-wide; for
/// tests and benchmarks that compare the two.
pub fn set_dependent_launches(on: bool) {
    DEPENDENT_LAUNCHES.store(on, Ordering::Relaxed);
}

/// Whether the decode kernels launch as programmatic dependents on `dev`: compute
/// capability 9.0 or later, unless [`set_dependent_launches`] turned them off.
pub fn dependent_launches(dev: &CudaDevice) -> Result<bool> {
    Ok(DEPENDENT_LAUNCHES.load(Ordering::Relaxed) && super::compute_major(dev)? >= 9)
}

/// The most arguments a kernel launched this way takes.
const MAX_ARGS: usize = 32;

/// A kernel's arguments, pushed in order with [`PushKernelArg::arg`] as with cudarc's
/// `LaunchArgs`, and its launch: as a programmatic dependent where `dependent`, else as
/// a plain launch.
pub struct DependentLaunch<'a> {
    func: &'a CudaFunction,
    stream: &'a CudaStream,
    dependent: bool,
    /// A pointer to each argument's value, as `cuLaunchKernelEx` takes them.
    args: Vec<*mut c_void>,
    /// The buffers' device addresses, where `args` points for them (boxed: they never
    /// move while the launch is built).
    addresses: Box<[sys::CUdeviceptr; MAX_ARGS]>,
    /// Records each buffer's use on the stream once the launch is queued.
    uses: Vec<SyncOnDrop<'a>>,
}

impl<'a> DependentLaunch<'a> {
    pub fn new(func: &'a CudaFunction, stream: &'a CudaStream, dependent: bool) -> Self {
        Self {
            func,
            stream,
            dependent,
            args: Vec::with_capacity(MAX_ARGS),
            addresses: Box::new([0; MAX_ARGS]),
            uses: Vec::new(),
        }
    }

    fn push_address(&mut self, address: sys::CUdeviceptr, used: SyncOnDrop<'a>) {
        let i = self.args.len();
        assert!(
            i < MAX_ARGS,
            "a dependent launch takes at most {MAX_ARGS} arguments"
        );
        self.addresses[i] = address;
        self.args
            .push(&mut self.addresses[i] as *mut sys::CUdeviceptr as *mut c_void);
        self.uses.push(used);
    }

    /// Queues the kernel on the stream.
    ///
    /// # Safety
    /// As cudarc's `LaunchArgs::launch`: the arguments must be the kernel's, in order,
    /// and the kernel must stay within its buffers. With `dependent`, the kernel must
    /// read nothing another kernel writes, and write nothing, before `wait_for_inputs`.
    pub unsafe fn launch(mut self, cfg: LaunchConfig) -> Result<()> {
        assert!(self.args.len() <= MAX_ARGS);
        self.stream.context().bind_to_thread().w()?;
        // SAFETY: a zeroed attribute value is valid for every member of the union.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attribute = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: u32::from(self.dependent),
        };
        // SAFETY: `args` points at live values of the kernel's parameters (the caller's
        // contract); the config and its attribute outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .w()?;
        // The buffers' uses are recorded now that the launch is queued.
        self.uses.clear();
        Ok(())
    }
}

/// Values: the kernel reads them through the pointer until the launch is queued.
macro_rules! value_args {
    ($($t:ty),*) => {$(
        // SAFETY: `arg` outlives the builder, so the pointer is live at the launch.
        unsafe impl<'a, 'b: 'a> PushKernelArg<&'b $t> for DependentLaunch<'a> {
            fn arg(&mut self, arg: &'b $t) -> &mut Self {
                assert!(self.args.len() < MAX_ARGS);
                self.args.push(arg as *const $t as *mut c_void);
                self
            }
        }
    )*};
}
value_args!(i32, u32, i64, u64, f32);

// SAFETY (the four below): the address is the buffer's, and its use is recorded on the
// stream after the launch, as cudarc's builder does.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b CudaView<'c, T>> for DependentLaunch<'a> {
    fn arg(&mut self, arg: &'b CudaView<'c, T>) -> &mut Self {
        let (address, used) = arg.device_ptr(self.stream);
        self.push_address(address, used);
        self
    }
}

unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CudaSlice<T>> for DependentLaunch<'a> {
    fn arg(&mut self, arg: &'b CudaSlice<T>) -> &mut Self {
        let (address, used) = arg.device_ptr(self.stream);
        self.push_address(address, used);
        self
    }
}

unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CudaSlice<T>> for DependentLaunch<'a> {
    fn arg(&mut self, arg: &'b mut CudaSlice<T>) -> &mut Self {
        let (address, used) = arg.device_ptr_mut(self.stream);
        self.push_address(address, used);
        self
    }
}
