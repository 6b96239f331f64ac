//! Per-thread shards: several best-fit [`Pool`]s side by side, each with
//! its own lock and its own upstream, so threads that allocate at the same
//! time rarely meet on one lock.
//!
//! # Implementation details
//!
//! - **Which shard serves a request.** A thread's first allocation from
//!   a set claims a shard (`shard_registry.rs`): one that is made and has
//!   no thread (so its memory is reused), else a new one, else the one with
//!   the fewest threads. A thread's exit hands its shard back with the
//!   memory it caches, so the number of shards is bounded by the set's
//!   count (by default the processors), never by the threads ever made.
//!   Shard 0 is made with the set; the others are made on first claim from
//!   the upstream factory. One thread alone always uses one shard, so a
//!   single-threaded program sees exactly one pool.
//!   (Tests and models may pin a thread to a shard by slot with
//!   [`set_thread_slot`](crate::pool::set_thread_slot).)
//! - **Worker shards** ([`Shards::with_workers`]; a device's sync pool
//!   with `shared_device_arenas`). Shard 0 remaps pages and is kept for
//!   the set's first thread; `count` *worker* shards stand beside it for
//!   the threads that come later (`shard_registry.rs`). Workers take whole
//!   chunks of one address space they all share
//!   ([`SharedChunks`](crate::upstream::SharedChunks)), so they trade free
//!   chunks as the pinned shards do, with no driver call. Remapping keeps
//!   one thread's repeating layout (a training loop) near its page floor;
//!   a new thread's layout is new, and in a remapping shard that costs
//!   page moves, each a driver call. Without worker shards, every device
//!   shard remaps pages in address space of its own.
//! - **Memory moves between shards.** A shard with no free block for a
//!   request first takes a wholly free chunk of another shard (pools whose
//!   chunks are whole upstream allocations: pinned memory, `cuMemAlloc`
//!   chunks), with no upstream call; the chunk directory records the new
//!   owner before the chunk's blocks are handed out (`shard_upstream.rs`).
//!   When every chunk holds live blocks (all threads busy), another shard
//!   *lends* a block of its free memory: the block stays the lender's
//!   (the directory sends its free there) and skips every thread cache,
//!   so it goes back where it came from. Only memory the request's stream
//!   can use with no wait moves. A chunk moves when it was freed on that
//!   stream (with its tag) or its work is known complete (no tag, or a
//!   host synchronisation saw it). A block is lent only on its own stream
//!   (or, idle, to a request on no stream): a block lent to another
//!   stream comes back tagged with it, and merged with the lender's
//!   pending free space it makes blocks whose reuse waits for every
//!   stream. Only then does the shard grow. Remapping shards trade
//!   otherwise (next item).
//! - **One address space per device** ([`Shards::sharing_space`]: a
//!   device's sync pool). The remapping shards' upstreams are views of
//!   one reservation, so a range of mapped pages can leave one shard and
//!   join another as it is. A shard about to map new memory, while the
//!   set holds more than 102 % of the most pages its blocks touched at
//!   once, takes a mapped free range of whole pieces from an idle shard
//!   (or what a shard in use holds above its budget, and past 110 % what
//!   it holds above the pages its live blocks touch now) with no driver call,
//!   or, failing a range, a block lent out of such memory (`handover.rs`,
//!   [`PoolConfig::hand_over_ranges`]).
//! - **Idle shards.** A shard whose threads all exited keeps its memory
//!   for the next thread to claim it, but gives its free memory to a
//!   shard that grows: before a shard's upstream makes new memory and
//!   the set would then hold more than 120 % of the most memory its
//!   blocks held at once (pages touched, in remapping shards), idle
//!   shards give back free memory (a remapping shard its kept memory and
//!   whole free pieces, a chunk shard its wholly free chunks; only memory
//!   no queued work may use) up to what the grower makes (`reclaim.rs`),
//!   so a resizing thread pool holds less than the sum of what every
//!   shard's threads once needed ([`PoolConfig::idle_shards_give`], off by
//!   default: new threads map again what idle shards gave). With
//!   [`PoolConfig::fresh_thread_budget`] a shard claimed by a new thread
//!   also starts its remap budget afresh, and shards in use give what
//!   they hold above it. Giving unmaps and releases in the giver, and
//!   the taker maps new memory; in one address space ranges change shard
//!   without either (previous item), before idle shards give.
//! - **Where a free goes.** Each shard's upstream is wrapped
//!   (`shard_upstream.rs`) so that every chunk it hands out is recorded in
//!   a directory shared by the set: a sorted array of chunks published
//!   through one atomic pointer. A free finds the owning shard with one
//!   load and a binary search, then frees there; no lock is shared by all
//!   shards, and a cross-thread free costs the same as a local one.
//! - **Streams.** Each shard is a whole [`Pool`]: a block freed on stream A
//!   keeps A's tag, and whoever reuses it orders after A exactly as with one
//!   pool. Threads that each keep their own stream mostly reuse their own
//!   shard's blocks, so reuse stays on the freeing stream.
//! - **Out of memory.** A size limit (`max_size`) holds for all shards
//!   together: every shard's upstream books its chunks against one total.
//!   When a shard's upstream can't deliver, it gives back the free memory
//!   of every other shard and asks once more, before the shard's own
//!   out-of-memory path (releasing its own free chunks) runs.

