//! Tying a graph-private pool's life to a CUDA graph: a user object whose
//! destructor hands the pool's release back to cumem.
//!
//! # Implementation details
//!
//! A capture cumem was not told of gets a private pool on the first cumem
//! call on one of its streams (`device/graph.rs`). cumem then creates a CUDA *user
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
//! calls happen.
//!
//! The queue's protocol: `post` pushes under the queue's lock, then raises
//! `pending` (release); `take` lowers `pending` (compare-exchange, acquire) and, if it was
//! raised, empties the list under the lock. An id posted is therefore
//! either in the list with `pending` raised, or taken: none is lost and
//! none is taken twice, and a call that finds `pending` lowered costs one
//! atomic load. `loom-tests` models it with the destructor on a thread of
//! its own.
//!
//! Host queues model all of this without a GPU: [`Stream::begin_host_capture`]
//! starts a capture that cumem is not told of, whose "graph" ([`HostGraph`])
//! runs the same destructor, with the same payload, when it and every
//! executable made from it ([`HostGraphExec`]) are dropped.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::capture::RelaxedCaptureMode;
use super::context::driver_err;
use super::stream::Stream;
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering};

/// A fresh capture id for a host queue. Host ids have the top bit set, so
/// they never meet the driver's.
pub(crate) fn next_host_capture_id() -> u64 {
    static NEXT: crate::sync::StaticAtomicU64 = crate::sync::StaticAtomicU64::new(1);
    (1 << 63) | NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Ids posted by destructors that run on other threads, for cumem to act
/// on at its next call.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct ReleaseQueue {
    pending: AtomicBool,
    items: Mutex<Vec<u64>>,
}

impl ReleaseQueue {
    /// An empty queue.
    pub fn new() -> Self {
        ReleaseQueue { pending: AtomicBool::new(false), items: Mutex::new(Vec::new()) }
    }

    /// Posts `id`. Any thread, at any time; makes no CUDA call and holds
    /// the lock only to push.
    pub fn post(&self, id: u64) {
        lock(&self.items).push(id);
        self.pending.store(true, Ordering::Release);
    }

    /// Whether ids may be waiting (one atomic load).
    #[inline]
    pub fn is_pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Takes every id posted so far.
    pub fn take(&self) -> Vec<u64> {
        if self.pending.compare_exchange(true, false, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return Vec::new();
        }
        std::mem::take(&mut *lock(&self.items))
    }
}

/// What a user object's destructor gets: the queue to post to and the id
/// of the pool to release.
struct Release {
    queue: Arc<ReleaseQueue>,
    pool: u64,
}

/// A destructor payload posting `pool` to `queue`, as a raw pointer for
/// the driver (or a host graph). Give it to [`run_release`] exactly once.
#[doc(hidden)]
pub fn release_payload(queue: Arc<ReleaseQueue>, pool: u64) -> *mut c_void {
    Box::into_raw(Box::new(Release { queue, pool })).cast()
}

/// The destructor of the user objects: posts the pool's id. Runs on a
/// driver thread; makes no CUDA call and never unwinds into the driver.
///
/// # Safety
/// `payload` came from [`release_payload`] and is passed here once.
#[doc(hidden)]
pub unsafe extern "C" fn run_release(payload: *mut c_void) {
    if payload.is_null() {
        return;
    }
    // SAFETY: the caller passes a pointer made by `release_payload`
    // (`Box::into_raw` of a `Release`), once.
    let release = unsafe { Box::from_raw(payload.cast::<Release>()) };
    // A panic must not cross into the driver's thread; `post` has nothing
    // that panics but an allocation failure, which aborts anyway.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| release.queue.post(release.pool)));
}

/// The graph a capture records into, to tie a pool's life to.
#[derive(Clone)]
pub(crate) enum CaptureGraph {
    /// A CUDA graph under capture (`cuStreamGetCaptureInfo`).
    Cuda(sys::CUgraph),
    /// A host queue's capture cumem was not told of.
    Host(Arc<HostGraphRefs>),
    /// A capture whose graph the driver does not tell (drivers older than
    /// CUDA 12.3) or a registered host capture: nothing to tie to.
    Unknown,
}

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
                // SAFETY: the driver did not take the payload; it is ours
                // to drop, once.
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
            lock(&refs.payloads).push(release_payload(queue.clone(), pool) as usize);
            Ok(())
        }
        CaptureGraph::Unknown => Err(Error::Capture(
            "the driver does not name the capture's graph (cuStreamGetCaptureInfo_v3 needs CUDA 12.3), so cumem \
             can't keep memory for it; register the capture with MemoryManager::begin_capture or capture_into"
                .into(),
        )),
    }
}

/// The references a host "graph" holds (the model of a CUDA graph's user
/// object references): their destructors run when the graph and every
/// executable made from it are gone.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct HostGraphRefs {
    /// Destructor payloads (`release_payload` pointers, as addresses).
    payloads: Mutex<Vec<usize>>,
}

impl Drop for HostGraphRefs {
    fn drop(&mut self) {
        for p in std::mem::take(&mut *lock(&self.payloads)) {
            // SAFETY: each address is a payload made by `release_payload`
            // and pushed once; it is taken out of the list here, once.
            unsafe { run_release(p as *mut c_void) };
        }
    }
}

/// A host queue's captured "graph" (the model of a CUDA graph, for tests
/// without a GPU): it records nothing, but cumem keeps the memory used
/// during its capture until it and every [`HostGraphExec`] made from it
/// are dropped, as for a CUDA graph.
#[doc(hidden)]
#[derive(Debug)]
pub struct HostGraph {
    refs: Arc<HostGraphRefs>,
}

impl HostGraph {
    /// An executable of the graph (`cuGraphInstantiate`): it keeps the
    /// graph's memory too.
    pub fn instantiate(&self) -> HostGraphExec {
        HostGraphExec { _refs: self.refs.clone() }
    }
}

/// An executable made from a [`HostGraph`].
#[doc(hidden)]
#[derive(Debug)]
pub struct HostGraphExec {
    _refs: Arc<HostGraphRefs>,
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
