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
//! - **Mapped runs inside free blocks**: when mapping the exact best fit's
//!   holes would take the pool above its budget (a move), placement first
//!   looks for a run of mapped pages inside a free block that holds the
//!   request ([`BestFit::allocate_in_spans`](super::BestFit::allocate_in_spans):
//!   the smallest such run among the best fits and the largest blocks) and
//!   places it at the run's start (a large free block whose first page is
//!   a hole often has hundreds of mapped pages further in).
//! - **Mapping** happens under the pool's remap lock, never under the pool
//!   lock: a placement that needs pages mapped is only looked at, not
//!   allocated ([`BestFit::place_preferring`]); the remap lock is taken,
//!   the placement made again and allocated, the touched holes mapped
//!   (one map call per piece of memory, one access call per run), and
//!   the allocation kept.
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
//! - **Lent memory**: memory that moves is not unmapped on the
//!   allocating thread: once no queued work may use it (its blocks'
//!   stream work is known complete, or after the wait above) it is lent
//!   ([`Upstream::lend_within`](crate::upstream::Upstream::lend_within)),
//!   mapped at its new place while its old place stays mapped, and the
//!   mapper thread unmaps the old place afterwards (a map that needs
//!   those addresses first unmaps it, or waits while the mapper does), so
//!   a move costs the allocating thread no unmap, the dearest of the calls
//!   (docs/results.md#growth-and-page-moves-what-the-driver-calls-cost).
//!   Memory is never lent while work that may use it could run beside the
//!   new owner's: through its old place that work would reach the new
//!   owner's memory. Lent memory the move's map did not use stays kept; a
//!   later map (maybe for another stream) takes it only once its fence
//!   has passed, waiting for it on the host if need be. Lent memory the
//!   pool releases (above its budget) leaves the device only with its old
//!   mapping: at the release where no queued work may use it, else at the
//!   next map once its fence has passed.
//! - **Moves behind a fence**: memory whose blocks were freed on a stream
//!   is lent with no wait on the host. The pool asks its fence maker
//!   ([`Pool::set_fence_maker`]; a device allocator records a CUDA event
//!   on that stream, or on every stream with frees not known complete
//!   for a block merged from frees on several, [`StreamTag::MIXED`]) for
//!   a fence there, and the requesting stream waits for it on the device
//!   (`cuStreamWaitEvent`, nothing when it is the same stream): the new
//!   owner's work runs after the old. The old mapping stays until the
//!   fence has passed: the mapper thread passes over it until then, and a
//!   map that needs those addresses waits for it. Memory moved for a
//!   request on no stream, or where no fence can be made, moves after a
//!   wait for the device and its peers (as does all memory of a region
//!   that peers map). Free blocks give work known complete first, then the
//!   rest from the top down; each run of spans of one kind is lent in one
//!   call, with one fence per stream. A program's allocating thread
//!   usually runs ahead of its streams, so nearly all free memory has work
//!   that may be queued: without fences every move would wait for the
//!   whole device.
//! - **Kept memory**: memory unmapped to move is kept (with no address)
//!   for the next map, which maps it before making new memory (held).
//! - **Out of memory**: [`Pool::release_cached`] unmaps every wholly free
//!   piece and releases the kept memory: the retry ladder's first step.
//! - Pools with [`PoolConfig::keep_chunks`](super::PoolConfig::keep_chunks)
//!   never remap (their graphs replay later into free-looking blocks).

use super::best_fit::Preferred;
use super::page_map::{budget, Pages};
use super::{Allocation, BestFit, Inner, Pool};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::tag::StreamTag;
use crate::upstream::{Chunk, Queued, Upstream};

/// Best-fit candidates placement tries for one touching only mapped pages.
pub const RANK_LIMIT: usize = 16;

/// The work one remap step does outside the pool lock.
struct Plan {
    alloc: Allocation,
    runs: Vec<Chunk>,
    /// Free spans that may give their memory, in the order they give:
    /// those whose work is known complete first, then the rest, highest
    /// first; each with what work may still use it.
    spans: Vec<(Chunk, Gives)>,
    want: usize,
    /// The requesting stream's id (0: none).
    stream: u64,
}

/// Which work may still use a free block that may give memory to a move
/// for a request on a stream: how its memory is lent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Gives {
    /// None: no wait.
    Settled,
    /// Work queued on this one stream (the requesting one, or another;
    /// [`StreamTag::MIXED`]'s stream: on several): no wait on the host,
    /// with a fence there that the requesting stream waits for on the
    /// device.
    Behind(u64),
    /// A request on no stream: a wait for the device.
    Pending,
}

