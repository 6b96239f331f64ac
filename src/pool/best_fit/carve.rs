//! A free range leaves the allocator: the chunk that held it is cut in
//! two around it (page remapping pools that share one address space hand
//! mapped free ranges to each other, `pool/handover.rs`).
//!
//! ```text
//!  before:  chunk [ used | free ..................... | used ]
//!  take:                    [ range ]
//!  after:   chunk [ used | free ]      chunk [ free ..| used ]
//! ```
//!
//! The side with more blocks keeps the chunk's id; the other side's
//! blocks get a new one. Nothing else moves: live blocks keep their
//! addresses and slots.

use super::{BestFit, ChunkInfo, NIL};
use crate::tag::StreamTag;
use crate::upstream::{Chunk, BLOCK_ALIGN};

impl BestFit {
    /// The free block that holds all of `[addr, addr + size)`, if one does
    /// (the hot block is coalesced first).
    fn free_slot_holding(&mut self, addr: usize, size: usize) -> Option<u32> {
        self.flush_hot();
        let end = addr.checked_add(size)?;
        let (_, &id) = self.chunks_by_addr.range(..=addr).next_back()?;
        let info = self.chunk_info(id);
        if end > info.chunk.end() {
            return None;
        }
        // Walk from the nearer end of the chunk.
        let holds = |b: &super::Block| b.free && b.addr <= addr && end <= b.addr + b.size;
        if addr - info.chunk.addr > info.chunk.end() - end {
            let mut slot = info.last;
            while slot != NIL {
                let b = &self.blocks[slot as usize];
                if b.addr <= addr {
                    return holds(b).then_some(slot);
                }
                slot = b.prev;
            }
            return None;
        }
        let mut slot = info.first;
        while slot != NIL {
            let b = &self.blocks[slot as usize];
            if addr < b.addr + b.size {
                return holds(b).then_some(slot);
            }
            slot = b.next;
        }
        None
    }

    /// The stream tag of the free block that holds all of `[addr, addr +
    /// size)`, or `None` when no free block holds it.
    pub fn free_range_tag(&mut self, addr: usize, size: usize) -> Option<StreamTag> {
        let slot = self.free_slot_holding(addr, size)?;
        Some(self.blocks[slot as usize].tag)
    }

    /// Takes `[addr, addr + size)` out of the allocator when one free block
    /// holds all of it (both ends multiples of [`BLOCK_ALIGN`]): the chunk
    /// that held it is cut in two around it (see the module docs). Returns
    /// the free block's stream tag; `None` (and nothing changes) when the
    /// range is not wholly free.
    pub fn take_free_range(&mut self, addr: usize, size: usize) -> Option<StreamTag> {
        if size == 0 || addr % BLOCK_ALIGN != 0 || size % BLOCK_ALIGN != 0 {
            return None;
        }
        let slot = self.free_slot_holding(addr, size)?;
        self.unindex_free(slot);
        let mut mid = slot;
        if self.blocks[slot as usize].addr < addr {
            let front = addr - self.blocks[slot as usize].addr;
            mid = self.split_off_tail(slot, front);
            self.index_free(slot);
        }
        if self.blocks[mid as usize].size > size {
            let rest = self.split_off_tail(mid, size);
            self.index_free(rest);
        }
        let m = self.blocks[mid as usize].clone();
        let id = m.chunk;
        let info = self.chunk_info(id).clone();
        self.chunks_by_addr.remove(&info.chunk.addr);
        let left = (m.prev != NIL).then(|| {
            self.blocks[m.prev as usize].next = NIL;
            let chunk = Chunk { addr: info.chunk.addr, size: addr - info.chunk.addr };
            ChunkInfo { chunk, first: info.first, last: m.prev }
        });
        let right = (m.next != NIL).then(|| {
            self.blocks[m.next as usize].prev = NIL;
            let chunk = Chunk { addr: addr + size, size: info.chunk.end() - (addr + size) };
            ChunkInfo { chunk, first: m.next, last: info.last }
        });
        // The side with more blocks keeps the chunk's id; the other's
        // blocks are relabelled (walked side by side, the shorter found
        // in as many steps as it has blocks).
        let (mut l, mut r) = (m.prev, m.next);
        while l != NIL && r != NIL {
            l = self.blocks[l as usize].prev;
            r = self.blocks[r as usize].next;
        }
        let (keep, other) = if l == NIL { (right, left) } else { (left, right) };
        self.chunks[id as usize] = None;
        let mut parts = 0;
        if let Some(part) = keep {
            self.chunks_by_addr.insert(part.chunk.addr, id);
            self.chunks[id as usize] = Some(part);
            parts += 1;
        } else {
            self.vacant_chunks.push(id);
        }
        if let Some(part) = other {
            let pid = match self.vacant_chunks.pop() {
                Some(pid) => pid,
                None => {
                    self.chunks.push(None);
                    (self.chunks.len() - 1) as u32
                }
            };
            let mut s = part.first;
            while s != NIL {
                self.blocks[s as usize].chunk = pid;
                s = self.blocks[s as usize].next;
            }
            self.chunks_by_addr.insert(part.chunk.addr, pid);
            self.chunks[pid as usize] = Some(part);
            parts += 1;
        }
        self.retire_slot(mid);
        self.stats.reserved -= size;
        self.stats.chunks = self.stats.chunks + parts - 1;
        // A part may be wholly free now.
        self.whole_free.store(true, crate::sync::Ordering::Relaxed);
        Some(m.tag)
    }

