//! What the shards of one set share through their upstreams: the chunk
//! directory (address → shard), the total held against the set's limit,
//! and the way back to the other shards when one runs out of memory.
//!
//! # Implementation details
//!
//! - **Directory.** A sorted array of `(start, end, shard)`, one entry per
//!   chunk, published through one atomic pointer: a free finds its shard
//!   with one load and a binary search, and takes no lock. Growth (rare)
//!   copies the array under a writers' lock, drops entries the new chunk
//!   overlaps (a range given back and handed out again), inserts, and
//!   publishes; the old copies stay allocated until the set is dropped, so
//!   a reader never sees freed memory (growth by new chunks is geometric
//!   for pinned memory and happens once per shard for expandable ones, so
//!   few copies are ever made). Growing a chunk in place only raises its
//!   entry's end (an atomic), and a chunk moving whole to another shard
//!   only changes its entry's owner (an atomic), with no copy. An entry is
//!   written before the chunk's blocks can be handed out, and whoever
//!   frees a block learned of it after that, so the entry is always found.
//! - **Chunks change hands.** Before a shard grows, the other shards are
//!   asked for a wholly free chunk that is large enough and that the
//!   request's stream can use with no wait (idle, or freed on that
//!   stream: it moves with its tag)
//!   (`Shared::take_free_chunk`, called by `Shards::allocate_elsewhere`;
//!   [`Pool`]'s `give_free_chunk`, under the giver's lock alone): it leaves the giver's pool, the directory records
//!   the taker as its owner, and only then does the taker hand out its
//!   blocks. A free in flight for a block of that chunk can't exist (the
//!   chunk had no live block); a stale free (a double free) finds either
//!   shard and is refused by both. Only upstreams whose chunks are whole
//!   allocations (not expandable reservations) trade chunks, so any
//!   shard's upstream can give a taken chunk back.
//! - **Out of memory.** When a shard's upstream can't deliver (the set's
//!   limit or the driver), the wrapper gives back the free memory of every
//!   other shard ([`Pool::release_cached`]) and asks once more. It runs in
//!   the growing shard's upstream call, outside every pool lock.

use super::Pool;

use crate::error::{Error, OomState, PoolKind, Result};
use crate::sync::{lock, Arc, AtomicU64, AtomicUsize, Mutex, Ordering};
use crate::tag::StreamTag;
use crate::upstream::{Chunk, Upstream};

/// One chunk of the directory.
#[derive(Debug)]
struct Entry {
    start: usize,
    /// Raised when the chunk grows in place.
    end: AtomicUsize,
    /// Changed when the chunk moves to another shard.
    shard: AtomicUsize,
}

/// The directory's current array and every array it replaced (each boxed
/// once more, so the array's own pointer and length sit at an address that
/// never moves and one atomic can publish both).
#[derive(Debug, Default)]
struct Versions {
    // The inner box's address is what `Directory::current` publishes.
    #[allow(clippy::vec_box)]
    all: Vec<Box<Box<[Entry]>>>,
}

/// Address → shard (see the module docs).
#[derive(Debug)]
pub(super) struct Directory {
    /// The current array: the address of the newest of `versions.all`'s
    /// inner boxes (0: none yet).
    current: AtomicUsize,
    versions: Mutex<Versions>,
}

impl Directory {
    fn new() -> Self {
        Directory { current: AtomicUsize::new(0), versions: Mutex::new(Versions::default()) }
    }

    /// The shard whose chunk holds `addr`.
    #[inline]
    pub(super) fn find(&self, addr: usize) -> Option<usize> {
        let ptr = self.current.load(Ordering::Acquire) as *const Box<[Entry]>;
        if ptr.is_null() {
            return None;
        }
        // SAFETY: `ptr` is the address of one of `versions`' inner boxes,
        // published with Release after its array was filled; those boxes
        // are never freed, moved or changed (but for the atomic `end`)
        // while the directory lives, and `&self` keeps it alive.
        let entries: &[Entry] = unsafe { &*ptr };
        let i = entries.partition_point(|e| e.start <= addr);
        let e = entries.get(i.checked_sub(1)?)?;
        (addr < e.end.load(Ordering::Acquire)).then(|| e.shard.load(Ordering::Acquire))
    }

