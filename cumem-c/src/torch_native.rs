//! Entry points for cumem_torch's native backend (a PyTorch
//! `CUDAAllocator` in `python/cumem_torch/csrc/`): allocation and
//! stream-ordered free that return a status (out of memory becomes
//! PyTorch's `OutOfMemoryError`), and the figures PyTorch's statistics
//! need beyond the other statistics entry points.

use std::ffi::{c_int, c_void};

use crate::ffi::{allocate_into, answer, manager, ordinal};
use crate::recorded::free_on;
use crate::status::{guard, Failure};
use crate::streams::{stream_for, CumemStream};
use crate::CumemStatus;

/// `cumem_torch_alloc` with a status: stores the pointer in `*out`.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (size 0, NULL `out`, a negative
/// device), `CUMEM_STATUS_OUT_OF_MEMORY`, `CUMEM_STATUS_SHUT_DOWN`,
/// `CUMEM_STATUS_NO_SUCH_DEVICE`, `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write; `stream` as in
/// `cumem_torch_alloc`.
#[no_mangle]
pub unsafe extern "C" fn cumem_torch_allocate(
    size: usize,
    device: c_int,
    stream: CumemStream,
    out: *mut *mut c_void,
) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe {
        allocate_into(out, || {
            let s = stream_for(ordinal(device)?, stream)?;
            Ok(manager()?.allocate_device_on(size, &s)?)
        })
    }
}

/// `cumem_torch_free` with a status.
///
/// # Errors
/// `CUMEM_STATUS_DOUBLE_FREE`, `CUMEM_STATUS_INTERIOR_POINTER`,
/// `CUMEM_STATUS_UNKNOWN_POINTER` (also NULL); nothing changes then.
///
/// # Safety
/// `stream` as in `cumem_torch_alloc`.
#[no_mangle]
pub unsafe extern "C" fn cumem_torch_release(ptr: *mut c_void, device: c_int, stream: CumemStream) -> CumemStatus {
    guard(|| {
        if ptr.is_null() {
            return Err(Failure::null("ptr"));
        }
        free_on(ptr as usize, ordinal(device)?, stream)
    })
}

/// One device's figures for PyTorch's statistics.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CumemTorchFigures {
    /// Physical bytes held from the driver: the sync pool's mapped pages,
    /// the memory tags' mapped pages (0 for a tag while it sleeps), the
    /// driver pools' reservation and the graph pools' chunks.
    pub reserved: u64,
    /// The largest `reserved` since the last peak reset (the parts' peaks).
    pub peak_reserved: u64,
    /// The sync pool's driver allocations (page maps, or chunks).
    pub device_allocs: u64,
    /// The sync pool's driver frees (page unmaps, or chunk frees).
    pub device_frees: u64,
    /// Allocations that failed at the driver, released the cache, retried.
    pub alloc_retries: u64,
    /// Chunks the sync pool holds.
    pub chunks: u64,
    /// The sync pool's largest free block.
    pub largest_free: u64,
    /// Physical bytes free in the sync pool (mapped, not in use, not
    /// parked in thread caches).
    pub free_bytes: u64,
    /// Bytes in live blocks of the memory tags' arenas (counted in
    /// neither the sync pool's figures nor `free_bytes`; asleep or not).
    pub tagged_in_use: u64,
    /// Bytes the live allocations of the memory tags asked for.
    pub tagged_requested: u64,
    /// Physical bytes mapped for the memory tags (part of `reserved`).
    pub tagged_mapped: u64,
}

/// Stores device `device`'s figures for PyTorch's statistics in `*out`.
///
/// # Errors
/// `CUMEM_STATUS_NO_SUCH_DEVICE`, `CUMEM_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_torch_figures(device: c_int, out: *mut CumemTorchFigures) -> CumemStatus {
    let figures = || {
        let d = manager()?.device_stats(ordinal(device)?)?;
        let natives = [d.native_pool.as_ref(), d.default_pool.as_ref()];
        let p = &d.pool;
        let tags = |f: fn(&cumem::pool::PoolStats) -> usize| d.tags.iter().map(|t| f(&t.pool)).sum::<usize>();
        Ok(CumemTorchFigures {
            reserved: (p.mapped + tags(|t| t.mapped) + d.graphs.reserved) as u64
                + natives.iter().flatten().map(|a| a.reserved_current).sum::<u64>(),
            peak_reserved: (p.peak_mapped + tags(|t| t.peak_mapped) + d.graphs.peak_reserved) as u64
                + natives.iter().flatten().map(|a| a.reserved_high).sum::<u64>(),
            device_allocs: p.map_calls,
            device_frees: p.unmap_calls,
            alloc_retries: p.oom_retries,
            chunks: p.chunks as u64,
            largest_free: p.largest_free as u64,
            free_bytes: p.mapped.saturating_sub(p.in_use + p.cached) as u64,
            tagged_in_use: tags(|t| t.in_use) as u64,
            tagged_requested: tags(|t| t.requested) as u64,
            tagged_mapped: tags(|t| t.mapped) as u64,
        })
    };
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, figures) }
}
