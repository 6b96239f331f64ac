//! The pages live blocks touch: the page floor of best fit's own
//! placement, counted as the whole pages lying inside free blocks.

use super::BestFit;
use crate::upstream::BLOCK_ALIGN;

/// Which pages live blocks touch, counted as the whole pages lying inside
/// free blocks: a page that no live block touches lies wholly inside one
/// free block, because free neighbours coalesce. Kept only where chunks
/// are whole pages (`shift` non-zero); the touched pages are then the
/// chunks' pages less `free_pages`.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct PageCount {
    /// log2 of the page size; 0 while not counting.
    pub(super) shift: u32,
    /// Whole pages inside free blocks.
    pub(super) free_pages: usize,
    /// The most pages live blocks touched at once (since the last reset).
    pub(super) peak_touched: usize,
}

impl PageCount {
    /// Whole pages inside `[addr, addr + size)`.
    #[inline]
    pub(super) fn whole(&self, addr: usize, size: usize) -> usize {
        if self.shift == 0 {
            return 0;
        }
        let first = addr.div_ceil(1 << self.shift);
        let end = (addr + size) >> self.shift;
        end.saturating_sub(first)
    }
}

impl BestFit {
    /// Counts the pages of `page` bytes (a power of two) that live blocks
    /// touch, for [`touched_pages`](Self::touched_pages). Every chunk must
    /// then start and end on a page boundary (a remapping pool's do).
    pub fn count_pages(&mut self, page: usize) {
        debug_assert!(page.is_power_of_two() && page >= BLOCK_ALIGN);
        self.flush_hot();
        self.pages.shift = page.trailing_zeros();
        self.pages.free_pages = self.count_free_pages();
        self.note_touched();
    }

    /// The whole pages inside free blocks, counted afresh.
    pub(super) fn count_free_pages(&self) -> usize {
        self.free_index.iter().map(|&(size, addr, _)| self.pages.whole(addr, size)).sum()
    }

    /// The pages live blocks touch now (counting on).
    pub(super) fn touched_now(&self) -> usize {
        (self.stats.reserved >> self.pages.shift) - self.pages.free_pages
    }

    /// The pages live blocks touch now, and the most they touched at once
    /// (0 unless [`count_pages`](Self::count_pages) was called).
    pub fn touched_pages(&self) -> (usize, usize) {
        if self.pages.shift == 0 {
            return (0, 0);
        }
        (self.touched_now(), self.pages.peak_touched)
    }

    /// Sets the touched-page peak to the count now.
    pub fn reset_touched_peak(&mut self) {
        self.flush_hot();
        self.pages.peak_touched = 0;
        self.note_touched();
    }

    /// Raises the touched-page peak to the count now (after an operation
    /// that may touch new pages; never inside one, whose steps may leave a
    /// block briefly out of the index).
    #[inline]
    pub(super) fn note_touched(&mut self) {
        if self.pages.shift != 0 {
            self.pages.peak_touched = self.pages.peak_touched.max(self.touched_now());
        }
    }
}
