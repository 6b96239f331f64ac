//! Page remapping: physical memory near the peak of live memory.
//!
//! # Implementation details
//!
//! A pool over an upstream that can remap ([`Upstream::can_remap`]) takes
//! its chunks as address space alone and keeps a bitmap of the pages of
//! its chunks that have no memory mapped (*holes*). Physical memory held is
//! the mapped pages; the address space may be larger.
//!
//! - **Placement** ranks mapped space first: among the first
//!   [`RANK_LIMIT`] candidates in best-fit order, the first whose placement
//!   touches no hole wins; only when none does is the exact best fit taken
//!   and its holes mapped. A pool whose mapped set fits its work therefore
//!   maps nothing: steady-state iterations move nothing.
//! - **Mapping** happens under the pool's remap lock, never under the pool
//!   lock: the allocation is undone, the remap lock taken, the placement
//!   made again, the touched holes mapped (one map call per piece of
//!   memory, one access call per run), and the allocation kept.
//! - **Budget**: a remapping pool keeps its physical memory within
//!   `(1 + slack)` times the most pages its live blocks have touched at
//!   once ([`BestFit::touched_pages`](super::BestFit::touched_pages)),
//!   the page floor of its own placement (slack:
//!   [`PoolConfig::remap_slack_ppm`](super::PoolConfig::remap_slack_ppm),
//!   1 % by default). Mapping that would take it above the budget first
//!   unmaps pieces of memory lying wholly in free blocks and maps their
//!   memory where it is needed, as many as the excess. Below the budget it
//!   maps new memory and moves nothing, so a workload whose layout shifts
//!   a little from iteration to iteration moves memory only when the
//!   shift would cost more than the slack.
//! - **Which memory moves**: the free blocks at the highest addresses give
//!   first. Best fit breaks ties toward low addresses, so the top of the
//!   range is what placement comes back to last.
//! - **Pieces**: new memory is mapped in pieces of at most
//!   [`remap_piece`](crate::upstream::remap_piece) bytes (8 MiB, growing
//!   to 32 MiB with the memory held; a piece is unmapped whole), so a
//!   large block's pages can move a few at a time.
//! - **Stream order**: the pages to reclaim are marked holes before the
//!   pool lock is dropped, so no allocation lands on them while they move;
//!   when a free block that gives pages carries a stream tag, the upstream
//!   waits for the device before it unmaps (or unmaps nothing when it
//!   can't wait now, and the pool grows instead).
//! - **Kept memory**: memory unmapped to move is kept (with no address)
//!   for the next map, which maps it before it makes new memory; it counts
//!   as held. The background mapper (`mapper.rs`, when on) keeps a reserve of it
//!   by unmapping free pages off the allocating thread, so an allocation
//!   that touches holes maps kept memory and unmaps nothing itself.
//! - **Out of memory**: [`Pool::release_cached`] unmaps every wholly free
//!   piece and releases the kept memory, the first step of the retry
//!   ladder.
//! - Pools with [`PoolConfig::keep_chunks`](super::PoolConfig::keep_chunks)
//!   never remap (their graphs replay later into free-looking blocks).

use super::{Allocation, Chunk, Error, Inner, Pool, Result, Upstream};
use crate::sync::lock;