    /// Records that `shard` holds `[start, end)`.
    fn insert(&self, start: usize, end: usize, shard: usize) {
        let mut v = lock(&self.versions);
        if let Some(cur) = v.all.last() {
            let i = cur.partition_point(|e| e.start < start);
            if let Some(e) = cur.get(i).filter(|e| e.start == start) {
                let (old_end, owner) = (e.end.load(Ordering::Acquire), e.shard.load(Ordering::Acquire));
                // A chunk grown in place keeps its start: raise its end.
                if owner == shard && end >= old_end {
                    e.end.fetch_max(end, Ordering::AcqRel);
                    return;
                }
                // A chunk moving to another shard whole: change its owner
                // in place (no new array: chunks move often while threads
                // come and go, and replaced arrays are kept until the set
                // is dropped).
                if end == old_end {
                    e.shard.store(shard, Ordering::Release);
                    return;
                }
            }
        }
        let old = v.all.last().map_or(&[][..], |b| &b[..][..]);
        let mut next: Vec<Entry> = old
            .iter()
            .filter(|e| e.end.load(Ordering::Acquire) <= start || end <= e.start)
            .map(|e| Entry {
                start: e.start,
                end: AtomicUsize::new(e.end.load(Ordering::Acquire)),
                shard: AtomicUsize::new(e.shard.load(Ordering::Acquire)),
            })
            .collect();
        let at = next.partition_point(|e| e.start < start);
        next.insert(at, Entry { start, end: AtomicUsize::new(end), shard: AtomicUsize::new(shard) });
        let next = Box::new(next.into_boxed_slice());
        let ptr = &*next as *const Box<[Entry]> as usize;
        v.all.push(next);
        self.current.store(ptr, Ordering::Release);
    }
}

/// The bytes all shards of a set hold, against the set's limit.
#[derive(Debug)]
struct Total {
    bytes: AtomicUsize,
    limit: Option<usize>,
    kind: PoolKind,
}

impl Total {
    fn book(&self, size: usize) -> Result<()> {
        let before = self.bytes.fetch_add(size, Ordering::AcqRel);
        match self.limit {
            Some(limit) if before + size > limit => {
                self.bytes.fetch_sub(size, Ordering::AcqRel);
                Err(Error::OutOfMemory {
                    pool: self.kind,
                    requested: size,
                    state: Box::new(OomState {
                        limit: Some(limit),
                        upstream: Some(format!("the pool's shards together hold {before} B of the {limit} B limit")),
                        hint: Some("raise max_pool_size, or free blocks you hold"),
                        ..Default::default()
                    }),
                })
            }
            _ => Ok(()),
        }
    }

    fn unbook(&self, size: usize) {
        self.bytes.fetch_sub(size, Ordering::AcqRel);
    }
}

/// The shard pools of a set, as the upstream wrappers reach them.
pub(super) type ShardPools = [crate::sync::InitCell<Pool<Box<dyn Upstream>>>];

/// What the shards of one set share.
pub(super) struct Shared {
    pub(super) directory: Directory,
    total: Total,
    /// Chunks one shard took from another.
    moved: AtomicU64,
    /// Calls that reached the shards' own upstreams (and succeeded).
    calls: AtomicU64,
    /// Blocks a shard lent from its free memory to another shard's thread.
    lent: AtomicU64,
    /// The set's pools (a boxed slice that never moves). Set once, before
    /// any shard is made; read only while an allocation from the set runs.
    pools: *const ShardPools,
}