    /// Allocates `[addr, addr + size)` when one free block holds it (the
    /// start of a range just taken from another pool, `pool/handover.rs`).
    pub fn allocate_free_at(&mut self, addr: usize, size: usize, requested: usize) -> Option<super::Allocation> {
        if addr % BLOCK_ALIGN != 0 {
            return None;
        }
        let slot = self.free_slot_holding(addr, size)?;
        Some(self.allocate_slot_at(slot, addr, size, requested))
    }

    /// Joins the chunk that starts at `addr` with the chunks that end
    /// where it starts and start where it ends, where the pool holds
    /// them (a range handed back next to where it was cut out): one chunk,
    /// whose free blocks that now touch coalesce.
    pub fn join_neighbours(&mut self, addr: usize) {
        self.flush_hot();
        let Some(&id) = self.chunks_by_addr.get(&addr) else { return };
        let end = self.chunk_info(id).chunk.end();
        if let Some(&next) = self.chunks_by_addr.get(&end) {
            self.join(id, next);
        }
        let before = self.chunks_by_addr.range(..addr).next_back().map(|(_, &p)| p);
        if let Some(prev) = before.filter(|&p| self.chunk_info(p).chunk.end() == addr) {
            self.join(prev, id);
        }
    }

    /// Chunk `b`, which starts where chunk `a` ends, becomes part of `a`.
    fn join(&mut self, a: u32, b: u32) {
        let Some(bi) = self.chunks[b as usize].take() else { return };
        self.vacant_chunks.push(b);
        self.chunks_by_addr.remove(&bi.chunk.addr);
        let mut s = bi.first;
        while s != NIL {
            self.blocks[s as usize].chunk = a;
            s = self.blocks[s as usize].next;
        }
        let a_last = self.chunk_info(a).last;
        self.blocks[a_last as usize].next = bi.first;
        self.blocks[bi.first as usize].prev = a_last;
        let ai = self.chunk_info_mut(a);
        ai.chunk.size += bi.chunk.size;
        ai.last = bi.last;
        self.stats.chunks -= 1;
        if self.blocks[a_last as usize].free && self.blocks[bi.first as usize].free {
            self.unindex_free(a_last);
            self.unindex_free(bi.first);
            self.absorb_next(a_last);
            self.index_free(a_last);
        }
        self.whole_free.store(true, crate::sync::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::super::BestFit;
    use crate::tag::StreamTag;
    use crate::upstream::Chunk;

    const MB: usize = 1 << 20;

    /// A range taken from the middle of a chunk leaves two chunks whose
    /// blocks still free, coalesce and allocate; ranges not wholly free
    /// are refused and change nothing.
    #[test]
    fn a_free_range_leaves_and_the_chunk_is_cut_around_it() {
        let mut f = BestFit::new();
        f.set_hot_block(true);
        let base = 1 << 30;
        assert!(f.add_chunk(Chunk { addr: base, size: 64 * MB }));
        let a = f.allocate(4 * MB, 256, 4 * MB).unwrap();
        let b = f.allocate(40 * MB, 256, 40 * MB).unwrap();
        let c = f.allocate(8 * MB, 256, 8 * MB).unwrap();
        f.free(b.addr, StreamTag::NONE).unwrap();
        assert!(f.take_free_range(a.addr, MB).is_none(), "live");
        assert!(f.take_free_range(b.addr + 39 * MB, 2 * MB).is_none(), "runs into a live block");
        assert!(f.take_free_range(b.addr + 100, MB).is_none(), "misaligned");
        f.check_invariants().unwrap();
        let before = f.stats();
        let tag = f.take_free_range(b.addr + 8 * MB, 16 * MB);
        assert_eq!(tag, Some(StreamTag::NONE));
        f.check_invariants().unwrap();
        let after = f.stats();
        assert_eq!(after.reserved, before.reserved - 16 * MB);
        assert_eq!(after.chunks, 2);
        assert!(!f.contains(b.addr + 10 * MB));
        assert!(f.contains(b.addr + 7 * MB) && f.contains(b.addr + 30 * MB));
        // The blocks on both sides still work: frees find their chunk and
        // coalesce within it.
        f.free(c.addr, StreamTag::NONE).unwrap();
        f.free(a.addr, StreamTag::NONE).unwrap();
        f.check_invariants().unwrap();
        let big = f.allocate(8 * MB + 4 * MB, 256, 1).unwrap();
        assert_eq!(big.addr, base, "the left part coalesced whole");
        f.free(big.addr, StreamTag::NONE).unwrap();
        assert!(f.allocate(40 * MB, 256, 1).is_none(), "no part holds 40 MiB");
        // The whole left chunk leaves; the right stays.
        assert!(f.take_free_range(base, 12 * MB).is_some());
        f.check_invariants().unwrap();
        assert_eq!(f.stats().chunks, 1);
        let r = f.take_free_range(base + 28 * MB, 36 * MB);
        assert!(r.is_some());
        assert_eq!((f.stats().chunks, f.stats().reserved), (0, 0));
        f.check_invariants().unwrap();
        // A range taken by another pool comes back as a chunk of its own.
        assert!(f.add_chunk(Chunk { addr: base + 8 * MB, size: 16 * MB }));
        let d = f.allocate_free_at(base + 8 * MB, MB, 1).unwrap();
        assert_eq!(d.addr, base + 8 * MB);
        assert!(f.allocate_free_at(base + 8 * MB, MB, 1).is_none(), "its first block is live");
        f.check_invariants().unwrap();
        f.free(d.addr, StreamTag::NONE).unwrap();
        // Ranges that meet join one chunk, whose free blocks coalesce.
        assert!(f.add_chunk(Chunk { addr: base + 24 * MB, size: 8 * MB }));
        let e = f.allocate(8 * MB, 256, 1).unwrap();
        assert_eq!(e.addr, base + 24 * MB);
        assert!(f.add_chunk(Chunk { addr: base, size: 8 * MB }));
        f.join_neighbours(base + 8 * MB);
        f.check_invariants().unwrap();
        assert_eq!(f.stats().chunks, 1, "three chunks joined");
        let whole = f.allocate(24 * MB, 256, 1).unwrap();
        assert_eq!(whole.addr, base, "the first two coalesced");
        f.free(e.addr, StreamTag::NONE).unwrap();
        f.free(whole.addr, StreamTag::NONE).unwrap();
        f.check_invariants().unwrap();
        assert_eq!(f.allocate(32 * MB, 256, 1).map(|a| a.addr), Some(base));
    }

    /// The tag of the free block goes with the range.
    #[test]
    fn the_range_keeps_its_stream_tag() {
        let mut f = BestFit::new();
        let base = 1 << 30;
        assert!(f.add_chunk(Chunk { addr: base, size: 8 * MB }));
        let a = f.allocate(8 * MB, 256, 1).unwrap();
        let tag = StreamTag { stream: 7, seq: 3 };
        f.free(a.addr, tag).unwrap();
        assert_eq!(f.free_range_tag(base + MB, MB), Some(tag));
        assert_eq!(f.take_free_range(base + MB, MB), Some(tag));
        f.check_invariants().unwrap();
        assert_eq!(f.stats().chunks, 2);
    }
}