mod lending;

use super::shard_registry::Registry;
use super::shard_upstream::{ShardPools, Shared, Tracked};
use super::{Allocation, BestFit, Freed, LiveBlock, Pool, PoolConfig, PoolSnapshot, PoolStats};
use crate::error::{Error, Result};
use crate::sync::{thread_slot, Arc, AtomicUsize, InitCell, Mutex, Ordering};
use crate::tag::StreamTag;
use crate::upstream::Upstream;

/// `Shards::base` before the first thread took shard 0.
const NO_BASE: usize = usize::MAX;

/// Makes the upstream of a new shard (called at most once per shard,
/// outside every pool lock).
pub type UpstreamFactory = Box<dyn Fn() -> Result<Box<dyn Upstream>> + Send + Sync>;

/// The most shards a set holds.
pub const MAX_SHARDS: usize = 64;

/// The default shard count: the processors (what can run at once; more
/// threads share shards), at most [`MAX_SHARDS`].
pub fn default_shard_count() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.clamp(1, MAX_SHARDS)
}

/// Several best-fit pools over upstreams of one kind, chosen by the calling
/// thread (see the module docs).
///
/// # Examples
/// ```
/// use cumem::pool::{Shards, PoolConfig, StreamTag};
/// use cumem::upstream::{Host, Upstream};
/// use cumem::PoolKind;
///
/// let make = || Ok(Box::new(Host::new()) as Box<dyn Upstream>);
/// let shards = Shards::new(make()?, Some(Box::new(make)), PoolConfig::new(PoolKind::Standalone), 4);
/// let a = shards.allocate(1000, 256)?;
/// // Any thread may free it: the free finds the shard that owns it.
/// std::thread::scope(|s| s.spawn(|| shards.deallocate(a.addr, StreamTag::NONE)).join().unwrap())?;
/// # Ok::<(), cumem::Error>(())
/// ```
pub struct Shards {
    /// The shards' pools (a boxed slice: the upstream wrappers point at it,
    /// so it never moves; see `shard_upstream.rs`).
    shards: Box<ShardPools>,
    make: Option<UpstreamFactory>,
    config: PoolConfig,
    /// The slot of the first thread that used the set (it gets shard 0).
    base: AtomicUsize,
    /// The directory and the total against the limit.
    shared: Arc<Shared>,
    /// Shards made so far (raised before a new shard hands out a block).
    made: AtomicUsize,
    /// Which threads use which shard.
    registry: Arc<Registry>,
    /// What merges of blocks freed on different streams ask, in every
    /// shard (see [`Pool::set_tag_oracle`]).
    oracle: once_cell::sync::OnceCell<crate::tag::TagOracle>,
    /// What every shard's page moves ask for a fence ([`Pool::set_fence_maker`]).
    fences: once_cell::sync::OnceCell<crate::tag::FenceMaker>,
    /// Held by the one shard of the set that grows through its upstream
    /// at a time (pools that don't remap pages): shards that need memory
    /// meanwhile wait, then look at the new memory before they grow too.
    growing: Mutex<()>,
    /// Per shard, the shard that lent its thread a block last.
    last_lender: Box<[AtomicUsize]>,
}

