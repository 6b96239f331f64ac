//! The hot block (see the module docs of `best_fit.rs`): the block freed
//! last waits uncoalesced, so that an allocation of exactly its size takes
//! it back with no index work.

use super::{Allocation, BestFit, HotSlot, NIL};

use crate::tag::StreamTag;

use crate::upstream::BLOCK_ALIGN;

impl BestFit {
    /// Keeps the block freed last hot (see the module docs): an allocation
    /// of exactly its size right after takes it back with no index work.
    pub fn set_hot_block(&mut self, on: bool) {
        self.flush_hot();
        self.hot_enabled = on;
    }

    /// Coalesces and indexes the hot block, if there is one. Every
    /// operation but a free and a hot allocation calls it first; the pool
    /// calls it before it reads the free blocks (statistics, snapshots).
    #[inline]
    pub fn flush_hot(&mut self) {
        if self.hot.0 != NIL {
            self.flush_hot_slow();
        }
    }

    /// [`flush_hot`](Self::flush_hot), then `f` on the coalesced blocks.
    pub fn flush_hot_then<R>(&mut self, f: impl FnOnce(&BestFit) -> R) -> R {
        self.flush_hot();
        f(self)
    }

    #[cold]
    fn flush_hot_slow(&mut self) {
        let slot = std::mem::replace(&mut self.hot, HotSlot(NIL)).0;
        self.index_coalesced(slot);
    }

    /// An allocation of `size` bytes from the hot block, when it has
    /// exactly that size and best fit over the coalesced blocks would
    /// place the request at its address too: no free block before it (the
    /// coalesced block would start there), and no other free block that
    /// fits and is smaller than the hot block with its free successor, or
    /// as large at a lower address. Placement is then exactly best fit's;
    /// only the index work is left out (and the free successor keeps its
    /// own stream tag instead of a merged one, which orders no less).
    #[inline]
    pub(super) fn take_hot(&mut self, size: usize, align: usize, requested: usize) -> Option<Allocation> {
        let slot = self.hot.0;
        if slot == NIL || align > BLOCK_ALIGN {
            return None;
        }
        let b = &self.blocks[slot as usize];
        if b.size != size || (b.prev != NIL && self.blocks[b.prev as usize].free) {
            return None;
        }
        let next = (b.next != NIL && self.blocks[b.next as usize].free).then(|| {
            let n = &self.blocks[b.next as usize];
            (n.size, n.addr, b.next)
        });
        let merged = size + next.map_or(0, |n| n.0);
        // Repeated allocation and free of one size leave the index: it stands.
        let check = (self.free_index.changes(), size, next, b.addr);
        if self.hot_clear != Some(check) {
            let rival = self.free_index.best_fit_except(size, next);
            if rival.is_some_and(|(rsize, raddr, _)| rsize < merged || (rsize == merged && raddr < b.addr)) {
                return None;
            }
            self.hot_clear = Some(check);
        }
        let b = &mut self.blocks[slot as usize];
        self.hot = HotSlot(NIL);
        b.free = false;
        b.requested = requested;
        let (addr, tag) = (b.addr, std::mem::replace(&mut b.tag, StreamTag::NONE));
        self.live.insert(addr, slot);
        self.count_allocation(size, requested);
        Some(Allocation { addr, size, tag })
    }
}

#[cfg(test)]
mod tests;
