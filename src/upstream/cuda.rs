//! The CUDA upstreams: device memory from `cuMemAlloc`, pinned host memory
//! registered with `cuMemHostRegister` (or from `cuMemHostAlloc`).

use std::collections::HashSet;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::{Chunk, Upstream};
use crate::cuda::{driver_err, vmm, RelaxedCaptureMode};
use crate::error::{Error, OomState, PoolKind, Result};
use crate::sync::{lock, Mutex};

/// Chunks are rounded to 2 MiB, the driver's large-page size for device memory.
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
        // SAFETY: the context is current; the memory is used only by address.
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

/// Page-locked host memory, portable to every context and mapped for the
/// devices. A chunk of 2 MiB or more is anonymous memory aligned to 2 MiB
/// that the kernel may back with huge pages (`mmap`,
/// `madvise(MADV_HUGEPAGE)`), registered with the driver
/// (`cuMemHostRegister(PORTABLE | DEVICEMAP)`, undone by
/// `cuMemHostUnregister` and `munmap`): pinning it runs about three times
/// as fast as `cuMemHostAlloc` (8 GiB in 1.8 s against 5.5 s on an H100
/// machine). Smaller chunks, and any chunk whose registration fails, come
/// from `cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)` / `cuMemFreeHost`.
pub struct CudaPinnedMemory {
    ctx: Arc<CudaContext>,
    /// The chunks from `cuMemHostAlloc` (the others were registered).
    host_allocated: Mutex<HashSet<usize>>,
}

/// The size from which chunks are registered huge-page memory.
const HUGE_PAGE: usize = 2 << 20;

impl CudaPinnedMemory {
    /// Pinned memory allocated while `ctx` is current.
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        CudaPinnedMemory { ctx, host_allocated: Mutex::new(HashSet::new()) }
    }

    /// `size` bytes of anonymous memory on a 2 MiB boundary, registered with
    /// the driver; `None` where that fails (leaving nothing behind).
    fn register(&self, size: usize) -> Option<Chunk> {
        // Over-reserved by a huge page, then trimmed to the aligned range.
        let span = size.checked_add(HUGE_PAGE)?;
        // SAFETY: an anonymous private mapping at an address of the
        // kernel's choosing; nothing else refers to it yet.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        let base = ptr as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        let unmap = |addr: usize, len: usize| {
            if len > 0 {
                // SAFETY: `addr..addr + len` is in our own mapping above.
                unsafe { libc::munmap(addr as *mut libc::c_void, len) };
            }
        };
        unmap(base, start - base);
        unmap(start + size, base + span - (start + size));
        // SAFETY: the range is ours; advice changes at most the page size.
        unsafe { libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE) };
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the context is current; the range is a live mapping of
        // `size` bytes that nothing else uses; it stays mapped until it is
        // unregistered (`deallocate_chunk`).
        let registered = unsafe { sys::cuMemHostRegister_v2(start as *mut std::ffi::c_void, size, flags) }.result();
        if registered.is_err() {
            unmap(start, size);
            return None;
        }
        Some(Chunk { addr: start, size })
    }
}

impl Upstream for CudaPinnedMemory {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let fault = crate::fault::check_driver(crate::fault::Point::HostAlloc);
        if fault.is_ok() && size >= HUGE_PAGE {
            if let Some(chunk) = self.register(size) {
                return Ok(chunk);
            }
        }
        // SAFETY: the context is current; the flags are a valid
        // combination; the memory is used only through the pool.
        let got = fault.and_then(|()| unsafe { result::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) });
        match got {
            Ok(ptr) => {
                lock(&self.host_allocated).insert(ptr as usize);
                Ok(Chunk { addr: ptr as usize, size })
            }
            Err(e) if is_oom(&e) => Err(oom(PoolKind::Pinned, size, "cuMemHostAlloc", e, None)),
            Err(e) => Err(driver_err("cuMemHostAlloc")(e)),
        }
    }

    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        let _relaxed = RelaxedCaptureMode::enter();
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        if lock(&self.host_allocated).remove(&chunk.addr) {
            // SAFETY: from `cuMemHostAlloc`, and no block in it is live.
            return unsafe { result::free_host(chunk.addr as *mut std::ffi::c_void) }
                .map_err(driver_err("cuMemFreeHost"));
        }
        // SAFETY: the chunk was registered by `register` and no block in it
        // is live; once unregistered, its mapping is ours to remove.
        unsafe { sys::cuMemHostUnregister(chunk.addr as *mut std::ffi::c_void) }
            .result()
            .map_err(driver_err("cuMemHostUnregister"))?;
        // SAFETY: as above: `register` mapped exactly this range.
        if unsafe { libc::munmap(chunk.addr as *mut libc::c_void, chunk.size) } != 0 {
            return Err(Error::Os { call: "munmap", source: std::io::Error::last_os_error() });
        }
        Ok(())
    }

    fn granularity(&self) -> usize {
        4096
    }

    fn name(&self) -> &'static str {
        "cuMemHostRegister (2 MiB pages) or cuMemHostAlloc"
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
