//! The seed's `MemoryManager` API in C form: initialisation, pinned and
//! device memory (with stream-ordered forms), copies, pool sizes, modes,
//! the summary and shutdown.

use std::ffi::{c_char, c_int, c_void, CStr};

use cumem::{Config, DeviceAllocatorMode, MemoryManager, Stream};

use crate::ffi::{allocate_into, answer, copy_text, manager, ordinal, put_opt};
use crate::status::{guard, Failure};
use crate::streams::{stream_for, CumemStream};
use crate::CumemStatus;

/// A device allocator mode (an `int` for `cumem_set_device_allocator_mode`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CumemMode {
    /// cumem's own pool, stream-ordered reuse through events.
    SyncPool = 0,
    /// `cuMemAllocAsync` on the device's default memory pool.
    AsyncStreamOrdered = 1,
    /// A dedicated native CUDA memory pool (`cuMemPoolCreate`).
    CudaAsyncPool = 2,
}

impl CumemMode {
    pub(crate) fn of(mode: DeviceAllocatorMode) -> CumemMode {
        match mode {
            DeviceAllocatorMode::SyncPool => CumemMode::SyncPool,
            DeviceAllocatorMode::AsyncStreamOrdered => CumemMode::AsyncStreamOrdered,
            DeviceAllocatorMode::CudaAsyncPool => CumemMode::CudaAsyncPool,
        }
    }
}

/// Creates the process-wide manager from a configuration string in
/// `CUMEM_CONF`'s syntax (`"device_pool_size=1GiB,mode=sync_pool"`), or
/// from `CUMEM_CONF` itself when `conf` is NULL. Optional: any other call
/// creates the manager from `CUMEM_CONF` on first use.
///
/// # Errors
/// `CUMEM_STATUS_CONFIG` (a bad key or value, named in the message),
/// `CUMEM_STATUS_ALREADY_INITIALIZED`, `CUMEM_STATUS_NO_SUCH_DEVICE`,
/// `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `conf` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cumem_init(conf: *const c_char) -> CumemStatus {
    guard(|| {
        let config = if conf.is_null() {
            Config::from_env()?
        } else {
            // SAFETY: non-null, and NUL-terminated (the caller's promise).
            let text = unsafe { CStr::from_ptr(conf) };
            let text = text
                .to_str()
                .map_err(|_| Failure::new(CumemStatus::Config, "the configuration string is not UTF-8"))?;
            text.parse::<Config>()?
        };
        MemoryManager::init(config)?;
        Ok(())
    })
}

/// Writes what the manager runs on ("CUDA (1 device(s))", "host fallback,
/// no GPU in use (why)") into `buf`, as `cumem_memory_summary` does.
///
/// # Safety
/// As `cumem_memory_summary`.
#[no_mangle]
pub unsafe extern "C" fn cumem_backend(buf: *mut c_char, len: usize, needed: *mut usize) -> CumemStatus {
    guard(|| {
        let text = manager()?.backend().to_string();
        // SAFETY: the caller's promises are copy_text's.
        unsafe { copy_text(&text, buf, len, needed) }
    })
}

/// Stores 1 in `*out` on the host fallback (host memory stands in for
/// device memory), 0 on CUDA.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_is_host_fallback(out: *mut c_int) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, || Ok(c_int::from(manager()?.backend().is_host()))) }
}

// ---- pinned host memory ----

/// Allocates `size` bytes of pinned (page-locked) host memory, 256-byte
/// aligned, and stores the pointer in `*out` (left unchanged on failure).
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (size 0 or absurd, `out` NULL),
/// `CUMEM_STATUS_OUT_OF_MEMORY`, `CUMEM_STATUS_SHUT_DOWN`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_allocate_pinned(size: usize, out: *mut *mut c_void) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { allocate_into(out, || Ok(manager()?.allocate_pinned(size)?.as_ptr() as usize as u64)) }
}

/// Returns pinned memory to the pool; no host code or copy may use it now.
///
/// # Errors
/// `CUMEM_STATUS_DOUBLE_FREE`, `CUMEM_STATUS_INTERIOR_POINTER`,
/// `CUMEM_STATUS_UNKNOWN_POINTER` (NULL, a device pointer, anything cumem's
/// pinned pool did not hand out); the pool is unchanged then.
#[no_mangle]
pub extern "C" fn cumem_free_pinned(ptr: *mut c_void) -> CumemStatus {
    guard(|| Ok(manager()?.free_pinned(ptr.cast())?))
}

