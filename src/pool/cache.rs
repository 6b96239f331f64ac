//! Per-thread caches of freed blocks in front of a [`Pool`](super::Pool).
//!
//! # Implementation details
//!
//! With [`PoolConfig::thread_cache`](super::PoolConfig::thread_cache) on,
//! requests of up to [`MAX_CACHED_BLOCK`] bytes (alignment at most 256) are
//! rounded up to a *size class*: exact 256 B steps up to 4 KiB, then 16
//! classes per doubling (at most 6.25 % more than the 256 B rounding). Each
//! thread has, per pool, a [`ThreadCache`]:
//!
//! ```text
//!  ThreadCaches (one per pool)            ThreadCache (one per thread and pool)
//!  +-----------------------------+        +--------------------------------+
//!  | registry: [Arc<ThreadCache>]| -----> | SpinLock<Local>                |
//!  | lent: 16 shards             |        |   live: addr -> size, requests |
//!  |   addr -> Arc<ThreadCache>  | -----> |   bins[class]: cached blocks   |
//!  | pool: Arc<SpinLock<Inner>>     |        |   delta: stats correction      |
//!  +-----------------------------+        +--------------------------------+
//! ```
//!
//! A block a thread takes from the shared pool for a class is *lent* to
//! that thread's cache (its *owner*) until the cache gives it back. A lent
//! block is, under the owner's lock, either *live* (in `live`, held by the
//! user) or *cached* (in one bin), never both, never in two bins: a free
//! moves it from `live` to a bin only when `live.remove` found it, so a
//! double free can't cache a block twice.
//!
//! - Hot path: allocate pops the class's bin, free pushes; both under the
//!   owner's own lock, uncontended unless another thread frees one of its
//!   blocks or drains it. No shared lock, no shared cache line.
//! - A free on another thread finds the owner in `lent` and frees into the
//!   owner's cache (the owner reuses it, or it is flushed).
//! - A bin over [`BIN_MAX`] blocks, or a cache over its byte budget, flushes
//!   its oldest blocks (largest classes first for the budget) to the pool.
//! - Every [`LOOK_EVERY`] frees into a cache, each bin gives three quarters
//!   of the blocks it held throughout since the last look (its low-water
//!   mark: the oldest blocks, which no hit took) back to the pool, so a
//!   cache holds about what its thread reuses, not a whole budget of
//!   sizes it no longer asks for, which other threads could use.
//! - A thread's exit flushes its cache (a thread-local destructor); its live
//!   blocks stay lent to the dead cache, and go back to the pool when freed.
//! - Before the pool grows, the growing thread's cache is flushed and the
//!   pool tried again; an allocation that would fail drains every cache.
//! - `release_cached`, `shutdown` and the pool's drop drain every cache in
//!   the registry; shutdown also closes them (nothing is cached after it).
//! - A miss above 4 KiB may take a block of one of the next two classes
//!   (at most 12.5 % larger) before it goes to the pool.
//! - A cached block keeps the stream tag it was freed with. A request on
//!   stream S takes only blocks tagged `NONE` or S (work on S is ordered
//!   after S's earlier work, so neither needs waiting); a request with no
//!   stream takes only `NONE` blocks. Blocks go back to the pool with
//!   their tags, so the pool orders their reuse as any other block's.
//! - Started by contention
//!   ([`PoolConfig::cache_when_contended`](super::PoolConfig::cache_when_contended),
//!   the device pools' default): the caches exist but serve nothing until
//!   allocations wait for the pool's lock [`WAITS_TO_SERVE`] times within
//!   [`WAIT_WINDOW_MS`]; from then on they serve, and never stop (so a
//!   free that sees them not serving knows no block was ever lent, and
//!   goes straight to the pool). One thread, or threads that take turns,
//!   keep one exact best fit with nothing parked per thread.
//! - Exact mode ([`PoolConfig::cache_exact`](super::PoolConfig::cache_exact),
//!   the device pools' default): nothing is rounded to a class; a bin holds
//!   blocks of any size of its class and a hit needs the exact size, so the
//!   caches add no fragmentation of their own.
//!
//! Lock order: registry → a cache → the pool → a `lent` shard. No lock is
//! taken while a later one in that order is held, so there is no deadlock.
//!
//! What the caches change about best fit: everything that reaches the
//! shared pool is still an exact best fit (of the class size). A cache hit
//! returns the most recently cached block of the request's class (or of a
//! class up to two steps larger) instead,
//! and cached blocks count as used in the shared pool, so memory parked in
//! one thread's cache is not available to another until flushed (an
//! allocation that would fail drains every cache and retries first).

