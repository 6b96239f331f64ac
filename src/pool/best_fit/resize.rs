//! Resizing in place: a live block grown into, or shrunk back from, the
//! free block after it; a block taken at a given address; whole free
//! chunks taken out; chunks extended or shrunk at their end (growth in
//! place, page remapping).

use super::{Allocation, BestFit, Block, NIL};

use crate::upstream::{Chunk, BLOCK_ALIGN};

use crate::tag::StreamTag;

impl BestFit {
    /// Allocates exactly `[addr, addr + size)` (`size` rounded) out of the
    /// free block that holds all of it, splitting off what lies before
    /// and after. `None` when no free block holds the range (nothing
    /// changes then).
    pub fn allocate_at(&mut self, addr: usize, size: usize, requested: usize) -> Option<Allocation> {
        if size == 0 || size % BLOCK_ALIGN != 0 || addr % BLOCK_ALIGN != 0 {
            return None;
        }
        let end = addr.checked_add(size)?;
        self.flush_hot();
        let &(_, _, slot) = self.free_index.at_least(size).find(|&&(bsize, at, _)| at <= addr && end <= at + bsize)?;
        Some(self.allocate_slot_at(slot, addr, size, requested))
    }

    /// Grows the live block at `addr` to `new_size` (rounded) in place, by
    /// taking the front of the free block after it. Returns whether it did.
    pub fn grow_in_place(&mut self, addr: usize, new_size: usize) -> bool {
        self.flush_hot();
        let Some(slot) = self.live.get(addr) else { return false };
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
        self.note_touched();
        true
    }

    /// Shrinks the live block at `addr` to `new_size` (rounded, non-zero)
    /// in place; the tail is freed and coalesced. Returns whether it did.
    pub fn shrink_in_place(&mut self, addr: usize, new_size: usize) -> bool {
        self.flush_hot();
        let Some(slot) = self.live.get(addr) else { return false };
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

    /// Sets the requested size of the live block at `addr` (in-place resize).
    pub fn set_requested(&mut self, addr: usize, requested: usize) {
        if let Some(slot) = self.live.get(addr) {
            let b = &mut self.blocks[slot as usize];
            self.stats.requested = self.stats.requested - b.requested + requested;
            self.stats.peak_requested = self.stats.peak_requested.max(self.stats.requested);
            b.requested = requested;
        }
    }

    /// Removes every chunk that is wholly free and returns them (with the
    /// tag of their one block) for the caller to give back to the upstream.
    pub fn take_free_chunks(&mut self) -> Vec<(Chunk, StreamTag)> {
        self.flush_hot();
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
        self.flush_hot();
        let (_, &id) = self.chunks_by_addr.range(..=addr).next_back()?;
        let info = self.chunk_info(id);
        let whole = info.first == info.last && self.blocks[info.first as usize].free;
        (whole && addr < info.chunk.end()).then(|| self.remove_chunk(id))
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

    /// Chunks whose last block is free but not the whole chunk, and its size.
    pub fn free_tails(&mut self) -> Vec<(Chunk, usize)> {
        self.flush_hot();
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
        self.flush_hot();
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
        self.flush_hot();
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
}
