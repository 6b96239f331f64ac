//! Graph-private pools: memory captured work uses is the graph's until it goes.
//!
//! # Implementation details
//!
//! Work captured into a CUDA graph runs again at every replay, long after
//! the capture returned, so the ordinary pool rule ("a freed block may be
//! reused once the work queued before the free is done") does not hold for
//! it. Each device's allocator therefore keeps, beside its pool:
//!
//! - **Private pools** ([`GraphPool`]). A capture is routed into one: every
//!   allocation on a capturing stream is served from it, and blocks freed
//!   during the capture go back to it. Nothing outside the private pool's
//!   graphs ever gets its memory, so replays can't overwrite anyone else's.
//!   Graphs captured one after another may share a private pool (their
//!   replays must then not overlap, as the graphs reuse each other's
//!   memory); a sequence of graphs then costs the memory of the largest.
//!   A private pool never returns chunks to the driver on its own
//!   ([`PoolConfig::keep_chunks`](crate::pool::PoolConfig::keep_chunks)).
//! - **Held blocks.** A block of the device's own pool (or a stream-ordered
//!   allocation) freed during a capture is used by the captured work, so it
//!   is not freed: the private pool holds it until it is retired.
//! - **Retirement.** Every capture routed into a private pool ties the
//!   pool to the capture's graph with a CUDA user object (graph_object.rs),
//!   which holds one of the pool's handles. When the last handle goes (the
//!   [`GraphPool`], every [`CapturedGraph`](crate::CapturedGraph), and the
//!   driver's destructor of every graph and executable captured into it,
//!   which runs only after their launches completed), the pool frees its
//!   held blocks and gives its free chunks back, after waiting for the
//!   streams that freed its blocks outside a capture. No device-wide wait
//!   is made: `cuCtxSynchronize` would invalidate any capture under way on
//!   the device, cumem's or not. Only a capture the driver does not name
//!   the graph of (drivers before CUDA 12.3) leaves its pool waiting for
//!   the device instead, never while a capture cumem routes is under way.
//!   Blocks still live in a retired pool (a graph's outputs) stay valid;
//!   when the last of them is freed, the pool retires for good.
//!
//! Stream order inside a private pool: a block freed during a capture on
//! stream S and reused on stream T of the same capture gets an event edge
//! (recorded on S, waited on by T: both are legal inside a capture). Those
//! tags are cleared when the capture ends, since later captures into the
//! pool replay after it. Blocks freed into a private pool outside a capture
//! (a graph output freed on a stream) carry their stream's tag until the
//! next capture into the pool begins, which first waits for those streams.
//!
//! **Captures cumem is not told of** (begun with cudarc's
//! `CudaStream::begin_capture`, or any other way) are found by asking the
//! driver, on every allocation and free on a stream, which capture the
//! stream belongs to (`cuStreamGetCaptureInfo`, one call). The first cumem
//! call in such a capture starts an *implicit* private pool for it (and
//! for the streams that join it), routed exactly like a registered one,
//! and ties the pool's life to the capture's graph with a CUDA user object
//! (graph_object.rs): when the graph and all its executables are
//! destroyed, the driver's destructor posts the pool, and the next cumem
//! call on the device releases it (held blocks back to their owners, free
//! chunks back to the driver). The driver runs that destructor only after
//! the executables' launches have completed, so no device-wide wait is
//! needed, and none is made (it could break someone else's capture).
//!
//! Only a program that sets `promise_registered_captures` skips the
//! question outside registered captures: the allocator then checks one
//! counter, and a capture it is not told of shares memory with eager work.

use std::collections::HashSet;
use std::sync::Arc;

use super::mode::DeviceAllocatorMode;
use super::reuse::StreamRegistry;
use crate::cuda::{ReleaseQueue, Stream};
use crate::error::{Error, PoolKind, Result};
use crate::pool::{Pool, PoolStats};
use crate::sync::{lock, AtomicBool, AtomicUsize, Mutex, Ordering};
use crate::tag::StreamTag;
use crate::upstream::Upstream;

/// A block of other memory that captured work freed: the graph keeps it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Held {
    /// A block of the device's own pool.
    Pool { addr: usize, size: usize },
    /// A stream-ordered allocation made outside the capture.
    StreamOrdered { addr: usize, size: usize, mode: DeviceAllocatorMode },
}