use std::cell::RefCell;
use std::ptr::NonNull;

use crossbeam::utils::CachePadded;

pub use super::classes::MAX_CACHED_BLOCK;
use super::classes::{class_of, AddrMap, CLASSES, EXACT_LIMIT};
use super::spin::SpinLock;
use super::{Allocation, Freed, Inner, PoolStats};
use crate::tag::StreamTag;
use bins::{CachedBlock, Delta, LiveEntry, Local};
use start::Start;
pub use start::{WAITS_TO_SERVE, WAIT_WINDOW_MS};

mod bins;
mod start;
use crate::sync::{lock, Arc, Mutex};

/// Blocks one bin holds before its older half is flushed.
pub const BIN_MAX: usize = 32;
/// Frees into a cache between two looks at which blocks no hit took.
pub const LOOK_EVERY: u32 = 256;
const LENT_SHARDS: usize = 16;
/// Larger classes a miss may take a cached block from.
const NEIGHBOURS: usize = 2;
/// [`LiveEntry::bin`] of a block too large for its cache's budget.
const NO_BIN: u32 = u32::MAX;

/// One shard of the map from lent block to owner cache.
type LentShard = CachePadded<Mutex<AddrMap<Arc<ThreadCache>>>>;

/// One thread's cache for one pool.
pub(super) struct ThreadCache {
    shared: Arc<ThreadCaches>,
    local: SpinLock<Local>,
}

/// What [`ThreadCaches::deallocate`] did with a free.
#[derive(Debug)]
pub(super) enum CacheFree {
    /// The block went into a cache.
    Cached(Freed),
    /// The block was lent and is no longer; the pool must free it (with the
    /// caller's tag) and report `Freed`.
    Return(Freed),
    /// A lent block that is not live: freed twice.
    DoubleFree,
    /// Not a lent block: the pool decides.
    NotLent,
}

/// The per-thread caches of one pool.
pub(super) struct ThreadCaches {
    pool: Arc<SpinLock<Inner>>,
    max_bytes: usize,
    /// Hits need the exact (256 B-rounded) size; no class rounding.
    exact: bool,
    registry: Mutex<Registry>,
    /// Figures of caches dropped from the registry.
    retired: Mutex<Delta>,
    lent: Box<[LentShard]>,
    /// When the caches serve, and how much each parks (`start.rs`).
    start: Start,
}

#[derive(Default)]
struct Registry {
    caches: Vec<Arc<ThreadCache>>,
    /// Set by shutdown: no new caches.
    closed: bool,
}

/// This thread's caches, one per pool it used.
struct LocalCaches(Vec<Arc<ThreadCache>>);

impl Drop for LocalCaches {
    fn drop(&mut self) {
        for tc in self.0.drain(..) {
            tc.retire();
        }
    }
}

/// Flushes the calling thread's caches, of every pool, back to their pools
/// and stops using them, as the thread's exit does. Later allocations on
/// this thread start new caches.
///
/// Threads that stay alive but stop allocating can call it to hand their
/// cached blocks back early. (Under loom, where thread-local destructors
/// can't use loom objects, models call it before a thread ends.)
pub fn release_thread_caches() {
    let caches = CACHES
        .try_with(|cell| cell.try_borrow_mut().map(|mut c| std::mem::take(&mut c.0)).unwrap_or_default())
        .unwrap_or_default();
    for tc in caches {
        tc.retire();
    }
}

