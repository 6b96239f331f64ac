//! The best-fit block allocator: the algorithm, with no locks and no CUDA.
//!
//! # Implementation details
//!
//! Memory arrives in *chunks* (from an upstream). Each chunk is cut into
//! *blocks* that tile it exactly; the blocks of one chunk form a doubly
//! linked list in address order:
//!
//! ```text
//!  chunk A                                   chunk B
//!  [ used 512 | free 1024 | used 256 ]       [ free 2048 ]
//!     ^prev=NIL   <->          next=NIL^        prev=next=NIL
//! ```
//!
//! All metadata lives here, outside the managed memory, which the allocator
//! never touches. Blocks live in a slab (`Vec<Block>` with a free-slot list);
//! links are slab indices.
//!
//! Indexes:
//! - `free_index`: every free block as `(size, addr, slot)`, ordered, so the
//!   best fit is the first entry at or after `(size, 0)`: the smallest block
//!   that fits, ties to the lowest address. O(log n); binned by size class
//!   so each search touches one small set (see `free_index.rs`).
//! - `live`: start address → slot of every allocated block, for `free`
//!   (`live_map.rs`: open addressing, no general hash map).
//! - `chunks_by_addr`: chunk start → chunk, for classifying bad pointers.
//!
//! Invariants (checked by [`BestFit::check_invariants`]):
//! 1. The blocks of a chunk tile it: the first starts at the chunk's start,
//!    each starts where the previous ends, the last ends at the chunk's end.
//! 2. Every block's address and size are multiples of [`BLOCK_ALIGN`].
//! 3. No two free blocks are neighbours (free neighbours are coalesced),
//!    except next to the *hot block* (below).
//! 4. `free_index` holds exactly the free blocks but the hot block, `live`
//!    exactly the used.
//!
//! The hot block ([`BestFit::set_hot_block`]; the device pools): the
//! block freed last is marked free and counted free, but neither coalesced
//! nor indexed until the next operation. An allocation of exactly its
//! size takes it back as it is when best fit over the coalesced blocks
//! would place the request at its address too (`hot.rs`); any other
//! operation first coalesces and indexes it ([`BestFit::flush_hot`]). So
//! placement is exactly best fit's, and a hot allocate + free pair of one
//! size touches no index entry and splits and merges nothing. Since such
//! a pair leaves the index as it was, the look for a better block is kept
//! with the index's count of changes and not repeated while the count
//! holds. All of it runs under the pool's lock, like everything here.
//!
//! Splitting and coalescing never cross a chunk boundary: links never do.

use std::collections::BTreeMap;

mod hot;
mod inspect;
mod live_map;
mod ranked;
mod resize;
mod tags;
mod touched;

use super::free_index::{FreeIndex, Key};

use super::stats::PoolStats;
use crate::tag::StreamTag;
use crate::upstream::Chunk;
use crate::upstream::BLOCK_ALIGN;
use live_map::LiveMap;
pub(crate) use ranked::Preferred;
use tags::Oracle;
use touched::PageCount;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    addr: usize,
    size: usize,
    prev: u32,
    next: u32,
    chunk: u32,
    free: bool,
    /// For a free block: the stream whose queued work may still use it.
    tag: StreamTag,
    /// For a used block: the size the caller asked for.
    requested: usize,
}

#[derive(Debug, Clone)]
struct ChunkInfo {
    chunk: Chunk,
    first: u32,
    last: u32,
}

/// A block handed out by [`BestFit::allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// The block's start.
    pub addr: usize,
    /// The block's size (the request rounded up to 256 B).
    pub size: usize,
    /// The stream that last freed (part of) the block, whose work may use it.
    pub tag: StreamTag,
}

/// What [`BestFit::free`] found wrong with a pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreeError {
    /// The address is the start of a block that is already free.
    DoubleFree,
    /// The address lies inside the block that starts at `block` (`size` B).
    Interior {
        /// The containing block's start.
        block: usize,
        /// Its size.
        size: usize,
    },
    /// The address is in no chunk of this allocator.
    Unknown,
}

/// What a successful [`BestFit::free`] released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    /// The block's size.
    pub size: usize,
    /// The size the caller had asked for.
    pub requested: usize,
}

