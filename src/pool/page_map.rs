//! The page book of a remapping pool: which pages of its chunks have
//! memory mapped, the physical figures, and the budget (`remap.rs` says
//! how pages move).

use super::{BestFit, PoolStats};

use crate::upstream::Chunk;

/// Which pages of a remapping pool's chunks have no memory mapped.
#[derive(Debug, Default)]
pub(super) struct Pages {
    shift: u32,
    /// The address of the first page of bit 0 (aligned to 64 pages).
    base: usize,
    /// One bit per page: set for a hole (nothing mapped, or memory moving).
    holes: Vec<u64>,
    hole_count: usize,
    /// Pages mapped, and the peak of the physical pages (mapped and kept).
    pub(super) mapped: usize,
    pub(super) peak: usize,
    /// Pages of memory unmapped and kept by the upstream for the next map
    /// ([`Upstream::kept`](crate::upstream::Upstream::kept)): held, with no address.
    pub(super) kept: usize,
    /// Pages the pool holds at least once mapped: its explicit initial
    /// size ([`Pool::set_initial_size`](super::Pool::set_initial_size)),
    /// mapped whole at the first growth and never moved to stay within the
    /// budget (released only with the cached memory).
    pub(super) floor: usize,
    /// Map calls (one per piece mapped) and unmap calls (one per piece).
    pub(super) map_calls: u64,
    pub(super) unmap_calls: u64,
    /// Nanoseconds allocating threads spent moving pages for the pool.
    pub(super) move_ns: u64,
    /// Moves whose memory waited for the device first.
    pub(super) move_waits: u64,
}

impl Pages {
    pub(super) fn new(page: usize) -> Self {
        Pages { shift: page.trailing_zeros(), ..Default::default() }
    }

    pub(super) fn page(&self) -> usize {
        1 << self.shift
    }

    /// log2 of the page size.
    pub(super) fn shift(&self) -> u32 {
        self.shift
    }

    fn index(&self, addr: usize) -> usize {
        (addr - self.base) >> self.shift
    }

    /// Makes room for the pages of `[addr, end)`. Pages are counted from
    /// the first chunk's start (chunks lie whole pages apart).
    fn cover(&mut self, addr: usize, end: usize) {
        let word_span = 64usize << self.shift;
        if self.holes.is_empty() {
            self.base = addr;
        } else if addr < self.base {
            let words = (self.base - addr).div_ceil(word_span);
            self.holes.splice(0..0, std::iter::repeat_n(0, words));
            self.base -= words * word_span;
        }
        let need = (end - self.base).div_ceil(word_span);
        if self.holes.len() < need {
            self.holes.resize(need, 0);
        }
    }

    /// Whether `[addr, addr + size)` touches no hole.
    #[inline]
    pub(super) fn clear(&self, addr: usize, size: usize) -> bool {
        if self.hole_count == 0 || addr < self.base {
            return true;
        }
        let (first, last) = (self.index(addr), self.index(addr + size - 1));
        // A word at a time, the first and last words masked to the range.
        for w in first / 64..=last / 64 {
            let Some(&bits) = self.holes.get(w) else { return true };
            let low = if w == first / 64 { u64::MAX << (first % 64) } else { u64::MAX };
            let high = if w == last / 64 { u64::MAX >> (63 - last % 64) } else { u64::MAX };
            if bits & low & high != 0 {
                return false;
            }
        }
        true
    }

    /// How many pages of `[addr, addr + size)` are holes (no allocation).
    pub(super) fn hole_count(&self, addr: usize, size: usize) -> usize {
        if self.hole_count == 0 || addr < self.base || size == 0 {
            return 0;
        }
        let (first, end) = (self.index(addr), self.index(addr + size - 1) + 1);
        let mut n = 0;
        let mut p = first;
        while p < end {
            let Some(&w) = self.holes.get(p / 64) else { break };
            let bits = (64 - p % 64).min(end - p);
            let mask = if bits == 64 { u64::MAX } else { ((1u64 << bits) - 1) << (p % 64) };
            n += (w & mask).count_ones() as usize;
            p += bits;
        }
        n
    }