impl Held {
    pub(super) fn addr(&self) -> usize {
        match *self {
            Held::Pool { addr, .. } | Held::StreamOrdered { addr, .. } => addr,
        }
    }

    fn size(&self) -> usize {
        match *self {
            Held::Pool { size, .. } | Held::StreamOrdered { size, .. } => size,
        }
    }
}

/// Makes the pool of a new private pool (its own upstream; no thread
/// caches, `keep_chunks` set), for the implicit pools of captures cumem
/// is not told of.
pub(crate) type GraphPoolFactory = Box<dyn Fn() -> Result<Pool<Box<dyn Upstream>>> + Send + Sync>;

/// What a free of a stream-ordered allocation is, as far as graphs go.
pub(super) enum StreamOrderedFree {
    /// Made outside the capture that frees it: the graph keeps it.
    Held,
    /// Made and freed in one capture: a graph free node (`cuMemFreeAsync`).
    InCapture,
    /// No capture: an ordinary `cuMemFreeAsync`.
    Eager,
}

/// A private pool and what belongs to it.
pub(super) struct PrivatePool {
    pub(super) id: u64,
    /// Started for a capture cumem was not told of: its one handle is the
    /// user object on the capture's graph.
    pub(super) implicit: bool,
    pub(super) pool: Pool<Box<dyn Upstream>>,
    /// Streams that freed blocks into `pool` whose tags are still set.
    pub(super) streams: StreamRegistry,
    /// Handles alive ([`GraphPool`] clones, captured graphs, and one per
    /// graph the driver holds a user object of); 0: retired.
    pub(super) handles: AtomicUsize,
    /// A capture into the pool could not be tied to its graph (a driver
    /// that does not name it): its release waits for the whole device.
    pub(super) untied: AtomicBool,
    /// A capture is routed into the pool now.
    pub(super) capturing: AtomicBool,
    /// Blocks were freed into the pool outside a capture since the last began.
    pub(super) tagged_outside: AtomicBool,
    pub(super) held: Mutex<Vec<Held>>,
}

/// A private pool's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Private pools alive (with handles, or with live blocks).
    pub pools: usize,
    /// Bytes the private pools hold from the driver.
    pub reserved: usize,
    /// Bytes in the private pools' live blocks (graph outputs and memory
    /// captured work allocated and did not free).
    pub in_use: usize,
    /// The largest `reserved` the private pools reached.
    pub peak_reserved: usize,
    /// Bytes of other memory that captured work freed and the graphs hold.
    pub held: usize,
}

impl GraphStats {
    pub(super) fn add(&mut self, pool: &PoolStats, held: usize) {
        self.pools += 1;
        self.reserved += pool.reserved;
        self.in_use += pool.in_use;
        self.peak_reserved += pool.peak_reserved;
        self.held += held;
    }
}

/// A capture routed into a private pool.
pub(super) struct Capture {
    /// The driver's capture id (a host queue's own id on the fallback).
    pub(super) id: u64,
    pub(super) pool: Arc<PrivatePool>,
    /// For an implicit capture, the stream cumem first saw it on (to ask
    /// whether it is still under way); `None` for a registered one.
    pub(super) origin: Option<Stream>,
}

#[derive(Default)]
pub(super) struct State {
    /// Captures routed: registered ones until they are unregistered,
    /// implicit ones until their graph is gone.
    pub(super) captures: Vec<Capture>,
    /// Every private pool alive.
    pub(super) pools: Vec<Arc<PrivatePool>>,
    /// Pools whose handles are gone, waiting for the device to be idle.
    pub(super) retired: Vec<Arc<PrivatePool>>,
    /// Addresses of held blocks (a second free of one is a double free).
    pub(super) held: HashSet<usize>,
}

/// One device's private pools and the captures routed into them.
pub(super) struct Graphs {
    /// Registered captures under way.
    pub(super) active: AtomicUsize,
    /// Ask the driver about every call on a stream, not only while a
    /// registered capture is under way (unless the program promised to
    /// register its captures).
    pub(super) detect: bool,
    /// Makes the pools of implicit captures (`None`: they get an error).
    pub(super) make_pool: Option<GraphPoolFactory>,
    /// Implicit captures whose graphs are alive.
    pub(super) implicit: AtomicUsize,
    /// Implicit pools whose graphs are gone, posted by the user objects'
    /// destructors (driver threads) for the next call to release.
    pub(super) releases: crate::sync::Arc<ReleaseQueue>,
    /// Retired registered pools waiting for a capture to end (retried).
    pub(super) deferred: AtomicBool,
    /// Private pools alive: frees the device pool lacks look there while > 0.
    pub(super) pools: AtomicUsize,
    /// Held blocks: frees check them while > 0.
    pub(super) held: AtomicUsize,
    pub(super) state: Mutex<State>,
}

