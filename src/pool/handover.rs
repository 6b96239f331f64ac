//! Mapped memory changes shard with no driver call: the remapping shards
//! of a device share one address space (each shard's upstream is a view
//! of one reservation), so a free range with memory mapped under it can
//! leave one shard's pool and join another's as it is.
//!
//! # Implementation details
//!
//! - **When.** A remapping shard about to map new memory for a request
//!   (`remap.rs`, `map_for`: the placement touches holes that its kept
//!   memory does not cover) first asks the set for a range
//!   ([`Upstream::take_mapped`], answered by the shard's `Tracked`
//!   wrapper). The set hands one over only when it would otherwise hold
//!   more than [`HAND_OVER_ABOVE_PPM`] of the most pages its blocks
//!   touched at once (the set's page floor, as seen at each such ask):
//!   below that, new memory is made and nothing moves, so shards keep
//!   what their own threads come back to.
//! - **Who gives.** Shards no thread uses first; then shards in use,
//!   first what they hold above their remap budget (the most pages their
//!   live blocks touched, with the slack), then, when the set would
//!   otherwise hold more than [`OVER_LIVE_ABOVE_PPM`] of its page floor,
//!   what they hold above the pages their live blocks touch now (with
//!   the slack): no shard keeps memory for a peak of its own that the
//!   set's peak doesn't reach (shards' peaks rarely coincide, and their
//!   sum is what a set of busy shards would otherwise hold). Below that
//!   the set's threads keep their working sets: a shard that gives below
//!   its own peak asks again when its thread returns to it, and with 16
//!   threads on a stream each, handing memory back and forth below 110 %
//!   halved the workload's speed in some passes.
//!   The highest-numbered first (new threads claim the lowest idle
//!   shard).
//!   A shard busy remapping (its remap lock taken) or allocating (its
//!   pool lock taken) is passed over: two shards that ask each other
//!   can't wait on each other, and an ask never waits for a thread
//!   descheduled while it holds its shard's lock.
//! - **What.** The giver picks free blocks whose queued work is known
//!   complete or was queued on the request's stream (stream order then
//!   covers it, and the range or block carries that stream's tag) and,
//!   inside them (a look at its largest free blocks only), spans of mapped
//!   pages at least as large as the request, the largest first; a shard
//!   in use gives at most what it holds above its budget. With the pool
//!   lock dropped, the upstream says where its pieces lie (a piece is
//!   mapped and unmapped whole), and the range is the run of whole pieces
//!   at the top of the first span that holds [`RANGE_PREFERRED`] (else
//!   the request). Under the pool lock again, a range still free and
//!   mapped (an allocation may have landed there meanwhile: then nothing
//!   moves) leaves the giver's allocator, which cuts its chunk around it
//!   ([`BestFit::take_free_range`](super::BestFit::take_free_range)), and
//!   its pages leave the giver's page book. When no range holds the
//!   request, a giver lends a block placed inside its mapped free memory
//!   (only to a shard with no thread cache, which would keep the block):
//!   the block stays the giver's, and its free goes back there.
//! - **Asking costs.** Only when the first look finds nothing does the set
//!   run its stream poll (`cuStreamQuery` of the streams with pending
//!   frees, no pool lock held; at most once a millisecond) and look once
//!   more; an ask that found nothing makes the set's asks map new memory without looking for
//!   [`QUIET_NS`], unless a thread handed its shard back meanwhile.
//! - **Ownership.** The chunk directory records the taker as the range's
//!   owner before the taker's pool adds it as a chunk whose pages are all
//!   mapped and places the request at its start. No block of the range is
//!   live while it moves, so no free can be in flight for it; a stale
//!   free (a double free) finds one of the two shards and is refused. The
//!   pieces under it are the address space's, not a shard's: whichever
//!   shard holds the range later unmaps them through its own view.
//! - **Budgets.** The giver's physical pages drop and the taker's rise by
//!   the range; the touched-page floors don't change (the range was free
//!   and joins as free), so each shard's remap budget goes with the pages
//!   its blocks touch, and the memory with the shard that needs it.

use super::best_fit::Preferred;
use super::page_map::{budget, live_need};
use super::remap::RANK_LIMIT;
use super::shard_upstream::Tracked;
use super::{Inner, Pool};
use crate::sync::{try_lock, Ordering};
use crate::tag::StreamTag;
use crate::upstream::{Chunk, MappedGift, Upstream};