/// How many best-fit candidates placement looks at for one that touches
/// only mapped pages.
pub const RANK_LIMIT: usize = 16;

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
    /// ([`Upstream::kept`]): held, with no address.
    pub(super) kept: usize,
    /// Map calls (one per piece mapped) and unmap calls (one per piece).
    pub(super) map_calls: u64,
    pub(super) unmap_calls: u64,
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
        if first / 64 == last / 64 {
            let w = self.holes.get(first / 64).copied().unwrap_or(0);
            let mask = (u64::MAX >> (63 - (last % 64))) & (u64::MAX << (first % 64));
            return w & mask == 0;
        }
        self.runs(first, last + 1, true).next().is_none()
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

    /// The runs of holes that `[addr, addr + size)` touches, as page-aligned
    /// chunks.
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

    /// Marks the pages of `run` (page-aligned) holes or not; returns how
    /// many changed.
    pub(super) fn mark(&mut self, run: Chunk, hole: bool) -> usize {
        self.cover(run.addr, run.end());
        let first = self.index(run.addr);
        (first..first + (run.size >> self.shift)).filter(|&p| self.set(p, hole) != hole).count()
    }

    /// Fills in the physical figures of `s`: the mapped pages with
    /// remapping on, else the chunks (all mapped).
    pub(super) fn fill_stats(&self, s: &mut super::PoolStats, remap: bool) {
        if remap {
            s.mapped = (self.mapped + self.kept) << self.shift;
            s.kept = self.kept << self.shift;
            s.peak_mapped = self.peak << self.shift;
            s.map_calls = self.map_calls;
            s.unmap_calls = self.unmap_calls;
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
/// placement plus the slack (`slack_ppm` millionths of it).
pub(super) fn budget(fit: &super::BestFit, slack_ppm: u32) -> usize {
    let (_, floor) = fit.touched_pages();
    floor + (floor as u128 * u128::from(slack_ppm)).div_ceil(1_000_000) as usize
}

/// The work one remap step does outside the pool lock.
struct Plan {
    alloc: Allocation,
    runs: Vec<Chunk>,
    /// Free spans that may give their memory: first those whose work is
    /// known complete (`settled`), then those with work that may be queued.
    settled: Vec<Chunk>,
    pending: Vec<Chunk>,
    want: usize,
}

impl<U: Upstream> Pool<U> {
    /// Allocates from the shared pool with page remapping: mapped space
    /// first; holes the placement touches are mapped under the remap lock.
    /// `Ok(None)` when no free block fits (the caller grows the pool).
    #[inline]
    pub(super) fn allocate_remapping(&self, rounded: usize, align: usize, size: usize) -> Result<Option<Allocation>> {
        {
            let mut inner = self.inner.lock();
            if inner.shut_down {
                return Err(Error::ShutDown("allocation"));
            }
            inner.used = true;
            let Inner { fit, pages, .. } = &mut *inner;
            match fit.allocate_preferring(rounded, align, size, RANK_LIMIT, |at, len| pages.clear(at, len)) {
                None => return Ok(None),
                Some((a, true)) => return Ok(Some(a)),
                Some((a, false)) => fit.undo_allocate(&a),
            }
        }
        self.map_for(rounded, align, size)
    }

    /// The slow path of [`allocate_remapping`](Self::allocate_remapping):
    /// under the remap lock, place again and map the holes the placement
    /// touches.
    #[cold]
    fn map_for(&self, rounded: usize, align: usize, size: usize) -> Result<Option<Allocation>> {
        let _remap = lock(&self.remap_lock);
        let plan = {
            let mut inner = self.inner.lock();
            if inner.shut_down {
                return Err(Error::ShutDown("allocation"));
            }
            let Inner { fit, pages, .. } = &mut *inner;
            let a = match fit.allocate_preferring(rounded, align, size, RANK_LIMIT, |at, len| pages.clear(at, len)) {
                None => return Ok(None),
                Some((a, true)) => return Ok(Some(a)),
                Some((a, false)) => a,
            };
            let runs = pages.holes_in(a.addr, a.size);
            let needed: usize = runs.iter().map(|r| r.size >> pages.shift).sum();
            let budget = budget(fit, self.config.remap_slack_ppm);
            // Kept memory maps without raising what is held; only the rest
            // is new memory, and only new memory above the budget makes
            // this thread unmap (the background mapper keeps memory kept).
            let new = needed.saturating_sub(pages.kept);
            let want = (pages.physical() + new).saturating_sub(budget);
            let (mut settled, mut pending) = (Vec::new(), Vec::new());
            if want > 0 {
                // Offer twice the excess (only whole pieces inside the
                // spans can move), memory no queued work may use first:
                // moving it needs no wait for the device.
                let mut offered = 0;
                let free = fit.free_blocks_highest_first(pages.page());
                for waits in [false, true] {
                    for &(addr, bsize, tag) in &free {
                        if offered >= 2 * want {
                            break;
                        }
                        if fit.tag_settled(tag) == waits {
                            continue;
                        }
                        let spans = if waits { &mut pending } else { &mut settled };
                        for span in pages.mapped_inside(addr, bsize) {
                            offered += span.size >> pages.shift;
                            spans.push(span);
                        }
                    }
                }
                for span in settled.iter().chain(&pending) {
                    // Holes while they may move: no allocation lands there.
                    pages.mark(*span, true);
                }
            }
            Plan { alloc: a, runs, settled, pending, want: want << pages.shift }
        };
        let r = self.carry_out(plan).map(Some);
        if let Some(job) = &self.mapper {
            // New memory made where kept pieces did not fit may have taken
            // the pool above its budget: the excess goes at once.
            job.trim_excess();
            if self.config.background_mapper {
                super::mapper::wake(job);
            }
        }
        r
    }

    /// Unmaps what `plan` reclaims and maps its runs (no pool lock held),
    /// then records the result.
    fn carry_out(&self, plan: Plan) -> Result<Allocation> {
        let (unmapped, unmap_err) = self.unmap_settled_first(&plan.settled, &plan.pending, plan.want);
        let mapped = match unmap_err {
            Some(e) => Err(e),
            None => self.upstream.map_runs(&plan.runs),
        };
        if mapped.is_err() {
            self.upstream.release_kept();
        }
        let kept = self.upstream.kept();
        let mut inner = self.inner.lock();
        let Inner { fit, pages, .. } = &mut *inner;
        for span in plan.settled.iter().chain(&plan.pending) {
            pages.mark(*span, false);
        }
        for piece in &unmapped {
            pages.mark(*piece, true);
            pages.mapped -= piece.size >> pages.shift;
        }
        pages.unmap_calls += unmapped.len() as u64;
        match mapped {
            Ok(calls) => {
                for run in &plan.runs {
                    pages.mapped += pages.mark(*run, false);
                }
                pages.map_calls += calls;
                pages.set_kept(kept);
                Ok(plan.alloc)
            }
            Err(e) => {
                pages.set_kept(kept);
                fit.undo_allocate(&plan.alloc);
                Err(e)
            }
        }
    }

    /// Unmaps up to `want` bytes of whole pieces inside the spans, keeping
    /// their memory for the next map: `settled` spans first, and only if
    /// they give too little, `pending` ones (after the upstream waits for
    /// the device), so a move waits for queued work only when it must.
    fn unmap_settled_first(&self, settled: &[Chunk], pending: &[Chunk], want: usize) -> (Vec<Chunk>, Option<Error>) {
        let mut out = Vec::new();
        for (spans, waits) in [(settled, false), (pending, true)] {
            let got: usize = out.iter().map(|c: &Chunk| c.size).sum();
            if got >= want || spans.is_empty() {
                continue;
            }
            match self.upstream.unmap_within(spans, want - got, waits, true) {
                Ok(v) => out.extend(v),
                // What the first call unmapped stays recorded.
                Err(e) => return (out, Some(e)),
            }
        }
        (out, None)
    }

    /// Unmaps every wholly free piece of memory (release and out-of-memory
    /// paths; the caller holds the remap lock); returns the bytes unmapped.
    pub(super) fn unmap_free_pages(&self) -> Result<usize> {
        let (spans, pending) = {
            let mut inner = self.inner.lock();
            let Inner { fit, pages, .. } = &mut *inner;
            let mut spans = Vec::new();
            let mut pending = false;
            for (addr, bsize, tag) in fit.free_blocks_highest_first(pages.page()) {
                for span in pages.mapped_inside(addr, bsize) {
                    pending |= !fit.tag_settled(tag);
                    spans.push(span);
                }
            }
            for span in &spans {
                pages.mark(*span, true);
            }
            (spans, pending)
        };
        let kept = self.upstream.kept();
        self.upstream.release_kept();
        if spans.is_empty() {
            self.inner.lock().pages.set_kept(0);
            return Ok(kept);
        }
        let r = self.upstream.unmap_within(&spans, usize::MAX, pending, false);
        let mut inner = self.inner.lock();
        let pages = &mut inner.pages;
        pages.set_kept(0);
        for span in &spans {
            pages.mark(*span, false);
        }
        let unmapped = r.as_ref().map_or(&[][..], |v| &v[..]);
        let mut bytes = 0;
        for piece in unmapped {
            pages.mark(*piece, true);
            pages.mapped -= piece.size >> pages.shift;
            bytes += piece.size;
        }
        pages.unmap_calls += unmapped.len() as u64;
        r.map(|_| bytes + kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_runs_match_a_page_by_page_walk() {
        let page = 4096;
        let mut p = Pages::new(page);
        let base = 1 << 30;
        p.add_unmapped(base, 300 * page);
        // Map a pattern that crosses word edges.
        let mut mapped = vec![false; 300];
        let mut x = 12345u64;
        for _ in 0..60 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let start = (x % 290) as usize;
            let len = 1 + (x >> 20) as usize % 9;
            p.mark(Chunk { addr: base + start * page, size: len * page }, false);
            mapped[start..start + len].iter_mut().for_each(|m| *m = true);
        }
        for (start, len) in [(0, 300), (63, 2), (1, 64), (100, 130), (299, 1)] {
            let addr = base + start * page + 256;
            let size = len * page - 512;
            let want_holes: usize = (start..start + len).filter(|&i| !mapped[i]).count();
            let got: usize = p.holes_in(addr, size).iter().map(|c| c.size / page).sum();
            assert_eq!(got, want_holes, "holes in {start}+{len}");
            assert_eq!(p.clear(addr, size), want_holes == 0, "clear {start}+{len}");
            // Whole pages inside: the first and last are cut by the 256 B.
            let inner = (start + 1..start + len - 1).filter(|&i| mapped[i]).count();
            let got: usize = p.mapped_inside(addr, size).iter().map(|c| c.size / page).sum();
            assert_eq!(got, inner, "mapped inside {start}+{len}");
        }
    }
}