/// Exact best-fit allocation with splitting and coalescing over address
/// ranges. See the module docs for the structure and its invariants.
#[derive(Debug, Default)]
pub struct BestFit {
    blocks: Vec<Block>,
    vacant: Vec<u32>,
    chunks: Vec<Option<ChunkInfo>>,
    vacant_chunks: Vec<u32>,
    chunks_by_addr: BTreeMap<usize, u32>,
    free_index: FreeIndex,
    live: LiveMap,
    stats: PoolStats,
    /// Asked when blocks freed on different streams merge.
    oracle: Oracle,
    /// Touched-page accounting (page remapping): see [`PageCount`].
    pages: PageCount,
    /// The block freed last, not yet coalesced nor indexed (module docs).
    hot: HotSlot,
    /// Whether frees leave the freed block hot.
    hot_enabled: bool,
    /// The last hot-block check that found no rival, as (index changes,
    /// size, free successor, address): asked again with the index
    /// unchanged, it has the same answer.
    hot_clear: Option<(u64, usize, Option<Key>, usize)>,
}

/// The slot of the hot block (`NIL`, the default: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HotSlot(u32);

impl Default for HotSlot {
    fn default() -> Self {
        HotSlot(NIL)
    }
}

/// Rounds `size` up to a multiple of [`BLOCK_ALIGN`], or `None` on overflow.
pub fn round_size(size: usize) -> Option<usize> {
    size.checked_next_multiple_of(BLOCK_ALIGN)
}

impl BestFit {
    /// An empty allocator with no chunks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Coalesces free block `slot` (not indexed) with its free neighbours
    /// and indexes the result.
    fn index_coalesced(&mut self, slot: u32) {
        let merged = self.coalesce(slot);
        self.index_free(merged);
    }

    /// The statistics of an allocation of `size` bytes (`requested` asked).
    #[inline]
    fn count_allocation(&mut self, size: usize, requested: usize) {
        let s = &mut self.stats;
        s.in_use += size;
        s.peak_in_use = s.peak_in_use.max(s.in_use);
        s.requested += requested;
        s.peak_requested = s.peak_requested.max(s.requested);
        s.allocations += 1;
        s.live_blocks += 1;
        self.note_touched();
    }

    fn new_slot(&mut self, block: Block) -> u32 {
        if let Some(slot) = self.vacant.pop() {
            self.blocks[slot as usize] = block;
            slot
        } else {
            self.blocks.push(block);
            (self.blocks.len() - 1) as u32
        }
    }

    fn retire_slot(&mut self, slot: u32) {
        self.vacant.push(slot);
    }

    fn index_free(&mut self, slot: u32) {
        let b = &self.blocks[slot as usize];
        self.pages.free_pages += self.pages.whole(b.addr, b.size);
        self.free_index.insert((b.size, b.addr, slot));
    }

    fn unindex_free(&mut self, slot: u32) {
        let b = &self.blocks[slot as usize];
        self.pages.free_pages -= self.pages.whole(b.addr, b.size);
        let removed = self.free_index.remove(&(b.size, b.addr, slot));
        debug_assert!(removed, "free block missing from the index");
    }

    /// Adds a chunk from the upstream as one free block.
    ///
    /// The chunk's address and size must be multiples of [`BLOCK_ALIGN`] and
    /// must not overlap a chunk already added (checked: such a chunk is
    /// refused and `false` returned).
    pub fn add_chunk(&mut self, chunk: Chunk) -> bool {
        if chunk.size == 0
            || chunk.addr % BLOCK_ALIGN != 0
            || chunk.size % BLOCK_ALIGN != 0
            || chunk.addr.checked_add(chunk.size).is_none()
            || self.overlaps_chunk(chunk)
        {
            return false;
        }
        let id = match self.vacant_chunks.pop() {
            Some(id) => id,
            None => {
                self.chunks.push(None);
                (self.chunks.len() - 1) as u32
            }
        };
        let slot = self.new_slot(Block {
            addr: chunk.addr,
            size: chunk.size,
            prev: NIL,
            next: NIL,
            chunk: id,
            free: true,
            tag: StreamTag::NONE,
            requested: 0,
        });
        self.chunks[id as usize] = Some(ChunkInfo { chunk, first: slot, last: slot });
        self.chunks_by_addr.insert(chunk.addr, id);
        self.index_free(slot);
        self.stats.reserved += chunk.size;
        self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
        self.stats.chunks += 1;
        true
    }

