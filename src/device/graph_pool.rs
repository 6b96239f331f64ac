//! The graph pool handle, and the device allocator's side of captures:
//! registering them, routing frees into private pools, retiring pools.
//! The rules are in the [`captures`](super::captures) module's docs.

use std::sync::Arc;

mod blocks;

use super::allocator::DeviceAllocator;
use super::captures::{Capture, GraphStats, Held, PrivatePool, StreamOrderedFree};
use super::mode::DeviceAllocatorMode;
use super::reuse::StreamRegistry;
use crate::cuda::{self, RelaxedCaptureMode, Stream};
use crate::error::{Error, PoolKind, Result};
use crate::pool::Pool;
use crate::sync::{lock, AtomicBool, AtomicUsize, Mutex, Ordering, StaticAtomicU64};
use crate::tag::StreamTag;
use crate::upstream::Upstream;

/// A graph-private pool of one device: captures routed into it take their
/// memory from it, and everything they allocate or free stays out of
/// everyone else's reach until the pool and every graph captured into it
/// are dropped. Clones are the same pool.
///
/// Create one with [`MemoryManager::graph_pool`](crate::MemoryManager::graph_pool);
/// capture with [`MemoryManager::begin_capture`](crate::MemoryManager::begin_capture).
///
/// # Examples
/// ```
/// use cumem::{Config, MemoryManager, Stream};
/// let mm = MemoryManager::new(Config::new())?;
/// let pool = mm.graph_pool()?;
/// assert_eq!(pool.stats().in_use, 0);
/// # Ok::<(), cumem::Error>(())
/// ```
pub struct GraphPool<'a> {
    device: &'a DeviceAllocator,
    inner: Arc<PrivatePool>,
}

impl std::fmt::Debug for GraphPool<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphPool").field("id", &self.inner.id).field("device", &self.device.ordinal()).finish()
    }
}

impl Clone for GraphPool<'_> {
    fn clone(&self) -> Self {
        self.inner.handles.fetch_add(1, Ordering::AcqRel);
        GraphPool { device: self.device, inner: self.inner.clone() }
    }
}

impl Drop for GraphPool<'_> {
    fn drop(&mut self) {
        if self.inner.handles.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.device.retire_graph_pool(self.inner.clone());
        }
    }
}

impl<'a> GraphPool<'a> {
    /// This pool's number (unique in the process).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Whether a capture is routed into the pool now.
    pub fn is_capturing(&self) -> bool {
        self.inner.capturing.load(Ordering::Acquire)
    }

    /// The device ordinal it belongs to.
    pub fn device(&self) -> usize {
        self.device.ordinal()
    }

    /// Its figures (`pools` is 1).
    pub fn stats(&self) -> GraphStats {
        let mut s = GraphStats::default();
        s.add(&self.inner.pool.stats(), self.inner.held_bytes());
        s
    }

    pub(crate) fn allocator(&self) -> &'a DeviceAllocator {
        self.device
    }
}

