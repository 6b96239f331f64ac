//! The driver's stream-ordered memory pools: a dedicated one
//! (`cuMemPoolCreate`) and the default one behind `cuMemAllocAsync`.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::cuda::{driver_err, register_pool, unregister_pool, Stream};
use crate::error::{Error, OomState, PoolKind, Result};

/// The attributes of a native pool (seed "Memory Pool"): reserved and used
/// memory, current and high-water.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NativePoolAttributes {
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`: memory the pool holds.
    pub reserved_current: u64,
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`: its high-water mark.
    pub reserved_high: u64,
    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`: memory in live allocations.
    pub used_current: u64,
    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH`: its high-water mark.
    pub used_high: u64,
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`: free memory the pool keeps
    /// before it returns memory to the system at a synchronisation.
    pub release_threshold: u64,
}

/// How the dedicated native pool is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NativePoolOptions {
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` (`u64::MAX`: keep everything).
    pub release_threshold: u64,
    /// POSIX file descriptors as a handle type, so allocations can be
    /// shared with other processes ([`crate::ipc`]). The driver refuses
    /// allocations from such a pool inside a graph capture.
    pub exportable: bool,
}

/// A handle on a native memory pool: either one cumem created
/// (`cuMemPoolCreate`, destroyed on drop) or the device's default pool.
pub struct NativePool {
    ctx: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
    owned: bool,
    /// Made with POSIX file descriptors as a handle type: its memory can be
    /// shared with other processes ([`crate::ipc`]).
    exportable: bool,
}

// SAFETY: a CUmemoryPool handle works on any thread; calls bind its context.
unsafe impl Send for NativePool {}
// SAFETY: the driver synchronises concurrent calls on one pool.
unsafe impl Sync for NativePool {}

impl NativePool {
    /// Creates a dedicated pool of device memory on the context's device
    /// (`cuMemPoolCreate`) and sets its release threshold. With
    /// `options.exportable`, and where the device supports it, the pool is
    /// exportable (POSIX file descriptors), so its allocations can be
    /// shared with other processes; a driver that refuses that gets a pool
    /// without.
    ///
    /// # Errors
    /// A driver error (for instance on a device without memory pools).
    pub fn create(ctx: Arc<CudaContext>, options: NativePoolOptions) -> Result<NativePool> {
        ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let make = |exportable: bool| {
            // SAFETY: CUmemPoolProps is plain data; all-zero is a valid start
            // (no handle types, no Windows attributes, no size limit).
            let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
            props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            props.handleTypes = if exportable {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            } else {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
            };
            props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = ctx.ordinal() as i32;
            // SAFETY: `props` is a valid, initialised CUmemPoolProps.
            unsafe { result::mem_pool::create(&props) }.map_err(driver_err("cuMemPoolCreate"))
        };
        let wanted = options.exportable && crate::cuda::vmm::posix_fd_supported(&ctx);
        let (pool, exportable) = match make(wanted) {
            Ok(p) => (p, wanted),
            Err(_) if wanted => (make(false)?, false),
            Err(e) => return Err(e),
        };
        let pool = NativePool { ctx, pool, owned: true, exportable };
        pool.set_release_threshold(options.release_threshold)?;
        // Devices granted peer access to this one reach the new pool too
        // (`cuMemPoolSetAccess`), as do later grants.
        register_pool(&pool.ctx, pool.pool)?;
        Ok(pool)
    }