// ---- device memory ----

/// Allocates `size` bytes on the default device, usable at once by any
/// stream, into `*out` (a device pointer, never dereferenced on the host).
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT`, `CUMEM_STATUS_OUT_OF_MEMORY`,
/// `CUMEM_STATUS_SHUT_DOWN`, `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_allocate_device(size: usize, out: *mut *mut c_void) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { allocate_into(out, || Ok(manager()?.allocate_device(size)?)) }
}

/// Allocates device memory for work on `stream` (a stream of the default
/// device): safe to use by work queued on `stream` from now on.
///
/// # Errors
/// As `cumem_allocate_device`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write; `stream` must be a
/// stream of the default device's primary context that lives until the
/// memory is freed and the frees queued on it have run.
#[no_mangle]
pub unsafe extern "C" fn cumem_allocate_device_on(
    size: usize,
    stream: CumemStream,
    out: *mut *mut c_void,
) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe {
        allocate_into(out, || {
            let mm = manager()?;
            Ok(mm.allocate_device_on(size, &stream_for(mm.config().device, stream)?)?)
        })
    }
}

/// Frees device memory at once: no queued work may still use it
/// (synchronise first, or use `cumem_free_device_on`).
///
/// # Errors
/// `CUMEM_STATUS_DOUBLE_FREE`, `CUMEM_STATUS_INTERIOR_POINTER`,
/// `CUMEM_STATUS_UNKNOWN_POINTER` (also NULL and pinned pointers); nothing
/// changes then.
#[no_mangle]
pub extern "C" fn cumem_free_device(ptr: *mut c_void) -> CumemStatus {
    guard(|| {
        manager()?.free_device(ptr as usize as u64)?;
        // No queued work uses it (promised): its noted streams need no wait.
        crate::recorded::forget_recorded(ptr as usize);
        Ok(())
    })
}

/// Frees device memory in stream order: work queued on `stream` before
/// this call may still use it; other streams reuse it only after that work.
///
/// # Errors
/// As `cumem_free_device`.
///
/// # Safety
/// `stream` as in `cumem_allocate_device_on`.
#[no_mangle]
pub unsafe extern "C" fn cumem_free_device_on(ptr: *mut c_void, stream: CumemStream) -> CumemStatus {
    guard(|| crate::recorded::free_on(ptr as usize, manager()?.config().device, stream))
}

// ---- copies ----

/// Checks a copy's pointers, then runs it on the default device's `stream`.
fn copy(dst: *const c_void, src: *const c_void, size: usize, stream: CumemStream, run: CopyFn) -> CumemStatus {
    guard(|| {
        if size > 0 && dst.is_null() {
            return Err(Failure::null("dst"));
        }
        if size > 0 && src.is_null() {
            return Err(Failure::null("src"));
        }
        let mm = manager()?;
        Ok(run(mm, &stream_for(mm.config().device, stream)?)?)
    })
}

type CopyFn<'a> = &'a dyn Fn(&MemoryManager, &Stream) -> cumem::Result<()>;

/// Queues a copy of `size` bytes from host memory `src` to device memory
/// `dst` on `stream` (`cuMemcpyHtoDAsync`; asynchronous from pinned
/// memory). On the host fallback it happens at once.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL pointers), `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// As `cudaMemcpyAsync`: `src` readable and `dst` a device allocation
/// writable for `size` bytes until the copy is done (synchronise
/// `stream`), neither written meanwhile; `stream` as in
/// `cumem_allocate_device_on`.
#[no_mangle]
pub unsafe extern "C" fn cumem_copy_to_device_async(
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
    stream: CumemStream,
) -> CumemStatus {
    copy(dst, src, size, stream, &|mm, s| {
        // SAFETY: the caller's promises are copy_to_device_async's.
        unsafe { mm.copy_to_device_async(dst as usize as u64, src.cast(), size, s) }
    })
}

