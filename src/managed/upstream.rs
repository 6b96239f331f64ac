//! The upstream of the managed pool: `cuMemAllocManaged` chunks.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::cuda::driver_err;
use crate::error::{Error, OomState, PoolKind, Result};
use crate::upstream::{Chunk, Upstream};

/// Managed (unified) memory, reachable from the host and from kernels on
/// every device (`cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)` / `cuMemFree`).
/// The driver migrates pages to whoever touches them.
///
/// The manager's managed pool uses it (example:
/// [`MemoryManager::managed_pool`](crate::MemoryManager::managed_pool)).
pub struct CudaManagedMemory {
    ctx: Arc<CudaContext>,
}

impl CudaManagedMemory {
    /// Managed memory allocated while `ctx` is current.
    ///
    /// # Errors
    /// [`Error::InvalidState`] when the device can't allocate managed
    /// memory (`CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY` is 0); a driver error.
    pub fn new(ctx: Arc<CudaContext>) -> Result<Self> {
        let supported = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)
            .map_err(driver_err("cuDeviceGetAttribute"))?;
        if supported == 0 {
            return Err(Error::InvalidState(format!(
                "device {} can't allocate managed memory (CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY is 0)",
                ctx.ordinal()
            )));
        }
        Ok(CudaManagedMemory { ctx })
    }
}

impl Upstream for CudaManagedMemory {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the context is current; the memory is used only by address.
        match unsafe { result::malloc_managed(size, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) } {
            Ok(ptr) => Ok(Chunk { addr: ptr as usize, size }),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::OutOfMemory {
                pool: PoolKind::Managed,
                requested: size,
                state: Box::new(OomState {
                    device_free: self.device_free(),
                    upstream: Some(format!("cuMemAllocManaged: {e}")),
                    ..Default::default()
                }),
            }),
            Err(e) => Err(driver_err("cuMemAllocManaged")(e)),
        }
    }

    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the chunk came from `cuMemAllocManaged` and no block in
        // it is live; `cuMemFree` waits for work that uses it.
        unsafe { result::memory_free(chunk.addr as sys::CUdeviceptr) }.map_err(driver_err("cuMemFree"))
    }

    fn granularity(&self) -> usize {
        // The large pages the driver migrates managed memory in.
        2 << 20
    }

    fn name(&self) -> &'static str {
        "cuMemAllocManaged"
    }

    fn host_accessible(&self) -> bool {
        true
    }

    fn device_free(&self) -> Option<usize> {
        self.ctx.mem_get_info().ok().map(|(free, _)| free)
    }
}
