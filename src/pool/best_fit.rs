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
//! - `live`: start address → slot of every allocated block, for `free`.
//! - `chunks_by_addr`: chunk start → chunk, for classifying bad pointers.
//!
//! Invariants (checked by [`BestFit::check_invariants`]):
//! 1. The blocks of a chunk tile it: the first starts at the chunk's start,
//!    each starts where the previous ends, the last ends at the chunk's end.
//! 2. Every block's address and size are multiples of [`BLOCK_ALIGN`].
//! 3. No two free blocks are neighbours (free neighbours are coalesced).
//! 4. `free_index` holds exactly the free blocks, `live` exactly the used.
//! 5. The statistics equal what the blocks add up to.
//!
//! Splitting and coalescing never cross a chunk boundary, because links
//! never do.

use std::collections::BTreeMap;

mod ranked;

use super::free_index::FreeIndex;

use super::stats::PoolStats;
use super::{StreamTag, BLOCK_ALIGN};
use crate::upstream::Chunk;

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
    /// The stream that last freed (part of) the block: work queued there
    /// before that free may still use it.
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
    live: hashbrown::HashMap<usize, u32>,
    stats: PoolStats,
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
        self.free_index.insert((b.size, b.addr, slot));
    }

    fn unindex_free(&mut self, slot: u32) {
        let b = &self.blocks[slot as usize];
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

    /// The smallest free block that can hold `size` bytes at an `align`
    /// boundary, ties to the lowest address.
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
        let slot = self.find(size, align)?;
        Some(self.allocate_slot(slot, size, align, requested))
    }

    /// Allocates `size` bytes at `align` from free block `slot`, which fits.
    fn allocate_slot(&mut self, slot: u32, size: usize, align: usize, requested: usize) -> Allocation {
        self.unindex_free(slot);
        let (addr, bsize, tag) = {
            let b = &self.blocks[slot as usize];
            (b.addr, b.size, b.tag)
        };
        let start = addr.next_multiple_of(align.max(BLOCK_ALIGN));
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

        let s = &mut self.stats;
        s.in_use += size;
        s.peak_in_use = s.peak_in_use.max(s.in_use);
        s.requested += requested;
        s.peak_requested = s.peak_requested.max(s.requested);
        s.allocations += 1;
        s.live_blocks += 1;
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

    /// Forgets which streams' queued work may still use the free blocks:
    /// every free block gets [`StreamTag::NONE`]. For a caller that knows
    /// that work is complete or otherwise ordered (a graph-private pool at
    /// the end of a capture). Linear in the number of blocks.
    pub fn clear_tags(&mut self) {
        for b in self.blocks.iter_mut().filter(|b| b.free) {
            b.tag = StreamTag::NONE;
        }
    }

    /// Frees the block starting at `addr`; `tag` names the stream whose
    /// queued work may still use it. Coalesces with free neighbours.
    ///
    /// # Errors
    /// A [`FreeError`] saying why `addr` is not a live block; nothing
    /// changes then.
    pub fn free(&mut self, addr: usize, tag: StreamTag) -> Result<Freed, FreeError> {
        let Some(slot) = self.live.remove(&addr) else {
            return Err(self.classify(addr));
        };
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
        let merged = self.coalesce(slot);
        self.index_free(merged);
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
        let b = &mut self.blocks[slot as usize];
        b.size += n.size;
        b.next = n.next;
        b.tag = b.tag.merge(n.tag);
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
        self.live.get(&addr).map(|&slot| self.blocks[slot as usize].size)
    }

    /// Whether `addr` lies in one of the pool's chunks.
    pub fn contains(&self, addr: usize) -> bool {
        self.overlaps_chunk(Chunk { addr, size: 1 })
    }

    /// The size of the live block at `addr`, or why freeing `addr` would
    /// fail. Changes nothing.
    pub fn check_live(&self, addr: usize) -> Result<usize, FreeError> {
        self.block_size(addr).ok_or_else(|| self.classify(addr))
    }

    /// Grows the live block at `addr` to `new_size` (rounded) in place, by
    /// taking the front of the free block after it. Returns whether it did.
    pub fn grow_in_place(&mut self, addr: usize, new_size: usize) -> bool {
        let Some(&slot) = self.live.get(&addr) else { return false };
        let b = &self.blocks[slot as usize];
        let size = b.size;
        if new_size <= size {
            return true;
        }
        let next = b.next;
        if next == NIL || !self.blocks[next as usize].free {
            return false;
        }
        let need = new_size - size;
        let nsize = self.blocks[next as usize].size;
        if nsize < need {
            return false;
        }
        self.unindex_free(next);
        if nsize > need {
            let rest = self.split_off_tail(next, need);
            self.index_free(rest);
        }
        // Now `next` is exactly `need` bytes: absorb it.
        self.absorb_next(slot);
        self.blocks[slot as usize].tag = StreamTag::NONE;
        let s = &mut self.stats;
        s.in_use += need;
        s.peak_in_use = s.peak_in_use.max(s.in_use);
        true
    }

    /// Shrinks the live block at `addr` to `new_size` (rounded, non-zero)
    /// in place; the tail is freed and coalesced. Returns whether it did.
    pub fn shrink_in_place(&mut self, addr: usize, new_size: usize) -> bool {
        let Some(&slot) = self.live.get(&addr) else { return false };
        let size = self.blocks[slot as usize].size;
        if new_size == 0 || new_size > size {
            return false;
        }
        if new_size == size {
            return true;
        }
        let tail = self.split_off_tail(slot, new_size);
        self.blocks[tail as usize].tag = StreamTag::NONE;
        self.stats.in_use -= size - new_size;
        let merged = self.coalesce(tail);
        self.index_free(merged);
        true
    }

    /// Sets the requested size recorded for the live block at `addr`
    /// (after an in-place resize).
    pub fn set_requested(&mut self, addr: usize, requested: usize) {
        if let Some(&slot) = self.live.get(&addr) {
            let b = &mut self.blocks[slot as usize];
            self.stats.requested = self.stats.requested - b.requested + requested;
            self.stats.peak_requested = self.stats.peak_requested.max(self.stats.requested);
            b.requested = requested;
        }
    }

    /// Removes every chunk that is wholly free and returns them (with the
    /// tag of their one block) for the caller to give back to the upstream.
    pub fn take_free_chunks(&mut self) -> Vec<(Chunk, StreamTag)> {
        let ids: Vec<u32> = self
            .chunks_by_addr
            .values()
            .copied()
            .filter(|&id| {
                let info = self.chunk_info(id);
                info.first == info.last && self.blocks[info.first as usize].free
            })
            .collect();
        ids.into_iter().map(|id| self.remove_chunk(id)).collect()
    }

    /// Removes the wholly free chunk that contains `addr`, if there is one.
    pub fn take_free_chunk_at(&mut self, addr: usize) -> Option<(Chunk, StreamTag)> {
        let (_, &id) = self.chunks_by_addr.range(..=addr).next_back()?;
        let info = self.chunk_info(id);
        let whole = info.first == info.last && self.blocks[info.first as usize].free;
        (whole && addr < info.chunk.end()).then(|| self.remove_chunk(id))
    }

    /// Removes the smallest wholly free chunk of at least `min` bytes whose
    /// one block carries no stream tag (its memory is idle), if there is
    /// one (for another arena to take).
    pub fn take_free_chunk_fitting(&mut self, min: usize) -> Option<Chunk> {
        let id = self
            .chunks_by_addr
            .values()
            .copied()
            .filter(|&id| {
                let info = self.chunk_info(id);
                let b = &self.blocks[info.first as usize];
                info.first == info.last && b.free && b.tag == StreamTag::NONE && info.chunk.size >= min
            })
            .min_by_key(|&id| self.chunk_info(id).chunk.size)?;
        Some(self.remove_chunk(id).0)
    }

    fn remove_chunk(&mut self, id: u32) -> (Chunk, StreamTag) {
        let info = self.chunks[id as usize].take().expect("live chunk");
        let slot = info.first;
        self.unindex_free(slot);
        let tag = self.blocks[slot as usize].tag;
        self.retire_slot(slot);
        self.vacant_chunks.push(id);
        self.chunks_by_addr.remove(&info.chunk.addr);
        self.stats.reserved -= info.chunk.size;
        self.stats.chunks -= 1;
        (info.chunk, tag)
    }

    /// The chunk with the highest end address, and whether its last block
    /// is free (and how large that free tail is).
    pub fn last_chunk(&self) -> Option<(Chunk, usize)> {
        let (_, &id) = self.chunks_by_addr.iter().next_back()?;
        let info = self.chunk_info(id);
        let last = &self.blocks[info.last as usize];
        Some((info.chunk, if last.free { last.size } else { 0 }))
    }

    /// Every chunk whose last block is free and not the whole chunk, with
    /// that free tail's size.
    pub fn free_tails(&self) -> Vec<(Chunk, usize)> {
        self.chunks_by_addr
            .values()
            .filter_map(|&id| {
                let info = self.chunk_info(id);
                let last = &self.blocks[info.last as usize];
                (last.free && info.first != info.last).then_some((info.chunk, last.size))
            })
            .collect()
    }

    /// Extends the chunk that starts at `chunk.addr` by `extra` bytes that
    /// the upstream mapped right after it; the new space joins its free
    /// tail. Returns whether the chunk was found.
    pub fn extend_chunk(&mut self, chunk: Chunk, extra: usize) -> bool {
        debug_assert!(extra % BLOCK_ALIGN == 0 && extra > 0);
        let Some(&id) = self.chunks_by_addr.get(&chunk.addr) else { return false };
        let end = self.chunk_info(id).chunk.end();
        if end != chunk.end() {
            return false;
        }
        let last = self.chunk_info(id).last;
        let slot = self.new_slot(Block {
            addr: end,
            size: extra,
            prev: last,
            next: NIL,
            chunk: id,
            free: true,
            tag: StreamTag::NONE,
            requested: 0,
        });
        self.blocks[last as usize].next = slot;
        let info = self.chunk_info_mut(id);
        info.last = slot;
        info.chunk.size += extra;
        self.stats.reserved += extra;
        self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
        let merged = self.coalesce(slot);
        self.index_free(merged);
        true
    }

    /// Cuts the free tail of the chunk at `chunk.addr` back by `amount`
    /// bytes (the caller returns them to the upstream). Returns whether the
    /// free tail was at least that large.
    pub fn shrink_chunk(&mut self, chunk: Chunk, amount: usize) -> bool {
        let Some(&id) = self.chunks_by_addr.get(&chunk.addr) else { return false };
        let info = self.chunk_info(id);
        let last = info.last;
        let b = &self.blocks[last as usize];
        if !b.free || b.size < amount || (b.size == amount && info.first == last) {
            return false;
        }
        let bsize = b.size;
        self.unindex_free(last);
        if bsize == amount {
            let prev = self.blocks[last as usize].prev;
            self.blocks[prev as usize].next = NIL;
            self.chunk_info_mut(id).last = prev;
            self.retire_slot(last);
        } else {
            self.blocks[last as usize].size -= amount;
            self.index_free(last);
        }
        self.chunk_info_mut(id).chunk.size -= amount;
        self.stats.reserved -= amount;
        true
    }

    /// Every chunk, in address order.
    pub fn chunks(&self) -> Vec<Chunk> {
        self.chunks_by_addr.values().map(|&id| self.chunk_info(id).chunk).collect()
    }

    /// The largest free block's size (0 if none).
    pub fn largest_free(&self) -> usize {
        self.free_index.last().map_or(0, |&(size, _, _)| size)
    }

    /// The number of free blocks.
    pub fn free_blocks(&self) -> usize {
        self.free_index.len()
    }

    /// The statistics, with the derived fields filled in.
    pub fn stats(&self) -> PoolStats {
        let mut s = self.stats.clone();
        s.largest_free = self.largest_free();
        s.free_blocks = self.free_index.len();
        s
    }

    /// Mutable access to the counters the pool layer keeps (upstream calls,
    /// retries, peaks).
    pub fn stats_mut(&mut self) -> &mut PoolStats {
        &mut self.stats
    }

    /// The number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.chunks_by_addr.len()
    }

    /// The number of blocks, live and free.
    pub fn block_count(&self) -> usize {
        self.live.len() + self.free_index.len()
    }

    /// Copies every chunk and block, in address order, into `chunks` and
    /// `blocks` (cleared first) without allocating. Returns `false`, with
    /// both left empty, when their capacity is too small (see
    /// [`chunk_count`](Self::chunk_count) and
    /// [`block_count`](Self::block_count)).
    pub fn snapshot_into(&self, chunks: &mut Vec<Chunk>, blocks: &mut Vec<super::snapshot::SnapshotBlock>) -> bool {
        use super::snapshot::{stream_of, BlockState, SnapshotBlock};
        chunks.clear();
        blocks.clear();
        if chunks.capacity() < self.chunk_count() || blocks.capacity() < self.block_count() {
            return false;
        }
        for (i, &id) in self.chunks_by_addr.values().enumerate() {
            let info = self.chunk_info(id);
            chunks.push(info.chunk);
            let mut slot = info.first;
            while slot != NIL {
                let b = &self.blocks[slot as usize];
                let (state, stream, requested) = match b.free {
                    true => (BlockState::Free, stream_of(b.tag), 0),
                    false => (BlockState::Live, 0, b.requested),
                };
                blocks.push(SnapshotBlock { addr: b.addr, size: b.size, requested, state, stream, chunk: i });
                slot = b.next;
            }
        }
        true
    }

    /// Every live block as `(addr, size, requested)`, in address order.
    pub fn live_blocks(&self) -> Vec<(usize, usize, usize)> {
        let mut v: Vec<_> = self
            .live
            .values()
            .map(|&slot| {
                let b = &self.blocks[slot as usize];
                (b.addr, b.size, b.requested)
            })
            .collect();
        v.sort_unstable();
        v
    }

    /// Every free block as `(addr, size)`, in address order.
    pub fn free_list(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<_> = self.free_index.iter().map(|&(size, addr, _)| (addr, size)).collect();
        v.sort_unstable();
        v
    }

    /// Checks every invariant of the module docs; returns the first broken
    /// one. Linear in the number of blocks: for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut free_seen = 0usize;
        let mut live_seen = 0usize;
        let mut in_use = 0usize;
        let mut requested = 0usize;
        let mut reserved = 0usize;
        for (&addr, &id) in &self.chunks_by_addr {
            let info = self.chunk_info(id);
            if info.chunk.addr != addr {
                return Err(format!("chunk {id} indexed at {addr:#x} starts at {:#x}", info.chunk.addr));
            }
            reserved += info.chunk.size;
            let mut at = info.chunk.addr;
            let mut slot = info.first;
            let mut prev = NIL;
            let mut prev_free = false;
            while slot != NIL {
                let b = &self.blocks[slot as usize];
                if b.addr != at {
                    return Err(format!("block at {:#x} should start at {at:#x}", b.addr));
                }
                if b.prev != prev || b.chunk != id {
                    return Err(format!("block at {:#x} has broken links", b.addr));
                }
                if b.addr % BLOCK_ALIGN != 0 || b.size % BLOCK_ALIGN != 0 || b.size == 0 {
                    return Err(format!("block at {:#x} ({} B) is misaligned", b.addr, b.size));
                }
                if b.free {
                    if prev_free {
                        return Err(format!("free block at {:#x} follows a free block", b.addr));
                    }
                    if !self.free_index.contains(&(b.size, b.addr, slot)) {
                        return Err(format!("free block at {:#x} is not indexed", b.addr));
                    }
                    free_seen += 1;
                } else {
                    if self.live.get(&b.addr) != Some(&slot) {
                        return Err(format!("used block at {:#x} is not in the live map", b.addr));
                    }
                    live_seen += 1;
                    in_use += b.size;
                    requested += b.requested;
                }
                prev_free = b.free;
                at += b.size;
                prev = slot;
                slot = b.next;
            }
            if prev != info.last {
                return Err(format!("chunk at {addr:#x}: last block link is wrong"));
            }
            if at != info.chunk.end() {
                return Err(format!("chunk at {addr:#x}: blocks end at {at:#x}, chunk at {:#x}", info.chunk.end()));
            }
        }
        if free_seen != self.free_index.len() {
            return Err(format!("{} indexed free blocks, {free_seen} in chunks", self.free_index.len()));
        }
        if live_seen != self.live.len() {
            return Err(format!("{} live entries, {live_seen} used blocks", self.live.len()));
        }
        let s = &self.stats;
        if s.in_use != in_use || s.requested != requested || s.reserved != reserved || s.live_blocks != live_seen {
            return Err(format!(
                "statistics drifted: in_use {} vs {in_use}, requested {} vs {requested}, reserved {} vs {reserved}, live {} vs {live_seen}",
                s.in_use, s.requested, s.reserved, s.live_blocks
            ));
        }
        Ok(())
    }
}