    fn overlaps_chunk(&self, chunk: Chunk) -> bool {
        let before = self.chunks_by_addr.range(..chunk.end()).next_back();
        match before {
            Some((_, &id)) => self.chunk_info(id).chunk.end() > chunk.addr,
            None => false,
        }
    }

    fn chunk_info(&self, id: u32) -> &ChunkInfo {
        self.chunks[id as usize].as_ref().expect("chunk id refers to a live chunk")
    }

    fn chunk_info_mut(&mut self, id: u32) -> &mut ChunkInfo {
        self.chunks[id as usize].as_mut().expect("chunk id refers to a live chunk")
    }

    /// The smallest free block holding `size` bytes at `align`, lowest first.
    fn find(&self, size: usize, align: usize) -> Option<u32> {
        if align <= BLOCK_ALIGN {
            return self.free_index.best_fit(size).map(|(_, _, slot)| slot);
        }
        let mut candidates = self.free_index.at_least(size);
        // Larger alignments: the first block (in size order) whose aligned
        // start still leaves room. Blocks of at least `size + align - 256`
        // always fit, so the scan ends there at the latest.
        candidates
            .find(|&&(bsize, addr, _)| {
                let start = addr.next_multiple_of(align);
                start - addr + size <= bsize
            })
            .map(|&(_, _, slot)| slot)
    }

    /// Allocates `size` bytes (rounded up to 256) aligned to `align` (a
    /// power of two), or `None` when no free block fits. `requested` is
    /// the size the caller asked for (statistics only).
    pub fn allocate(&mut self, size: usize, align: usize, requested: usize) -> Option<Allocation> {
        debug_assert!(size % BLOCK_ALIGN == 0 && size > 0);
        debug_assert!(align.is_power_of_two());
        if let Some(a) = self.take_hot(size, align, requested) {
            return Some(a);
        }
        self.flush_hot();
        let slot = self.find(size, align)?;
        Some(self.allocate_slot(slot, size, align, requested))
    }

    /// Allocates `size` bytes at `align` from free block `slot`, which fits.
    fn allocate_slot(&mut self, slot: u32, size: usize, align: usize, requested: usize) -> Allocation {
        let start = self.blocks[slot as usize].addr.next_multiple_of(align.max(BLOCK_ALIGN));
        self.allocate_slot_at(slot, start, size, requested)
    }

    /// Allocates `[start, start + size)` from free block `slot`, which
    /// holds it (`start` a multiple of [`BLOCK_ALIGN`]).
    fn allocate_slot_at(&mut self, slot: u32, start: usize, size: usize, requested: usize) -> Allocation {
        self.unindex_free(slot);
        let (addr, bsize, tag) = {
            let b = &self.blocks[slot as usize];
            (b.addr, b.size, b.tag)
        };
        debug_assert!(start >= addr && start + size <= addr + bsize && start % BLOCK_ALIGN == 0);
        let mut slot = slot;
        if start > addr {
            // The aligned start leaves a free block in front.
            let front = start - addr;
            let back = self.split_off_tail(slot, front);
            self.index_free(slot);
            slot = back;
        }
        let remaining = self.blocks[slot as usize].size;
        if remaining > size {
            let rest = self.split_off_tail(slot, size);
            self.index_free(rest);
        }
        let b = &mut self.blocks[slot as usize];
        b.free = false;
        b.requested = requested;
        b.tag = StreamTag::NONE;
        self.live.insert(start, slot);
        debug_assert_eq!(b.addr, start);
        debug_assert!(bsize >= size);
        self.count_allocation(size, requested);
        Allocation { addr: start, size, tag }
    }

    /// Cuts block `slot` after `keep` bytes; the tail becomes a new free
    /// block (same tag, not indexed) whose slot is returned.
    fn split_off_tail(&mut self, slot: u32, keep: usize) -> u32 {
        let b = self.blocks[slot as usize].clone();
        debug_assert!(keep < b.size && keep % BLOCK_ALIGN == 0);
        let tail = self.new_slot(Block {
            addr: b.addr + keep,
            size: b.size - keep,
            prev: slot,
            next: b.next,
            chunk: b.chunk,
            free: true,
            tag: b.tag,
            requested: 0,
        });
        if b.next != NIL {
            self.blocks[b.next as usize].prev = tail;
        } else {
            self.chunk_info_mut(b.chunk).last = tail;
        }
        let head = &mut self.blocks[slot as usize];
        head.size = keep;
        head.next = tail;
        tail
    }

