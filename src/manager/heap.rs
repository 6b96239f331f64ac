//! The device `malloc` heap: the fixed-size heap that kernels' `malloc()`,
//! `__nv_aligned_device_malloc()` and `free()` draw on.
//!
//! # Implementation details
//!
//! The heap's size is a context limit (`CU_LIMIT_MALLOC_HEAP_SIZE`, read
//! with `cuCtxGetLimit`, set with `cuCtxSetLimit`). The driver allocates the
//! heap (8 MiB unless set) for the first module that uses it, and its size
//! is fixed once a kernel that calls `malloc()` or `free()` has run in the
//! context: the CUDA Programming Guide says to set it before such a module
//! is loaded, and the driver API reference says `cuCtxSetLimit` then fails
//! with `CUDA_ERROR_INVALID_VALUE`.
//!
//! What the driver does (seen with driver 580.159 on an H100, by
//! `tests/device_heap.rs`, the `device_malloc` example and a probe):
//! - a setting is rounded up to at least 4 MiB (0 and 1 MiB both read
//!   back as 4 MiB);
//! - loading a module whose kernels call `malloc` does not yet fix the
//!   size; the first launch of such a kernel does, and from then on
//!   `cuCtxSetLimit` fails with `CUDA_ERROR_INVALID_VALUE`, even after the
//!   module is unloaded.
//!
//! So the rule to follow is the guide's (before loading), and the error to
//! expect when it is broken is `CUDA_ERROR_INVALID_VALUE`, which cumem turns
//! into [`Error::ConfigTooLate`]. A driver that took the call but kept the
//! old size would be caught too: the size is read back after setting it.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use super::{Backend, MemoryManager};
use crate::error::{Error, Result};

const WHAT: &str = "the device malloc heap size";

const TOO_LATE: &str = "the heap's size is fixed once a kernel that calls malloc() or free() has run in this \
     context (cuCtxSetLimit answered CUDA_ERROR_INVALID_VALUE); set it before loading modules whose kernels \
     call malloc, for example right after MemoryManager::init()";

const KEPT: &str = "the driver accepted cuCtxSetLimit but kept the old size, as it does once a kernel that calls \
     malloc() or free() has run in this context; set it before loading modules whose kernels call malloc";

impl MemoryManager {
    /// The device malloc heap's size on the default device
    /// (`cuCtxGetLimit` with `CU_LIMIT_MALLOC_HEAP_SIZE`): the heap that
    /// kernels' `malloc()` draws on. 8 MiB unless set.
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback; a driver error.
    ///
    /// # Examples
    /// ```
    /// use cumem::{Error, MemoryManager};
    /// match MemoryManager::global()?.device_malloc_heap_size() {
    ///     Ok(bytes) => println!("kernels may malloc {bytes} B in all"),
    ///     Err(Error::NeedsGpu(_)) => println!("no GPU here"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), cumem::Error>(())
    /// ```
    pub fn device_malloc_heap_size(&self) -> Result<usize> {
        let ctx = self.heap_ctx()?;
        ctx.bind_to_thread().map_err(crate::cuda::driver_err("cuCtxSetCurrent"))?;
        heap_limit()
    }

    /// Sets the device malloc heap's size on the default device
    /// (`cuCtxSetLimit` with `CU_LIMIT_MALLOC_HEAP_SIZE`) and returns the
    /// size now in effect, which the driver may round up (it keeps at least
    /// 4 MiB).
    ///
    /// Call it before any module whose kernels call `malloc()` is loaded
    /// into the context: the heap is allocated for such modules and its size
    /// can't change once one of their kernels has run.
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback; [`Error::ConfigTooLate`]
    /// once the size is fixed (the driver refuses, or takes the call and
    /// keeps the old size); other driver errors.
    pub fn set_device_malloc_heap_size(&self, bytes: usize) -> Result<usize> {
        let ctx = self.heap_ctx()?;
        ctx.bind_to_thread().map_err(crate::cuda::driver_err("cuCtxSetCurrent"))?;
        let before = heap_limit()?;
        match result::ctx::set_limit(sys::CUlimit::CU_LIMIT_MALLOC_HEAP_SIZE, bytes) {
            Ok(()) => {}
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE => {
                return Err(Error::ConfigTooLate { what: WHAT, why: TOO_LATE })
            }
            Err(e) => return Err(crate::cuda::driver_err("cuCtxSetLimit")(e)),
        }
        let now = heap_limit()?;
        // Rounding only ever raises the size to at least `bytes`; a size
        // still below `bytes` and unchanged is the old one, kept.
        if now < bytes && now == before {
            return Err(Error::ConfigTooLate { what: WHAT, why: KEPT });
        }
        Ok(now)
    }

    fn heap_ctx(&self) -> Result<Arc<CudaContext>> {
        match &self.backend {
            Backend::Host { .. } => Err(Error::NeedsGpu("the device malloc heap")),
            Backend::Cuda { .. } => self
                .default_device()?
                .context()
                .cloned()
                .or_else(|| self.pinned_ctx.clone())
                .ok_or(Error::NeedsGpu("the device malloc heap")),
        }
    }
}

/// The current context's heap limit. The caller binds the context.
fn heap_limit() -> Result<usize> {
    result::ctx::get_limit(sys::CUlimit::CU_LIMIT_MALLOC_HEAP_SIZE).map_err(crate::cuda::driver_err("cuCtxGetLimit"))
}
