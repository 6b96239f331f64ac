//! The CUDA upstreams: device memory from `cuMemAlloc`, pinned host memory
//! from `cuMemHostAlloc`.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::{Chunk, Upstream};
use crate::cuda::{driver_err, vmm, RelaxedCaptureMode};
use crate::error::{Error, OomState, PoolKind, Result};

/// Chunks are rounded to 2 MiB, the size of the large pages the driver
/// maps device memory with.
const DEVICE_GRANULARITY: usize = 2 << 20;

fn is_oom(e: &DriverError) -> bool {
    e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
}

fn oom(pool: PoolKind, size: usize, call: &str, e: DriverError, device_free: Option<usize>) -> Error {
    Error::OutOfMemory {
        pool,
        requested: size,
        state: Box::new(OomState { device_free, upstream: Some(format!("{call}: {e}")), ..Default::default() }),
    }
}

/// Device memory straight from the driver (`cuMemAlloc` / `cuMemFree`).
pub struct CudaDeviceMemory {
    ctx: Arc<CudaContext>,
}

impl CudaDeviceMemory {
    /// Device memory of the context's device.
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        CudaDeviceMemory { ctx }
    }
}

impl Upstream for CudaDeviceMemory {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let fault = crate::fault::check_driver(crate::fault::Point::Create);
        // SAFETY: the context is current; the memory is only used through
        // the addresses the pool hands out.
        let got = fault.and_then(|()| unsafe { result::malloc_sync(size) });
        match got {
            Ok(ptr) => Ok(Chunk { addr: ptr as usize, size }),
            Err(e) if is_oom(&e) => Err(oom(PoolKind::Device, size, "cuMemAlloc", e, self.device_free())),
            Err(e) => Err(driver_err("cuMemAlloc")(e)),
        }
    }

    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the pool returns a chunk from `allocate_chunk` once no
        // block in it is live; `cuMemFree` waits for work that uses it.
        unsafe { result::free_sync(chunk.addr as sys::CUdeviceptr) }.map_err(driver_err("cuMemFree"))
    }

    fn granularity(&self) -> usize {
        DEVICE_GRANULARITY
    }

    fn name(&self) -> &'static str {
        "cuMemAlloc"
    }

    fn host_accessible(&self) -> bool {
        false
    }

    fn device_free(&self) -> Option<usize> {
        self.ctx.mem_get_info().ok().map(|(free, _)| free)
    }
}

/// Page-locked host memory, portable to every context
/// (`cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)` / `cuMemFreeHost`).
pub struct CudaPinnedMemory {
    ctx: Arc<CudaContext>,
}

impl CudaPinnedMemory {
    /// Pinned memory allocated while `ctx` is current.
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        CudaPinnedMemory { ctx }
    }
}

impl Upstream for CudaPinnedMemory {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let fault = crate::fault::check_driver(crate::fault::Point::HostAlloc);
        // SAFETY: the context is current; the flags are a valid
        // combination; the memory is used only through the pool.
        let got = fault.and_then(|()| unsafe { result::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) });
        match got {
            Ok(ptr) => Ok(Chunk { addr: ptr as usize, size }),
            Err(e) if is_oom(&e) => Err(oom(PoolKind::Pinned, size, "cuMemHostAlloc", e, None)),
            Err(e) => Err(driver_err("cuMemHostAlloc")(e)),
        }
    }

    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the chunk came from `cuMemHostAlloc` and no block in it is
        // live.
        unsafe { result::free_host(chunk.addr as *mut std::ffi::c_void) }.map_err(driver_err("cuMemFreeHost"))
    }

    fn granularity(&self) -> usize {
        4096
    }

    fn name(&self) -> &'static str {
        "cuMemHostAlloc"
    }

    fn host_accessible(&self) -> bool {
        true
    }
}

/// The upstream of a graph-private pool: as [`device_upstream`], but
/// giving a chunk back waits for no device (the pool's owner has waited
/// for the work that used it).
pub(crate) fn graph_upstream(ctx: Arc<CudaContext>, expandable: bool) -> Result<Box<dyn Upstream>> {
    if expandable && vmm::vmm_supported(&ctx)? {
        return Ok(Box::new(super::CudaVmm::new(ctx.ordinal())?.owner_settles()));
    }
    Ok(Box::new(CudaDeviceMemory::new(ctx)))
}

/// The upstream of a device's sync pool: expandable segments on CUDA
/// virtual memory (one reserved range that grows by mapping) when asked for
/// and supported, else plain `cuMemAlloc` chunks.
pub(crate) fn device_upstream(ctx: Arc<CudaContext>, expandable: bool) -> Result<Box<dyn Upstream>> {
    if expandable && vmm::vmm_supported(&ctx)? {
        return Ok(Box::new(super::CudaVmm::new(ctx.ordinal())?));
    }
    Ok(Box::new(CudaDeviceMemory::new(ctx)))
}
