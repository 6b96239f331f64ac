//! Tying a graph-private pool's life to a CUDA graph: a user object whose
//! destructor hands the pool's release back to cumem.
//!
//! # Implementation details
//!
//! A capture cumem was not told of gets a private pool on the first cumem
//! call on one of its streams (`device/captures.rs`). cumem then creates a CUDA *user
//! object* (`cuUserObjectCreate`) and moves its one reference to the
//! capture's graph (`cuGraphRetainUserObject` with
//! `CU_GRAPH_USER_OBJECT_MOVE`). The driver gives every executable graph
//! instantiated from that graph its own reference, and runs the object's
//! destructor once the graph and all its executables are destroyed (for an
//! executable with launches still in flight, after they complete). A
//! capture that fails or is abandoned destroys its graph, so its pool is
//! released the same way.
//!
//! The destructor runs on a thread of the driver, at any time, and may
//! make no CUDA call; it only posts the pool's id to a [`ReleaseQueue`].
//! The next cumem call on the device that is not itself captured takes the
//! posted ids and releases the pools (`device/graph_pool.rs`): that is where the driver
//! calls happen. The queue, the payload and the host model of a graph are
//! in `graph_release.rs`.

use cudarc::driver::sys;

use super::capture::{CaptureGraph, RelaxedCaptureMode};
use super::context::driver_err;
use super::graph_release::{
    next_host_capture_id, release_payload, run_release, HostGraph, HostGraphRefs, Release, ReleaseQueue,
};
use super::stream::Stream;
use crate::error::{Error, Result};
use crate::sync::Arc;

/// Ties the release of pool `pool` to `graph`: once the graph and its
/// executables are gone, `pool` is posted to `queue`.
///
/// # Errors
/// [`Error::Capture`] when the driver gives no graph to tie to; a driver
/// error. After an error nothing is posted for `pool`.
pub(crate) fn tie_to_graph(graph: &CaptureGraph, queue: &Arc<ReleaseQueue>, pool: u64) -> Result<()> {
    match graph {
        CaptureGraph::Cuda(g) => {
            // Legal even while this thread captures in the global mode.
            let _relaxed = RelaxedCaptureMode::enter();
            let payload = release_payload(queue.clone(), pool);
            let mut object: sys::CUuserObject = std::ptr::null_mut();
            // SAFETY: `object` is a valid out-location; the destructor is
            // `run_release` with a payload made for it, which the driver
            // passes to it once, when the last reference goes. The flag is
            // the one the driver requires.
            let created = unsafe {
                sys::cuUserObjectCreate(
                    &mut object,
                    payload,
                    Some(run_release),
                    1,
                    sys::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32,
                )
            }
            .result();
            if let Err(e) = created {
                // SAFETY: the driver did not take the payload: ours to drop.
                drop(unsafe { Box::from_raw(payload.cast::<Release>()) });
                return Err(driver_err("cuUserObjectCreate")(e));
            }
            // SAFETY: `g` is the graph of a capture under way (the driver
            // just named it), `object` a live user object whose one
            // reference this call moves to the graph.
            let retained = unsafe {
                sys::cuGraphRetainUserObject(
                    *g,
                    object,
                    1,
                    sys::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as u32,
                )
            }
            .result();
            // On failure the reference stays ours and is never released:
            // the pool's memory may already be in the graph, so it must
            // never come back (a leak, never a release too early).
            retained.map_err(driver_err("cuGraphRetainUserObject"))
        }
        CaptureGraph::Host(refs) => {
            refs.hold(release_payload(queue.clone(), pool));
            Ok(())
        }
        CaptureGraph::Unknown => Err(Error::Capture(
            "the driver does not name the capture's graph (cuStreamGetCaptureInfo_v3 needs CUDA 12.3), so cumem \
             can't keep memory for it; register the capture with MemoryManager::begin_capture or capture_into"
                .into(),
        )),
    }
}
impl Stream {
    /// Begins a capture on a host queue that cumem is not told of (the
    /// model of `CudaStream::begin_capture`, for tests without a GPU).
    ///
    /// # Errors
    /// [`Error::Capture`] for a CUDA stream, or a host queue that captures.
    #[doc(hidden)]
    pub fn begin_host_capture(&self) -> Result<()> {
        if !self.is_host() || self.host_capture().is_some() {
            return Err(Error::Capture("begin_host_capture: not a host queue, or it captures already".into()));
        }
        self.set_host_graph(Some(Arc::new(HostGraphRefs::default())));
        self.set_host_capture(Some(next_host_capture_id()));
        Ok(())
    }

    /// Ends a capture begun with [`begin_host_capture`](Self::begin_host_capture):
    /// its graph, or `None` when `abandon` is set (the model of a capture
    /// that fails: the graph is destroyed at once).
    ///
    /// # Errors
    /// [`Error::Capture`] when no such capture is under way.
    #[doc(hidden)]
    pub fn end_host_capture(&self, abandon: bool) -> Result<Option<HostGraph>> {
        let refs = self.set_host_graph(None).ok_or_else(|| Error::Capture("no host capture to end".into()))?;
        self.set_host_capture(None);
        Ok((!abandon).then_some(HostGraph { refs }))
    }
}