// SAFETY: `pools` points at the set's boxed slice of pools, which are
// `Sync`; it is only dereferenced while the set is borrowed (see
// `Tracked::release_others`), and everything else is atomics and locks.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// The state for a set whose pools are `pools`, with `limit` for all of
    /// them together.
    pub(super) fn new(pools: &ShardPools, limit: Option<usize>, kind: PoolKind) -> Arc<Self> {
        Arc::new(Shared {
            directory: Directory::new(),
            total: Total { bytes: AtomicUsize::new(0), limit, kind },
            moved: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            lent: AtomicU64::new(0),
            pools: pools as *const ShardPools,
        })
    }

    pub(super) fn moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }

    pub(super) fn upstream_calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn count_call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Blocks one shard lent another out of its own free memory.
    pub(super) fn lent(&self) -> u64 {
        self.lent.load(Ordering::Relaxed)
    }

    pub(super) fn count_lent(&self) {
        self.lent.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes a wholly free chunk of at least `size` bytes that work on
    /// `stream` can use with no wait from a shard other than `taker`,
    /// with the tag that orders its reuse, recorded in the directory as
    /// `taker`'s (see the module docs).
    ///
    /// # Safety
    /// The set that owns the pools must be alive: call it only while an
    /// allocation from the set runs (it borrows the set).
    pub(super) unsafe fn take_free_chunk(&self, taker: usize, size: usize, stream: u64) -> Option<(Chunk, StreamTag)> {
        // SAFETY: the caller borrows the set, which owns the boxed slice
        // `pools` points at.
        let pools = unsafe { &*self.pools };
        let others = pools.iter().enumerate().filter(|(i, _)| *i != taker);
        let (c, tag) = others.filter_map(|(_, cell)| cell.get()).find_map(|p| p.give_free_chunk(size, stream))?;
        // Recorded before the taker's pool holds it, so every block it
        // hands out is found here.
        self.directory.insert(c.addr, c.end(), taker);
        self.moved.fetch_add(1, Ordering::Relaxed);
        Some((c, tag))
    }
}

/// Shard `index`'s upstream: records its chunks in the directory, books
/// them against the limit, and takes the other shards' free memory when
/// its own upstream can't deliver.
pub(super) struct Tracked {
    pub(super) inner: Box<dyn Upstream>,
    pub(super) shared: Arc<Shared>,
    pub(super) index: usize,
}

impl Tracked {
    /// Gives back the free memory of every shard but this one; the bytes
    /// released.
    fn release_others(&self) -> usize {
        // SAFETY: an upstream allocates only for an allocation from its
        // pool, which runs through `&Shards`; the set owns the boxed slice
        // `pools` points at, so it is alive and unmoved for that borrow.
        let pools = unsafe { &*self.shared.pools };
        let others = pools.iter().enumerate().filter(|(i, _)| *i != self.index);
        others.filter_map(|(_, cell)| cell.get()).map(|p| p.release_cached().unwrap_or(0)).sum()
    }

    /// Books `size` bytes against the limit, obtains a chunk with `get`
    /// (allocated, or reserved for remapping) and records it.
    fn try_allocate(&self, size: usize, get: impl Fn(&dyn Upstream, usize) -> Result<Chunk>) -> Result<Chunk> {
        self.shared.total.book(size)?;
        let c = get(&*self.inner, size).inspect_err(|_| self.shared.total.unbook(size))?;
        self.shared.count_call();
        // An upstream may hand out more than asked (geometric growth).
        self.shared.total.bytes.fetch_add(c.size.saturating_sub(size), Ordering::AcqRel);
        self.shared.directory.insert(c.addr, c.end(), self.index);
        Ok(c)
    }

    /// Books `extra` bytes, extends `chunk` in place with `extend` (mapped,
    /// or address space for remapping) and records the longer chunk.
    fn try_extend_once(
        &self,
        chunk: Chunk,
        extra: usize,
        extend: impl Fn(&dyn Upstream, Chunk, usize) -> Result<bool>,
    ) -> Result<bool> {
        self.shared.total.book(extra)?;
        let ok = extend(&*self.inner, chunk, extra).inspect_err(|_| self.shared.total.unbook(extra))?;
        if ok {
            self.shared.count_call();
            self.shared.directory.insert(chunk.addr, chunk.end() + extra, self.index);
        } else {
            self.shared.total.unbook(extra);
        }
        Ok(ok)
    }
}

