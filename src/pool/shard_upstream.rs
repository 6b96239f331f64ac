//! What the shards of one set share through their upstreams: the chunk
//! directory (address → shard), the total held against the set's limit,
//! and the way back to the other shards when one runs out of memory.
//!
//! # Implementation details
//!
//! - **Directory.** A sorted table of `(start, end, shard)`, one entry per
//!   chunk the shards hold, read under a sequence lock: a free finds its
//!   shard with a few loads and a binary search, takes no lock and writes
//!   nothing, and retries only when a writer changed the table meanwhile.
//!   Writers (a chunk added, grown in place, moved to another shard or
//!   given back upstream) write the new table under a lock into a table
//!   other than the current one, then publish it, so readers never wait
//!   for a writer (with 16 threads and ranges changing shard a thousand
//!   times a second they did): entries a new chunk overlaps go (a range
//!   given back and handed out again), a chunk given back leaves. When no
//!   other table has room, a new one twice as large is made; tables stay
//!   allocated until the set is dropped (a reader may still look at one),
//!   so all of them together stay within a few times the largest, however
//!   long the program runs. An
//!   entry is written before the chunk's blocks can be handed out, and
//!   whoever frees a block learned of it after that, so the entry is
//!   always found.
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
//! - **Idle shards give first.** Before a shard's upstream makes new
//!   memory (a chunk, growth in place, or pages mapped beyond the memory
//!   it keeps) that would take the set above 120 % of the most memory its
//!   blocks held at once (`reclaim::RECLAIM_ABOVE_PPM`; pages touched in remapping
//!   shards; the peak as seen at each growth), the shards no thread uses
//!   now (their threads exited:
//!   `shard_registry.rs`) give back as much of their free memory
//!   ([`Pool`]'s `reclaim_free`, `reclaim.rs`), so the set holds about
//!   what its live threads need, not the sum of what every thread ever
//!   needed. With [`PoolConfig::fresh_thread_budget`](super::PoolConfig::fresh_thread_budget),
//!   shards in use give what they hold above their remap budget too (a
//!   shard claimed by a new thread then starts its budget afresh). It runs in the growing shard's upstream call, outside every
//!   pool lock (a remapping shard holds its own remap lock; an idle
//!   shard's is only tried).
//! - **Out of memory.** When a shard's upstream can't deliver (the set's
//!   limit or the driver), the wrapper gives back the free memory of every
//!   other shard ([`Pool::release_cached`]) and asks once more. It runs in
//!   the growing shard's upstream call, outside every pool lock.

use super::shard_registry::Registry;
use super::{Pool, PoolConfig};

use crate::error::{Error, OomState, PoolKind, Result};
use crate::sync::{fence, lock, Arc, AtomicU64, AtomicU8, AtomicUsize, Mutex, Ordering};
use crate::tag::StreamTag;
use crate::upstream::{Chunk, MappedGift, Upstream};

/// One chunk of the directory (atomics: readers may read an entry while
/// a writer rewrites it, and then retry).
#[derive(Debug, Default)]
struct Entry {
    start: AtomicUsize,
    end: AtomicUsize,
    shard: AtomicUsize,
}

/// One array of entries: the first `len` are in use, sorted by start.
#[derive(Debug)]
struct Table {
    len: AtomicUsize,
    entries: Box<[Entry]>,
}

/// The least capacity of a table.
const TABLE_MIN: usize = 16;

/// The owners of an address space's granules, for a set whose chunks all
/// lie in one reservation and start and end on its granularity (one
/// address space per device): a free finds its shard with one load, and
/// a range that changes shard rewrites only its own granules.
#[derive(Debug)]
struct Granules {
    base: usize,
    shift: u32,
    /// Per granule, its shard + 1 (0: recorded in the table, if anywhere).
    owners: Box<[AtomicU8]>,
}

/// The most granules a map holds (bytes of address space, allocated
/// zeroed: the pages no chunk reached are never touched).
const GRANULES_MAX: usize = 1 << 26;