impl Gives {
    /// The kind of a free block tagged `tag`, for a request on `stream`
    /// (0: none), where the pool can make fences or not.
    fn of(fit: &BestFit, tag: StreamTag, stream: u64, fences: bool) -> Gives {
        if fit.tag_settled(tag) {
            Gives::Settled
        } else if fences && stream != 0 && tag.stream != 0 {
            // (A merged block's streams are not known: its fence covers
            // every stream with work that may be queued.)
            Gives::Behind(tag.stream)
        } else {
            Gives::Pending
        }
    }
}

/// Where [`place_mapped`] put a request.
pub(super) enum Placed {
    /// On mapped pages: nothing to map.
    Mapped(Allocation),
    /// No free block fits: the pool must grow.
    NoFit,
    /// A free block fits, but pages must be mapped there first.
    NeedsMap,
}

/// The placement of a remapping pool that needs no map (under the pool's
/// lock): best fit preferring mapped pages; where no candidate is mapped
/// where it starts and mapping would move memory, mapped memory inside a
/// free block, if some holds the request.
#[inline]
pub(super) fn place_mapped(
    fit: &mut BestFit,
    pages: &Pages,
    slack_ppm: u32,
    rounded: usize,
    align: usize,
    size: usize,
) -> Placed {
    match fit.place_preferring(rounded, align, size, RANK_LIMIT, |at, len| pages.clear(at, len)) {
        None => Placed::NoFit,
        Some(Preferred::Taken(a)) => Placed::Mapped(a),
        Some(Preferred::BestFit(at)) => {
            // Looked at where it lies, not allocated: nothing to undo.
            let moves = would_move(pages, at.addr, rounded, budget(fit, pages, slack_ppm));
            let spans = |at, len| pages.mapped_inside(at, len);
            match moves.then(|| fit.allocate_in_spans(rounded, align, size, spans)).flatten() {
                Some(a) => Placed::Mapped(a),
                None => Placed::NeedsMap,
            }
        }
    }
}

/// Whether mapping the holes of `a` would take the pool above `budget`
/// (physical pages), so that memory would have to move: kept memory maps
/// without raising what is held.
fn would_move(pages: &Pages, addr: usize, size: usize, budget: usize) -> bool {
    pages.physical() + hole_pages(pages, addr, size).saturating_sub(pages.kept) > budget
}

/// The pages of `[addr, addr + size)` with no memory mapped.
fn hole_pages(pages: &Pages, addr: usize, size: usize) -> usize {
    pages.hole_count(addr, size)
}

impl<U: Upstream> Pool<U> {
    /// Allocates from the shared pool with page remapping: mapped space
    /// first; holes the placement touches are mapped under the remap lock.
    /// `Ok(None)` when no free block fits (the caller grows the pool).
    /// `stream` is the request's (0: none).
    #[inline]
    pub(super) fn allocate_remapping(
        &self,
        rounded: usize,
        align: usize,
        size: usize,
        stream: u64,
    ) -> Result<Option<Allocation>> {
        {
            let mut inner = self.inner.lock();
            if inner.shut_down {
                return Err(Error::ShutDown("allocation"));
            }
            inner.used = true;
            let Inner { fit, pages, .. } = &mut *inner;
            match place_mapped(fit, pages, self.config.remap_slack_ppm, rounded, align, size) {
                Placed::Mapped(a) => return Ok(Some(a)),
                Placed::NoFit => return Ok(None),
                Placed::NeedsMap => {}
            }
        }
        self.map_for(rounded, align, size, stream)
    }