/// A set of shards hands a mapped range to a shard that would map new
/// memory only when it would otherwise hold more than this many
/// millionths of the most pages its blocks touched at once (102 %): a
/// hand-over costs no driver call, so the set holds close to its floor.
pub(super) const HAND_OVER_ABOVE_PPM: u64 = 1_020_000;

/// Shards in use give what they hold above the pages their live blocks
/// touch now only when the set would otherwise hold more than this many
/// millionths of the most pages its blocks touched at once (110 %): a
/// shard that gives below its own peak asks again when its thread
/// returns to it, so this costs hand-overs back and forth.
pub(super) const OVER_LIVE_ABOVE_PPM: u64 = 1_100_000;

/// A range handed over is at least the request and, where a span holds
/// it, this large: a shard that needs memory now will likely need more
/// soon, and every hand-over costs a look at the other shards.
const RANGE_PREFERRED: usize = 64 << 20;

/// After an ask that found nothing to take, asks of the set map new
/// memory without looking for this long (nanoseconds), unless a shard
/// went idle meanwhile: the others' memory rarely frees up from one
/// allocation to the next, and a look takes every free shard's lock.
const QUIET_NS: u64 = 1_000_000;

/// Nanoseconds since the first look of the process (the quiet period's
/// clock).
#[cfg(not(loom))]
fn now_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64
}

/// Under loom every ask looks (no clock in a model).
#[cfg(loom)]
fn now_ns() -> u64 {
    u64::MAX
}

/// Which shards give, in turn (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Giver {
    /// Shards no thread uses: any mapped free range.
    Idle,
    /// Shards in use: what they hold above their remap budget.
    OverBudget,
    /// Shards in use: what they hold above the pages their live blocks
    /// touch now, with the slack.
    OverLive,
}

/// How many spans a giver offers at most for one hand-over.
const CANDIDATES: usize = 8;

impl Tracked {
    /// Mapped memory of another shard for a request of `size` bytes at
    /// `align` on `stream` (see the module docs): a range recorded in the
    /// directory as this shard's, or with `lend` and no range to be had,
    /// a block lent out of another shard's mapped free memory.
    pub(super) fn hand_over(
        &self,
        size: usize,
        align: usize,
        requested: usize,
        stream: u64,
        lend: bool,
    ) -> Option<MappedGift> {
        if !self.shared.hand_over || size == 0 {
            return None;
        }
        let t0 = now_ns();
        let r = self.ask(size, align, requested, stream, lend);
        if t0 != u64::MAX {
            self.shared.asks.fetch_add(1, Ordering::Relaxed);
            self.shared.ask_ns.fetch_add(now_ns().saturating_sub(t0), Ordering::Relaxed);
        }
        r
    }

