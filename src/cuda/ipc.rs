//! Driver calls that share device memory with other processes, for the
//! kinds of memory that are not VMM mappings (those are in [`super::vmm`]):
//! `cuMemAlloc` allocations (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`)
//! and allocations of an exportable native pool, imported on the other
//! side (`cuMemPoolImportFromShareableHandle` / `cuMemPoolImportPointer`).

use std::os::fd::{AsRawFd, BorrowedFd};

use cudarc::driver::{sys, CudaContext};

use super::driver_err;
use crate::error::Result;

fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))
}

/// The `cuMemAlloc` block holding `addr`: base, size (`cuMemGetAddressRange`).
///
/// # Errors
/// A driver error (not device memory of this context).
pub(crate) fn allocation_range(ctx: &CudaContext, addr: u64) -> Result<(u64, usize)> {
    bind(ctx)?;
    let (mut base, mut size) = (0, 0);
    // SAFETY: both out-pointers are locals; the driver only looks `ptr` up.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }
        .result()
        .map_err(driver_err("cuMemGetAddressRange"))?;
    Ok((base, size))
}

/// The IPC handle of the `cuMemAlloc` block at `base` (`cuIpcGetMemHandle`).
///
/// # Errors
/// A driver error (for example memory that is not a `cuMemAlloc` base).
pub(crate) fn ipc_handle(ctx: &CudaContext, base: u64) -> Result<[u8; 64]> {
    bind(ctx)?;
    // SAFETY: CUipcMemHandle is 64 plain bytes.
    let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: `handle` is a valid out-pointer.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }.result().map_err(driver_err("cuIpcGetMemHandle"))?;
    Ok(handle.reserved.map(|b| b as u8))
}

/// Opens another process's `cuMemAlloc` allocation in `ctx`
/// (`cuIpcOpenMemHandle` with lazy peer access); returns its base here.
///
/// # Errors
/// A driver error: a malformed handle, or this process's (never opened).
pub(crate) fn open_ipc_handle(ctx: &CudaContext, handle: &[u8; 64]) -> Result<u64> {
    bind(ctx)?;
    let raw = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
    let mut base = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
    // SAFETY: `base` is a valid out-pointer; the driver validates the handle.
    unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, raw, flags) }.result().map_err(driver_err("cuIpcOpenMemHandle"))?;
    Ok(base)
}

/// Closes what [`open_ipc_handle`] opened (`cuIpcCloseMemHandle`).
///
/// # Safety
/// Nothing may use the memory any more: its address stops being valid here.
pub(crate) unsafe fn close_ipc_handle(ctx: &CudaContext, base: u64) -> Result<()> {
    bind(ctx)?;
    // SAFETY: from `cuIpcOpenMemHandle`, closed once; unused (the caller).
    unsafe { sys::cuIpcCloseMemHandle(base) }.result().map_err(driver_err("cuIpcCloseMemHandle"))
}

/// Imports another process's exportable native pool from its POSIX file
/// descriptor (`cuMemPoolImportFromShareableHandle`; the descriptor stays
/// open) and gives `ctx`'s device read-write access to it
/// (`cuMemPoolSetAccess`) when `grant_access` is set.
///
/// # Errors
/// A driver error.
pub(crate) fn import_pool(ctx: &CudaContext, fd: BorrowedFd<'_>, grant_access: bool) -> Result<sys::CUmemoryPool> {
    bind(ctx)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: `pool` is a valid out-pointer; for POSIX descriptors the
    // driver takes the descriptor's number in place of a pointer and does
    // not close it.
    let rc = unsafe { sys::cuMemPoolImportFromShareableHandle(&mut pool, fd.as_raw_fd() as usize as *mut _, kind, 0) };
    rc.result().map_err(driver_err("cuMemPoolImportFromShareableHandle"))?;
    if grant_access {
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ctx.cu_device(),
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `pool` was imported above; the descriptor outlives the call.
        let rc = unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) };
        if let Err(e) = rc.result() {
            // SAFETY: the imported pool has no allocation yet.
            let _ = unsafe { sys::cuMemPoolDestroy(pool) };
            return Err(driver_err("cuMemPoolSetAccess")(e));
        }
    }
    Ok(pool)
}

/// The allocation another process exported from `pool` (imported with
/// [`import_pool`]) as `data` (`cuMemPoolImportPointer`).
///
/// # Errors
/// A driver error (the allocation was freed, or the data is malformed).
pub(crate) fn import_pool_pointer(ctx: &CudaContext, pool: sys::CUmemoryPool, data: &[u8; 64]) -> Result<u64> {
    bind(ctx)?;
    let mut share = sys::CUmemPoolPtrExportData { reserved: *data };
    let mut ptr = 0;
    // SAFETY: `pool` is an imported pool and both pointers are valid locals.
    unsafe { sys::cuMemPoolImportPointer(&mut ptr, pool, &mut share) }
        .result()
        .map_err(driver_err("cuMemPoolImportPointer"))?;
    Ok(ptr)
}

/// Frees an imported pointer (`cuMemFree`), then its pool (`cuMemPoolDestroy`).
///
/// # Safety
/// Nothing may use the memory any more.
pub(crate) unsafe fn close_pool_import(ctx: &CudaContext, pool: sys::CUmemoryPool, ptr: u64) -> Result<()> {
    bind(ctx)?;
    // SAFETY: from `cuMemPoolImportPointer`, freed once; unused (the caller).
    let freed = unsafe { sys::cuMemFree_v2(ptr) }.result().map_err(driver_err("cuMemFree"));
    // SAFETY: the pool was imported and its one imported pointer is freed.
    let destroyed = unsafe { sys::cuMemPoolDestroy(pool) }.result().map_err(driver_err("cuMemPoolDestroy"));
    freed.and(destroyed)
}

/// The UUID of `ctx`'s device (`cuDeviceGetUuid`): how processes agree on a
/// device whatever its ordinal in each.
///
/// # Errors
/// A driver error.
pub(crate) fn device_uuid(ctx: &CudaContext) -> Result<[u8; 16]> {
    let uuid = ctx.uuid().map_err(driver_err("cuDeviceGetUuid"))?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// The ordinal here of the device with `uuid`, if this process sees it.
pub(crate) fn ordinal_of_uuid(uuid: &[u8; 16]) -> Option<usize> {
    let n = super::driver_status().devices();
    (0..n).find(|&d| {
        super::device_context(d).ok().flatten().is_some_and(|ctx| device_uuid(&ctx).is_ok_and(|u| &u == uuid))
    })
}