    /// The device's default pool, the one `cuMemAllocAsync` uses
    /// (`cuDeviceGetDefaultMemPool`), with its release threshold set.
    ///
    /// # Errors
    /// A driver error.
    pub fn device_default(ctx: Arc<CudaContext>, release_threshold: u64) -> Result<NativePool> {
        ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the device handle comes from a live context.
        let pool = unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }
            .map_err(driver_err("cuDeviceGetDefaultMemPool"))?;
        let pool = NativePool { ctx, pool, owned: false, exportable: false };
        pool.set_release_threshold(release_threshold)?;
        Ok(pool)
    }

    fn set_u64(&self, attr: sys::CUmemPool_attribute, mut value: u64, call: &'static str) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the pool is live; these attributes take a cuuint64_t.
        unsafe { result::mem_pool::set_attribute(self.pool, attr, &mut value as *mut u64 as *mut c_void) }
            .map_err(driver_err(call))
    }

    fn get_u64(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let mut value = 0u64;
        // SAFETY: the pool is live; these attributes are a cuuint64_t.
        unsafe { result::mem_pool::get_attribute(self.pool, attr, &mut value as *mut u64 as *mut c_void) }
            .map_err(driver_err("cuMemPoolGetAttribute"))?;
        Ok(value)
    }

    /// Whether the pool's memory can be shared with other processes.
    pub fn exportable(&self) -> bool {
        self.exportable
    }

    /// Exports the pool as a POSIX file descriptor
    /// (`cuMemPoolExportToShareableHandle`) and `ptr`, one of its live
    /// allocations, as the 64 bytes another process imports it by
    /// (`cuMemPoolExportPointer`).
    ///
    /// # Errors
    /// [`Error::Ipc`] for a pool with no exportable handle type; driver errors.
    pub fn export(&self, ptr: u64) -> Result<(std::os::fd::OwnedFd, [u8; 64])> {
        use std::os::fd::FromRawFd;
        if !self.exportable {
            return Err(Error::Ipc(format!(
                "the native pool of device {} is not exportable: set exportable_native_pool=true \
                 (Config::exportable_native_pool) before its first use, on a device and driver that share \
                 memory as POSIX file descriptors",
                self.ctx.ordinal()
            )));
        }
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let mut fd: std::ffi::c_int = -1;
        let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX descriptors the driver writes one `int` through
        // the pointer, which points at `fd`; the pool is live.
        let rc = unsafe {
            sys::cuMemPoolExportToShareableHandle(&mut fd as *mut std::ffi::c_int as *mut c_void, self.pool, kind, 0)
        };
        rc.result().map_err(driver_err("cuMemPoolExportToShareableHandle"))?;
        if fd < 0 {
            return Err(Error::Ipc(format!("cuMemPoolExportToShareableHandle returned descriptor {fd}")));
        }
        // SAFETY: the driver made this descriptor for the caller, its owner.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: CUmemPoolPtrExportData is 64 plain bytes.
        let mut data: sys::CUmemPoolPtrExportData = unsafe { std::mem::zeroed() };
        // SAFETY: `data` is a valid out-pointer; the driver checks that
        // `ptr` is a live allocation of an exportable pool.
        unsafe { sys::cuMemPoolExportPointer(&mut data, ptr) }
            .result()
            .map_err(driver_err("cuMemPoolExportPointer"))?;
        Ok((fd, data.reserved))
    }

    /// Sets `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`: the free bytes the pool
    /// keeps cached across synchronisations (`u64::MAX`: keep everything).
    ///
    /// # Errors
    /// A driver error.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        use sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD as A;
        self.set_u64(A, bytes, "cuMemPoolSetAttribute(RELEASE_THRESHOLD)")
    }

    /// Reads the pool's attributes (`cuMemPoolGetAttribute`).
    ///
    /// # Errors
    /// A driver error.
    pub fn attributes(&self) -> Result<NativePoolAttributes> {
        use sys::CUmemPool_attribute::*;
        Ok(NativePoolAttributes {
            reserved_current: self.get_u64(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.get_u64(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used_current: self.get_u64(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: self.get_u64(CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            release_threshold: self.get_u64(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)?,
        })
    }

    /// Resets both high-water marks to the current values (by setting 0).
    ///
    /// # Errors
    /// A driver error.
    pub fn reset_high_watermarks(&self) -> Result<()> {
        use sys::CUmemPool_attribute::*;
        self.set_u64(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0, "cuMemPoolSetAttribute(RESERVED_MEM_HIGH)")?;
        self.set_u64(CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0, "cuMemPoolSetAttribute(USED_MEM_HIGH)")
    }

    /// Releases free memory down to `min_bytes_to_keep` (`cuMemPoolTrimTo`).
    ///
    /// # Errors
    /// A driver error.
    pub fn trim_to(&self, min_bytes_to_keep: usize) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the pool is live.
        unsafe { result::mem_pool::trim_to(self.pool, min_bytes_to_keep) }.map_err(driver_err("cuMemPoolTrimTo"))
    }

    /// `size` bytes in stream order on `stream` (`cuMemAllocFromPoolAsync`).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] or another driver error.
    pub fn allocate_async(&self, size: usize, stream: &Stream) -> Result<u64> {
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the pool and the stream belong to the current context; the
        // memory is handed out as an address, never a reference.
        let r = unsafe { result::mem_pool::alloc_async(self.pool, size, stream.cu_stream()) };
        r.map_err(|e| {
            if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                Error::OutOfMemory {
                    pool: PoolKind::Device,
                    requested: size,
                    state: Box::new(OomState {
                        device_free: self.ctx.mem_get_info().ok().map(|m| m.0),
                        upstream: Some(format!("cuMemAllocFromPoolAsync: {e}")),
                        ..Default::default()
                    }),
                }
            } else {
                driver_err("cuMemAllocFromPoolAsync")(e)
            }
        })
    }

    /// The device the pool's memory lives on.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The raw handle.
    pub fn raw(&self) -> sys::CUmemoryPool {
        self.pool
    }
}

impl Drop for NativePool {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        unregister_pool(self.pool);
        let r = self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent")).and_then(|()| {
            // SAFETY: cumem created this pool and drops its handle once; the
            // manager drops it only when no allocation from it is live.
            unsafe { result::mem_pool::destroy(self.pool) }.map_err(driver_err("cuMemPoolDestroy"))
        });
        if let Err(e) = r {
            eprintln!("cumem: destroying a native memory pool failed: {e}");
        }
    }
}

/// `size` bytes from the current pool, in stream order (`cuMemAllocAsync`).
///
/// # Errors
/// [`Error::OutOfMemory`] or another driver error.
pub fn allocate_async(ctx: &CudaContext, size: usize, stream: &Stream) -> Result<u64> {
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
    // SAFETY: the stream is the current context's; memory leaves as an address.
    unsafe { result::malloc_async(stream.cu_stream(), size) }.map_err(|e| {
        if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            Error::OutOfMemory {
                pool: PoolKind::Device,
                requested: size,
                state: Box::new(OomState {
                    device_free: ctx.mem_get_info().ok().map(|m| m.0),
                    upstream: Some(format!("cuMemAllocAsync: {e}")),
                    ..Default::default()
                }),
            }
        } else {
            driver_err("cuMemAllocAsync")(e)
        }
    })
}

/// Frees in stream order (`cuMemFreeAsync`).
///
/// # Safety
/// `ptr` came from a stream-ordered allocation on this context and is not
/// used by work ordered after this free.
pub unsafe fn free_async(ctx: &CudaContext, ptr: u64, stream: &Stream) -> Result<()> {
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
    // SAFETY: the caller vouches for `ptr`; the stream is valid.
    unsafe { result::free_async(ptr, stream.cu_stream()) }.map_err(driver_err("cuMemFreeAsync"))
}