    /// [`hand_over`](Self::hand_over) itself (that one counts the asks
    /// and their time).
    fn ask(&self, size: usize, align: usize, requested: usize, stream: u64, lend: bool) -> Option<MappedGift> {
        let idle_now = self.shared.registry.handed_back();
        let now = now_ns();
        if now < self.shared.quiet_until.load(Ordering::Relaxed)
            && self.shared.quiet_since.load(Ordering::Relaxed) == idle_now
        {
            return None;
        }
        // SAFETY: as in `release_others`: a shard asks only while an
        // allocation from its pool runs, which borrows the set that owns
        // the boxed slice `pools` points at.
        let pools = unsafe { &*self.shared.pools };
        // One shard (a single-threaded program): nothing to ask.
        pools.iter().filter(|c| c.get().is_some()).nth(1)?;
        let (held, live) = self.set_footprint(pools);
        let peak = self.shared.peak_live.fetch_max(live, Ordering::Relaxed).max(live);
        let room = (peak as u128 * u128::from(HAND_OVER_ABOVE_PPM) / 1_000_000) as usize;
        let range = size.next_multiple_of(self.inner.granularity());
        if held + range <= room {
            return None;
        }
        // Idle shards first, then shards in use: first what they hold
        // above their budget, then what they hold above the pages their
        // live blocks touch now (the set is short, so no shard keeps
        // memory for a peak of its own that the set's peak doesn't
        // reach); the highest-numbered first.
        let short = (peak as u128 * u128::from(OVER_LIVE_ABOVE_PPM) / 1_000_000) as usize;
        let tiers: &[Giver] = if held + range > short {
            &[Giver::Idle, Giver::OverBudget, Giver::OverLive]
        } else {
            &[Giver::Idle, Giver::OverBudget]
        };
        let givers = || {
            tiers.iter().copied().flat_map(move |tier| {
                pools.iter().enumerate().rev().filter_map(move |(j, cell)| {
                    let p = cell.get().filter(|_| j != self.index)?;
                    if (self.shared.registry.users(j) == 0) != (tier == Giver::Idle) {
                        return None;
                    }
                    // What the shard may give: anything free when idle,
                    // else what it held above its budget or its live
                    // blocks' pages as last looked at (the look under
                    // its lock that gives says what is free now).
                    let most = match tier {
                        Giver::Idle => usize::MAX,
                        Giver::OverBudget => self.shared.excess[j].load(Ordering::Relaxed),
                        Giver::OverLive => self.shared.above_live[j].load(Ordering::Relaxed),
                    };
                    (most >= range).then_some((p, most))
                })
            })
        };
        // First what the request's stream or finished work freed; then,
        // once the set's stream poll has said which streams are idle now
        // (no pool lock is held here), once more.
        for polled in [false, true] {
            if polled {
                // At most one poll a millisecond: a poll asks the driver
                // about every stream with pending frees.
                let last = self.shared.polled_at.load(Ordering::Relaxed);
                let due = now == u64::MAX || now.saturating_sub(last) >= QUIET_NS || last == 0;
                let Some(poll) = self.shared.poll.get().filter(|_| due) else { break };
                self.shared.polled_at.store(now.max(1), Ordering::Relaxed);
                poll();
            }
            let give =
                |(p, most): (&Pool<Box<dyn Upstream>>, usize)| p.give_range(range, RANGE_PREFERRED.min(most), stream);
            if let Some((r, tag)) = givers().find_map(give) {
                // Recorded before the taker's pool holds it, so every
                // block it hands out is found here.
                self.shared.directory.carve(r.addr, r.end(), self.index);
                self.shared.handed.fetch_add(1, Ordering::Relaxed);
                self.shared.handed_bytes.fetch_add(r.size as u64, Ordering::Relaxed);
                return Some(MappedGift::Range(r, tag));
            }
            // Loans come from idle shards only: a loan is made for one
            // block, and a shard in use would take its owner's lock for
            // each.
            if lend {
                let idle = givers().filter(|&(_, most)| most == usize::MAX);
                if let Some(a) = idle.map(|(p, _)| p).find_map(|p| p.lend_mapped(size, align, requested, stream)) {
                    self.shared.count_lent();
                    return Some(MappedGift::Block(Chunk { addr: a.addr, size: a.size }, a.tag));
                }
            }
        }
        self.shared.quiet_since.store(idle_now, Ordering::Relaxed);
        self.shared.quiet_until.store(now.saturating_add(QUIET_NS), Ordering::Relaxed);
        None
    }
}

impl Tracked {
    /// The physical memory the set holds and what its live blocks hold
    /// ([`Pool::try_footprint`] of every shard not busy now, whose excess
    /// over its budget is kept for the choice of givers; a busy shard
    /// counts as last seen), looked at afresh at most every
    /// [`FOOTPRINT_NS`]: every ask needs it, and a look takes every free
    /// shard's lock.
    fn set_footprint(&self, pools: &super::shard_upstream::ShardPools) -> (usize, usize) {
        let now = now_ns();
        let cached = &self.shared.footprint;
        let (at, held, live) = *crate::sync::lock(cached);
        if now != u64::MAX && now.saturating_sub(at) < FOOTPRINT_NS && at != 0 {
            return (held, live);
        }
        let (mut held, mut live) = (0, 0);
        for (j, p) in pools.iter().enumerate().filter_map(|(j, c)| Some((j, c.get()?))) {
            // A shard busy now (its lock taken) counts as last seen: an
            // ask never waits for a shard's thread, which may have been
            // descheduled holding its lock (asks then took hundreds of
            // microseconds with 16 threads on 16 processors).
            let (h, l) = match p.try_footprint() {
                Some((h, l, over, over_live)) => {
                    self.shared.excess[j].store(over, Ordering::Relaxed);
                    self.shared.above_live[j].store(over_live, Ordering::Relaxed);
                    self.shared.seen[j].store(h, l);
                    (h, l)
                }
                None => self.shared.seen[j].load(),
            };
            held += h;
            live += l;
        }
        *crate::sync::lock(cached) = (now.max(1), held, live);
        (held, live)
    }
}