impl Granules {
    /// A map of `space` at `granularity` (a power of two), if it is small
    /// enough.
    fn new(space: Chunk, granularity: usize) -> Option<Self> {
        if !granularity.is_power_of_two() || space.addr % granularity != 0 {
            return None;
        }
        let count = space.size / granularity;
        if count == 0 || count > GRANULES_MAX {
            return None;
        }
        Some(Granules { base: space.addr, shift: granularity.trailing_zeros(), owners: zeroed_owners(count) })
    }

    /// The granules `[start, end)` covers exactly, if it lies inside the
    /// map on granule edges.
    fn covering(&self, start: usize, end: usize) -> Option<std::ops::Range<usize>> {
        let mask = (1usize << self.shift) - 1;
        let (a, b) = (start.checked_sub(self.base)?, end.checked_sub(self.base)?);
        let fits = a < b && a & mask == 0 && b & mask == 0 && (b >> self.shift) <= self.owners.len();
        fits.then(|| (a >> self.shift)..(b >> self.shift))
    }

    /// The granules `[start, end)` touches inside the map.
    fn touching(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        let first = (start.saturating_sub(self.base) >> self.shift).min(self.owners.len());
        let last = end.saturating_sub(self.base).div_ceil(1 << self.shift).min(self.owners.len());
        first..last.max(first)
    }

    fn set(&self, granules: std::ops::Range<usize>, owner: u8) {
        for g in &self.owners[granules] {
            g.store(owner, Ordering::Release);
        }
    }

    /// The shard recorded for `addr`, if any.
    #[inline]
    fn find(&self, addr: usize) -> Option<usize> {
        let i = addr.checked_sub(self.base)? >> self.shift;
        let owner = self.owners.get(i)?.load(Ordering::Acquire);
        (owner != 0).then(|| usize::from(owner) - 1)
    }
}

/// `count` owners, all 0, in memory that stays untouched until written.
#[cfg(not(loom))]
fn zeroed_owners(count: usize) -> Box<[AtomicU8]> {
    let layout = std::alloc::Layout::array::<AtomicU8>(count).expect("at most GRANULES_MAX bytes");
    // SAFETY: `layout` is not empty (count > 0); all-zero bytes are valid
    // `AtomicU8`s (0), and the box takes ownership of exactly this
    // allocation, with this layout, as a slice of `count` of them.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut AtomicU8;
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, count))
    }
}

/// Loom's atomics are made one by one (models use small spaces).
#[cfg(loom)]
fn zeroed_owners(count: usize) -> Box<[AtomicU8]> {
    (0..count).map(|_| AtomicU8::new(0)).collect()
}

/// Address → shard (see the module docs).
#[derive(Debug)]
pub(super) struct Directory {
    /// Chunks on the granules of the set's one address space, when it has
    /// one; the table holds the rest.
    granules: Option<Granules>,
    /// Moves (by 2) before and after a writer fills a table (a sequence
    /// lock: readers retry when it moved under them).
    seq: AtomicUsize,
    /// The current table: the address of the last of `tables` (0: none).
    current: AtomicUsize,
    /// Every table made. Writers hold this lock and fill a table other
    /// than the current one; tables are never freed while the directory
    /// lives (a reader may still look at an old one), but a new one is
    /// made only when no other has room, twice the size needed, so
    /// together they stay within a few times the largest.
    // Boxed: a table's address is what `current` publishes, so it must
    // not move when the list grows.
    #[allow(clippy::vec_box)]
    tables: Mutex<Vec<Box<Table>>>,
}

impl Directory {
    /// A directory; with `space`, chunks on its granules (of
    /// `granularity` bytes) are recorded per granule.
    fn new(space: Option<(Chunk, usize)>) -> Self {
        Directory {
            granules: space.and_then(|(space, granularity)| Granules::new(space, granularity)),
            seq: AtomicUsize::new(0),
            current: AtomicUsize::new(0),
            tables: Mutex::new(Vec::new()),
        }
    }

