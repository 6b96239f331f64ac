//! [`Pool::snapshot`]: a pool's chunks and blocks, for pictures and checks.
//!
//! # Implementation details
//! Nothing is allocated while a lock is held: the counts are read under
//! the lock, the vectors allocated outside it, then filled under the lock
//! again; when the pool grew in between, the fill reports it and the
//! snapshot tries again with room for the new size. Blocks parked in
//! thread caches are live in the shared allocator and are marked
//! [`BlockState::Cached`] from the caches' own lists, read after the
//! allocator, so a pool in use may show a block in a state it just left.

use super::Pool;

use crate::tag::StreamTag;
use crate::upstream::{Chunk, Upstream};

/// What a block is used for.
///
/// # Examples
/// See [`PoolSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// Held by a user.
    Live,
    /// Free in the shared pool.
    Free,
    /// Freed by its user, parked in a thread cache (not in the shared pool).
    Cached,
}

/// One block of a [`PoolSnapshot`].
///
/// # Examples
/// See [`PoolSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotBlock {
    /// Its start.
    pub addr: usize,
    /// Its size in bytes (a multiple of 256).
    pub size: usize,
    /// The size asked for (live and cached blocks; 0 for free ones). With
    /// thread caches this is the request the shared pool lent the block
    /// for, which a cache may since have handed to a smaller request.
    pub requested: usize,
    /// Live, free or cached.
    pub state: BlockState,
    /// For free and cached blocks: the id of the stream whose queued work
    /// may still use it (0: none, `u64::MAX`: several).
    pub stream: u64,
    /// Index of its chunk in [`PoolSnapshot::chunks`].
    pub chunk: usize,
}

/// A pool's chunks and blocks at one moment, in address order.
///
/// # Examples
/// ```
/// use cumem::pool::{BlockState, Pool, PoolConfig, StreamTag};
/// use cumem::upstream::Host;
/// let mut config = PoolConfig::new(cumem::PoolKind::Standalone);
/// config.thread_cache = false;
/// let pool = Pool::new(Host::new(), config);
/// let a = pool.allocate(1000, 256)?;
/// let snap = pool.snapshot();
/// assert_eq!(snap.chunks.len(), 1);
/// let live: usize = snap.blocks.iter().filter(|b| b.state == BlockState::Live).map(|b| b.size).sum();
/// assert_eq!(live, pool.stats().in_use);
/// pool.deallocate(a.addr, StreamTag::NONE)?;
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolSnapshot {
    /// Every chunk held from the upstream.
    pub chunks: Vec<Chunk>,
    /// Every block; the blocks of each chunk tile it.
    pub blocks: Vec<SnapshotBlock>,
}

impl PoolSnapshot {
    /// The bytes of blocks in `state`.
    pub fn bytes(&self, state: BlockState) -> usize {
        self.blocks.iter().filter(|b| b.state == state).map(|b| b.size).sum()
    }

    /// The number of blocks in `state`.
    pub fn count(&self, state: BlockState) -> usize {
        self.blocks.iter().filter(|b| b.state == state).count()
    }
}

impl<U: Upstream> Pool<U> {
    /// A copy of the pool's chunks and blocks (see [`PoolSnapshot`]).
    /// Takes the lock briefly, allocating nothing under it.
    pub fn snapshot(&self) -> PoolSnapshot {
        let mut snap = PoolSnapshot::default();
        loop {
            let (chunks, blocks) = {
                let inner = self.inner.lock();
                (inner.fit.chunk_count(), inner.fit.block_count())
            };
            // Room for a little growth, allocated outside the lock.
            snap.chunks = Vec::with_capacity(chunks + 4);
            snap.blocks = Vec::with_capacity(blocks + 64);
            if self.inner.lock().fit.snapshot_into(&mut snap.chunks, &mut snap.blocks) {
                break;
            }
        }
        if let Some(cache) = &self.cache {
            let cached = cache.cached_blocks();
            for b in snap.blocks.iter_mut().filter(|b| b.state == BlockState::Live) {
                if let Ok(i) = cached.binary_search_by_key(&b.addr, |&(addr, _)| addr) {
                    b.state = BlockState::Cached;
                    b.stream = cached[i].1.stream;
                }
            }
        }
        snap
    }
}

/// Tag of a snapshot block from an allocator tag.
pub(super) fn stream_of(tag: StreamTag) -> u64 {
    tag.stream
}