impl Drop for Shards {
    fn drop(&mut self) {
        // The idle hook borrows the pools (and its `Shared` the registry:
        // removing it also breaks that cycle).
        self.registry.clear_idle();
    }
}

impl std::fmt::Debug for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shards")
            .field("count", &self.shards.len())
            .field("made", &self.made())
            .field("config", &self.config)
            .finish()
    }
}

impl Shards {
    /// A set of `count` shards (at least 1, at most [`MAX_SHARDS`]): shard
    /// 0 over `first`, the others made on first use with `make` (`None`:
    /// one shard only).
    pub fn new(first: Box<dyn Upstream>, make: Option<UpstreamFactory>, config: PoolConfig, count: usize) -> Self {
        Self::build(first, make, config, count, false, false)
    }

    /// As [`new`](Self::new), for shards whose upstreams are views of one
    /// address space (each maps and unmaps anywhere in it, as
    /// [`CudaVmm::view`](crate::upstream::CudaVmm::view) gives): a
    /// remapping shard that would map new memory may then take a mapped
    /// free range of another shard instead, with no driver call
    /// ([`PoolConfig::hand_over_ranges`]; see the module docs).
    pub fn sharing_space(first: Box<dyn Upstream>, make: UpstreamFactory, config: PoolConfig, count: usize) -> Self {
        Self::build(first, Some(make), config, count, false, true)
    }

    /// A set whose shard 0 remaps pages and is kept for the first thread,
    /// with `count` worker shards beside it made with `make` (chunks that
    /// can change shard: see the module docs). Without remapping in shard
    /// 0, or with `count` 1, as [`new`](Self::new).
    pub fn with_workers(first: Box<dyn Upstream>, make: UpstreamFactory, config: PoolConfig, count: usize) -> Self {
        Self::build(first, Some(make), config, count, true, false)
    }

    fn build(
        first: Box<dyn Upstream>,
        make: Option<UpstreamFactory>,
        config: PoolConfig,
        count: usize,
        workers: bool,
        one_space: bool,
    ) -> Self {
        let count = if make.is_some() { count.clamp(1, MAX_SHARDS) } else { 1 };
        let primary_remaps = workers && super::would_remap(&*first, &config) && count > 1;
        let count = count + usize::from(primary_remaps);
        let shards: Box<ShardPools> = (0..count).map(|_| InitCell::new()).collect();
        let registry = Registry::new(count, primary_remaps);
        // Every shard's chunks lie in the first's address space: frees find
        // their shard by granule.
        let space = one_space.then(|| first.address_space().map(|s| (s, first.granularity()))).flatten();
        let shared = Shared::new(&shards, registry.clone(), &config, one_space, space);
        if shared.hand_over && config.trim_idle_shards {
            let set = shared.clone();
            registry.on_idle(Box::new(move || {
                // The exiting thread's cached blocks count as free first.
                super::cache::release_thread_caches();
                // SAFETY: the set's drop removes this hook (waiting for a
                // run in progress) before its pools go.
                unsafe { set.trim_idle() };
            }));
        }
        let pool = Pool::new(Self::track(first, &shared, 0), config.clone());
        if shared.hand_over {
            pool.share_pages(shared.pages.clone(), 0);
        }
        // A new cell is empty, so this always sets it.
        let _ = shards[0].init(|| Ok::<_, ()>(pool));
        Shards {
            shards,
            make,
            config,
            base: AtomicUsize::new(NO_BASE),
            shared,
            made: AtomicUsize::new(1),
            registry,
            growing: Mutex::new(()),
            last_lender: (0..count).map(|_| AtomicUsize::new(0)).collect(),
            oracle: once_cell::sync::OnceCell::new(),
            fences: once_cell::sync::OnceCell::new(),
        }
    }