    /// Frees the block starting at `addr`; `tag` names the stream whose
    /// queued work may still use it. Coalesces with free neighbours.
    ///
    /// # Errors
    /// A [`FreeError`] saying why `addr` is not a live block (no change).
    pub fn free(&mut self, addr: usize, tag: StreamTag) -> Result<Freed, FreeError> {
        let Some(slot) = self.live.remove(addr) else {
            return Err(self.classify(addr));
        };
        // The block freed before goes where it belongs first (while this
        // one still counts as live to its coalescing).
        self.flush_hot();
        let (size, requested) = {
            let b = &mut self.blocks[slot as usize];
            b.free = true;
            b.tag = tag;
            (b.size, std::mem::take(&mut b.requested))
        };
        let s = &mut self.stats;
        s.in_use -= size;
        s.requested -= requested;
        s.frees += 1;
        s.live_blocks -= 1;
        if self.hot_enabled {
            self.hot = HotSlot(slot);
        } else {
            self.index_coalesced(slot);
        }
        Ok(Freed { size, requested })
    }

    /// Merges free block `slot` (not indexed) with its free neighbours, which
    /// are unindexed; returns the slot of the merged block (not indexed).
    fn coalesce(&mut self, mut slot: u32) -> u32 {
        let next = self.blocks[slot as usize].next;
        if next != NIL && self.blocks[next as usize].free {
            self.unindex_free(next);
            self.absorb_next(slot);
        }
        let prev = self.blocks[slot as usize].prev;
        if prev != NIL && self.blocks[prev as usize].free {
            self.unindex_free(prev);
            self.absorb_next(prev);
            slot = prev;
        }
        slot
    }

    /// Block `slot` swallows its next neighbour.
    fn absorb_next(&mut self, slot: u32) {
        let next = self.blocks[slot as usize].next;
        let n = self.blocks[next as usize].clone();
        let tag = self.merge_tags(self.blocks[slot as usize].tag, n.tag);
        let b = &mut self.blocks[slot as usize];
        b.size += n.size;
        b.next = n.next;
        b.tag = tag;
        if n.next != NIL {
            self.blocks[n.next as usize].prev = slot;
        } else {
            self.chunk_info_mut(n.chunk).last = slot;
        }
        self.retire_slot(next);
    }

    /// Says what `addr` is when it is not a live block's start.
    fn classify(&self, addr: usize) -> FreeError {
        let Some((_, &id)) = self.chunks_by_addr.range(..=addr).next_back() else {
            return FreeError::Unknown;
        };
        let info = self.chunk_info(id);
        if addr >= info.chunk.end() {
            return FreeError::Unknown;
        }
        let mut slot = info.first;
        while slot != NIL {
            let b = &self.blocks[slot as usize];
            if addr == b.addr && b.free {
                return FreeError::DoubleFree;
            }
            if addr >= b.addr && addr < b.addr + b.size {
                return FreeError::Interior { block: b.addr, size: b.size };
            }
            slot = b.next;
        }
        FreeError::Unknown
    }

    /// The size of the live block starting at `addr`.
    pub fn block_size(&self, addr: usize) -> Option<usize> {
        self.live.get(addr).map(|slot| self.blocks[slot as usize].size)
    }

    /// The bytes asked for the live block at `addr`, if there is one.
    pub fn requested_of(&self, addr: usize) -> Option<usize> {
        self.live.get(addr).map(|slot| self.blocks[slot as usize].requested)
    }

    /// Whether `addr` lies in one of the pool's chunks.
    pub fn contains(&self, addr: usize) -> bool {
        self.overlaps_chunk(Chunk { addr, size: 1 })
    }

    /// The size of the live block at `addr`, or why freeing it would fail.
    pub fn check_live(&self, addr: usize) -> Result<usize, FreeError> {
        self.block_size(addr).ok_or_else(|| self.classify(addr))
    }
}
