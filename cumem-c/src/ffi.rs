//! Helpers of the C boundary: the process-wide manager, writing results
//! through out-pointers, device numbers from C.

use std::ffi::{c_char, c_int, c_void};

use cumem::MemoryManager;

use crate::status::{Failure, Outcome};
use crate::CumemStatus;

/// The process-wide manager (configured from `CUMEM_CONF` on first use).
pub(crate) fn manager() -> Outcome<&'static MemoryManager> {
    Ok(MemoryManager::global()?)
}

/// Writes `value` through `out`, refusing NULL.
///
/// # Safety
/// `out` must be NULL or valid for a write of one `T`.
pub(crate) unsafe fn put<T>(out: *mut T, name: &str, value: T) -> Outcome {
    if out.is_null() {
        return Err(Failure::null(name));
    }
    // SAFETY: non-null, and the caller promises it is valid for a write.
    unsafe { out.write(value) };
    Ok(())
}

/// Runs `body` in the guard, storing its value in `*out` (kept on failure).
///
/// # Safety
/// `out` must be NULL (an error, and `body` does not run) or valid for a
/// write of one `T`.
pub(crate) unsafe fn answer<T>(out: *mut T, body: impl FnOnce() -> Outcome<T>) -> CumemStatus {
    crate::status::guard(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let value = body()?;
        // SAFETY: non-null, and the caller's promise about `out`.
        unsafe { put(out, "out", value) }
    })
}

/// [`answer`] for an allocation: the device address `allocate` makes.
///
/// # Safety
/// As [`answer`].
pub(crate) unsafe fn allocate_into(out: *mut *mut c_void, allocate: impl FnOnce() -> Outcome<u64>) -> CumemStatus {
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, || Ok(allocate()? as usize as *mut c_void)) }
}

/// Writes `value` through `out` unless it is NULL (an optional result).
///
/// # Safety
/// `out` must be NULL or valid for a write of one `T`.
pub(crate) unsafe fn put_opt<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-null, and the caller promises it is valid for a write.
        unsafe { out.write(value) };
    }
}

/// Copies `text` NUL-terminated into `buf` (`len` bytes); `*needed` (when
/// not NULL) gets the bytes the whole text needs, its NUL included. A
/// buffer too small gets as much as fits, NUL-terminated, and
/// `CUMEM_STATUS_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `buf` must be NULL or valid for writes of `len` bytes; `needed` NULL or
/// valid for a write.
pub(crate) unsafe fn copy_text(text: &str, buf: *mut c_char, len: usize, needed: *mut usize) -> Outcome {
    let need = text.len() + 1;
    // SAFETY: the caller's promise about `needed`.
    unsafe { put_opt(needed, need) };
    if buf.is_null() {
        return if len == 0 { Err(too_small(need, 0)) } else { Err(Failure::null("buf")) };
    }
    if len == 0 {
        return Err(too_small(need, 0));
    }
    let n = text.len().min(len - 1);
    // SAFETY: `buf` is valid for `len` bytes (the caller's promise) and
    // `n + 1 <= len`; the source is a distinct Rust string.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
        buf.add(n).write(0);
    }
    if n < text.len() {
        Err(too_small(need, len))
    } else {
        Ok(())
    }
}

fn too_small(need: usize, len: usize) -> Failure {
    Failure::new(CumemStatus::BufferTooSmall, format!("the text needs {need} B with its NUL; the buffer holds {len} B"))
}

/// A device number from C as an ordinal.
pub(crate) fn ordinal(device: c_int) -> Outcome<usize> {
    usize::try_from(device)
        .map_err(|_| Failure::new(CumemStatus::InvalidArgument, format!("device {device} is negative")))
}