    fn track(inner: Box<dyn Upstream>, shared: &Arc<Shared>, index: usize) -> Box<dyn Upstream> {
        Box::new(Tracked { inner, shared: shared.clone(), index })
    }

    /// Sets what every shard (made now or later) asks when blocks freed on
    /// different streams merge ([`Pool::set_tag_oracle`]). Only the first
    /// call has an effect.
    pub fn set_tag_oracle(&self, oracle: crate::tag::TagOracle) {
        if self.oracle.set(oracle).is_ok() {
            let o = self.oracle.get().expect("just set");
            self.pools().for_each(|(_, p)| p.set_tag_oracle(o.clone()));
        }
    }

    /// Sets what the set asks before idle shards give memory to a shard
    /// that grows, and what each shard's background mapper asks
    /// ([`StreamPoll`](crate::pool::StreamPoll)): without it, memory
    /// freed on a stream counts as free of queued work only after a host
    /// synchronisation saw it. Only the first call has an effect.
    pub fn set_stream_poll(&self, poll: crate::tag::StreamPoll) {
        if self.shared.poll.set(poll).is_ok() {
            let poll = self.shared.poll.get().expect("just set");
            self.pools().for_each(|(_, p)| p.set_stream_poll(poll.clone()));
        }
    }

    /// Sets what every shard's page moves (made now or later) ask for a
    /// fence on the requesting stream ([`Pool::set_fence_maker`]). Only
    /// the first call has an effect.
    pub fn set_fence_maker(&self, fences: crate::tag::FenceMaker) {
        if self.fences.set(fences).is_ok() {
            let f = self.fences.get().expect("just set");
            self.pools().for_each(|(_, p)| p.set_fence_maker(f.clone()));
        }
    }

    /// How many shards the set may hold.
    pub fn count(&self) -> usize {
        self.shards.len()
    }

    /// How many shards were made so far.
    pub fn made(&self) -> usize {
        self.made.load(Ordering::Acquire)
    }

    /// Shard 0, the one a single thread uses.
    pub fn primary(&self) -> &Pool<Box<dyn Upstream>> {
        self.shards[0].get().expect("shard 0 is made with the set")
    }

    /// The shards made so far, with their indexes.
    pub fn pools(&self) -> impl Iterator<Item = (usize, &Pool<Box<dyn Upstream>>)> {
        self.shards.iter().enumerate().filter_map(|(i, a)| a.get().map(|p| (i, p)))
    }

    /// The configuration every shard shares.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// The index of the shard the calling thread allocates from: the one it
    /// claimed (see the module docs), or by slot for a thread pinned with
    /// [`set_thread_slot`](crate::pool::set_thread_slot).
    #[inline]
    pub fn home(&self) -> usize {
        let n = self.shards.len();
        if n == 1 {
            return 0;
        }
        if crate::sync::thread_pinned() {
            return self.home_by_slot(n);
        }
        // A shard claimed by a new thread starts its remap budget afresh
        // (see the module docs, "Idle shards").
        let rebase = |i: usize| {
            if let Some(p) = self.shards[i].get().filter(|_| self.config.fresh_thread_budget) {
                p.rebase_budget();
            }
        };
        Registry::home(&self.registry, |i| self.shards[i].get().is_some(), rebase)
    }

    /// Threads using shard `i` now (claims; pinned threads are not
    /// counted).
    pub fn threads_on(&self, i: usize) -> usize {
        self.registry.users(i)
    }

    /// In a set of remapping shards that hand ranges over: the bytes of
    /// the pages the shards' live blocks touch now, and the most they
    /// touched at once as looked at (when a shard's own count passed its
    /// own peak, and at trims); `(0, 0)` in other sets.
    pub fn page_floor(&self) -> (usize, usize) {
        if !self.shared.hand_over {
            return (0, 0);
        }
        let page = self.primary().page_size();
        let (now, peak) = self.shared.pages.sample();
        (now * page, peak * page)
    }

