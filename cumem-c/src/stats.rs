//! Statistics, the summary table, cached-memory release and shutdown.

use std::ffi::{c_char, c_int};

use cumem::pool::PoolStats;

use crate::ffi::{answer, copy_text, manager, put_opt};
use crate::status::{guard, Failure};
use crate::CumemStatus;

/// One pool's figures, in bytes or counts.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CumemPoolStats {
    /// Bytes in live blocks.
    pub in_use: usize,
    /// The largest `in_use` since the last peak reset.
    pub peak_in_use: usize,
    /// Bytes the live allocations asked for.
    pub requested: usize,
    /// The largest `requested` since the last peak reset.
    pub peak_requested: usize,
    /// Physical bytes the pool holds from the driver: its mapped pages
    /// where it remaps pages, else its chunks.
    pub reserved: usize,
    /// The largest `reserved` since the last peak reset.
    pub peak_reserved: usize,
    /// Bytes in blocks parked in per-thread caches.
    pub cached: usize,
    /// Live blocks.
    pub live_blocks: usize,
    /// Free blocks.
    pub free_blocks: usize,
    /// Chunks taken from the driver.
    pub chunks: usize,
    /// The largest free block.
    pub largest_free: usize,
}

impl From<PoolStats> for CumemPoolStats {
    fn from(s: PoolStats) -> Self {
        CumemPoolStats {
            in_use: s.in_use,
            peak_in_use: s.peak_in_use,
            requested: s.requested,
            peak_requested: s.peak_requested,
            // Physical memory: a remapping pool's address space holds
            // unmapped holes (for other pools `mapped` is `reserved`).
            reserved: s.mapped,
            peak_reserved: s.peak_mapped,
            cached: s.cached,
            live_blocks: s.live_blocks,
            free_blocks: s.free_blocks,
            chunks: s.chunks,
            largest_free: s.largest_free,
        }
    }
}

/// One device's figures across its modes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CumemDeviceStats {
    /// The sync pool.
    pub pool: CumemPoolStats,
    /// Bytes in live stream-ordered allocations (the two async modes).
    pub stream_ordered_in_use: usize,
    /// The largest `stream_ordered_in_use` since the last peak reset.
    pub stream_ordered_peak_in_use: usize,
    /// Live stream-ordered allocations.
    pub stream_ordered_live: usize,
    /// Bytes the driver's pools (the default, the dedicated) reserve now.
    pub native_reserved: u64,
    /// Their largest reservation (the driver's high-water attribute).
    pub native_peak_reserved: u64,
    /// Bytes the graph-private pools hold from the driver.
    pub graph_reserved: usize,
    /// The largest `graph_reserved`.
    pub graph_peak_reserved: usize,
    /// Sync-pool reuses of a block freed on another stream that waited.
    pub stream_waits: u64,
    /// Cross-stream reuses that needed no new wait.
    pub stream_waits_elided: u64,
    /// Bytes in live blocks of the memory tags (not in `pool`; per tag:
    /// `cumem_tag_usage`).
    pub tagged_in_use: usize,
    /// Physical bytes mapped for the memory tags (none while asleep).
    pub tagged_mapped: usize,
    /// The sum of the tags' largest `mapped` since the last peak reset.
    pub tagged_peak_mapped: usize,
    /// Page moves of the sync pool that waited for the device (a request
    /// on no stream, or no fence on the freeing streams could be made).
    pub move_waits: u64,
}

/// What `cumem_shutdown` found.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CumemShutdownReport {
    /// Allocations still live (they stay valid).
    pub live_count: usize,
    /// Their bytes.
    pub live_bytes: usize,
    /// Bytes returned to the driver.
    pub released_bytes: usize,
}

/// Stores the pinned pool's figures in `*out`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_pinned_stats(out: *mut CumemPoolStats) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, || Ok(CumemPoolStats::from(manager()?.pinned_stats()))) }
}