impl Upstream for Tracked {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        // Chunks of other shards were offered before the pool grew
        // (`Shards::allocate_elsewhere`).
        let get = |u: &dyn Upstream, n| u.allocate_chunk(n);
        match self.try_allocate(size, get) {
            Err(Error::OutOfMemory { .. }) if self.release_others() > 0 => self.try_allocate(size, get),
            r => r,
        }
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        self.inner.deallocate_chunk(chunk)?;
        self.shared.total.unbook(chunk.size);
        Ok(())
    }
    // Page remapping (pool/remap.rs): address space is booked and recorded
    // like allocated chunks; mapping inside it goes straight through, as
    // does everything not overridden here.
    fn inner(&self) -> Option<&dyn Upstream> {
        Some(&*self.inner)
    }
    fn try_extend(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        let extend = |u: &dyn Upstream, c, n| u.try_extend(c, n);
        match self.try_extend_once(chunk, extra, extend) {
            Err(Error::OutOfMemory { .. }) if self.release_others() > 0 => self.try_extend_once(chunk, extra, extend),
            r => r,
        }
    }
    fn try_shrink(&self, chunk: Chunk, amount: usize) -> Result<bool> {
        let ok = self.inner.try_shrink(chunk, amount)?;
        if ok {
            self.shared.total.unbook(amount);
        }
        Ok(ok)
    }
    fn reserve_chunk(&self, size: usize) -> Result<Chunk> {
        self.try_allocate(size, |u, n| u.reserve_chunk(n))
    }
    fn try_extend_reserved(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        self.try_extend_once(chunk, extra, |u, c, n| u.try_extend_reserved(c, n))
    }
    fn map_runs(&self, runs: &[Chunk]) -> Result<u64> {
        // A failed map leaves nothing mapped, so it may be tried again once
        // the other shards gave their free memory back.
        let r = match self.inner.map_runs(runs) {
            Err(Error::OutOfMemory { .. }) if self.release_others() > 0 => self.inner.map_runs(runs),
            r => r,
        };
        if let Ok(n) = r {
            self.shared.calls.fetch_add(n, Ordering::Relaxed);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::{Shared, Tracked};
    use crate::error::PoolKind;
    use crate::upstream::forwarding::methods_not_forwarded;

    #[test]
    fn a_chunk_that_moves_or_grows_changes_its_entry_in_place() {
        let d = super::Directory::new();
        let versions = || super::lock(&d.versions).all.len();
        d.insert(0x10000, 0x20000, 1);
        assert_eq!((d.find(0x18000), versions()), (Some(1), 1));
        d.insert(0x10000, 0x20000, 3);
        assert_eq!((d.find(0x18000), versions()), (Some(3), 1), "moved: owner changed, no copy");
        d.insert(0x10000, 0x30000, 3);
        assert_eq!((d.find(0x28000), versions()), (Some(3), 1), "grown in place: no copy");
        d.insert(0x50000, 0x60000, 2);
        assert_eq!((d.find(0x58000), d.find(0x18000), versions()), (Some(2), Some(3), 2));
        // A different range at the same start (given back, handed out
        // again) replaces the entry.
        d.insert(0x10000, 0x18000, 1);
        assert_eq!((d.find(0x14000), d.find(0x28000)), (Some(1), None));
        assert_eq!(d.find(0x5000), None);
    }

    #[test]
    fn the_shard_wrapper_forwards_every_method() {
        let pools: Box<super::ShardPools> = Box::new([]);
        let shared = Shared::new(&pools, None, PoolKind::Device);
        let missed = methods_not_forwarded(|inner| Box::new(Tracked { inner, shared, index: 0 }));
        assert_eq!(missed, Vec::<&str>::new());
    }
}