    /// The slow path of [`allocate_remapping`](Self::allocate_remapping):
    /// under the remap lock, place again and map the holes touched.
    #[cold]
    fn map_for(&self, rounded: usize, align: usize, size: usize, stream: u64) -> Result<Option<Allocation>> {
        let _remap = lock(&self.remap_lock);
        let plan = {
            let mut inner = self.inner.lock();
            if inner.shut_down {
                return Err(Error::ShutDown("allocation"));
            }
            let Inner { fit, pages, .. } = &mut *inner;
            let at = match fit.place_preferring(rounded, align, size, RANK_LIMIT, |at, len| pages.clear(at, len)) {
                None => return Ok(None),
                Some(Preferred::Taken(a)) => return Ok(Some(a)),
                Some(Preferred::BestFit(at)) => at,
            };
            // Mapped memory may have been freed since the look above.
            let a = if would_move(pages, at.addr, rounded, budget(fit, pages, self.config.remap_slack_ppm)) {
                let worst = hole_pages(pages, at.addr, rounded);
                let spans = |at, len| pages.mapped_inside(at, len);
                if let Some(a) = fit.allocate_in_spans(rounded, align, size, spans) {
                    return Ok(Some(a));
                }
                // Else the placement that maps the fewest pages. (Neither
                // look changes the blocks when it finds nothing.)
                let spans = |at, len| pages.mapped_inside(at, len);
                let holes = |at, len| hole_pages(pages, at, len);
                match fit.allocate_fewest_holes(rounded, align, size, worst, spans, holes) {
                    Some(a) => a,
                    None => fit.allocate_best_fit(at, rounded, size),
                }
            } else {
                fit.allocate_best_fit(at, rounded, size)
            };
            let runs = pages.holes_in(a.addr, a.size);
            let needed: usize = runs.iter().map(|r| r.size >> pages.shift()).sum();
            let budget = budget(fit, pages, self.config.remap_slack_ppm);
            // Kept memory maps without raising what is held; only the rest
            // is new memory, and only new memory above the budget makes
            // this thread unmap (the background mapper keeps memory kept).
            let new = needed.saturating_sub(pages.kept);
            let want = (pages.physical() + new).saturating_sub(budget);
            let mut spans = Vec::new();
            if want > 0 {
                // Offer twice the excess (only whole pieces inside the
                // spans can move), memory no queued work may use first
                // (moving it needs no wait), then the rest from the top
                // down: memory only one stream's work may use moves behind
                // a fence, the rest after a wait.
                let mut offered = 0;
                let fences = self.mapper.as_ref().is_some_and(|job| job.fences.get().is_some());
                let free = fit.free_blocks_highest_first(pages.page());
                for settled in [true, false] {
                    for &(addr, bsize, tag) in &free {
                        if offered >= 2 * want {
                            break;
                        }
                        let gives = Gives::of(fit, tag, stream, fences);
                        if (gives == Gives::Settled) != settled {
                            continue;
                        }
                        for span in pages.mapped_inside(addr, bsize) {
                            offered += span.size >> pages.shift();
                            spans.push((span, gives));
                        }
                    }
                }
                for (span, _) in &spans {
                    // Holes while they may move: no allocation lands there.
                    pages.mark(*span, true);
                }
            }
            Plan { alloc: a, runs, spans, want: want << pages.shift(), stream }
        };
        let r = self.carry_out(plan).map(Some);
        if let Some(job) = &self.mapper {
            // New memory made where kept pieces did not fit may have taken
            // the pool above its budget: the excess goes at once.
            job.trim_excess();
            job.moved();
            if self.upstream.has_stale() {
                super::mapper::wake(job);
            }
        }
        r
    }

    /// Maps the first `bytes` of `chunk`, the pool's first chunk, at once:
    /// a pool given an explicit size holds that much memory from its first
    /// allocation (the seed's pool size), and keeps it ([`Pages::floor`]).
    ///
    /// # Errors
    /// The upstream's error mapping the memory (the chunk stays, unmapped;
    /// allocations then map pages as they need them).
    pub(super) fn map_initial(&self, chunk: Chunk, bytes: usize) -> Result<()> {
        let _remap = lock(&self.remap_lock);
        let runs = {
            let inner = self.inner.lock();
            let size = bytes.next_multiple_of(inner.pages.page()).min(chunk.size);
            inner.pages.holes_in(chunk.addr, size)
        };
        let mapped = self.upstream.map_runs(&runs);
        let kept = self.upstream.kept();
        let mut inner = self.inner.lock();
        let pages = &mut inner.pages;
        pages.set_kept(kept);
        let calls = mapped?;
        for run in &runs {
            pages.mapped += pages.mark(*run, false);
        }
        pages.map_calls += calls;
        pages.floor = bytes.min(chunk.size) >> pages.shift();
        pages.peak = pages.peak.max(pages.physical());
        Ok(())
    }

