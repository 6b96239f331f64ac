//! The hot block (see the module docs of `best_fit.rs`): the block freed
//! last waits uncoalesced, so that an allocation of exactly its size takes
//! it back with no index work.

use super::{Allocation, BestFit, StreamTag, BLOCK_ALIGN, NIL};

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
        if self.hot != NIL {
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
        let slot = std::mem::replace(&mut self.hot, NIL);
        self.index_coalesced(slot);
    }

    /// An allocation of `size` bytes at `align` from the hot block, when it
    /// has exactly that size and alignment.
    #[inline]
    pub(super) fn take_hot(&mut self, size: usize, align: usize, requested: usize) -> Option<Allocation> {
        let slot = self.hot;
        if slot == NIL {
            return None;
        }
        let b = &mut self.blocks[slot as usize];
        if b.size != size || b.addr % align.max(BLOCK_ALIGN) != 0 {
            return None;
        }
        self.hot = NIL;
        b.free = false;
        b.requested = requested;
        let (addr, tag) = (b.addr, std::mem::replace(&mut b.tag, StreamTag::NONE));
        self.live.insert(addr, slot);
        self.count_allocation(size, requested);
        Some(Allocation { addr, size, tag })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BestFit, FreeError, StreamTag};
    use crate::upstream::Chunk;

    const K: usize = 1024;

    /// Four 1 KiB blocks at the front of a 1 MiB chunk, then a free tail.
    fn four(hot: bool) -> (BestFit, [usize; 4]) {
        let mut f = BestFit::new();
        f.set_hot_block(hot);
        assert!(f.add_chunk(Chunk { addr: 1 << 20, size: 1 << 20 }));
        let a = [0; 4].map(|_| f.allocate(K, 256, K).unwrap().addr);
        (f, a)
    }

    /// With the hot block, an allocation of the size freed last takes that
    /// very block back, where best fit (without it) takes the lowest
    /// address among equal fits; without it the same steps give the
    /// lowest one. Every other operation sees the blocks coalesced.
    #[test]
    fn the_block_freed_last_is_taken_back_by_an_allocation_of_its_size() {
        for hot in [false, true] {
            let (mut f, [a, _, c, _]) = four(hot);
            f.free(a, StreamTag::NONE).unwrap();
            f.free(c, StreamTag::NONE).unwrap();
            f.check_invariants().unwrap();
            let again = f.allocate(K, 256, K).unwrap();
            assert_eq!(again.addr, if hot { c } else { a }, "hot block {hot}");
            f.check_invariants().unwrap();
            // A different size: the hot block (if any) is coalesced first.
            f.free(again.addr, StreamTag::NONE).unwrap();
            let big = f.allocate(2 * K, 256, 2 * K).unwrap();
            f.flush_hot();
            f.check_invariants().unwrap();
            assert_eq!(f.stats().in_use, 2 * K + 2 * K, "hot block {hot}");
            assert!(big.addr > c, "hot block {hot}: 2 KiB fits only past the four blocks");
        }
    }

    /// The hot block counts as free at once (statistics), refuses a second
    /// free, and is an interior-pointer error inside; a wholly free chunk
    /// whose last block is hot is still taken out whole.
    #[test]
    fn a_hot_block_is_free_for_every_check_and_for_chunk_release() {
        let (mut f, [a, b, c, d]) = four(true);
        f.free(a, StreamTag::NONE).unwrap();
        assert_eq!(f.stats().in_use, 3 * K);
        assert_eq!(f.free(a, StreamTag::NONE), Err(FreeError::DoubleFree));
        assert!(matches!(f.free(a + 256, StreamTag::NONE), Err(FreeError::Interior { .. })));
        assert_eq!(f.block_count(), 5, "3 live, the hot one and the free tail");
        for p in [b, c, d] {
            f.free(p, StreamTag::NONE).unwrap();
        }
        f.check_invariants().unwrap();
        let taken = f.take_free_chunks();
        assert_eq!(taken.len(), 1, "the chunk is wholly free once its hot block is coalesced");
        assert_eq!(f.stats().reserved, 0);
        f.check_invariants().unwrap();
    }

    /// A free that leaves its chunk wholly free once coalesced raises the
    /// flag other arenas read before they look for such a chunk, though
    /// the block waits hot.
    #[test]
    fn a_hot_block_that_frees_its_chunk_raises_the_whole_free_flag() {
        let (mut f, [a, b, c, d]) = four(true);
        let flag = f.whole_free_flag();
        for p in [a, b, c] {
            f.free(p, StreamTag::NONE).unwrap();
        }
        flag.store(false, std::sync::atomic::Ordering::Relaxed);
        f.free(d, StreamTag::NONE).unwrap();
        assert!(flag.load(std::sync::atomic::Ordering::Relaxed));
        assert_eq!(f.take_free_chunk_fitting(0, 0).map(|(c, _)| c.size), Some(1 << 20));
    }

    /// An allocation undone (its pages not mapped yet) is never left hot:
    /// the next allocation of that size goes through placement again.
    #[test]
    fn an_undone_allocation_is_not_left_hot() {
        let (mut f, [a, ..]) = four(true);
        f.free(a, StreamTag::NONE).unwrap();
        let x = f.allocate(4 * K, 256, 4 * K).unwrap();
        f.undo_allocate(&x);
        f.check_invariants().unwrap();
        assert_eq!(f.block_count(), 5, "a free, 3 live, the free tail: nothing hot");
        assert_eq!(f.free_blocks(), 2, "both free blocks are indexed");
    }
}