    /// Blocks a shard lent out of its free memory to another shard's
    /// thread (no upstream call) so far.
    pub fn blocks_lent(&self) -> u64 {
        self.shared.lent()
    }

    /// Chunks taken by one shard from another (no upstream call) so far.
    pub fn chunks_moved(&self) -> u64 {
        self.shared.moved()
    }

    /// Bytes of free memory shards no thread used gave back for shards
    /// that grew, so far (see the module docs).
    pub fn bytes_reclaimed(&self) -> usize {
        self.shared.reclaimed() as usize
    }

    /// Mapped free ranges one shard handed to another (no driver call)
    /// so far, and their bytes (see the module docs).
    pub fn ranges_handed_over(&self) -> (u64, usize) {
        let bytes = self.shared.handed_bytes.load(Ordering::Relaxed) as usize;
        (self.shared.handed.load(Ordering::Relaxed), bytes)
    }

    /// Asks of a shard about to map new memory for another shard's mapped
    /// memory so far, and the nanoseconds they took in all (see the
    /// module docs).
    pub fn hand_over_asks(&self) -> (u64, u64) {
        (self.shared.asks.load(Ordering::Relaxed), self.shared.ask_ns.load(Ordering::Relaxed))
    }

    /// Calls that reached the upstreams themselves (allocations, growth in
    /// place, mappings) so far; chunks moved between shards are not counted.
    pub fn upstream_calls(&self) -> u64 {
        self.shared.upstream_calls()
    }

    /// The shard of a thread pinned by slot: the first slot to use the set
    /// gets shard 0, the others follow by slot.
    fn home_by_slot(&self, n: usize) -> usize {
        let slot = thread_slot();
        let mut base = self.base.load(Ordering::Relaxed);
        if base == NO_BASE {
            base = match self.base.compare_exchange(NO_BASE, slot, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => slot,
                Err(first) => first,
            };
        }
        slot.wrapping_sub(base) % n
    }

    /// The calling thread's shard and its index, made on first use (shard
    /// 0 when it can't be made).
    #[inline]
    fn home_shard(&self) -> (usize, &Pool<Box<dyn Upstream>>) {
        let i = self.home();
        match self.shards[i].get() {
            Some(p) => (i, p),
            None => self.make_shard(i),
        }
    }

    /// Makes shard `i` (shard 0 when it can't be made).
    #[cold]
    fn make_shard(&self, i: usize) -> (usize, &Pool<Box<dyn Upstream>>) {
        let shard = &self.shards[i];
        let (Some(make), false) = (&self.make, self.primary().is_shut_down()) else { return (0, self.primary()) };
        let made = shard.get_or_init(|| {
            let pool = make().map(|u| Pool::new(Self::track(u, &self.shared, i), self.config.clone()));
            if let (Ok(p), Some(o)) = (&pool, self.oracle.get()) {
                p.set_tag_oracle(o.clone());
            }
            if let (Ok(p), Some(poll)) = (&pool, self.shared.poll.get()) {
                p.set_stream_poll(poll.clone());
            }
            if let (Ok(p), Some(f)) = (&pool, self.fences.get()) {
                p.set_fence_maker(f.clone());
            }
            if let (Ok(p), true) = (&pool, self.shared.hand_over) {
                p.share_pages(self.shared.pages.clone(), i);
            }
            if pool.is_ok() {
                self.made.fetch_add(1, Ordering::AcqRel);
            }
            pool
        });
        match made {
            Ok(p) => (i, p),
            Err(_) => (0, self.primary()),
        }
    }

    /// [`Pool::allocate`] from the calling thread's shard.
    ///
    /// # Errors
    /// As [`Pool::allocate`].
    pub fn allocate(&self, size: usize, align: usize) -> Result<Allocation> {
        self.allocate_for(size, align, 0)
    }

