//! Fences on streams: CUDA events recorded where a page move lends memory
//! that work queued on the stream may still use (`pool/remap.rs`).
//!
//! # Implementation details
//!
//! A move that lends memory whose blocks were freed on the requesting
//! stream needs no wait for the device: the new owner's work is queued
//! on the same stream, after the old owner's. Only the memory's old
//! mapping must stay until the old work is done. The fence is an event
//! recorded on the stream at the move (`cuEventRecord`, one driver call
//! on the allocating thread, where the wait it replaces was a
//! `cuCtxSynchronize`). The mapper thread asks it (`cuEventQuery`) before
//! it unmaps the old mapping; a map that needs those addresses waits for
//! it (`cuEventSynchronize`), in relaxed capture mode, so a capture under
//! way on another stream is not broken. Events are made once and reused
//! (a device's [`EventPool`]).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent};

use super::{driver_err, Stream};
use crate::error::Result;
use crate::sync::{lock, Mutex};
use crate::tag::Fence;

/// Events kept for reuse per device (more are destroyed on return).
const KEPT: usize = 64;

/// A device's events for fences, made on demand and reused.
#[derive(Default)]
pub(crate) struct EventPool {
    free: Mutex<Vec<CudaEvent>>,
}

impl EventPool {
    /// An event of `ctx`: a kept one, or a new one.
    fn take(&self, ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
        let kept = lock(&self.free).pop();
        match kept {
            Some(e) => Ok(e),
            None => ctx.new_event(None).map_err(driver_err("cuEventCreate")),
        }
    }

    /// Takes `event` back for reuse (destroyed when enough are kept).
    fn put(&self, event: CudaEvent) {
        let mut free = lock(&self.free);
        if free.len() < KEPT {
            free.push(event);
        }
    }
}

/// A fence on a stream: an event recorded there.
struct EventFence {
    /// `Some` until the fence drops and gives it back.
    event: Option<CudaEvent>,
    pool: Arc<EventPool>,
}

impl Fence for EventFence {
    fn passed(&self) -> bool {
        // A failed question counts as not passed (the wait then reports it).
        self.event.as_ref().is_some_and(|e| e.is_complete())
    }

    fn wait(&self) -> Result<()> {
        match &self.event {
            Some(e) => e.synchronize().map_err(driver_err("cuEventSynchronize")),
            None => Ok(()),
        }
    }
}

impl Drop for EventFence {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            self.pool.put(e);
        }
    }
}

/// A fence at the end of the work queued so far on `on`, with an event of
/// `pool`, and the work queued on `then` from now on ordered after it
/// (`cuStreamWaitEvent`) when `then` is another stream; `None` on a host
/// queue, a stream whose handle is gone, while a capture cumem knows of
/// is under way or `on` captures (an event recorded on a capturing stream
/// would record nothing), or when the driver refuses.
pub(crate) fn fence_on(on: &Stream, then: &Stream, pool: &Arc<EventPool>) -> Option<Arc<dyn Fence>> {
    let event = record_for(on, then, pool)?;
    Some(Arc::new(EventFence { event: Some(event), pool: pool.clone() }))
}

/// [`fence_on`] on each of `streams` at once (memory of blocks freed on
/// several of them): the fence passes when all have; `None` when any one
/// can't be made.
pub(crate) fn fence_on_all(streams: &[Stream], then: &Stream, pool: &Arc<EventPool>) -> Option<Arc<dyn Fence>> {
    let mut events = Vec::with_capacity(streams.len());
    for on in streams {
        match record_for(on, then, pool) {
            Some(e) => events.push(EventFence { event: Some(e), pool: pool.clone() }),
            // The events recorded so far go back as the fences drop.
            None => return None,
        }
    }
    Some(Arc::new(AllOf(events)))
}

/// An event recorded after the work queued so far on `on`, which `then`
/// waits for when it is another stream (see [`fence_on`]).
fn record_for(on: &Stream, then: &Stream, pool: &Arc<EventPool>) -> Option<CudaEvent> {
    let cuda = on.cudarc()?;
    if super::captures_under_way() {
        return None;
    }
    let other = then.id() != on.id();
    // The requesting stream does not capture (else it would not be here).
    if other && !matches!(on.unless_gone(|| super::capture_of(on)), Ok(Some(None))) {
        return None;
    }
    let recorded = on.unless_gone(|| {
        let event = pool.take(cuda.context())?;
        crate::fault::check_driver(crate::fault::Point::EventRecord)
            .and_then(|()| event.record(cuda))
            .map_err(driver_err("cuEventRecord"))?;
        Ok(event)
    });
    let event = recorded.ok().flatten()?;
    if other {
        let waited = then.unless_gone(|| {
            let then = then.cudarc().ok_or(crate::error::Error::NeedsGpu("a stream to order"))?;
            crate::fault::check_driver(crate::fault::Point::EventRecord)
                .and_then(|()| then.wait(&event))
                .map_err(driver_err("cuStreamWaitEvent"))
        });
        if !matches!(waited, Ok(Some(()))) {
            // Not ordered: the event goes back, and the move waits instead.
            pool.put(event);
            return None;
        }
    }
    Some(event)
}

/// Fences on several streams, passed when all have.
struct AllOf(Vec<EventFence>);

impl Fence for AllOf {
    fn passed(&self) -> bool {
        self.0.iter().all(|f| f.passed())
    }

    fn wait(&self) -> Result<()> {
        self.0.iter().try_for_each(|f| f.wait())
    }
}