#[cfg(not(loom))]
std::thread_local! {
    static CACHES: RefCell<LocalCaches> = const { RefCell::new(LocalCaches(Vec::new())) };
}

#[cfg(loom)]
loom::thread_local! {
    static CACHES: RefCell<LocalCaches> = RefCell::new(LocalCaches(Vec::new()));
}

fn lent_shard(addr: usize) -> usize {
    (((addr >> 8) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % LENT_SHARDS
}

impl ThreadCaches {
    /// Caches in front of the pool state `pool`, each holding at most
    /// `max_bytes`; serving from the start, or (`when_contended`) once the
    /// pool's lock is contended.
    pub(super) fn new(pool: Arc<SpinLock<Inner>>, max_bytes: usize, exact: bool, when_contended: bool) -> Arc<Self> {
        Arc::new(ThreadCaches {
            pool,
            max_bytes,
            exact,
            registry: Mutex::new(Registry::default()),
            retired: Mutex::new(Delta::default()),
            lent: (0..LENT_SHARDS).map(|_| CachePadded::new(Mutex::new(AddrMap::default()))).collect(),
            start: Start::new(when_contended),
        })
    }

    /// This thread's cache for this pool, created on first use; `None`
    /// while thread-locals are being torn down. The thread-local holds an
    /// `Arc` to the cache, so the pointer stays valid until this thread
    /// calls [`release_thread_caches`] or exits.
    ///
    /// The hot paths use this rather than [`with_local`](Self::with_local):
    /// results returned through the closure cost a store-forwarding stall.
    #[inline]
    fn local(this: &Arc<Self>) -> Option<NonNull<ThreadCache>> {
        CACHES
            .try_with(|cell| {
                {
                    let caches = cell.try_borrow().ok()?;
                    if let Some(tc) = caches.0.iter().find(|tc| Arc::ptr_eq(&tc.shared, this)) {
                        return Some(NonNull::from(&**tc));
                    }
                }
                Self::register_local(this, cell).map(|tc| NonNull::from(&*tc))
            })
            .ok()
            .flatten()
    }

    /// Runs `f` on this thread's cache for this pool, creating it first.
    /// `None` while thread-locals are being torn down.
    fn with_local<R>(this: &Arc<Self>, f: impl FnOnce(&Arc<ThreadCache>) -> R) -> Option<R> {
        CACHES
            .try_with(|cell| {
                {
                    let caches = cell.try_borrow().ok()?;
                    if let Some(tc) = caches.0.iter().find(|tc| Arc::ptr_eq(&tc.shared, this)) {
                        return Some(f(tc));
                    }
                }
                let tc = Self::register_local(this, cell)?;
                Some(f(&tc))
            })
            .ok()
            .flatten()
    }

    /// Creates this thread's cache for this pool and keeps it in `cell`.
    #[cold]
    fn register_local(this: &Arc<Self>, cell: &RefCell<LocalCaches>) -> Option<Arc<ThreadCache>> {
        let tc = Self::register(this)?;
        let mut caches = cell.try_borrow_mut().ok()?;
        // Forget caches of pools that shut down or were dropped.
        caches.0.retain(|c| !c.local.lock().closed);
        caches.0.push(tc.clone());
        Some(tc)
    }

    fn register(this: &Arc<Self>) -> Option<Arc<ThreadCache>> {
        let local =
            Local { bins: (0..CLASSES).map(|_| Vec::new()).collect(), low: vec![0; CLASSES], ..Local::default() };
        let tc = Arc::new(ThreadCache { shared: this.clone(), local: SpinLock::new(local) });
        let mut reg = lock(&this.registry);
        if reg.closed {
            return None;
        }
        reg.caches.push(tc.clone());
        this.start.cache_opened();
        Some(tc)
    }

    /// Whether hits need the exact size (no class rounding).
    pub(super) fn exact(&self) -> bool {
        self.exact
    }

    /// Serves a request of class `class` (`size` bytes: the class size, or
    /// the exact rounded size with [`exact`](Self::exact)) for work on
    /// stream `want` (0: none) from this thread's cache.
    #[inline]
    pub(super) fn allocate(
        this: &Arc<Self>,
        class: usize,
        size: usize,
        requested: usize,
        want: u64,
    ) -> Option<Allocation> {
        let tc = Self::local(this)?;
        // SAFETY: `local` hands out a cache the thread-local keeps alive
        // until this thread releases it, which nothing below does.
        let tc = unsafe { tc.as_ref() };
        {
            let mut l = tc.local.lock();
            let b = match l.pop(class, size, want, this.exact) {
                Some(b) => b,
                None if this.exact => return None,
                None => l.pop_larger(class, want)?,
            };
            l.cached_bytes -= b.size;
            l.delta.add(Delta {
                in_use: b.size as isize,
                requested: requested as isize,
                live: 1,
                allocations: 1,
                frees: 0,
            });
            let e = LiveEntry::new(b.size, b.bin, requested, b.pool_requested);
            l.live.insert(b.addr, e);
            Some(Allocation { addr: b.addr, size: b.size, tag: b.tag })
        }
    }

    /// Lends `a`, just allocated from the pool for `requested` bytes, to
    /// this thread's cache. Returns `false` (the block stays a plain pool
    /// block) when the caches are closed.
    pub(super) fn lend(this: &Arc<Self>, a: &Allocation, requested: usize) -> bool {
        Self::with_local(this, |tc| {
            let mut l = tc.local.lock();
            if l.closed {
                return false;
            }
            // A block larger than half the budget is lent (so that frees
            // find it) but never cached. Class bins hold blocks of the
            // class's size only; exact bins any size of their class.
            let bin = match class_of(a.size) {
                Some((c, size)) if (this.exact || size == a.size) && a.size <= this.max_bytes / 2 => c as u32,
                _ => NO_BIN,
            };
            l.live.insert(a.addr, LiveEntry::new(a.size, bin, requested, requested));
            lock(&this.lent[lent_shard(a.addr)]).insert(a.addr, tc.clone());
            true
        })
        .unwrap_or(false)
    }

    fn owner(&self, addr: usize) -> Option<Arc<ThreadCache>> {
        lock(&self.lent[lent_shard(addr)]).get(&addr).cloned()
    }

    /// Frees `addr` into a cache when it is a lent block.
    #[inline]
    pub(super) fn deallocate(this: &Arc<Self>, addr: usize, tag: StreamTag) -> CacheFree {
        // Most frees happen on the thread that allocated.
        if let Some(tc) = Self::local(this) {
            // SAFETY: as in `allocate`.
            let tc = unsafe { tc.as_ref() };
            let mut l = tc.local.lock();
            if let Some(e) = l.live.remove(&addr) {
                return this.free_into(&mut l, addr, e, tag);
            }
        }
        this.deallocate_remote(addr, tag)
    }

    /// Frees `addr`, not live in this thread's cache, into its owner's.
    #[cold]
    fn deallocate_remote(&self, addr: usize, tag: StreamTag) -> CacheFree {
        let Some(owner) = self.owner(addr) else {
            return CacheFree::NotLent;
        };
        let mut l = owner.local.lock();
        match l.live.remove(&addr) {
            Some(e) => self.free_into(&mut l, addr, e, tag),
            None => CacheFree::DoubleFree,
        }
    }

    /// Under the owner's lock `l`: parks the live block `e` in a bin, or
    /// unlends it when it can't be cached.
    #[inline]
    fn free_into(&self, l: &mut Local, addr: usize, e: LiveEntry, tag: StreamTag) -> CacheFree {
        let freed = Freed { size: e.size(), requested: e.requested as usize };
        if tag == StreamTag::MIXED || l.closed || l.dead || e.bin == NO_BIN {
            return self.give_back(l, addr, e, freed);
        }
        let class = e.bin as usize;
        l.delta.add(Delta {
            in_use: -(e.size() as isize),
            requested: -(e.requested as isize),
            live: -1,
            allocations: 0,
            frees: 1,
        });
        l.cached_bytes += e.size();
        l.bins[class].push(CachedBlock {
            addr,
            size: e.size(),
            bin: e.bin,
            pool_requested: e.pool_requested as usize,
            tag,
        });
        l.frees_since_look += 1;
        if l.bins[class].len() > BIN_MAX || l.cached_bytes > self.budget() || l.frees_since_look >= LOOK_EVERY {
            self.trim(l, class);
        }
        CacheFree::Cached(freed)
    }

    /// Under the owner's lock: unlends the uncacheable live block `e` (freed).
    #[cold]
    fn give_back(&self, l: &mut Local, addr: usize, e: LiveEntry, freed: Freed) -> CacheFree {
        lock(&self.lent[lent_shard(addr)]).remove(&addr);
        l.delta.requested += e.pool_requested as isize - e.requested as isize;
        CacheFree::Return(freed)
    }

    /// Under the owner's lock: flushes the older half of a full bin, the
    /// largest classes while the cache is over its budget, and every
    /// [`LOOK_EVERY`] frees most of what no hit took since the last look.
    #[cold]
    fn trim(&self, l: &mut Local, class: usize) {
        let mut out = Vec::new();
        if l.frees_since_look >= LOOK_EVERY {
            l.collect(&mut out);
        }
        if l.bins[class].len() > BIN_MAX {
            l.take_oldest(class, BIN_MAX / 2, &mut out);
        }
        let budget = self.budget();
        if l.cached_bytes > budget {
            l.take((0..CLASSES).rev(), budget / 4 * 3, &mut out);
        }
        self.flush(&out);
    }

    /// Gives blocks taken out of a cache (statistics already corrected) back
    /// to the pool. The owner's own flushes hold its cache's lock; a drain
    /// of every cache flushes with it dropped (`drain_all`).
    fn flush(&self, blocks: &[CachedBlock]) {
        if blocks.is_empty() {
            return;
        }
        let mut inner = self.pool.lock();
        for b in blocks {
            // Under the pool lock: nobody lends it anew before its entry goes.
            lock(&self.lent[lent_shard(b.addr)]).remove(&b.addr);
            let r = inner.fit.free(b.addr, b.tag);
            debug_assert!(r.is_ok(), "a cached block was not live in the pool: {r:?}");
        }
    }

    /// Makes the lent block at `addr` a plain pool block before it is
    /// resized in place; `false` if it is parked in a cache (not the
    /// caller's to resize).
    pub(super) fn unlend(&self, addr: usize) -> bool {
        let Some(owner) = self.owner(addr) else {
            return true;
        };
        let mut l = owner.local.lock();
        let Some(e) = l.live.remove(&addr) else {
            return false;
        };
        lock(&self.lent[lent_shard(addr)]).remove(&addr);
        l.delta.requested += e.pool_requested as isize - e.requested as isize;
        self.pool.lock().fit.set_requested(addr, e.requested as usize);
        true
    }

    /// What the user asked for the lent block at `addr`: `Some(None)` if it
    /// is cached (not the user's), `None` if it is not lent.
    pub(super) fn lent_requested(&self, addr: usize) -> Option<Option<usize>> {
        let owner = self.owner(addr)?;
        let l = owner.local.lock();
        Some(l.live.get(&addr).map(|e| e.requested as usize))
    }

    /// The size of the lent block at `addr`: `Some(None)` if it is cached
    /// (not the user's), `None` if it is not lent.
    pub(super) fn lent_size(&self, addr: usize) -> Option<Option<usize>> {
        let owner = self.owner(addr)?;
        let l = owner.local.lock();
        Some(l.live.get(&addr).map(LiveEntry::size))
    }

    /// Flushes every cache to the pool; with `close`, caches take nothing
    /// from then on. Returns the bytes flushed.
    pub(super) fn drain_all(&self, close: bool) -> usize {
        let caches: Vec<Arc<ThreadCache>> = {
            let mut reg = lock(&self.registry);
            reg.closed |= close;
            reg.caches.clone()
        };
        let mut drained = 0;
        let mut out = Vec::new();
        for tc in &caches {
            out.clear();
            {
                let mut l = tc.local.lock();
                l.closed |= close;
                drained += l.cached_bytes;
                l.take(0..CLASSES, 0, &mut out);
            }
            // Flushed with the cache's lock dropped: its owner allocates
            // and frees meanwhile instead of waiting for the pool's lock
            // (16 threads draining each other's caches spent a tenth of
            // their time yielding). The blocks are in neither place
            // until then: a free of one is a double free either way (it
            // is not live in the cache), and only statistics read in
            // between see them missing.
            self.flush(&out);
        }
        self.prune();
        drained
    }

    /// Flushes the calling thread's cache to the pool. Other threads'
    /// caches are left alone (they may be busy).
    pub(super) fn drain_local(this: &Arc<Self>) {
        Self::with_local(this, |tc| {
            let mut l = tc.local.lock();
            let mut out = Vec::new();
            l.take(0..CLASSES, 0, &mut out);
            this.flush(&out);
        });
    }

    /// Drops caches of exited threads that hold no live block.
    fn prune(&self) {
        let mut reg = lock(&self.registry);
        let mut retired = lock(&self.retired);
        reg.caches.retain(|tc| {
            let l = tc.local.lock();
            let gone = l.dead && l.live.is_empty();
            if gone {
                retired.add(l.delta);
            }
            !gone
        });
    }

    /// Every block parked in a cache as `(addr, tag)`, sorted by address
    /// (for snapshots). Vectors are sized with each cache's lock dropped
    /// and filled under it, retrying if the cache grew meanwhile.
    pub(super) fn cached_blocks(&self) -> Vec<(usize, StreamTag)> {
        let caches: Vec<Arc<ThreadCache>> = lock(&self.registry).caches.clone();
        let mut all = Vec::new();
        for tc in &caches {
            loop {
                let n = tc.local.lock().bins.iter().map(Vec::len).sum::<usize>();
                all.reserve(n + 16);
                let l = tc.local.lock();
                if l.bins.iter().map(Vec::len).sum::<usize>() <= all.capacity() - all.len() {
                    all.extend(l.bins.iter().flatten().map(|b| (b.addr, b.tag)));
                    break;
                }
            }
        }
        all.sort_unstable();
        all
    }

    /// Corrects the shared pool's statistics `s` for what the caches hold.
    pub(super) fn adjust(&self, s: &mut PoolStats) {
        let mut d = *lock(&self.retired);
        let caches: Vec<Arc<ThreadCache>> = lock(&self.registry).caches.clone();
        for tc in &caches {
            let l = tc.local.lock();
            d.add(l.delta);
            s.cached += l.cached_bytes;
        }
        s.in_use = s.in_use.wrapping_add_signed(d.in_use);
        s.requested = s.requested.wrapping_add_signed(d.requested);
        s.live_blocks = s.live_blocks.wrapping_add_signed(d.live);
        s.allocations = s.allocations.wrapping_add_signed(d.allocations);
        s.frees = s.frees.wrapping_add_signed(d.frees);
    }

    /// Drains and closes every cache and forgets them (the pool is going
    /// away; this also breaks the reference cycle registry → cache → here).
    pub(super) fn detach(&self) {
        self.drain_all(true);
        lock(&self.registry).caches.clear();
        for shard in self.lent.iter() {
            lock(shard).clear();
        }
    }
}

impl ThreadCache {
    /// The owning thread is exiting: flush, and cache nothing more.
    fn retire(&self) {
        {
            let mut l = self.local.lock();
            l.dead = true;
            self.shared.start.cache_closed();
            let mut out = Vec::new();
            l.take(0..CLASSES, 0, &mut out);
            self.shared.flush(&out);
        }
        self.shared.prune();
    }
}
