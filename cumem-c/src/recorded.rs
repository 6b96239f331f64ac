//! The streams a device block was used on besides its own
//! (`cumem_record_stream`), and the free ordered after them (`torch.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use crate::ffi::manager;
use crate::status::Outcome;
use crate::streams::{stream_for, CumemStream};

/// Frees that first ordered their stream after recorded streams.
static RECORDED_WAITS: AtomicU64 = AtomicU64::new(0);

/// How many frees so far first ordered their stream after recorded ones.
pub(crate) fn recorded_waits() -> u64 {
    RECORDED_WAITS.load(Ordering::Relaxed)
}

/// Extra streams per device pointer (`cumem_record_stream`), and how many
/// pointers have any (frees skip the lock while it is 0).
fn recorded() -> &'static Mutex<HashMap<usize, Vec<CumemStreamKey>>> {
    static RECORDED: OnceLock<Mutex<HashMap<usize, Vec<CumemStreamKey>>>> = OnceLock::new();
    RECORDED.get_or_init(Mutex::default)
}
static RECORDED_COUNT: AtomicUsize = AtomicUsize::new(0);

/// A raw stream kept as an integer (raw pointers are not `Send`).
type CumemStreamKey = usize;

/// The streams noted for `ptr`, removed.
fn take_recorded(ptr: usize) -> Vec<CumemStreamKey> {
    if RECORDED_COUNT.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    let mut t = recorded().lock().unwrap_or_else(PoisonError::into_inner);
    match t.remove(&ptr) {
        Some(v) => {
            RECORDED_COUNT.fetch_sub(1, Ordering::AcqRel);
            v
        }
        None => Vec::new(),
    }
}

/// Drops the streams noted for `ptr` (freed with no stream).
pub(crate) fn forget_recorded(ptr: usize) {
    drop(take_recorded(ptr));
}

/// Frees `ptr` on `stream` of `device`, ordered after its recorded streams.
pub(crate) fn free_on(ptr: usize, device: usize, stream: CumemStream) -> Outcome {
    let mm = manager()?;
    let s = stream_for(device, stream)?;
    let others = take_recorded(ptr);
    for raw in &others {
        let other = stream_for(device, *raw as CumemStream)?;
        if !other.same_as(&s) {
            s.wait_for(&other)?;
            RECORDED_WAITS.fetch_add(1, Ordering::Relaxed);
        }
    }
    match mm.free_device_on(ptr as u64, &s) {
        Ok(()) => Ok(()),
        Err(e) => {
            // The block was not freed: its notes stay with it.
            if !others.is_empty() {
                let mut t = recorded().lock().unwrap_or_else(PoisonError::into_inner);
                if t.insert(ptr, others).is_none() {
                    RECORDED_COUNT.fetch_add(1, Ordering::AcqRel);
                }
            }
            Err(e.into())
        }
    }
}

/// Notes that `ptr` is used by work on `stream` too (once per stream).
pub(crate) fn note(ptr: usize, stream: CumemStream) {
    let mut t = recorded().lock().unwrap_or_else(PoisonError::into_inner);
    let streams = t.entry(ptr).or_insert_with(|| {
        RECORDED_COUNT.fetch_add(1, Ordering::AcqRel);
        Vec::new()
    });
    if !streams.contains(&(stream as usize)) {
        streams.push(stream as usize);
    }
}
