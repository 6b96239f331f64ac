//! The per-block `malloc` kernels of `kernels.cu`, compiled with NVRTC, and
//! one round of them: allocate, use three times, copy out and free. Shared
//! by the `device_malloc` example and `tests/device_heap.rs`.

#![allow(dead_code)] // each includer uses part of it

use std::error::Error;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cumem::DeviceBuffer;

/// Blocks per launch: one heap allocation each.
pub const NUM_BLOCKS: u32 = 64;
/// Threads per block: each owns one `int` of its block's buffer.
pub const THREADS: u32 = 128;
/// How many times `usemem` runs; each adds the thread's index.
pub const USES: i32 = 3;
/// The bytes a block's threads use.
pub const BYTES_USED: u64 = THREADS as u64 * 4;

/// The three kernels, loaded into a context.
pub struct MallocKernels {
    stream: Arc<CudaStream>,
    allocmem: CudaFunction,
    usemem: CudaFunction,
    freemem: CudaFunction,
}

/// What one round found.
#[derive(Debug)]
pub struct Round {
    /// Blocks whose `malloc` returned NULL, as the kernel counted them.
    pub failures: u32,
    /// Each thread's final value; -1 for threads of blocks without memory.
    pub out: Vec<i32>,
}

impl MallocKernels {
    /// Compiles `kernels.cu` (`compile_ptx`) and loads it into `ctx`
    /// (`cuModuleLoadData`). The heap size must be set before this.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, Box<dyn Error>> {
        let src = format!("#define NUM_BLOCKS {NUM_BLOCKS}\n{}", include_str!("kernels.cu"));
        let ptx = cudarc::nvrtc::compile_ptx(src)?;
        let module = ctx.load_module(ptx)?;
        Ok(MallocKernels {
            stream: ctx.default_stream(),
            allocmem: module.load_function("allocmem")?,
            usemem: module.load_function("usemem")?,
            freemem: module.load_function("freemem")?,
        })
    }

    /// Each block mallocs `bytes` (at least [`BYTES_USED`]), the threads
    /// fill and update the buffer over [`USES`] launches, and a last launch
    /// copies it into a device buffer and frees it.
    pub fn round(&self, bytes: u64) -> Result<Round, Box<dyn Error>> {
        assert!(bytes >= BYTES_USED, "each thread uses one int of its block's buffer");
        let mut failures = DeviceBuffer::<u32>::new(1)?;
        failures.zero()?;
        let out = DeviceBuffer::<i32>::new((NUM_BLOCKS * THREADS) as usize)?;
        let (failures_ptr, out_ptr) = (failures.device_ptr(), out.device_ptr());
        let cfg = LaunchConfig { grid_dim: (NUM_BLOCKS, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match the kernels' signatures (u64, unsigned*;
        // none; int*), and the buffers hold 1 and NUM_BLOCKS * THREADS values,
        // as many as the kernels touch. They outlive the launches: the stream
        // is synchronised before they drop.
        unsafe {
            self.stream.launch_builder(&self.allocmem).arg(&bytes).arg(&failures_ptr).launch(cfg)?;
            for _ in 0..USES {
                self.stream.launch_builder(&self.usemem).launch(cfg)?;
            }
            self.stream.launch_builder(&self.freemem).arg(&out_ptr).launch(cfg)?;
        }
        self.stream.synchronize()?;
        Ok(Round { failures: failures.to_vec()?[0], out: out.to_vec()? })
    }
}

impl Round {
    /// Checks every value: `USES * thread` for blocks that got memory, -1
    /// for those that did not, and as many of those as the kernel counted.
    /// Returns the blocks that got memory.
    pub fn check(&self) -> Result<u32, String> {
        let mut served = 0;
        for (b, block) in self.out.chunks(THREADS as usize).enumerate() {
            if block.iter().all(|&v| v == -1) {
                continue;
            }
            for (t, &v) in block.iter().enumerate() {
                if v != USES * t as i32 {
                    return Err(format!("block {b}, thread {t}: {v}, expected {}", USES * t as i32));
                }
            }
            served += 1;
        }
        if NUM_BLOCKS - served != self.failures {
            return Err(format!(
                "{} blocks had no memory but the kernel counted {} failed mallocs",
                NUM_BLOCKS - served,
                self.failures
            ));
        }
        Ok(served)
    }
}