impl Graphs {
    pub(super) fn new(detect: bool, make_pool: Option<GraphPoolFactory>) -> Self {
        Graphs {
            active: AtomicUsize::new(0),
            detect,
            make_pool,
            implicit: AtomicUsize::new(0),
            releases: crate::sync::Arc::new(ReleaseQueue::new()),
            deferred: AtomicBool::new(false),
            pools: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            state: Mutex::default(),
        }
    }

    /// Captures under way.
    pub(super) fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// Whether calls on a stream must ask which capture it belongs to.
    #[inline]
    pub(super) fn watching(&self) -> bool {
        self.detect || self.active() > 0
    }

    /// Whether pools wait to be released (one or two atomic loads).
    #[inline]
    pub(super) fn releases_pending(&self) -> bool {
        self.releases.is_pending() || self.deferred.load(Ordering::Acquire)
    }

    /// Whether frees must be checked against held blocks or routed into a
    /// capture before the device pool sees them.
    #[inline]
    pub(super) fn routes_frees(&self) -> bool {
        self.watching() || self.held.load(Ordering::Acquire) > 0
    }

    /// Whether private pools exist (an unknown pointer may be theirs).
    #[inline]
    pub(super) fn has_pools(&self) -> bool {
        self.pools.load(Ordering::Acquire) > 0
    }

    /// The private pool capture `id` is routed into.
    pub(super) fn routed(&self, id: u64) -> Option<Arc<PrivatePool>> {
        lock(&self.state).captures.iter().find(|c| c.id == id).map(|c| c.pool.clone())
    }

    /// The private pool whose chunks hold `addr`.
    pub(super) fn pool_containing(&self, addr: usize) -> Option<Arc<PrivatePool>> {
        lock(&self.state).pools.iter().find(|p| p.pool.contains(addr)).cloned()
    }

    /// Whether `addr` is a held block.
    #[inline]
    pub(super) fn is_held(&self, addr: usize) -> bool {
        self.held.load(Ordering::Acquire) > 0 && lock(&self.state).held.contains(&addr)
    }

    /// Keeps `block` for pool `p` until it retires.
    ///
    /// # Errors
    /// [`Error::DoubleFree`] when the block is held already.
    pub(super) fn hold(&self, p: &PrivatePool, block: Held) -> Result<()> {
        let mut state = lock(&self.state);
        if !state.held.insert(block.addr()) {
            return Err(Error::DoubleFree { pool: PoolKind::Device, addr: block.addr() });
        }
        lock(&p.held).push(block);
        self.held.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Figures of every private pool.
    pub(super) fn stats(&self) -> GraphStats {
        let pools: Vec<Arc<PrivatePool>> = lock(&self.state).pools.clone();
        let mut s = GraphStats::default();
        for p in pools {
            s.add(&p.pool.stats(), p.held_bytes());
        }
        s
    }
}

impl Drop for Graphs {
    fn drop(&mut self) {
        // The manager goes while graphs it gave implicit pools to may still
        // exist (their destructors have not run): those pools' memory must
        // never go back, so they are leaked on purpose.
        let state = std::mem::take(&mut *lock(&self.state));
        for p in state.pools {
            if p.handles.load(Ordering::Acquire) > 0 {
                std::mem::forget(p);
            }
        }
    }
}

impl PrivatePool {
    pub(super) fn held_bytes(&self) -> usize {
        lock(&self.held).iter().map(Held::size).sum()
    }

    /// The tag of a block freed into this pool on `stream` (`None`: no work).
    pub(super) fn free_tag(&self, stream: Option<&Stream>, in_capture: bool) -> StreamTag {
        match stream {
            Some(s) if !s.is_host() || in_capture => {
                self.streams.register(s);
                if !in_capture {
                    self.tagged_outside.store(true, Ordering::Release);
                }
                s.free_tag()
            }
            _ => StreamTag::NONE,
        }
    }

    /// Whether the last handle is gone and no block is live.
    pub(super) fn finished(&self) -> bool {
        self.handles.load(Ordering::Acquire) == 0 && self.pool.stats().in_use == 0
    }
}
