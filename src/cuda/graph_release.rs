//! The release queue that a graph's user-object destructor posts to, and
//! the host model of a captured graph (for tests without a GPU).
//!
//! # Implementation details
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
//! Host queues model all of this without a GPU: [`Stream::begin_host_capture`](super::Stream::begin_host_capture)
//! starts a capture that cumem is not told of, whose "graph" ([`HostGraph`])
//! runs the same destructor, with the same payload, when it and every
//! executable made from it ([`HostGraphExec`]) are dropped.

use std::ffi::c_void;

use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering};

/// A fresh capture id for a host queue (top bit set: never the driver's).
pub(crate) fn next_host_capture_id() -> u64 {
    static NEXT: crate::sync::StaticAtomicU64 = crate::sync::StaticAtomicU64::new(1);
    (1 << 63) | NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Ids posted by destructors on other threads, for cumem's next call.
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

    /// Posts `id` (any thread, any time; no CUDA call; locks only to push).
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

/// What a user object's destructor gets: the queue and the pool's id.
pub(super) struct Release {
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
    // SAFETY: the caller passes `release_payload`'s `Box::into_raw`, once.
    let release = unsafe { Box::from_raw(payload.cast::<Release>()) };
    // A panic must not cross into the driver's thread; `post` has nothing
    // that panics but an allocation failure, which aborts anyway.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| release.queue.post(release.pool)));
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

impl HostGraphRefs {
    /// Holds a destructor payload (from [`release_payload`]) until the
    /// graph and its executables are gone.
    pub(super) fn hold(&self, payload: *mut c_void) {
        lock(&self.payloads).push(payload as usize);
    }
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
    pub(super) refs: Arc<HostGraphRefs>,
}

impl HostGraph {
    /// An executable of the graph (`cuGraphInstantiate`): it keeps the memory.
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
