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
    /// The most pages live blocks touched at once, ever: the page floor
    /// that sets the remap budget (`pool/remap.rs`). Never reset: a reset
    /// of the reported peaks must not change what the pool may hold.
    pub(super) peak_touched: usize,
    /// The most pages live blocks touched at once since the last peak
    /// reset ([`BestFit::reset_touched_peak`]): reported only.
    pub(super) reported_peak: usize,
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

    /// The pages live blocks touch now, and the most they ever touched at
    /// once, which peak resets leave alone: the page floor of the remap
    /// budget (0 unless [`count_pages`](Self::count_pages) was called).
    pub fn touched_pages(&self) -> (usize, usize) {
        if self.pages.shift == 0 {
            return (0, 0);
        }
        (self.touched_now(), self.pages.peak_touched)
    }

    /// The most pages live blocks touched at once since the last
    /// [`reset_touched_peak`](Self::reset_touched_peak) (the reported
    /// `peak_touched`).
    pub fn reported_touched_peak(&self) -> usize {
        if self.pages.shift == 0 {
            return 0;
        }
        self.pages.reported_peak
    }

    /// Sets the reported touched-page peak to the count now. The peak that
    /// sets the remap budget stays: statistics never change behaviour.
    pub fn reset_touched_peak(&mut self) {
        self.flush_hot();
        self.pages.reported_peak = 0;
        self.note_touched();
    }

    /// Raises the touched-page peak to the count now (after an operation
    /// that may touch new pages; never inside one, whose steps may leave a
    /// block briefly out of the index).
    #[inline]
    pub(super) fn note_touched(&mut self) {
        if self.pages.shift != 0 {
            let now = self.touched_now();
            self.pages.peak_touched = self.pages.peak_touched.max(now);
            self.pages.reported_peak = self.pages.reported_peak.max(now);
        }
    }
}
