//! Waiting before a region gives memory back, without breaking anyone's
//! CUDA graph capture, and giving it back whole or not at all.
//!
//! # Implementation details
//! Before memory is unmapped, the work queued on the device that may still
//! read it must be done. A region waits one of two ways ([`Waiter`]):
//! - **its stream** (growable buffers made for a stream): the work that
//!   uses the memory is ordered on that stream, so `cuStreamSynchronize` of
//!   it is enough, and in the relaxed capture mode it is legal while other
//!   streams capture (on an H200, without it the driver refuses it during
//!   another thread's global-mode capture and invalidates that capture).
//!   While the
//!   stream itself captures, it can't be waited on: the release is
//!   deferred.
//! - **the device** (no stream): `cuCtxSynchronize`, which is illegal while
//!   any stream of the context captures (the call fails and invalidates the
//!   capture). It is never made while a capture is known: one registered
//!   with cumem ([`captures_under_way`]), or one on a blocking stream, which
//!   the legacy stream reports (`cuStreamIsCapturing` of it answers
//!   `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` without invalidating anything).
//!   Then the release is deferred too. A capture cumem is not told of on a
//!   non-blocking stream can't be seen: such programs give their buffers a
//!   stream.
//!
//! What is deferred ([`Remains`]: mappings to undo, memory to release,
//! address ranges to free) waits in a process-wide list, and every later
//! wait of any region first tries to release it (the waits run with the
//! list's lock released). A driver failure while undoing a mapping leaks
//! the remains (logged) instead of releasing memory or freeing addresses
//! that may still be mapped.

use super::{Backing, Region, Reservation, Segment};
use crate::cuda::{capture_of, captures_under_way, vmm, RelaxedCaptureMode, Stream};
use crate::error::Result;
use crate::sync::{lock, Mutex};
use cudarc::driver::{sys, CudaContext};
use once_cell::sync::Lazy;
use std::sync::Arc;

/// How a region waits for the work that may use its memory.
#[derive(Debug, Clone)]
pub(crate) enum Waiter {
    /// Host memory: nothing runs asynchronously on it.
    None,
    /// The context (`cuCtxSynchronize`) when no capture is known.
    Device(Arc<CudaContext>),
    /// One stream (`cuStreamSynchronize`) when it does not capture.
    Stream(Stream),
}

/// What a wait achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// The work is done: memory can be given back now.
    Now,
    /// A capture forbids the wait: give nothing back yet.
    Later,
}

impl Waiter {
    /// Waits for the work that may use the memory, unless a capture
    /// forbids it.
    ///
    /// # Errors
    /// A driver error from the wait (the memory must then not be given
    /// back: its users' state is unknown).
    pub(crate) fn settle(&self) -> Result<Settled> {
        match self {
            Waiter::None => Ok(Settled::Now),
            Waiter::Stream(stream) => {
                // An invalidated capture on the stream is an error too.
                if capture_of(stream)?.is_some() {
                    return Ok(Settled::Later);
                }
                // A global-mode capture elsewhere makes the driver refuse
                // even this unrelated stream's wait (and the refusal
                // invalidates that capture) unless this thread is relaxed.
                let _relaxed = RelaxedCaptureMode::enter();
                stream.synchronize()?;
                Ok(Settled::Now)
            }
            Waiter::Device(ctx) => {
                if captures_under_way() || blocking_capture(ctx) {
                    return Ok(Settled::Later);
                }
                vmm::synchronize(ctx)?;
                Ok(Settled::Now)
            }
        }
    }
}