    /// The shard whose chunk holds `addr`.
    #[inline]
    pub(super) fn find(&self, addr: usize) -> Option<usize> {
        if let Some(shard) = self.granules.as_ref().and_then(|g| g.find(addr)) {
            return Some(shard);
        }
        let mut attempt = 0;
        loop {
            let before = self.seq.load(Ordering::Acquire);
            let ptr = self.current.load(Ordering::Acquire) as *const Table;
            if ptr.is_null() {
                return None;
            }
            // SAFETY: `ptr` is the address of one of `tables`' boxes,
            // published with Release after the box was made; boxes are
            // never freed or moved while the directory lives, and `&self`
            // keeps it alive. Its entries are atomics, so a writer
            // changing them meanwhile is no data race (the sequence check
            // below discards what it read then).
            let table: &Table = unsafe { &*ptr };
            let found = table.find(addr);
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == before {
                return found;
            }
            crate::sync::backoff(attempt);
            attempt += 1;
        }
    }

    /// Entries now, and tables allocated (the current one and the smaller
    /// ones it replaced).
    pub(super) fn sizes(&self) -> (usize, usize) {
        let tables = lock(&self.tables);
        (self.current_of(&tables).map_or(0, |t| t.len.load(Ordering::Relaxed)), tables.len())
    }

    /// The current table among `tables` (the lock on them held).
    fn current_of<'a>(&self, tables: &'a [Box<Table>]) -> Option<&'a Table> {
        let current = self.current.load(Ordering::Relaxed);
        tables.iter().map(|t| &**t).find(|t| *t as *const Table as usize == current)
    }

    /// The current entries as `(start, end, shard)` (writers only: the
    /// lock on `tables` is held, so nothing changes them meanwhile).
    fn entries(&self, tables: &[Box<Table>]) -> Vec<(usize, usize, usize)> {
        let Some(t) = self.current_of(tables) else { return Vec::new() };
        let len = t.len.load(Ordering::Relaxed);
        let load = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        t.entries[..len].iter().map(|e| (load(&e.start), load(&e.end), load(&e.shard))).collect()
    }

    /// Makes `next` the directory's entries: written into a table other
    /// than the current one (the newest with room, else a new one twice
    /// as large), which then becomes current. Readers of the current
    /// table never wait for a writer; a reader still looking at the table
    /// being rewritten (current two changes ago) sees the count move and
    /// looks again.
    #[allow(clippy::vec_box)]
    fn publish(&self, tables: &mut Vec<Box<Table>>, next: &[(usize, usize, usize)]) {
        let current = self.current.load(Ordering::Relaxed);
        let address = |t: &Table| t as *const Table as usize;
        let target = match tables.iter().rposition(|t| address(t) != current && t.entries.len() >= next.len()) {
            Some(i) => i,
            None => {
                let capacity = (next.len() * 2).max(TABLE_MIN);
                tables.push(Box::new(Table {
                    len: AtomicUsize::new(0),
                    entries: (0..capacity).map(|_| Entry::default()).collect(),
                }));
                tables.len() - 1
            }
        };
        let table = &tables[target];
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq + 2, Ordering::Release);
        // A reader that sees any store below to a table it looks at also
        // sees the count moved.
        fence(Ordering::Release);
        for (e, &(start, end, shard)) in table.entries.iter().zip(next) {
            e.start.store(start, Ordering::Relaxed);
            e.end.store(end, Ordering::Relaxed);
            e.shard.store(shard, Ordering::Relaxed);
        }
        table.len.store(next.len(), Ordering::Relaxed);
        self.current.store(address(table), Ordering::Release);
        self.seq.store(seq + 4, Ordering::Release);
    }

    /// Records that `shard` holds `[start, end)`: a new chunk, a chunk
    /// grown in place (same start, longer end) or one moved to another
    /// shard; what other entries hold outside it stays theirs
    /// ([`carve`](Self::carve)).
    fn insert(&self, start: usize, end: usize, shard: usize) {
        self.carve(start, end, shard);
    }

    /// `entries` with `[start, end)` cut out: an entry it overlaps keeps
    /// what lies outside it.
    fn without(entries: &[(usize, usize, usize)], start: usize, end: usize) -> Vec<(usize, usize, usize)> {
        let mut next = Vec::with_capacity(entries.len() + 1);
        for &(s, e, owner) in entries {
            if e <= start || end <= s {
                next.push((s, e, owner));
                continue;
            }
            if s < start {
                next.push((s, start, owner));
            }
            if end < e {
                next.push((end, e, owner));
            }
        }
        next
    }

    /// Records that `shard` holds `[start, end)`, a range cut out of
    /// other chunks (handed over, `handover.rs`): the entries it overlaps
    /// keep what lies outside it, under their own shards.
    pub(super) fn carve(&self, start: usize, end: usize, shard: usize) {
        let mut tables = lock(&self.tables);
        let before = self.entries(&tables);
        if let Some(granules) = self.granules.as_ref().and_then(|g| Some((g, g.covering(start, end)?))) {
            // On granule edges: the granules record it (the table keeps
            // nothing of it).
            let (g, range) = granules;
            g.set(range, u8::try_from(shard + 1).expect("at most MAX_SHARDS shards"));
            let next = Self::without(&before, start, end);
            if next != before {
                self.publish(&mut tables, &next);
            }
            return;
        }
        if let Some(g) = &self.granules {
            // Off the granules' edges (no chunk of one address space is):
            // granules it touches look in the table.
            g.set(g.touching(start, end), 0);
        }
        let mut next = Self::without(&before, start, end);
        let at = next.partition_point(|&(s, _, _)| s < start);
        next.insert(at, (start, end, shard));
        // Neighbours of one shard become one entry: ranges that change
        // shard would otherwise cut the table into ever more entries.
        next.dedup_by(|b, a| {
            let joins = a.1 == b.0 && a.2 == b.2;
            if joins {
                a.1 = b.1;
            }
            joins
        });
        self.publish(&mut tables, &next);
    }

    /// Forgets `[start, end)` (a chunk given back upstream); an entry that
    /// reaches past it (neighbours of one shard joined by
    /// [`carve`](Self::carve)) keeps the rest.
    fn remove_range(&self, start: usize, end: usize) {
        let mut tables = lock(&self.tables);
        if let Some(g) = &self.granules {
            match g.covering(start, end) {
                Some(range) => g.set(range, 0),
                // Granules it touches partly record the rest of their
                // chunk in the table, or nowhere.
                None => g.set(g.touching(start, end), 0),
            }
        }
        let before = self.entries(&tables);
        let next = Self::without(&before, start, end);
        if next != before {
            self.publish(&mut tables, &next);
        }
    }
}