/// Stores `device`'s figures in `*out` (making its allocator if need be).
///
/// # Errors
/// `CUMEM_STATUS_NO_SUCH_DEVICE`, `CUMEM_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_device_stats(device: c_int, out: *mut CumemDeviceStats) -> CumemStatus {
    let stats = || {
        let ordinal = crate::ffi::ordinal(device)?;
        let d = manager()?.device_stats(ordinal)?;
        let natives = [d.native_pool.as_ref(), d.default_pool.as_ref()];
        let move_waits = d.pool.move_waits;
        Ok(CumemDeviceStats {
            pool: d.pool.into(),
            stream_ordered_in_use: d.stream_ordered.in_use,
            stream_ordered_peak_in_use: d.stream_ordered.peak_in_use,
            stream_ordered_live: d.stream_ordered.live,
            native_reserved: natives.iter().flatten().map(|a| a.reserved_current).sum(),
            native_peak_reserved: natives.iter().flatten().map(|a| a.reserved_high).sum(),
            graph_reserved: d.graphs.reserved,
            graph_peak_reserved: d.graphs.peak_reserved,
            stream_waits: d.stream_waits,
            stream_waits_elided: d.stream_waits_elided,
            tagged_in_use: d.tags.iter().map(|t| t.pool.in_use).sum(),
            tagged_mapped: d.tags.iter().map(|t| t.pool.mapped).sum(),
            tagged_peak_mapped: d.tags.iter().map(|t| t.pool.peak_mapped).sum(),
            move_waits,
        })
    };
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, stats) }
}

/// Stores cumem's default device in `*out`: the one calls without a device
/// use (`device=` of the configuration, default 0).
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_default_device(out: *mut c_int) -> CumemStatus {
    let device = || {
        let device = manager()?.config().device;
        c_int::try_from(device)
            .map_err(|_| Failure::new(CumemStatus::Other, format!("device {device} does not fit an int")))
    };
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, device) }
}

/// Sets every peak figure to its current value.
#[no_mangle]
pub extern "C" fn cumem_reset_peak_stats() -> CumemStatus {
    guard(|| {
        manager()?.reset_peak_stats();
        Ok(())
    })
}

/// Returns all cached free memory (pinned and device) to the driver;
/// stores the bytes released in `*released` when it is not NULL.
///
/// # Errors
/// `CUMEM_STATUS_CAPTURE` while a graph capture cumem routes is under way;
/// `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `released` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_release_cached(released: *mut usize) -> CumemStatus {
    guard(|| {
        let n = manager()?.release_cached()?;
        // SAFETY: the caller's promise about `released`.
        unsafe { put_opt(released, n) };
        Ok(())
    })
}

/// Writes a readable table of every pool's state into `buf` (`len`
/// bytes), NUL-terminated; `*needed` (unless NULL) gets the bytes it needs
/// with its NUL (`buf` NULL and `len` 0 to learn it). A buffer too small
/// gets as much as fits and `CUMEM_STATUS_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `buf` must be NULL or valid for writes of `len` bytes; `needed` NULL or
/// valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_memory_summary(buf: *mut c_char, len: usize, needed: *mut usize) -> CumemStatus {
    guard(|| {
        let text = manager()?.memory_summary();
        // SAFETY: the caller's promises are copy_text's.
        unsafe { copy_text(&text, buf, len, needed) }
    })
}

/// Waits until every allocation and free recorded so far is in the event
/// log (`log=`; nothing to do without one or before the manager exists).
/// A program that exits without it loses what was still buffered.
///
/// # Errors
/// An error writing the log file (kept: later flushes report it too).
#[no_mangle]
pub extern "C" fn cumem_flush_log() -> CumemStatus {
    guard(|| {
        if let Some(mm) = cumem::MemoryManager::global_if_made() {
            mm.flush_event_log()?;
        }
        Ok(())
    })
}

/// Stops serving allocations, returns all free memory to the driver and
/// stores what is still live (valid, and freeable) in `*report` unless
/// NULL. Twice is harmless.
///
/// # Errors
/// `CUMEM_STATUS_DRIVER` (what could be released, was);
/// `CUMEM_STATUS_CAPTURE` while a graph capture cumem routes is under way.
///
/// # Safety
/// `report` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_shutdown(report: *mut CumemShutdownReport) -> CumemStatus {
    guard(|| {
        let r = manager()?.shutdown()?;
        let c = CumemShutdownReport {
            live_count: r.live_count,
            live_bytes: r.live_bytes,
            released_bytes: r.released_bytes,
        };
        // SAFETY: the caller's promise about `report`.
        unsafe { put_opt(report, c) };
        Ok(())
    })
}

#[cfg(test)]
mod tests;