/// Whether a blocking stream of `ctx` captures (or the question failed,
/// which counts as yes): the legacy stream's capture status.
fn blocking_capture(ctx: &CudaContext) -> bool {
    if ctx.bind_to_thread().is_err() {
        return true;
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the null stream is the legacy stream of the current context
    // (bound just above); `status` is a valid local. The question
    // invalidates no capture.
    let rc = unsafe { sys::cuStreamIsCapturing(std::ptr::null_mut(), &mut status) };
    rc != sys::CUresult::CUDA_SUCCESS || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

impl Region {
    /// Waits for the work that may use the memory before some of it is
    /// given back, unless a capture forbids the wait ([`Waiter`]); first
    /// releases what earlier waits deferred.
    ///
    /// # Errors
    /// A driver error from the wait.
    pub(crate) fn settle(&self) -> Result<Settled> {
        release_deferred_where(matches!(self.waiter, Waiter::Device(_)) && !self.owner_settles);
        if self.owner_settles {
            return Ok(Settled::Now);
        }
        self.waiter.settle()
    }

    /// From now on, waits for `stream` alone (not the device) before
    /// memory is given back: all work that uses the memory is ordered on
    /// it.
    pub(crate) fn set_waiter(&mut self, waiter: Waiter) {
        self.waiter = waiter;
    }

    /// Every piece's mapping as remains to undo, with the segments (taken
    /// out of the region) and, with `own`, the pieces' memory, the spares
    /// and the guard too (the region is left empty).
    pub(super) fn remains_of(&mut self, own: bool) -> Remains {
        let mut remains = Remains::default();
        // Old mappings of lent memory are undone with the rest.
        // Their fences have passed after a wait for the device; one made
        // by an owner that settles its own work is waited for here (a
        // failed wait means the context is lost, and its work with it).
        for fence in self.stale.iter().filter_map(|m| m.fence.as_ref()) {
            if !fence.passed() {
                if let Err(e) = fence.wait() {
                    eprintln!("cumem: waiting for the work on moved memory: {e}");
                }
            }
        }
        let stale = std::mem::take(&mut self.stale).into_iter().map(|m| (m.offset, m.size));
        let pieces = self.pieces.iter().map(|p| (p.offset, p.size));
        for (offset, size) in pieces.chain(stale) {
            let s = self.segment_of(offset);
            remains.maps.push((s, offset - self.segments[s].offset, size));
        }
        if own {
            remains.backings = self.pieces.drain(..).map(|p| p.backing).collect();
            remains.backings.extend(self.spare.drain(..).map(|(_, b)| b));
            remains.guard = self.guard.take();
        }
        remains.segments = std::mem::take(&mut self.segments);
        remains
    }
}

/// Memory a region gives back: mappings to undo (`(segment, offset in
/// it, size)`), then memory to release, then address ranges to free, in
/// that order. Dropping it does all that, or leaks it all (logged) when an
/// unmap fails.
#[derive(Debug, Default)]
pub(super) struct Remains {
    pub(super) maps: Vec<(usize, usize, usize)>,
    pub(super) backings: Vec<Backing>,
    pub(super) segments: Vec<Segment>,
    pub(super) guard: Option<Reservation>,
}

impl Remains {
    /// Gives everything back now (after the wait).
    pub(super) fn release(mut self) {
        let mut failed = None;
        for &(s, offset, size) in &self.maps {
            let result = match &self.segments[s].res {
                Reservation::Cuda(range) => fail_point().and_then(|()| range.unmap(offset, size)),
                Reservation::Host(_) => fail_point(),
            };
            if let Err(e) = result {
                failed = Some(e);
                break;
            }
        }
        self.maps.clear();
        if let Some(e) = failed {
            eprintln!("cumem: unmapping a region failed ({e}); its memory and addresses are leaked");
            self.leak();
        }
        // Else dropping releases the memory, then frees the addresses.
    }

    /// Keeps everything forever (nothing is released or freed twice).
    pub(super) fn leak(self) {
        LEAKED.fetch_add(1, crate::sync::Ordering::Relaxed);
        #[cfg(test)]
        LEAKED_HERE.with(|l| l.set(l.get() + 1));
        std::mem::forget(self);
    }

    /// Waits with `waiter` and releases, or defers, or leaks on an error.
    pub(super) fn settle_and_release(self, waiter: Waiter) {
        // Nothing was mapped (a reservation alone, or one that failed to
        // grow): no work can use memory that is not there, so nothing is
        // waited for (a wait would break a capture under way).
        if self.maps.is_empty() && self.backings.is_empty() {
            return self.release();
        }
        // Deferred device-wide waits come back only through a device wait
        // (see `release_deferred_where`).
        release_deferred_where(matches!(waiter, Waiter::Device(_)));
        match waiter.settle() {
            Ok(Settled::Now) => self.release(),
            Ok(Settled::Later) => lock(&DEFERRED).push((waiter, self)),
            Err(e) => {
                eprintln!("cumem: waiting before unmapping a region failed ({e}); its memory is leaked");
                self.leak();
            }
        }
    }
}

/// Remains whose wait a capture forbade, with their waiter.
static DEFERRED: Lazy<Mutex<Vec<(Waiter, Remains)>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// Remains leaked after a failure (for tests and diagnostics).
static LEAKED: crate::sync::StaticAtomicU64 = crate::sync::StaticAtomicU64::new(0);

/// Releases the deferred remains whose waits are now allowed (each waiter
/// is asked once per call; the list's lock is not held meanwhile).
pub(crate) fn release_deferred() {
    release_deferred_where(true);
}

/// As [`release_deferred`]; with `device_waits` false, remains that wait
/// for a whole device are left for later. A region that waits for its own
/// stream passes false: its caller keeps the device-wide wait away (it may
/// break a capture cumem is not told of), and a deferred device wait must
/// not come back through it.
fn release_deferred_where(device_waits: bool) {
    let pending = std::mem::take(&mut *lock(&DEFERRED));
    if pending.is_empty() {
        return;
    }
    let mut keep = Vec::new();
    for (waiter, remains) in pending {
        if !device_waits && matches!(waiter, Waiter::Device(_)) {
            keep.push((waiter, remains));
            continue;
        }
        match waiter.settle() {
            Ok(Settled::Now) => remains.release(),
            Ok(Settled::Later) => keep.push((waiter, remains)),
            Err(e) => {
                eprintln!("cumem: waiting before unmapping a region failed ({e}); its memory is leaked");
                remains.leak();
            }
        }
    }
    lock(&DEFERRED).extend(keep);
}

/// The number of region remains deferred until a capture ends, and of
/// those leaked after a failure (process-wide).
pub(crate) fn deferred_and_leaked() -> (usize, u64) {
    (lock(&DEFERRED).len(), LEAKED.load(crate::sync::Ordering::Relaxed))
}

#[cfg(test)]
thread_local! {
    /// Unmaps that fail on this thread (tests of the failure path).
    static FAIL_UNMAPS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// Remains leaked by this thread.
    static LEAKED_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A chosen failure for tests; nothing otherwise.
fn fail_point() -> Result<()> {
    #[cfg(test)]
    if FAIL_UNMAPS.with(|f| f.replace(f.get().saturating_sub(1))) > 0 {
        return Err(crate::error::Error::InvalidState("injected unmap failure".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
