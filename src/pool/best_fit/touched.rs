//! The pages live blocks touch: the page floor of best fit's own
//! placement, counted as the whole pages lying inside free blocks.

use super::BestFit;
use crate::sync::{Arc, AtomicUsize, Ordering};
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

/// The pages live blocks touch, summed over the allocators of a set of
/// pools (shards), and the most they touched at once: each allocator adds
/// its changes as it makes them ([`BestFit::share_pages`]).
#[derive(Debug)]
pub(crate) struct SetPages {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl SetPages {
    pub(crate) fn new() -> Self {
        SetPages { now: AtomicUsize::new(0), peak: AtomicUsize::new(0) }
    }

    /// The pages live blocks of the set touch now, and the most they
    /// touched at once.
    pub(crate) fn load(&self) -> (usize, usize) {
        (self.now.load(Ordering::Relaxed), self.peak.load(Ordering::Relaxed))
    }
}

impl BestFit {
    /// Adds this allocator's touched pages (counting on: see
    /// [`count_pages`](Self::count_pages)) to `set`'s sum from now on.
    pub(crate) fn share_pages(&mut self, set: Arc<SetPages>) {
        self.set_pages = Some((set, 0));
        self.publish_touched();
    }

    /// Brings the set's sum up to date with the pages live blocks touch
    /// now (after an allocation or a free; a change missed meanwhile is
    /// added with the next).
    #[inline]
    pub(super) fn publish_touched(&mut self) {
        if self.pages.shift == 0 {
            return;
        }
        let now = self.touched_now();
        let Some((set, published)) = &mut self.set_pages else { return };
        if now > *published {
            let sum = set.now.fetch_add(now - *published, Ordering::Relaxed) + (now - *published);
            if sum > set.peak.load(Ordering::Relaxed) {
                set.peak.fetch_max(sum, Ordering::Relaxed);
            }
        } else if now < *published {
            set.now.fetch_sub(*published - now, Ordering::Relaxed);
        }
        *published = now;
    }

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

    /// Sets the peak that sets the remap budget to the count now: the
    /// pool passed to a new thread (a shard claimed anew,
    /// `pool/shards.rs`), whose layout owes nothing to the last one's.
    pub fn rebase_touched_peak(&mut self) {
        self.flush_hot();
        if self.pages.shift != 0 {
            self.pages.peak_touched = self.touched_now();
        }
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
            self.publish_touched();
        }
    }
}