impl Table {
    fn find(&self, addr: usize) -> Option<usize> {
        let len = self.len.load(Ordering::Relaxed).min(self.entries.len());
        let entries = &self.entries[..len];
        let i = entries.partition_point(|e| e.start.load(Ordering::Relaxed) <= addr);
        let e = entries.get(i.checked_sub(1)?)?;
        (addr < e.end.load(Ordering::Relaxed)).then(|| e.shard.load(Ordering::Relaxed))
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

/// A shard's footprint as last seen by an ask (`handover.rs`): the
/// memory it held and what its live blocks held, in bytes.
pub(super) struct Seen {
    held: AtomicUsize,
    live: AtomicUsize,
}

impl Seen {
    pub(super) fn store(&self, held: usize, live: usize) {
        self.held.store(held, Ordering::Relaxed);
        self.live.store(live, Ordering::Relaxed);
    }

    pub(super) fn load(&self) -> (usize, usize) {
        (self.held.load(Ordering::Relaxed), self.live.load(Ordering::Relaxed))
    }
}

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
    /// Bytes idle shards gave back for a shard that grew.
    pub(super) reclaimed: AtomicU64,
    /// The most bytes the shards' blocks held at once, as seen when a
    /// shard grew (what the set may hold 120 % of before idle shards give).
    pub(super) peak_live: AtomicUsize,
    /// The pages each shard's live blocks touch, and the most their sum
    /// reached (sets that hand ranges over): what a trim after a thread's
    /// exit keeps 102 % of (`reclaim.rs`).
    pub(super) pages: Arc<super::best_fit::SetPages>,
    /// Which threads use which shard (idle shards give first).
    pub(super) registry: Arc<Registry>,
    /// Idle shards give at all ([`PoolConfig::idle_shards_give`](super::PoolConfig::idle_shards_give)).
    pub(super) give: bool,
    /// Remapping shards of one address space hand mapped free ranges to a
    /// shard that would map new memory (`handover.rs`).
    pub(super) hand_over: bool,
    /// Ranges handed over, and their bytes.
    pub(super) handed: AtomicU64,
    pub(super) handed_bytes: AtomicU64,
    /// Asks for mapped memory, and the nanoseconds they took.
    pub(super) asks: AtomicU64,
    pub(super) ask_ns: AtomicU64,
    /// After an ask for mapped memory that found none, asks pass over
    /// until this time (`handover.rs`, nanoseconds on its clock) unless a
    /// shard went idle since: the registry's count of shards handed back
    /// then.
    pub(super) quiet_until: AtomicU64,
    pub(super) quiet_since: AtomicUsize,
    /// When an ask last ran the stream poll (`handover.rs`).
    pub(super) polled_at: AtomicU64,
    /// The set's footprint as last looked at: when (nanoseconds on the
    /// hand-over clock, 0: never), the memory held and what the live
    /// blocks hold (`handover.rs`).
    pub(super) footprint: Mutex<(u64, usize, usize)>,
    /// Per shard, what it held above its remap budget at that look.
    pub(super) excess: Box<[AtomicUsize]>,
    /// Per shard, what it held above the pages its live blocks touched
    /// then, with the slack (`handover.rs`: what a shard in use gives
    /// when no shard holds memory above its budget).
    pub(super) above_live: Box<[AtomicUsize]>,
    /// Per shard, what it held and what its live blocks held at the last
    /// look that found it free (a busy shard counts as last seen).
    pub(super) seen: Box<[Seen]>,
    /// Shards in use give what they hold above their budget too
    /// ([`PoolConfig::fresh_thread_budget`](super::PoolConfig::fresh_thread_budget)).
    pub(super) follow_threads: bool,
    /// Asked before idle shards give, so that memory freed on streams
    /// that are idle now counts as free of queued work
    /// ([`Shards::set_stream_poll`](super::Shards::set_stream_poll)).
    pub(super) poll: once_cell::sync::OnceCell<crate::tag::StreamPoll>,
    /// The set's pools (a boxed slice that never moves). Set once, before
    /// any shard is made; read only while an allocation from the set runs,
    /// or from the registry's idle hook, which the set's drop removes
    /// (waiting for a run in progress) before its pools go.
    pub(super) pools: *const ShardPools,
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
    /// `space`: the one address space every shard's chunks lie in, and its
    /// granularity (see [`Upstream::address_space`]), if there is one.
    pub(super) fn new(
        pools: &ShardPools,
        registry: Arc<Registry>,
        config: &PoolConfig,
        one_space: bool,
        space: Option<(Chunk, usize)>,
    ) -> Arc<Self> {
        let (limit, kind) = (config.max_size, config.kind);
        Arc::new(Shared {
            directory: Directory::new(space),
            total: Total { bytes: AtomicUsize::new(0), limit, kind },
            moved: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            lent: AtomicU64::new(0),
            reclaimed: AtomicU64::new(0),
            peak_live: AtomicUsize::new(0),
            pages: Arc::new(super::best_fit::SetPages::new(pools.len())),
            registry,
            give: config.idle_shards_give,
            hand_over: one_space && config.hand_over_ranges,
            handed: AtomicU64::new(0),
            handed_bytes: AtomicU64::new(0),
            asks: AtomicU64::new(0),
            ask_ns: AtomicU64::new(0),
            quiet_until: AtomicU64::new(0),
            quiet_since: AtomicUsize::new(0),
            polled_at: AtomicU64::new(0),
            footprint: Mutex::new((0, 0, 0)),
            excess: (0..pools.len()).map(|_| AtomicUsize::new(0)).collect(),
            above_live: (0..pools.len()).map(|_| AtomicUsize::new(0)).collect(),
            seen: (0..pools.len()).map(|_| Seen { held: AtomicUsize::new(0), live: AtomicUsize::new(0) }).collect(),
            follow_threads: config.fresh_thread_budget,
            poll: once_cell::sync::OnceCell::new(),
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

    /// Bytes idle shards gave back for shards that grew.
    pub(super) fn reclaimed(&self) -> u64 {
        self.reclaimed.load(Ordering::Relaxed)
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
        self.reclaim_idle(size);
        match self.try_allocate(size, get) {
            Err(Error::OutOfMemory { .. }) if self.release_others() > 0 => self.try_allocate(size, get),
            r => r,
        }
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        self.inner.deallocate_chunk(chunk)?;
        // The chunk had no live block: no free can look for it.
        self.shared.directory.remove_range(chunk.addr, chunk.end());
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
        self.reclaim_idle(extra);
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
    fn take_mapped(&self, size: usize, align: usize, requested: usize, stream: u64, lend: bool) -> Option<MappedGift> {
        self.hand_over(size, align, requested, stream, lend)
    }
    fn map_runs(&self, runs: &[Chunk]) -> Result<u64> {
        // Kept memory maps first; only the rest is new memory.
        let bytes: usize = runs.iter().map(|r| r.size).sum();
        self.reclaim_idle(bytes.saturating_sub(self.inner.kept()));
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
    use super::{Chunk, PoolConfig, Shared, Tracked};
    use crate::error::PoolKind;
    use crate::upstream::forwarding::methods_not_forwarded;

    #[test]
    fn chunks_that_move_grow_or_go_change_their_entries() {
        let d = super::Directory::new(None);
        d.insert(0x10000, 0x20000, 1);
        assert_eq!(d.find(0x18000), Some(1));
        d.insert(0x10000, 0x20000, 3);
        assert_eq!(d.find(0x18000), Some(3), "moved: owner changed");
        d.insert(0x10000, 0x30000, 3);
        assert_eq!(d.find(0x28000), Some(3), "grown in place");
        d.insert(0x50000, 0x60000, 2);
        assert_eq!((d.find(0x58000), d.find(0x18000)), (Some(2), Some(3)));
        // Given back, then a different range at the same start handed out
        // again.
        d.remove_range(0x10000, 0x30000);
        d.insert(0x10000, 0x18000, 1);
        assert_eq!((d.find(0x14000), d.find(0x28000)), (Some(1), None));
        assert_eq!(d.find(0x5000), None);
        d.remove_range(0x10000, 0x18000);
        assert_eq!((d.find(0x14000), d.find(0x58000), d.sizes().0), (None, Some(2), 1));
        // A range cut out of a chunk for another shard: the rest stays;
        // neighbours of one shard join, and giving back one chunk of a
        // joined entry leaves the other.
        d.insert(0x60000, 0x70000, 2);
        d.carve(0x64000, 0x68000, 3);
        assert_eq!((d.find(0x62000), d.find(0x66000), d.find(0x6a000)), (Some(2), Some(3), Some(2)));
        assert_eq!(d.sizes().0, 3, "[0x50000, 0x64000) of shard 2 joined");
        d.remove_range(0x50000, 0x60000);
        assert_eq!((d.find(0x58000), d.find(0x62000)), (None, Some(2)));
    }

    #[test]
    fn a_directory_of_chunks_that_come_and_go_stays_small() {
        let d = super::Directory::new(None);
        for i in 0..10_000usize {
            let start = 0x1000_0000 + i * 0x10_0000;
            d.insert(start, start + 0x8000, i % 4);
            if i >= 8 {
                d.remove_range(start - 8 * 0x10_0000, start - 8 * 0x10_0000 + 0x8000);
            }
            assert_eq!(d.find(start + 1), Some(i % 4));
        }
        assert_eq!(d.sizes(), (8, 2), "eight chunks, two tables used in turn");
        // Many chunks at once: tables double (two of each size, used in
        // turn), few are made.
        for i in 0..1000usize {
            d.insert(0x9000_0000 + i * 0x1000, 0x9000_0000 + i * 0x1000 + 0x800, 0);
        }
        let (entries, tables) = d.sizes();
        assert_eq!(entries, 1008);
        assert!(tables <= 16, "{tables} tables");
    }

    /// Readers never wait for writers and never see a torn table: while
    /// one thread adds, carves and removes chunks (tables filled in turn,
    /// and grown), others look up chunks that stay and always find them.
    #[test]
    fn lookups_during_rewrites_find_the_chunks_that_stay() {
        let d = super::Directory::new(None);
        let stay: Vec<usize> = (0..64).map(|i| 0x4000_0000 + i * 0x100_0000).collect();
        for (i, &s) in stay.iter().enumerate() {
            d.insert(s, s + 0x8000, i % 7);
        }
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(|| {
                    let mut looks = 0u64;
                    while !done.load(std::sync::atomic::Ordering::Relaxed) || looks < 10_000 {
                        for (i, &s) in stay.iter().enumerate() {
                            assert_eq!(d.find(s + 0x4000), Some(i % 7), "chunk {i}");
                            assert_eq!(d.find(s + 0x9000), None, "past chunk {i}");
                        }
                        looks += 1;
                    }
                });
            }
            for round in 0..2_000usize {
                // Chunks between the ones that stay come, change shard
                // and go; some rounds add many, so tables grow.
                let n = if round % 100 == 0 { 300 } else { 3 };
                let base = |k: usize| 0x4000_0000 + (k % 64) * 0x100_0000 + 0x10_0000 + (k / 64) * 0x1_0000;
                for k in 0..n {
                    d.insert(base(k), base(k) + 0x8000, k % 5);
                }
                d.carve(base(0), base(0) + 0x4000, 9);
                for k in 0..n {
                    d.remove_range(base(k), base(k) + 0x8000);
                }
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let (entries, tables) = d.sizes();
        assert_eq!(entries, 64);
        assert!(tables <= 16, "{tables} tables");
    }

    /// In one address space, chunks on granule edges are found by granule
    /// (the table stays empty), ranges carved out change only their own
    /// granules, and a chunk off the edges goes to the table.
    #[test]
    fn chunks_of_one_address_space_are_found_by_granule() {
        const G: usize = 0x20_0000;
        let space = Chunk { addr: 0x7000_0000_0000, size: 64 * G };
        let d = super::Directory::new(Some((space, G)));
        let at = |g: usize| space.addr + g * G;
        d.insert(at(0), at(8), 1);
        d.insert(at(8), at(12), 2);
        assert_eq!(
            (d.find(at(0)), d.find(at(8) - 1), d.find(at(8)), d.find(at(12))),
            (Some(1), Some(1), Some(2), None)
        );
        assert_eq!(d.sizes().0, 0, "nothing in the table");
        // A range handed over from shard 1 to shard 3.
        d.carve(at(2), at(4), 3);
        assert_eq!(
            (d.find(at(1)), d.find(at(2)), d.find(at(4) - 1), d.find(at(4))),
            (Some(1), Some(3), Some(3), Some(1))
        );
        d.remove_range(at(2), at(4));
        assert_eq!((d.find(at(2)), d.find(at(1)), d.find(at(4))), (None, Some(1), Some(1)));
        // Off the edges: the table, and the granules it touches look there.
        d.insert(at(20) + 0x1000, at(21), 5);
        assert_eq!((d.find(at(20) + 0x1000), d.find(at(20)), d.sizes().0), (Some(5), None, 1));
        // A chunk on the edges over it cuts it out of the table.
        d.insert(at(20), at(22), 6);
        assert_eq!((d.find(at(20) + 0x1000), d.find(at(21) + 1), d.sizes().0), (Some(6), Some(6), 0));
        // Outside the space: the table.
        d.insert(space.end(), space.end() + G, 7);
        assert_eq!((d.find(space.end()), d.sizes().0), (Some(7), 1));
        // A space too large for a map: the table does everything.
        let huge = super::Directory::new(Some((Chunk { addr: 0, size: usize::MAX / 2 }, 4096)));
        huge.insert(G, 2 * G, 1);
        assert_eq!((huge.find(G), huge.sizes().0), (Some(1), 1));
    }

    #[test]
    fn the_shard_wrapper_forwards_every_method() {
        let pools: Box<super::ShardPools> = Box::new([]);
        let registry = super::Registry::new(1, false);
        let shared = Shared::new(&pools, registry, &PoolConfig::new(PoolKind::Device), false, None);
        let missed = methods_not_forwarded(|inner| Box::new(Tracked { inner, shared, index: 0 }));
        assert_eq!(missed, Vec::<&str>::new());
    }
}