    /// [`Pool::allocate_for`] from the calling thread's shard; when it is
    /// out of memory, the other shards' free memory goes back to the
    /// upstream and the request is tried once more.
    ///
    /// # Errors
    /// As [`Pool::allocate_for`].
    #[inline]
    pub fn allocate_for(&self, size: usize, align: usize, stream: u64) -> Result<Allocation> {
        match self.allocate_quick(size, align, stream) {
            Some(a) => Ok(a),
            None => self.allocate_past_quick(size, align, stream),
        }
    }

    /// [`Pool::allocate_quick`] in the calling thread's shard: the common
    /// case of [`allocate_for`](Self::allocate_for), with no error to carry.
    #[inline(always)]
    pub(crate) fn allocate_quick(&self, size: usize, align: usize, stream: u64) -> Option<Allocation> {
        self.home_shard().1.allocate_quick(size, align, stream)
    }

    /// [`allocate_for`](Self::allocate_for) after
    /// [`allocate_quick`](Self::allocate_quick) gave `None`.
    ///
    /// # Errors
    /// As [`Pool::allocate_for`].
    #[inline(never)]
    pub(crate) fn allocate_past_quick(&self, size: usize, align: usize, stream: u64) -> Result<Allocation> {
        let (i, home) = self.home_shard();
        // Memory moves between shards only where chunks are whole
        // allocations (not page remapping, not kept for graphs, not one
        // growing reservation).
        if self.shards.len() == 1 || home.remaps() || self.config.keep_chunks {
            // Out of memory, the shard's upstream takes the other shards'
            // free memory first (shard_upstream.rs): the result needs no
            // second look here.
            return home.allocate_past_quick(size, align, stream, true)?.ok_or_else(super::allocate::no_growth_miss);
        }
        match home.allocate_past_quick(size, align, stream, false)? {
            Some(a) => Ok(a),
            None => self.allocate_elsewhere(i, home, size, align, stream),
        }
    }

    /// The shard whose chunk holds `addr` (one look-up in the directory).
    #[inline]
    fn owner(&self, addr: usize) -> Option<&Pool<Box<dyn Upstream>>> {
        self.shards.get(self.shared.directory.find(addr)?)?.get()
    }

    fn unknown(&self, addr: usize) -> Error {
        Error::UnknownPointer { pool: self.config.kind, addr }
    }

    /// [`Pool::deallocate`] in the shard that owns the block, whichever
    /// thread calls.
    ///
    /// # Errors
    /// As [`Pool::deallocate`].
    #[inline(always)]
    pub fn deallocate(&self, addr: usize, tag: StreamTag) -> Result<Freed> {
        // One shard (a single thread so far): nothing to look up. A block
        // of a later shard was handed out after the count rose.
        let owner = if self.made.load(Ordering::Acquire) == 1 { Some(self.primary()) } else { self.owner(addr) };
        match owner {
            Some(p) => p.deallocate(addr, tag),
            None => Err(self.unknown(addr)),
        }
    }

    /// [`Pool::check_live`] in the shard that owns the block.
    ///
    /// # Errors
    /// As [`Pool::check_live`].
    pub fn check_live(&self, addr: usize) -> Result<usize> {
        match self.owner(addr) {
            Some(p) => p.check_live(addr),
            None => Err(self.unknown(addr)),
        }
    }

    /// The size of the live block at `addr`, if there is one.
    pub fn block_size(&self, addr: usize) -> Option<usize> {
        self.owner(addr)?.block_size(addr)
    }

    /// The bytes asked for the live block at `addr`, if there is one.
    pub fn requested_size(&self, addr: usize) -> Option<usize> {
        self.owner(addr)?.requested_size(addr)
    }

    /// The pieces of memory mapped over the live block at `addr` (`size`
    /// bytes), as the owning shard's upstream maps them
    /// ([`Upstream::mapped_pieces`]).
    pub fn mapped_pieces(&self, addr: usize, size: usize) -> Option<Vec<crate::upstream::Chunk>> {
        self.owner(addr)?.upstream().mapped_pieces(addr, size)
    }

    /// Whether `addr` lies in one of the shards' chunks.
    pub fn contains(&self, addr: usize) -> bool {
        self.owner(addr).is_some_and(|p| p.contains(addr))
    }