/// A private pool's number (unique in the process).
fn next_pool_id() -> u64 {
    static NEXT: StaticAtomicU64 = StaticAtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl DeviceAllocator {
    /// The capture `stream` takes part in and its private pool, or `None`
    /// when it does not capture. A capture cumem does not know yet gets an
    /// implicit private pool here, tied to its graph.
    ///
    /// # Errors
    /// [`Error::Capture`] when the stream's capture was invalidated, or it
    /// is unknown and the program promised to register its captures, or
    /// its pool can't be tied to its graph; a driver error.
    #[inline]
    pub(super) fn capture_for(&self, stream: &Stream) -> Result<Option<(u64, Arc<PrivatePool>)>> {
        match cuda::capture_info(stream)? {
            None => Ok(None),
            Some((id, graph)) => self.capture_pool(stream, id, graph),
        }
    }

    /// The private pool of capture `id` (recording into `graph`), which
    /// `stream` takes part in: see [`capture_for`](Self::capture_for).
    #[inline(never)]
    fn capture_pool(
        &self,
        stream: &Stream,
        id: u64,
        graph: cuda::CaptureGraph,
    ) -> Result<Option<(u64, Arc<PrivatePool>)>> {
        if let Some(p) = self.graphs.routed(id) {
            return Ok(Some((id, p)));
        }
        let Some(make) = self.graphs.make_pool.as_ref().filter(|_| self.graphs.detect) else {
            return Err(Error::Capture(format!(
                "the stream captures a graph (capture {id}) that cumem was not told about, and the program \
                 promised to register its captures (promise_registered_captures); begin it with \
                 MemoryManager::begin_capture, or register it with MemoryManager::capture_into"
            )));
        };
        if matches!(graph, cuda::CaptureGraph::Unknown) {
            // Nothing to tie a pool's life to: refuse before it is used.
            return cuda::tie_to_graph(&graph, &self.graphs.releases, 0).map(|()| None);
        }
        let pool = {
            // Legal even while this thread captures in the global mode.
            let _relaxed = RelaxedCaptureMode::enter();
            make()?
        };
        debug_assert!(pool.config().keep_chunks && !pool.config().thread_cache);
        let inner = Arc::new(PrivatePool {
            id: next_pool_id(),
            implicit: true,
            pool,
            streams: StreamRegistry::default(),
            handles: AtomicUsize::new(1),
            untied: AtomicBool::new(false),
            capturing: AtomicBool::new(true),
            tagged_outside: AtomicBool::new(false),
            held: Mutex::new(Vec::new()),
        });
        {
            let mut state = lock(&self.graphs.state);
            if let Some(c) = state.captures.iter().find(|c| c.id == id) {
                // Another stream of the capture got there first.
                return Ok(Some((id, c.pool.clone())));
            }
            state.captures.push(Capture { id, pool: inner.clone(), origin: Some(stream.clone()) });
            state.pools.push(inner.clone());
            self.graphs.pools.fetch_add(1, Ordering::AcqRel);
            self.graphs.implicit.fetch_add(1, Ordering::AcqRel);
            // Whether its capture still runs is not known without asking:
            // page remapping waits for no device while its graph lives.
            cuda::count_capture(true);
        }
        // Outside the lock: driver calls. A pool that can't be tied to the
        // graph stays routed, never released (another stream of the capture
        // may use it already): a leak, never a reuse too early.
        cuda::tie_to_graph(&graph, &self.graphs.releases, inner.id)?;
        Ok(Some((id, inner)))
    }

    /// Releases the implicit pools whose graphs are gone, and retries
    /// registered pools whose release waited for a capture to end. Call
    /// from calls not on a capturing stream; costs one or two atomic loads
    /// when nothing waits.
    #[inline]
    pub(super) fn settle_graph_releases(&self) {
        if self.graphs.releases_pending() {
            self.settle_graph_releases_slow();
        }
    }

    #[cold]
    fn settle_graph_releases_slow(&self) {
        for id in self.graphs.releases.take() {
            let p = {
                let mut state = lock(&self.graphs.state);
                // An implicit capture ends with its graph; a registered one
                // (no origin) ended when its scope went.
                if let Some(i) = state.captures.iter().position(|c| c.pool.id == id && c.origin.is_some()) {
                    state.captures.swap_remove(i);
                    self.graphs.implicit.fetch_sub(1, Ordering::AcqRel);
                    cuda::count_capture(false);
                }
                state.pools.iter().find(|p| p.id == id).cloned()
            };
            if let Some(p) = p {
                if p.implicit {
                    p.capturing.store(false, Ordering::Release);
                }
                if p.handles.fetch_sub(1, Ordering::AcqRel) == 1 {
                    self.retire_graph_pool(p);
                }
            }
        }
        if self.graphs.deferred.swap(false, Ordering::AcqRel) {
            self.release_retired_or_log();
        }
    }

    /// Whether a capture cumem routes is under way: a registered one, or
    /// an implicit one (asks the driver about the stream each was first
    /// seen on). Nothing may synchronise streams or the device meanwhile.
    pub(super) fn capture_under_way(&self) -> Result<bool> {
        Ok(self.graphs.active() > 0 || self.implicit_capture_under_way()?)
    }

    /// Whether a capture cumem routes implicitly is still under way.
    fn implicit_capture_under_way(&self) -> Result<bool> {
        if self.graphs.implicit.load(Ordering::Acquire) == 0 {
            return Ok(false);
        }
        let origins: Vec<(u64, Stream)> = lock(&self.graphs.state)
            .captures
            .iter()
            .filter_map(|c| c.origin.as_ref().map(|s| (c.id, s.clone())))
            .collect();
        for (id, s) in origins {
            match cuda::capture_of(&s) {
                Ok(Some(now)) if now == id => return Ok(true),
                Ok(_) => {}
                // An invalidated capture is still under way until it ends.
                Err(Error::Capture(_)) => return Ok(true),
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }

    /// A new graph-private pool, made as implicit captures' pools are.
    ///
    /// # Errors
    /// Errors making the pool's upstream.
    pub(crate) fn graph_pool(&self) -> Result<GraphPool<'_>> {
        let make =
            self.graphs.make_pool.as_ref().ok_or(Error::InvalidState("this device makes no graph pools".into()))?;
        Ok(self.new_graph_pool(make()?))
    }

    /// A new private pool over `pool` (its own upstream; no thread caches,
    /// `keep_chunks` set).
    pub(crate) fn new_graph_pool(&self, pool: Pool<Box<dyn Upstream>>) -> GraphPool<'_> {
        debug_assert!(pool.config().keep_chunks && !pool.config().thread_cache);
        let inner = Arc::new(PrivatePool {
            id: next_pool_id(),
            implicit: false,
            pool,
            streams: StreamRegistry::default(),
            handles: AtomicUsize::new(1),
            untied: AtomicBool::new(false),
            capturing: AtomicBool::new(false),
            tagged_outside: AtomicBool::new(false),
            held: Mutex::new(Vec::new()),
        });
        lock(&self.graphs.state).pools.push(inner.clone());
        self.graphs.pools.fetch_add(1, Ordering::AcqRel);
        GraphPool { device: self, inner }
    }

    /// Routes the capture `stream` takes part in into `pool` from now on.
    /// Blocks freed into the pool on other streams since its last capture
    /// are first waited for (those streams must not capture).
    ///
    /// # Errors
    /// [`Error::Capture`] when the stream does not capture, the pool already
    /// has a capture, or blocks of the pool wait on a capturing stream; a
    /// driver error.
    pub(crate) fn register_capture(&self, stream: &Stream, pool: &GraphPool<'_>) -> Result<u64> {
        let p = &pool.inner;
        let (id, graph) =
            cuda::capture_info(stream)?.ok_or_else(|| Error::Capture("the stream does not capture".into()))?;
        if self.graphs.routed(id).is_some() {
            return Err(Error::Capture(
                "the capture already has a private pool of its own (a cumem call on it came before capture_into); \
                 register it right after beginning it"
                    .into(),
            ));
        }
        if p.capturing.swap(true, Ordering::AcqRel) {
            return Err(Error::Capture(format!("graph pool {} already has a capture under way", p.id)));
        }
        if let Err(e) = self.settle_outside_frees(p) {
            p.capturing.store(false, Ordering::Release);
            return Err(e);
        }
        // The graph holds a handle of the pool until the driver destroys it
        // and every executable of it, after their launches.
        p.handles.fetch_add(1, Ordering::AcqRel);
        let tied = !matches!(graph, cuda::CaptureGraph::Unknown)
            && cuda::tie_to_graph(&graph, &self.graphs.releases, p.id).is_ok();
        if !tied {
            // Nothing will post the pool: its release waits for the device.
            p.handles.fetch_sub(1, Ordering::AcqRel);
            p.untied.store(true, Ordering::Release);
        }
        lock(&self.graphs.state).captures.push(Capture { id, pool: p.clone(), origin: None });
        self.graphs.active.fetch_add(1, Ordering::AcqRel);
        cuda::count_capture(true);
        Ok(id)
    }

    /// Waits for the streams that freed into `p` uncaptured; clears the tags.
    fn settle_outside_frees(&self, p: &PrivatePool) -> Result<()> {
        if !p.tagged_outside.load(Ordering::Acquire) {
            return Ok(());
        }
        for s in p.streams.streams() {
            if cuda::capture_of(&s)?.is_some() {
                return Err(Error::Capture(
                    "blocks of the graph pool were freed on a stream that now captures; synchronize it before the \
                     capture begins"
                        .into(),
                ));
            }
            let _relaxed = RelaxedCaptureMode::enter();
            s.synchronize()?;
        }
        p.streams.clear();
        p.pool.clear_tags();
        p.tagged_outside.store(false, Ordering::Release);
        Ok(())
    }

    /// Ends the routing of capture `id`: the pool's blocks freed during the
    /// capture lose their tags (later users of the pool replay after this
    /// graph), and pools retired meanwhile are released once no capture is
    /// left.
    pub(crate) fn unregister_capture(&self, id: u64) {
        let p = {
            let mut state = lock(&self.graphs.state);
            let Some(i) = state.captures.iter().position(|c| c.id == id && c.origin.is_none()) else { return };
            state.captures.swap_remove(i).pool
        };
        p.streams.clear();
        p.pool.clear_tags();
        p.capturing.store(false, Ordering::Release);
        self.graphs.active.fetch_sub(1, Ordering::AcqRel);
        cuda::count_capture(false);
        self.release_retired_or_log();
    }

    /// Frees `addr` when a capture routes the free (`Ok(None)`: it is the
    /// device pool's business). Call while [`Graphs::routes_frees`].
    pub(super) fn free_routed(&self, addr: usize, stream: Option<&Stream>) -> Result<Option<usize>> {
        if self.graphs.is_held(addr) {
            return Err(Error::DoubleFree { pool: PoolKind::Device, addr });
        }
        let capture = match stream {
            Some(s) if self.graphs.watching() => self.capture_for(s)?,
            _ => None,
        };
        let Some((_, p)) = capture else { return Ok(None) };
        if p.pool.contains(addr) {
            let tag = p.free_tag(stream, true);
            return Ok(Some(p.pool.deallocate(addr, tag)?.size));
        }
        // A block of the device pool that captured work used: the graph's.
        let size = self.pool.check_live(addr)?;
        self.graphs.hold(&p, Held::Pool { addr, size })?;
        Ok(Some(size))
    }

    /// Frees `addr` into its private pool, uncaptured (`Ok(None)`: none).
    pub(super) fn free_into_private(&self, addr: usize, stream: Option<&Stream>) -> Result<Option<usize>> {
        let Some(p) = self.graphs.pool_containing(addr) else { return Ok(None) };
        let tag = p.free_tag(stream, false);
        let size = p.pool.deallocate(addr, tag)?.size;
        if p.finished() {
            self.retire_graph_pool(p);
        }
        Ok(Some(size))
    }

    /// Keeps a stream-ordered allocation freed during a capture that did
    /// not make it for the capture's pool, and says what the free is.
    pub(super) fn hold_stream_ordered(
        &self,
        addr: usize,
        size: usize,
        mode: DeviceAllocatorMode,
        made_in: u64,
        stream: Option<&Stream>,
    ) -> Result<StreamOrderedFree> {
        let capture = match stream {
            Some(s) if self.graphs.watching() => self.capture_for(s)?,
            _ => None,
        };
        match capture {
            Some((id, p)) if id != made_in => {
                self.graphs.hold(&p, Held::StreamOrdered { addr, size, mode })?;
                Ok(StreamOrderedFree::Held)
            }
            Some(_) => Ok(StreamOrderedFree::InCapture),
            None => Ok(StreamOrderedFree::Eager),
        }
    }

    /// Queues `p` for release (its handles are gone, or its last block was
    /// freed after that) and releases what can be released now.
    pub(super) fn retire_graph_pool(&self, p: Arc<PrivatePool>) {
        {
            let mut state = lock(&self.graphs.state);
            if !state.retired.iter().any(|r| Arc::ptr_eq(r, &p)) {
                state.retired.push(p);
            }
        }
        self.release_retired_or_log();
    }

    fn release_retired_or_log(&self) {
        if let Err(e) = self.release_retired() {
            eprintln!("cumem: releasing a graph pool's memory on device {} failed: {e}", self.ordinal());
        }
    }

    /// Releases retired pools: waits for the device (their graphs' work may
    /// still run), frees their held blocks, gives their free chunks back;
    /// a pool whose blocks are all free is dropped. Does nothing while a
    /// routed capture is under way (the last one to end comes back here).
    pub(super) fn release_retired(&self) -> Result<()> {
        // Pools tied to their graphs: the driver ran the graphs' destructors
        // after the graphs' work, so they go back at once. A pool with a
        // capture that could not be tied waits for the device, which must
        // not be synchronised while a capture is under way.
        let (tied, untied): (Vec<_>, Vec<_>) = std::mem::take(&mut lock(&self.graphs.state).retired)
            .into_iter()
            .partition(|p| !p.untied.load(Ordering::Acquire));
        let mut retired = tied;
        if !untied.is_empty() {
            // (A driver error asking about a capture counts as "under way".)
            let wait = self.graphs.active() > 0 || self.implicit_capture_under_way().unwrap_or(true);
            let synced = !wait
                && self.context().is_none_or(|ctx| {
                    let _relaxed = RelaxedCaptureMode::enter();
                    ctx.synchronize().is_ok()
                });
            if synced {
                retired.extend(untied);
            } else {
                lock(&self.graphs.state).retired.extend(untied);
                if self.graphs.active() == 0 {
                    // No registered capture ends here: the next call retries.
                    self.graphs.deferred.store(true, Ordering::Release);
                }
            }
        }
        if retired.is_empty() {
            return Ok(());
        }
        let _relaxed = RelaxedCaptureMode::enter();
        let mut first_err = None;
        for p in retired {
            let held = std::mem::take(&mut *lock(&p.held));
            for block in held {
                lock(&self.graphs.state).held.remove(&block.addr());
                self.graphs.held.fetch_sub(1, Ordering::AcqRel);
                if self.exported_outlives_graph(block) {
                    // Its last release frees it (exports.rs).
                    continue;
                }
                let r = match block {
                    Held::Pool { addr, .. } => self.pool.deallocate(addr, StreamTag::NONE).map(|_| ()),
                    Held::StreamOrdered { addr, size, mode } => self.free_stream_ordered_now(addr, size, mode),
                };
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            }
            if !p.untied.load(Ordering::Acquire) && !self.settle_pool_streams(&p, &mut first_err) {
                // A stream that freed into the pool captures: retried later.
                lock(&self.graphs.state).retired.push(p);
                self.graphs.deferred.store(true, Ordering::Release);
                continue;
            }
            p.streams.clear();
            p.pool.clear_tags();
            if let Err(e) = p.pool.release_cached() {
                first_err.get_or_insert(e);
            }
            if p.finished() {
                let mut state = lock(&self.graphs.state);
                if let Some(i) = state.pools.iter().position(|q| Arc::ptr_eq(q, &p)) {
                    state.pools.swap_remove(i);
                    self.graphs.pools.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Waits for the streams that freed blocks into implicit pool `p`
    /// outside its capture (eager users of the graph's outputs); `false`
    /// when one of them captures now (it can't be waited for).
    fn settle_pool_streams(&self, p: &PrivatePool, first_err: &mut Option<Error>) -> bool {
        for s in p.streams.streams() {
            match cuda::capture_of(&s) {
                Ok(None) => {
                    if let Err(e) = s.synchronize() {
                        first_err.get_or_insert(e);
                    }
                }
                _ => return false,
            }
        }
        true
    }

    /// Figures of the device's private pools.
    pub(super) fn graphs_stats(&self) -> GraphStats {
        self.graphs.stats()
    }
}
