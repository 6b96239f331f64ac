//! Looking without changing: chunks, statistics, snapshots, and the
//! invariant check the tests run after every operation.

use super::{BestFit, PoolStats, NIL};

use crate::upstream::{Chunk, BLOCK_ALIGN};

impl BestFit {
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
        let (touched, _) = self.touched_pages();
        s.touched = touched << self.pages.shift;
        s.peak_touched = self.reported_touched_peak() << self.pages.shift;
        s
    }

    /// The counters the pool layer keeps (upstream calls, retries, peaks).
    pub fn stats_mut(&mut self) -> &mut PoolStats {
        &mut self.stats
    }

    /// The number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.chunks_by_addr.len()
    }

    /// The number of blocks, live and free.
    pub fn block_count(&self) -> usize {
        self.live.len() + self.free_index.len() + usize::from(self.hot.0 != NIL)
    }

    /// Copies every chunk and block, in address order, into `chunks` and
    /// `blocks` (cleared first) without allocating. Returns `false`, with
    /// both left empty, when their capacity is too small (see
    /// [`chunk_count`](Self::chunk_count) and
    /// [`block_count`](Self::block_count)).
    pub fn snapshot_into(
        &mut self,
        chunks: &mut Vec<Chunk>,
        blocks: &mut Vec<crate::pool::pool_snapshot::SnapshotBlock>,
    ) -> bool {
        use crate::pool::pool_snapshot::{stream_of, BlockState, SnapshotBlock};
        self.flush_hot();
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
        let mut v = Vec::with_capacity(self.live.len());
        self.each_block(|_, b| {
            if !b.free {
                v.push((b.addr, b.size, b.requested));
            }
        });
        v
    }

    /// Every free block as `(addr, size)`, in address order (the hot
    /// block, not coalesced yet, is not in the list).
    pub fn free_list(&self) -> Vec<(usize, usize)> {
        let mut v = Vec::with_capacity(self.free_index.len());
        self.each_block(|slot, b| {
            if b.free && slot != self.hot.0 {
                v.push((b.addr, b.size));
            }
        });
        v
    }

    /// Calls `f` with every block, in address order: chunk by chunk, each
    /// chunk's blocks along their links (the invariant check proves the
    /// links agree with the live map and the free index).
    fn each_block(&self, mut f: impl FnMut(u32, &super::Block)) {
        for &id in self.chunks_by_addr.values() {
            let mut slot = self.chunk_info(id).first;
            while slot != NIL {
                let b = &self.blocks[slot as usize];
                f(slot, b);
                slot = b.next;
            }
        }
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
            let mut prev_hot = false;
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
                let hot = slot == self.hot.0;
                if b.free {
                    // Only the (uncoalesced) hot block may touch a free one.
                    if prev_free && !hot && !prev_hot {
                        return Err(format!("free block at {:#x} follows a free block", b.addr));
                    }
                    if hot {
                        if self.free_index.contains(&(b.size, b.addr, slot)) || self.live.contains(b.addr) {
                            return Err(format!("hot block at {:#x} is indexed or live", b.addr));
                        }
                    } else if !self.free_index.contains(&(b.size, b.addr, slot)) {
                        return Err(format!("free block at {:#x} is not indexed", b.addr));
                    } else {
                        free_seen += 1;
                    }
                } else if hot {
                    return Err(format!("hot block at {:#x} is in use", b.addr));
                } else {
                    if self.live.get(b.addr) != Some(slot) {
                        return Err(format!("used block at {:#x} is not in the live map", b.addr));
                    }
                    live_seen += 1;
                    in_use += b.size;
                    requested += b.requested;
                }
                prev_free = b.free;
                prev_hot = hot;
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
        let free_pages = self.count_free_pages();
        if free_pages != self.pages.free_pages {
            return Err(format!("{} free whole pages counted, {free_pages} in free blocks", self.pages.free_pages));
        }
        Ok(())
    }
}