/// How long the set's footprint may be reused (nanoseconds).
const FOOTPRINT_NS: u64 = 100_000;

/// The run of whole pieces at the top of `span` (the pieces mapped over
/// it, in address order, the first and last possibly reaching past it)
/// that holds at least `size` bytes.
fn top_pieces(pieces: &[Chunk], span: Chunk, size: usize) -> Option<Chunk> {
    let inside = pieces.iter().filter(|p| p.addr >= span.addr && p.end() <= span.end());
    let mut start = None;
    let mut end = None;
    for p in inside.rev() {
        // Pieces tile the mapped span: each ends where the next starts.
        if start.is_some_and(|s| p.end() != s) {
            break;
        }
        end.get_or_insert(p.end());
        start = Some(p.addr);
        if end? - p.addr >= size {
            return Some(Chunk { addr: p.addr, size: end? - p.addr });
        }
    }
    None
}

impl<U: Upstream> Pool<U> {
    /// The physical memory the pool holds, what its live blocks hold (the
    /// pages they touch, in a remapping pool), and what it holds above its
    /// remap budget and above what its live blocks need now
    /// ([`live_need`]; both 0 for other pools), in bytes: a short look
    /// under the lock that leaves the hot block as it is (asked of every
    /// shard before a hand-over); `None` when another thread holds the
    /// lock.
    pub(super) fn try_footprint(&self) -> Option<(usize, usize, usize, usize)> {
        let mut inner = self.inner.try_lock()?;
        let Inner { fit, pages, .. } = &mut *inner;
        let (touched, _) = fit.touched_pages();
        let slack = self.config.remap_slack_ppm;
        let (over, over_live) = if self.remap {
            let above = |keep: usize| pages.physical().saturating_sub(keep) << pages.shift();
            (above(budget(fit, pages, slack)), above(live_need(fit, pages, slack)))
        } else {
            (0, 0)
        };
        let s = fit.stats_mut();
        let held = if self.remap { pages.physical() << pages.shift() } else { s.reserved };
        Some((held, s.in_use.max(touched << pages.shift()), over, over_live))
    }

    /// Gives up a mapped free range of at least `size` bytes (up to
    /// `preferred` where a span holds that much) whose queued work is known
    /// complete or was queued on `stream` (see the module docs), with the
    /// tag that orders its reuse; `None` when none is free, or the pool is
    /// busy remapping.
    pub(super) fn give_range(&self, size: usize, preferred: usize, stream: u64) -> Option<(Chunk, StreamTag)> {
        if !self.remap || self.config.keep_chunks {
            return None;
        }
        let _remap = try_lock(&self.remap_lock)?;
        let spans = {
            // A giver busy now is passed over (its thread holds the lock).
            let mut inner = self.inner.try_lock()?;
            if inner.shut_down {
                return None;
            }
            let Inner { fit, pages, .. } = &mut *inner;
            let mut spans = Vec::new();
            for (addr, bsize, tag) in fit.largest_free_blocks(4 * CANDIDATES, size) {
                if fit.usable_on(tag, stream) {
                    spans.extend(pages.mapped_inside(addr, bsize).into_iter().filter(|s| s.size >= size));
                }
            }
            // The largest first: a range as large as preferred comes from
            // one span.
            spans.sort_unstable_by_key(|s| std::cmp::Reverse(s.size));
            spans.truncate(CANDIDATES);
            spans
        };
        if spans.is_empty() {
            return None;
        }
        let chosen = spans.iter().find_map(|s| {
            let pieces = self.upstream.mapped_pieces(s.addr, s.size)?;
            top_pieces(&pieces, *s, preferred.min(s.size)).or_else(|| top_pieces(&pieces, *s, size))
        });
        let range = chosen?;
        let mut inner = self.inner.lock();
        let Inner { fit, pages, .. } = &mut *inner;
        // The lock was dropped while the upstream looked: the range must
        // still be free and mapped (an allocation may have landed on it),
        // and frees merged into its block may have changed the tag.
        if !pages.clear(range.addr, range.size) {
            return None;
        }
        let tag = fit.free_range_tag(range.addr, range.size).filter(|&t| fit.usable_on(t, stream))?;
        let tag = if fit.tag_settled(tag) { StreamTag::NONE } else { tag };
        fit.take_free_range(range.addr, range.size)?;
        pages.forget(range.addr, range.size);
        Some((range, tag))
    }

