//! PyTorch's pluggable-allocator entry points, and what PyTorch does not
//! tell a pluggable allocator: the streams a tensor was used on besides
//! its own (`record_stream`).
//!
//! PyTorch (`CUDAPluggableAllocator(path, "cumem_torch_alloc",
//! "cumem_torch_free")`) calls `alloc(size, device, stream)` with the
//! current stream and `free(ptr, size, device, stream)` with the
//! allocation's; cumem frees in that stream's order.
//!
//! `Tensor.record_stream(s)` never reaches a pluggable allocator from
//! Python (its binding sets no record-stream hook), so the block would be
//! reused while `s` may still read it. [`cumem_record_stream`]
//! (`cumem_torch.record_stream`) notes such streams; the free then orders
//! the allocation's stream after each (`cuEventRecord` +
//! `cuStreamWaitEvent`).

use std::ffi::{c_int, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::ffi::{answer, manager, ordinal};
use crate::recorded::free_on;
use crate::status::{guard, panic_message, set_last_error, Failure, Outcome};
use crate::streams::{stream_for, CumemStream};
use crate::CumemStatus;

/// Counters of the PyTorch entry points, which can't return a status.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CumemTorchCounters {
    /// `cumem_torch_alloc` calls that returned NULL for a non-zero size.
    pub alloc_failures: u64,
    /// `cumem_torch_free` calls that failed (the block stayed as it was).
    pub free_failures: u64,
    /// Frees first ordered after streams noted by `cumem_record_stream`.
    pub recorded_stream_waits: u64,
}

static ALLOC_FAILURES: AtomicU64 = AtomicU64::new(0);
static FREE_FAILURES: AtomicU64 = AtomicU64::new(0);

/// How many failures are also printed to stderr (PyTorch drops the
/// status; the first few say why a program then fails).
const PRINTED_FAILURES: u64 = 8;

/// Runs the body of an entry point that can't return a status: a failure
/// (or panic) becomes the thread's last error and is counted in `counter`.
fn quietly<T>(counter: &AtomicU64, what: &str, body: impl FnOnce() -> Outcome<T>) -> Option<T> {
    let message = match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => return Some(value),
        Ok(Err(f)) => f.message,
        Err(payload) => panic_message(payload.as_ref()),
    };
    set_last_error(&message);
    if counter.fetch_add(1, Ordering::Relaxed) < PRINTED_FAILURES {
        eprintln!("cumem: {what} failed: {message}");
    }
    None
}

/// PyTorch's allocation entry point: `size` bytes on `device` for work on
/// `stream`. NULL for size 0 and on failure (the thread's last error says
/// why; the first few are printed, as PyTorch does not check).
///
/// # Safety
/// `stream` must be a stream of `device`'s primary context (PyTorch's
/// streams are) that outlives the frees queued on it.
#[no_mangle]
pub unsafe extern "C" fn cumem_torch_alloc(size: usize, device: c_int, stream: CumemStream) -> *mut c_void {
    if size == 0 {
        return std::ptr::null_mut();
    }
    let allocate = || {
        let mm = manager()?;
        let s = stream_for(ordinal(device)?, stream)?;
        Ok(mm.allocate_device_on(size, &s)?)
    };
    quietly(&ALLOC_FAILURES, "cumem_torch_alloc", allocate).map_or(std::ptr::null_mut(), |p| p as usize as *mut c_void)
}

/// PyTorch's free entry point: frees `ptr` in the order of `stream` (the
/// allocation's). NULL is ignored; a failure (an unknown pointer, a double
/// free) changes nothing, becomes the thread's last error and is counted.
///
/// # Safety
/// As `cumem_torch_alloc`.
#[no_mangle]
pub unsafe extern "C" fn cumem_torch_free(ptr: *mut c_void, size: usize, device: c_int, stream: CumemStream) {
    let _ = size;
    if ptr.is_null() {
        return;
    }
    quietly(&FREE_FAILURES, "cumem_torch_free", || free_on(ptr as usize, ordinal(device)?, stream));
}

/// Notes that allocation `ptr` is used by work on `stream` of `device`
/// besides its own stream (`Tensor.record_stream`): its free first makes
/// the freeing stream wait for the work queued on `stream` up to now.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL, a negative device).
///
/// # Safety
/// `stream` as in `cumem_torch_alloc`.
#[no_mangle]
pub unsafe extern "C" fn cumem_record_stream(ptr: *mut c_void, device: c_int, stream: CumemStream) -> CumemStatus {
    guard(|| {
        if ptr.is_null() {
            return Err(Failure::null("ptr"));
        }
        // Wrap the stream now: a bad device fails here, not at the free.
        stream_for(ordinal(device)?, stream)?;
        crate::recorded::note(ptr as usize, stream);
        Ok(())
    })
}

/// Stores the PyTorch entry points' counters in `*out`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_torch_counters(out: *mut CumemTorchCounters) -> CumemStatus {
    let counters = || {
        Ok(CumemTorchCounters {
            alloc_failures: ALLOC_FAILURES.load(Ordering::Relaxed),
            free_failures: FREE_FAILURES.load(Ordering::Relaxed),
            recorded_stream_waits: crate::recorded::recorded_waits(),
        })
    };
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, counters) }
}