    /// The runs `[start, end)` of pages in `[first, end)` that are holes
    /// (`holes`) or mapped (`!holes`), in order, a word at a time.
    fn runs(&self, first: usize, end: usize, holes: bool) -> impl Iterator<Item = (usize, usize)> + '_ {
        let bit = move |p: usize| -> bool {
            let w = self.holes.get(p / 64).copied().unwrap_or(0);
            (w >> (p % 64)) & 1 == 1
        };
        // The next page at or after `p` (before `end`) whose bit is `want`.
        let seek = move |mut p: usize, want: bool| -> usize {
            while p < end {
                let w = self.holes.get(p / 64).copied().unwrap_or(0);
                let w = if want { w } else { !w } >> (p % 64);
                if w != 0 {
                    return (p + w.trailing_zeros() as usize).min(end);
                }
                p = (p / 64 + 1) * 64;
            }
            end
        };
        let mut p = first;
        std::iter::from_fn(move || {
            let start = seek(p, holes);
            if start >= end {
                return None;
            }
            let stop = seek(start, !holes);
            debug_assert!(bit(start) == holes);
            p = stop;
            Some((start, stop))
        })
    }

    fn set(&mut self, page: usize, hole: bool) -> bool {
        let (w, bit) = (page / 64, 1u64 << (page % 64));
        let was = self.holes[w] & bit != 0;
        if hole {
            self.holes[w] |= bit;
        } else {
            self.holes[w] &= !bit;
        }
        if was != hole {
            if hole {
                self.hole_count += 1;
            } else {
                self.hole_count -= 1;
            }
        }
        was
    }

    fn chunk_of(&self, (start, stop): (usize, usize)) -> Chunk {
        Chunk { addr: self.base + (start << self.shift), size: (stop - start) << self.shift }
    }

    /// The runs of holes `[addr, addr + size)` touches (page-aligned).
    pub(super) fn holes_in(&self, addr: usize, size: usize) -> Vec<Chunk> {
        let (first, last) = (self.index(addr), self.index(addr + size - 1));
        self.runs(first, last + 1, true).map(|r| self.chunk_of(r)).collect()
    }

    /// The mapped runs of whole pages inside `[addr, addr + size)`.
    pub(super) fn mapped_inside(&self, addr: usize, size: usize) -> Vec<Chunk> {
        let page = self.page();
        let start = (addr - self.base).next_multiple_of(page) >> self.shift;
        let end = (addr + size - self.base) >> self.shift;
        if start >= end {
            return Vec::new();
        }
        self.runs(start, end, false).map(|r| self.chunk_of(r)).collect()
    }

    /// Marks `run`'s pages (page-aligned) holes or not; how many changed.
    pub(super) fn mark(&mut self, run: Chunk, hole: bool) -> usize {
        self.cover(run.addr, run.end());
        let first = self.index(run.addr);
        (first..first + (run.size >> self.shift)).filter(|&p| self.set(p, hole) != hole).count()
    }

    /// Fills in the physical figures of `s`: the mapped pages with
    /// remapping on, else the chunks (all mapped).
    pub(super) fn fill_stats(&self, s: &mut PoolStats, remap: bool) {
        if remap {
            s.mapped = (self.mapped + self.kept) << self.shift;
            s.kept = self.kept << self.shift;
            s.peak_mapped = self.peak << self.shift;
            s.map_calls = self.map_calls;
            s.unmap_calls = self.unmap_calls;
            s.page_move_ns = self.move_ns;
            s.move_waits = self.move_waits;
        } else {
            s.mapped = s.reserved;
            s.peak_mapped = s.peak_reserved;
            s.map_calls = s.upstream_allocs;
            s.unmap_calls = s.upstream_frees;
        }
    }

    /// The physical pages held: mapped and kept.
    pub(super) fn physical(&self) -> usize {
        self.mapped + self.kept
    }

    /// Records the upstream's kept memory (`bytes`, read outside the pool
    /// lock under the remap lock) and raises the peak.
    pub(super) fn set_kept(&mut self, bytes: usize) {
        self.kept = bytes >> self.shift;
        self.peak = self.peak.max(self.physical());
    }

    /// Adds a chunk's new address space (nothing mapped).
    pub(super) fn add_unmapped(&mut self, addr: usize, size: usize) {
        self.mark(Chunk { addr, size }, true);
    }

    /// Forgets the pages of `[addr, addr + size)` (given back to the
    /// upstream); returns how many of them were mapped.
    pub(super) fn forget(&mut self, addr: usize, size: usize) -> usize {
        let pages = size >> self.shift;
        let was_holes = self.mark(Chunk { addr, size }, false);
        let mapped = pages - was_holes;
        self.mapped -= mapped;
        mapped
    }
}

/// The physical pages a remapping pool may hold: the page floor of its
/// placement plus the slack (`slack_ppm` millionths of it), and never less
/// than the pool's explicit size ([`Pages::floor`]).
pub(super) fn budget(fit: &BestFit, pages: &Pages, slack_ppm: u32) -> usize {
    let (_, floor) = fit.touched_pages();
    with_slack(floor, slack_ppm).max(pages.floor)
}

fn with_slack(pages: usize, slack_ppm: u32) -> usize {
    pages + (pages as u128 * u128::from(slack_ppm)).div_ceil(1_000_000) as usize
}

#[cfg(test)]
mod tests;