    /// [`Pool::grow_in_place`] in the shard that owns the block.
    pub fn grow_in_place(&self, addr: usize, new_size: usize) -> bool {
        self.owner(addr).is_some_and(|p| p.grow_in_place(addr, new_size))
    }

    /// [`Pool::shrink_in_place`] in the shard that owns the block.
    pub fn shrink_in_place(&self, addr: usize, new_size: usize) -> bool {
        self.owner(addr).is_some_and(|p| p.shrink_in_place(addr, new_size))
    }

    /// Whether any shard allocated yet.
    pub fn used(&self) -> bool {
        self.pools().any(|(_, p)| p.used())
    }

    /// Sets the bytes the first allocation of shard 0 reserves.
    ///
    /// # Errors
    /// [`Error::ConfigTooLate`] once it has allocated.
    pub fn set_initial_size(&self, bytes: usize) -> Result<()> {
        self.primary().set_initial_size(bytes)
    }

    /// [`Pool::release_cached`] of every shard; returns the bytes released.
    ///
    /// # Errors
    /// The first upstream error (every shard is still tried).
    pub fn release_cached(&self) -> Result<usize> {
        let mut released = 0;
        let mut first_err = None;
        for (_, p) in self.pools() {
            match p.release_cached() {
                Ok(b) => released += b,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(released), Err)
    }

    /// The chunk directory's size: entries now, and arrays allocated
    /// (the current one and replaced ones not yet reclaimed).
    pub fn directory_sizes(&self) -> (usize, usize) {
        self.shared.directory.sizes()
    }

    /// [`Pool::clear_tags`] of every shard.
    pub fn clear_tags(&self) {
        self.pools().for_each(|(_, p)| p.clear_tags());
    }

    /// A copy of every shard's chunks and blocks together, in address
    /// order (see [`PoolSnapshot`]); each shard's lock is taken in turn.
    pub fn snapshot(&self) -> PoolSnapshot {
        let mut all = PoolSnapshot::default();
        for (_, p) in self.pools() {
            let s = p.snapshot();
            all.chunks.extend(s.chunks);
            all.blocks.extend(s.blocks);
        }
        all.chunks.sort_by_key(|c| c.addr);
        all.blocks.sort_by_key(|b| b.addr);
        all
    }

    /// The shards' statistics added up (peaks are the sum of each shard's
    /// peak: an upper bound of the set's peak).
    pub fn stats(&self) -> PoolStats {
        let mut total = PoolStats::default();
        self.pools().for_each(|(_, p)| total.accumulate(&p.stats()));
        total
    }

    /// Sets every shard's peaks to their current values.
    pub fn reset_peaks(&self) {
        self.pools().for_each(|(_, p)| p.reset_peaks());
    }

    /// Checks every shard's invariants ([`BestFit::check_invariants`]).
    ///
    /// # Errors
    /// The first broken invariant, naming the shard.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        for (i, p) in self.pools() {
            p.with_fit(BestFit::check_invariants).map_err(|e| format!("shard {i}: {e}"))?;
        }
        Ok(())
    }

    /// Runs `f` on shard 0's allocator under its lock (tests, summaries).
    pub fn with_fit<R>(&self, f: impl FnOnce(&BestFit) -> R) -> R {
        self.primary().with_fit(f)
    }

    /// The upstream of shard 0.
    pub fn upstream(&self) -> &dyn Upstream {
        &**self.primary().upstream()
    }

    /// [`Pool::shutdown`] of every shard; lists the blocks still live.
    /// Shards not made yet stay unmade.
    ///
    /// # Errors
    /// The first upstream error.
    pub fn shutdown(&self) -> Result<Vec<LiveBlock>> {
        let mut live = Vec::new();
        for (_, p) in self.pools() {
            live.extend(p.shutdown()?);
        }
        Ok(live)
    }

    /// Whether [`shutdown`](Shards::shutdown) was called.
    pub fn is_shut_down(&self) -> bool {
        self.primary().is_shut_down()
    }
}