    /// Lends a block of `size` bytes at `align` for another shard's
    /// thread out of mapped free memory whose queued work is known
    /// complete or was queued on `stream`; its free comes back here
    /// through the directory.
    pub(super) fn lend_mapped(
        &self,
        size: usize,
        align: usize,
        requested: usize,
        stream: u64,
    ) -> Option<super::Allocation> {
        if !self.remap || self.config.keep_chunks {
            return None;
        }
        let mut inner = self.inner.lock();
        if inner.shut_down {
            return None;
        }
        let Inner { fit, pages, .. } = &mut *inner;
        let a = fit.allocate_in_spans(size, align, requested, |at, len| pages.mapped_inside(at, len))?;
        if !fit.usable_on(a.tag, stream) {
            fit.undo_allocate(&a);
            return None;
        }
        let tag = if fit.tag_settled(a.tag) { StreamTag::NONE } else { a.tag };
        Some(super::Allocation { tag, ..a })
    }

    /// Before a remapping pool maps new memory for a request of `rounded`
    /// bytes at `align`: mapped memory of another pool of the same address
    /// space, when the upstream gives some (see the module docs): a range
    /// added as a chunk, the request placed at its start, or a block lent
    /// (only without a thread cache, which would keep the block here).
    /// `None` when the placement needs no new memory or nothing came.
    pub(super) fn adopt_for(
        &self,
        rounded: usize,
        align: usize,
        size: usize,
        stream: u64,
    ) -> Option<super::Allocation> {
        if align > self.remap_page || !self.config.hand_over_ranges {
            return None;
        }
        {
            let mut inner = self.inner.lock();
            if inner.shut_down {
                return None;
            }
            let Inner { fit, pages, .. } = &mut *inner;
            let at = match fit.place_preferring(rounded, align, size, RANK_LIMIT, |at, len| pages.clear(at, len))? {
                Preferred::Taken(a) => {
                    // Mapped already: no new memory is made.
                    fit.undo_allocate(&a);
                    return None;
                }
                Preferred::BestFit(at) => at,
            };
            let holes = pages.hole_count(at.addr, rounded);
            let moves =
                pages.physical() + holes.saturating_sub(pages.kept) > budget(fit, pages, self.config.remap_slack_ppm);
            // Kept memory covers the holes and nothing moves: no new
            // memory is made.
            if holes <= pages.kept && !moves {
                return None;
            }
        }
        match self.upstream.take_mapped(rounded, align, size, stream, self.cache.is_none())? {
            MappedGift::Block(b, tag) => Some(super::Allocation { addr: b.addr, size: b.size, tag }),
            MappedGift::Range(range, tag) => {
                let mut inner = self.inner.lock();
                let Inner { fit, pages, .. } = &mut *inner;
                if !fit.add_chunk_tagged(range, tag) {
                    // Address space of one reservation never overlaps: a
                    // broken upstream. The range stays out of every pool
                    // (its pages stay mapped) rather than in two.
                    return None;
                }
                pages.add_mapped(range.addr, range.size);
                // A range next to the pool's own chunks (often one it gave
                // before) joins them: chunk boundaries would keep free
                // blocks apart.
                fit.join_neighbours(range.addr);
                fit.allocate_free_at(range.addr, rounded, size)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::top_pieces;
    use crate::upstream::Chunk;

    const MB: usize = 1 << 20;

    fn c(addr: usize, size: usize) -> Chunk {
        Chunk { addr: addr * MB, size: size * MB }
    }

    /// The range is the whole pieces at the top of the span, as few as
    /// hold the request; pieces reaching past the span don't count.
    #[test]
    fn a_range_is_whole_pieces_from_the_top_of_its_span() {
        let pieces = [c(0, 8), c(8, 8), c(16, 32), c(48, 8)];
        assert_eq!(top_pieces(&pieces, c(4, 48), 8 * MB), Some(c(16, 32)), "the piece at 48 reaches past");
        assert_eq!(top_pieces(&pieces, c(0, 56), 4 * MB), Some(c(48, 8)));
        assert_eq!(top_pieces(&pieces, c(0, 56), 16 * MB), Some(c(16, 40)));
        assert_eq!(top_pieces(&pieces, c(0, 56), 56 * MB), Some(c(0, 56)));
        assert_eq!(top_pieces(&pieces, c(0, 56), 57 * MB), None);
        assert_eq!(top_pieces(&pieces, c(1, 6), MB), None, "no whole piece inside");
    }
}
