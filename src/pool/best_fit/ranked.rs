//! Placement that ranks some space ahead of the rest (page remapping:
//! mapped pages ahead of unmapped ones), and the views of free space a
//! remapping pool needs.

use super::{Allocation, BestFit};

use crate::tag::StreamTag;

use crate::upstream::BLOCK_ALIGN;

impl BestFit {
    /// As [`allocate`](BestFit::allocate), but among the first `limit`
    /// candidates in best-fit order (smallest fitting block, then lowest
    /// address) takes the first whose placement `[addr, addr + size)` `preferred`
    /// accepts; when none does, the exact best fit. Says whether the
    /// placement is a preferred one.
    #[inline]
    pub fn allocate_preferring(
        &mut self,
        size: usize,
        align: usize,
        requested: usize,
        limit: usize,
        mut preferred: impl FnMut(usize, usize) -> bool,
    ) -> Option<(Allocation, bool)> {
        debug_assert!(size % BLOCK_ALIGN == 0 && size > 0);
        let align = align.max(BLOCK_ALIGN);
        // The hot block was live until its free: its pages are all there.
        if let Some(a) = self.take_hot(size, align, requested) {
            return Some((a, true));
        }
        self.flush_hot();
        if align == BLOCK_ALIGN {
            // The common case: the exact best fit is preferred.
            let (_, addr, slot) = self.free_index.best_fit(size)?;
            if preferred(addr, size) {
                return Some((self.allocate_slot(slot, size, align, requested), true));
            }
        }
        self.allocate_ranked(size, align, requested, limit, preferred)
    }

    /// The scan of [`allocate_preferring`](Self::allocate_preferring) past
    /// the exact best fit.
    #[cold]
    fn allocate_ranked(
        &mut self,
        size: usize,
        align: usize,
        requested: usize,
        limit: usize,
        mut preferred: impl FnMut(usize, usize) -> bool,
    ) -> Option<(Allocation, bool)> {
        let mut first = None;
        let mut chosen = None;
        for (seen, &(bsize, addr, slot)) in self.free_index.at_least(size).enumerate() {
            let start = addr.next_multiple_of(align);
            if start - addr + size > bsize {
                continue;
            }
            first.get_or_insert(slot);
            if preferred(start, size) {
                chosen = Some(slot);
                break;
            }
            if seen + 1 >= limit {
                break;
            }
        }
        let hit = chosen.is_some();
        let slot = chosen.or(first)?;
        Some((self.allocate_slot(slot, size, align, requested), hit))
    }

    /// Takes back an allocation just made (a caller that can't use its
    /// placement yet): frees it with the tag the block had and undoes the
    /// counts it added (peaks stay).
    pub fn undo_allocate(&mut self, a: &Allocation) {
        // Not left hot: the placement may cover pages that are not mapped,
        // and a hot block is taken back as it is.
        let freed = self.free(a.addr, a.tag);
        self.flush_hot();
        if freed.is_ok() {
            self.stats.allocations -= 1;
            self.stats.frees -= 1;
        }
    }

    /// Every free block of at least `min` bytes as `(addr, size, tag)`,
    /// highest address first.
    pub fn free_blocks_highest_first(&mut self, min: usize) -> Vec<(usize, usize, StreamTag)> {
        self.flush_hot();
        let mut v: Vec<(usize, usize, StreamTag)> = self
            .free_index
            .at_least(min)
            .map(|&(size, addr, slot)| (addr, size, self.blocks[slot as usize].tag))
            .collect();
        v.sort_unstable_by_key(|b| std::cmp::Reverse(b.0));
        v
    }
}