/// Queues a copy of `size` bytes from device memory `src` to host memory
/// `dst` on `stream` (`cuMemcpyDtoHAsync`).
///
/// # Errors
/// As `cumem_copy_to_device_async`.
///
/// # Safety
/// As `cumem_copy_to_device_async`, with the roles swapped: `dst` must
/// not be read or written until the copy is done.
#[no_mangle]
pub unsafe extern "C" fn cumem_copy_to_host_async(
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
    stream: CumemStream,
) -> CumemStatus {
    copy(dst, src, size, stream, &|mm, s| {
        // SAFETY: the caller's promises are copy_to_host_async's.
        unsafe { mm.copy_to_host_async(dst.cast(), src as usize as u64, size, s) }
    })
}

// ---- pool sizes and modes ----

/// Sets the bytes the first pinned allocation reserves.
///
/// # Errors
/// `CUMEM_STATUS_CONFIG_TOO_LATE` after the first pinned allocation.
#[no_mangle]
pub extern "C" fn cumem_set_pinned_pool_size(size: usize) -> CumemStatus {
    guard(|| Ok(manager()?.set_pinned_pool_size(size)?))
}

/// Sets the bytes the first device allocation of the sync pool reserves.
///
/// # Errors
/// `CUMEM_STATUS_CONFIG_TOO_LATE` after the first device allocation.
#[no_mangle]
pub extern "C" fn cumem_set_device_pool_size(size: usize) -> CumemStatus {
    guard(|| Ok(manager()?.set_device_pool_size(size)?))
}

// ---- peers ----

/// Lets kernels on device `accessor` use all memory of device `owner` that
/// cumem hands out, now and later (`MemoryManager::enable_peer_access`;
/// one-way; twice, or `accessor == owner`, is harmless). Needed even after
/// `cudaDeviceEnablePeerAccess` for memory mapped before the accessor's
/// context existed, with no cumem allocation since.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` for a negative device;
/// `CUMEM_STATUS_NO_SUCH_DEVICE`; `CUMEM_STATUS_OTHER` when the devices
/// have no peer path; `CUMEM_STATUS_DRIVER`.
#[no_mangle]
pub extern "C" fn cumem_enable_peer_access(accessor: c_int, owner: c_int) -> CumemStatus {
    guard(|| {
        let (a, o) = (ordinal(accessor)?, ordinal(owner)?);
        Ok(manager()?.enable_peer_access(a, o)?)
    })
}

/// Requests device allocator mode `mode` (a `CumemMode`) for every device;
/// stores the default device's mode in effect (`CUMEM_MODE_SYNC_POOL`
/// without stream-ordered allocation) in `*effective` unless NULL. Live
/// allocations stay valid.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` for a value that is not a mode.
///
/// # Safety
/// `effective` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_set_device_allocator_mode(mode: c_int, effective: *mut CumemMode) -> CumemStatus {
    guard(|| {
        // The C values are the modes' places in `DeviceAllocatorMode::ALL`.
        let mode =
            usize::try_from(mode).ok().and_then(|i| DeviceAllocatorMode::ALL.get(i).copied()).ok_or_else(|| {
                let modes: Vec<String> =
                    DeviceAllocatorMode::ALL.iter().enumerate().map(|(i, m)| format!("{i} {m}")).collect();
                Failure::new(
                    CumemStatus::InvalidArgument,
                    format!("{mode} is not a device allocator mode ({})", modes.join(", ")),
                )
            })?;
        let now = CumemMode::of(manager()?.set_device_allocator_mode(mode)?);
        // SAFETY: the caller's promise about `effective`.
        unsafe { put_opt(effective, now) };
        Ok(())
    })
}

/// Stores the requested device allocator mode in `*out`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_requested_device_allocator_mode(out: *mut CumemMode) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, || Ok(CumemMode::of(manager()?.requested_device_allocator_mode()))) }
}

/// Stores the default device's device allocator mode in effect in `*out`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_effective_device_allocator_mode(out: *mut CumemMode) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, || Ok(CumemMode::of(manager()?.effective_device_allocator_mode()))) }
}

/// Stores 1 in `*out` when the default device supports stream-ordered
/// allocation (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`), else 0.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_supports_async_device_allocator(out: *mut c_int) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, || Ok(c_int::from(manager()?.supports_async_device_allocator()))) }
}

#[cfg(test)]
mod tests;
