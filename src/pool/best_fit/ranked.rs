//! Placement that ranks some space ahead of the rest (page remapping:
//! mapped pages ahead of unmapped ones), and the views of free space a
//! remapping pool needs.

use super::{Allocation, BestFit, NIL};

use crate::tag::StreamTag;

use crate::upstream::{Chunk, BLOCK_ALIGN};

/// How many free blocks [`BestFit::allocate_in_spans`] looks into, among
/// the best fits and again among the largest.
pub const SPAN_LIMIT: usize = 32;

/// Where [`BestFit::place_preferring`] found room.
pub(crate) enum Preferred {
    /// A preferred placement, allocated.
    Taken(Allocation),
    /// None preferred: the exact best fit, not allocated.
    BestFit(BestFitAt),
}

/// The exact best fit of a request, found but not allocated: the free
/// block's slot and the aligned start in it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BestFitAt {
    slot: u32,
    /// Where the placement would start.
    pub(crate) addr: usize,
}

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
        preferred: impl FnMut(usize, usize) -> bool,
    ) -> Option<(Allocation, bool)> {
        Some(match self.place_preferring(size, align, requested, limit, preferred)? {
            Preferred::Taken(a) => (a, true),
            Preferred::BestFit(fit) => (self.allocate_slot_at(fit.slot, fit.addr, size, requested), false),
        })
    }

    /// [`allocate_preferring`](Self::allocate_preferring) that allocates
    /// only a preferred placement: when none is, it says where the exact
    /// best fit lies and leaves the blocks as they were, for a caller that
    /// looks further before it decides ([`allocate_best_fit`](Self::allocate_best_fit)
    /// takes it). `None`: no free block fits.
    #[inline]
    pub(crate) fn place_preferring(
        &mut self,
        size: usize,
        align: usize,
        requested: usize,
        limit: usize,
        mut preferred: impl FnMut(usize, usize) -> bool,
    ) -> Option<Preferred> {
        debug_assert!(size % BLOCK_ALIGN == 0 && size > 0);
        let align = align.max(BLOCK_ALIGN);
        // The hot block was live until its free, so its pages are there,
        // unless they were given back meanwhile (a memory tag's sleep
        // unmaps live blocks' pages, and a block freed while asleep comes
        // here with holes): it is taken only where it is preferred.
        let hot = self.hot.0;
        if hot != NIL && preferred(self.blocks[hot as usize].addr, size) {
            if let Some(a) = self.take_hot(size, align, requested) {
                return Some(Preferred::Taken(a));
            }
        }
        self.flush_hot();
        let mut asked = None;
        if align == BLOCK_ALIGN {
            // The common case: the exact best fit is preferred.
            let (_, addr, slot) = self.free_index.best_fit(size)?;
            if preferred(addr, size) {
                return Some(Preferred::Taken(self.allocate_slot_at(slot, addr, size, requested)));
            }
            asked = Some(slot);
        }
        self.place_ranked(size, align, requested, limit, asked, preferred)
    }

    /// Allocates at the exact best fit [`place_preferring`](Self::place_preferring)
    /// found, with no change to the blocks since.
    pub(crate) fn allocate_best_fit(&mut self, fit: BestFitAt, size: usize, requested: usize) -> Allocation {
        debug_assert!(self.blocks[fit.slot as usize].free);
        self.allocate_slot_at(fit.slot, fit.addr, size, requested)
    }

    /// The scan of [`place_preferring`](Self::place_preferring) past the
    /// exact best fit (`asked`: the block whose start `preferred` already
    /// turned down, not asked again).
    #[cold]
    fn place_ranked(
        &mut self,
        size: usize,
        align: usize,
        requested: usize,
        limit: usize,
        asked: Option<u32>,
        mut preferred: impl FnMut(usize, usize) -> bool,
    ) -> Option<Preferred> {
        let mut first = None;
        let mut chosen = None;
        for (seen, &(bsize, addr, slot)) in self.free_index.at_least(size).enumerate() {
            let start = addr.next_multiple_of(align);
            if start - addr + size > bsize {
                continue;
            }
            first.get_or_insert(BestFitAt { slot, addr: start });
            if Some(slot) != asked && preferred(start, size) {
                chosen = Some((slot, start));
                break;
            }
            if seen + 1 >= limit {
                break;
            }
        }
        match chosen {
            Some((slot, start)) => Some(Preferred::Taken(self.allocate_slot_at(slot, start, size, requested))),
            None => first.map(Preferred::BestFit),
        }
    }

    /// An allocation of `size` bytes at `align` inside a span that
    /// `spans` reports for a free block (`spans(addr, size)`: the spans of
    /// the free block at `addr` a placement may use, in address order),
    /// or `None` when no span of any free block holds it. The smallest
    /// such span wins (ties: the lowest address), and the block is placed
    /// at its start: best fit over the spans instead of over the blocks.
    /// (A remapping pool: the mapped runs inside free blocks, so a request
    /// that fits in mapped memory somewhere in the middle of a large free
    /// block is placed there instead of mapping pages at a block's start.)
    pub fn allocate_in_spans(
        &mut self,
        size: usize,
        align: usize,
        requested: usize,
        mut spans: impl FnMut(usize, usize) -> Vec<Chunk>,
    ) -> Option<Allocation> {
        debug_assert!(size % BLOCK_ALIGN == 0 && size > 0);
        let align = align.max(BLOCK_ALIGN);
        self.flush_hot();
        // (span size, start, slot) of the best span so far.
        let mut best: Option<(usize, usize, u32)> = None;
        for (bsize, addr, slot) in self.span_candidates(size) {
            for span in spans(addr, bsize) {
                let start = span.addr.next_multiple_of(align);
                if start + size > span.end() || best.is_some_and(|b| (span.size, start) >= (b.0, b.1)) {
                    continue;
                }
                best = Some((span.size, start, slot));
            }
        }
        let (_, start, slot) = best?;
        Some(self.allocate_slot_at(slot, start, size, requested))
    }

    /// The free blocks placement looks into for spans: the first
    /// [`SPAN_LIMIT`] in best-fit order and the [`SPAN_LIMIT`] largest
    /// (where large mapped runs lie), as `(size, addr, slot)`.
    fn span_candidates(&self, size: usize) -> impl Iterator<Item = (usize, usize, u32)> + '_ {
        let near = self.free_index.at_least(size).take(SPAN_LIMIT);
        let large = self.free_index.largest_first().take_while(move |k| k.0 >= size).take(SPAN_LIMIT);
        near.chain(large).copied()
    }

    /// An allocation of `size` bytes at `align` that touches fewer than
    /// `worst` pages `holes` counts (`holes(addr, size)`), the fewest
    /// found, or `None`. Looked at: the same free blocks as
    /// [`allocate_in_spans`](Self::allocate_in_spans), each at its start
    /// and at the start of every span `spans` reports in it.
    /// (A remapping pool: the placement that needs the fewest pages mapped
    /// when none needs none, so the fewest pieces move.)
    pub fn allocate_fewest_holes(
        &mut self,
        size: usize,
        align: usize,
        requested: usize,
        worst: usize,
        mut spans: impl FnMut(usize, usize) -> Vec<Chunk>,
        mut holes: impl FnMut(usize, usize) -> usize,
    ) -> Option<Allocation> {
        debug_assert!(size % BLOCK_ALIGN == 0 && size > 0);
        let align = align.max(BLOCK_ALIGN);
        self.flush_hot();
        // (holes, start, slot) of the best placement so far.
        let mut best: Option<(usize, usize, u32)> = None;
        for (bsize, addr, slot) in self.span_candidates(size) {
            let end = addr + bsize;
            let mut consider = |start: usize| {
                if start < addr || start + size > end {
                    return;
                }
                let n = holes(start, size);
                if n < worst && best.is_none_or(|b| n < b.0) {
                    best = Some((n, start, slot));
                }
            };
            consider(addr.next_multiple_of(align));
            for span in spans(addr, bsize) {
                consider(span.addr.next_multiple_of(align));
            }
        }
        let (_, start, slot) = best?;
        Some(self.allocate_slot_at(slot, start, size, requested))
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

    /// Free blocks of at least `min` bytes, `(addr, size, tag)`, top first.
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

#[cfg(test)]
mod tests;