    /// Unmaps what `plan` reclaims and maps its runs (no pool lock held),
    /// then records the result.
    fn carry_out(&self, plan: Plan) -> Result<Allocation> {
        let t0 = std::time::Instant::now();
        let (unmapped, waits, unmap_err) = self.unmap_settled_first(&plan);
        let mapped = match unmap_err {
            Some(e) => Err(e),
            None => self.upstream.map_runs(&plan.runs),
        };
        if mapped.is_err() {
            self.upstream.release_kept();
        }
        let kept = self.upstream.kept();
        let took = t0.elapsed().as_nanos() as u64;
        let mut inner = self.inner.lock();
        let Inner { fit, pages, .. } = &mut *inner;
        pages.move_ns += took;
        pages.move_waits += waits;
        for (span, _) in &plan.spans {
            pages.mark(*span, false);
        }
        for piece in &unmapped {
            pages.mark(*piece, true);
            pages.mapped -= piece.size >> pages.shift();
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

    /// Unmaps up to `plan.want` bytes of whole pieces inside the plan's
    /// spans, keeping their memory for the next map, in the plan's order:
    /// each run of spans of one kind in one call, with no wait (work
    /// known complete), behind a fence on the one stream whose work may
    /// use them, or after a wait for the device (the rest).
    /// Returns what moved, how many calls waited for the device, and the
    /// first error.
    fn unmap_settled_first(&self, plan: &Plan) -> (Vec<Chunk>, u64, Option<Error>) {
        let mut out = Vec::new();
        let (mut got, mut waits) = (0, 0);
        // One fence per stream whose memory the move takes.
        let mut fences: Vec<(u64, Option<std::sync::Arc<dyn crate::tag::Fence>>)> = Vec::new();
        let mut rest = &plan.spans[..];
        while let Some(&(_, gives)) = rest.first() {
            if got >= plan.want {
                break;
            }
            let n = rest.iter().take_while(|(_, g)| *g == gives).count();
            let (run, after) = rest.split_at(n);
            rest = after;
            // The memory is lent, not unmapped: the map below maps it at
            // its new addresses while the old stay mapped, and the mapper
            // thread unmaps those (`Upstream::lend_within`; memory queued
            // work may use is lent only after the wait for that work, or
            // behind a fence that the requesting stream waits for).
            let queued = match gives {
                Gives::Settled => Queued::Nothing,
                Gives::Behind(on) => {
                    let fence = match fences.iter().find(|(s, _)| *s == on) {
                        Some((_, f)) => f.clone(),
                        None => {
                            let f = self.fence_on(on, plan.stream);
                            fences.push((on, f.clone()));
                            f
                        }
                    };
                    fence.map_or(Queued::Any, Queued::Before)
                }
                Gives::Pending => Queued::Any,
            };
            let waited = matches!(queued, Queued::Any);
            let spans: Vec<Chunk> = run.iter().map(|(c, _)| *c).collect();
            match self.upstream.lend_within(&spans, plan.want - got, queued) {
                Ok(v) => {
                    waits += u64::from(waited && !v.is_empty());
                    got += v.iter().map(|c| c.size).sum::<usize>();
                    out.extend(v);
                }
                // What the first call unmapped stays recorded.
                Err(e) => return (out, waits, Some(e)),
            }
        }
        (out, waits, None)
    }

    /// A fence at the end of the work queued so far on stream `on`, with
    /// the requesting stream `then` ordered after it, where the pool has a
    /// fence maker and it can make one.
    fn fence_on(&self, on: u64, then: u64) -> Option<std::sync::Arc<dyn crate::tag::Fence>> {
        self.mapper.as_ref()?.fences.get()?(on, then)
    }

    /// Unmaps every wholly free piece of memory and releases the kept
    /// memory (release and out-of-memory paths; the caller holds the remap
    /// lock); returns the bytes given back.
    pub(super) fn unmap_free_pages(&self) -> Result<usize> {
        // Memory released below is freed only once no old mapping of it
        // is left (waited for where work may still use it).
        self.upstream.unmap_stale(usize::MAX, true);
        let kept = self.upstream.kept();
        self.upstream.release_kept();
        self.inner.lock().pages.set_kept(0);
        let unmapped = self.unmap_spans(|fit, pages| {
            let mut spans = Vec::new();
            let mut pending = false;
            for (addr, bsize, tag) in fit.free_blocks_highest_first(pages.page()) {
                for span in pages.mapped_inside(addr, bsize) {
                    pending |= !fit.tag_settled(tag);
                    spans.push(span);
                }
            }
            (spans, pending)
        })?;
        Ok(unmapped + kept)
    }

    /// Unmaps the whole pieces inside the mapped spans `pick` chooses under
    /// the pool lock (with whether queued work may still use them), with no
    /// pool lock held while the upstream unmaps (the caller holds the remap
    /// lock), and records what went; returns the bytes unmapped.
    pub(super) fn unmap_spans(&self, pick: impl FnOnce(&mut BestFit, &Pages) -> (Vec<Chunk>, bool)) -> Result<usize> {
        let (spans, pending) = {
            let mut inner = self.inner.lock();
            let Inner { fit, pages, .. } = &mut *inner;
            let (spans, pending) = pick(fit, pages);
            for span in &spans {
                // Holes while they go: nothing lands on them meanwhile.
                pages.mark(*span, true);
            }
            (spans, pending)
        };
        if spans.is_empty() {
            return Ok(0);
        }
        let r = self.upstream.unmap_within(&spans, usize::MAX, pending, false);
        let mut inner = self.inner.lock();
        let pages = &mut inner.pages;
        for span in &spans {
            pages.mark(*span, false);
        }
        let unmapped = r.as_ref().map_or(&[][..], |v| &v[..]);
        let mut bytes = 0;
        for piece in unmapped {
            pages.mark(*piece, true);
            pages.mapped -= piece.size >> pages.shift();
            bytes += piece.size;
        }
        pages.unmap_calls += unmapped.len() as u64;
        r.map(|_| bytes)
    }
}
