//! Memory an idle shard gives up for a shard that grows: the free memory
//! of a pool whose threads are gone goes back to the upstream, so that the
//! shard that needs memory now makes new memory without raising what the
//! set holds (see the `shards` module docs, "Idle shards").
//!
//! # Implementation details
//!
//! - **Remapping pools** give their kept memory first, then whole pieces
//!   lying in free blocks whose stream work is known complete, highest
//!   first (as the pool's own moves pick them). Pieces whose work may
//!   still run stay: the growing thread would rather make new memory than
//!   wait for the device. The order is the pool's own move order: the
//!   pieces are marked holes under the pool lock *before* it is dropped,
//!   so no allocation lands on them while they are unmapped; a free that
//!   arrives meanwhile only makes more space free (the model
//!   `idle_shard_gives_pages_while_a_free_is_in_flight` checks it).
//! - **The remap lock is only tried**: a pool busy remapping (its thread
//!   came back, or its background mapper runs) is passed over, so two
//!   shards that reclaim from each other can't wait on each other's lock.
//! - **Chunk pools** (pinned memory, `cuMemAlloc` chunks) give wholly
//!   free chunks whose work is known complete, smallest first.
//! - Pools that keep their chunks (graph pools) give nothing.
//! - **When and from whom** (`Tracked::reclaim_idle`, called by a shard's
//!   upstream before it makes new memory): only when the set would then
//!   hold more than [`RECLAIM_ABOVE_PPM`] of the most memory its blocks
//!   held at once, from the highest-numbered idle shards first.
//! - **After a thread's exit** (`Shared::trim_idle`, the registry's idle
//!   hook, in sets of remapping shards that share one address space, with
//!   [`PoolConfig::trim_idle_shards`](super::PoolConfig::trim_idle_shards)): a
//!   shard left with no thread is memory nobody uses now, so the set gives
//!   back what it holds above [`HAND_OVER_ABOVE_PPM`] of the most pages
//!   its blocks touched at once, from the idle shards, highest-numbered
//!   first (new threads claim the lowest). The set keeps its peak's pages
//!   for the threads that come next; what busy shards kept above it (their
//!   own peaks, which rarely coincide) no longer outlives them. Only
//!   tried: a trim running meanwhile (another exit) or a busy shard is
//!   passed over, and the exiting thread waits for nothing but its own
//!   driver calls.

use super::handover::HAND_OVER_ABOVE_PPM;
use super::page_map::budget;
use super::shard_upstream::{Shared, Tracked};
use super::{Inner, Pool};
use crate::sync::{try_lock, Ordering};
use crate::upstream::Upstream;

/// A set of shards gives idle memory to a growing shard only when it
/// would otherwise hold more than this many millionths of the most memory
/// its blocks held at once (120 %; in remapping shards the pages the
/// blocks touch, the least a shard can hold): below, growth makes new
/// memory and moves nothing.
pub(super) const RECLAIM_ABOVE_PPM: u64 = 1_200_000;

impl Tracked {
    /// Before this shard makes `need` bytes of new memory: when the set
    /// would then hold more than [`RECLAIM_ABOVE_PPM`] of the most memory
    /// its blocks held at once (as seen at growths; pages touched, in
    /// remapping shards), the shards no thread uses give back free
    /// memory, up to the excess or `need` (see the module docs).
    pub(super) fn reclaim_idle(&self, need: usize) {
        if need == 0 || !self.shared.give {
            return;
        }
        // SAFETY: as in `release_others`: an upstream makes memory only
        // for an allocation from its pool, which borrows the set.
        let pools = unsafe { &*self.shared.pools };
        // One shard (a single-threaded program): nothing to ask.
        if pools.iter().filter(|c| c.get().is_some()).nth(1).is_none() {
            return;
        }
        // Live memory as pages: a remapping shard's blocks hold the pages
        // they touch (no shard can hold less), a chunk shard's the bytes.
        let (held, live) = pools.iter().filter_map(|c| c.get()).fold((0usize, 0usize), |(h, l), p| {
            let s = p.stats();
            (h + s.mapped, l + s.in_use.max(s.touched))
        });
        let peak = self.shared.peak_live.fetch_max(live, Ordering::Relaxed).max(live);
        let room = (peak as u128 * u128::from(RECLAIM_ABOVE_PPM) / 1_000_000) as usize;
        let need = (held + need).saturating_sub(room).min(need);
        if need == 0 {
            return;
        }
        // Frees on streams that are idle now need no wait: ask once (no
        // pool lock is held here) before the shards pick what to give.
        if let Some(poll) = self.shared.poll.get() {
            poll();
        }
        let mut given = 0;
        // Idle shards first, then (following threads) the excess of
        // shards in use; the highest-numbered first: a new thread claims
        // the lowest-numbered idle shard, so memory stays where the next
        // threads will look for it.
        for idle in [true, false] {
            if !idle && !self.shared.follow_threads {
                break;
            }
            for (j, cell) in pools.iter().enumerate().rev() {
                if given >= need {
                    break;
                }
                let Some(p) = cell.get().filter(|_| j != self.index) else { continue };
                if (self.shared.registry.users(j) == 0) != idle {
                    continue;
                }
                // An idle shard gives any free memory; one in use only
                // what it holds above its budget.
                let room = if idle { need - given } else { p.excess().min(need - given) };
                given += p.reclaim_free(room);
            }
        }
        if given > 0 {
            self.shared.reclaimed.fetch_add(given as u64, Ordering::Relaxed);
        }
    }
}

impl Shared {
    /// A shard was left with no thread (the registry's idle hook, on the
    /// exiting thread): the idle shards give back what the set holds above
    /// [`HAND_OVER_ABOVE_PPM`] of the most pages its blocks touched at
    /// once (see the module docs). Returns the bytes given back.
    ///
    /// # Safety
    ///
    /// The set's pools must outlive the call: the registry's idle hook
    /// calls it, and the set's drop removes that hook (waiting for a run
    /// in progress) before its pools go.
    pub(super) unsafe fn trim_idle(&self) -> usize {
        if !self.hand_over {
            return 0;
        }
        // SAFETY: the caller keeps the set alive for the call (see
        // `# Safety`), so the boxed slice `pools` points at outlives this
        // borrow.
        let pools = unsafe { &*self.pools };
        let made = || pools.iter().enumerate().filter_map(|(j, c)| Some((j, c.get()?)));
        if made().nth(1).is_none() {
            return 0;
        }
        // What the set holds (each shard's lock taken in turn, no other
        // lock held), and the most pages its blocks touched at once.
        let held: usize = made().map(|(_, p)| p.stats().mapped).sum();
        let page = pools[0].get().map_or(0, Pool::page_size);
        let peak = self.pages.sample().1 * page;
        let room = (peak as u128 * u128::from(HAND_OVER_ABOVE_PPM) / 1_000_000) as usize;
        let excess = held.saturating_sub(room);
        if excess == 0 {
            return 0;
        }
        // Frees on streams that are idle now need no wait: ask once (no
        // pool lock is held here).
        if let Some(poll) = self.poll.get() {
            poll();
        }
        let mut given = 0;
        for (j, cell) in pools.iter().enumerate().rev() {
            if given >= excess {
                break;
            }
            if let Some(p) = cell.get().filter(|_| self.registry.users(j) == 0) {
                given += p.reclaim_free(excess - given);
            }
        }
        if given > 0 {
            self.reclaimed.fetch_add(given as u64, Ordering::Relaxed);
        }
        given
    }
}

impl<U: Upstream> Pool<U> {
    /// Gives back up to about `want` bytes of free memory (see the module
    /// docs); returns the bytes given back. Errors of the upstream end
    /// the step (what was given back stays recorded) and count as nothing
    /// given.
    pub(super) fn reclaim_free(&self, want: usize) -> usize {
        if want == 0 || self.config.keep_chunks {
            return 0;
        }
        if self.remap {
            self.reclaim_pages(want)
        } else {
            self.reclaim_chunks(want)
        }
    }

    /// The physical memory a remapping pool holds above its budget now
    /// (0 for other pools): what it gives while a thread still uses it.
    pub(super) fn excess(&self) -> usize {
        if !self.remap {
            return 0;
        }
        let inner = self.inner.lock();
        let over = inner.pages.physical().saturating_sub(budget(&inner.fit, &inner.pages, self.config.remap_slack_ppm));
        over << inner.pages.shift()
    }

    /// A new thread took the pool (a shard claimed anew): the remap budget
    /// starts again from the pages its live blocks touch now, so memory a
    /// former thread needed is no longer the pool's to keep (it is above
    /// the budget: the pool's own moves use it first, and shards that grow
    /// may take it).
    /// The page a remapping pool maps (0 for other pools).
    pub fn page_size(&self) -> usize {
        if self.remap {
            self.inner.lock().pages.page()
        } else {
            0
        }
    }

    /// Adds this pool's touched pages to `set`'s sum from now on
    /// ([`BestFit::share_pages`](super::BestFit::share_pages)).
    pub(super) fn share_pages(&self, set: crate::sync::Arc<super::best_fit::SetPages>, index: usize) {
        self.inner.lock().fit.share_pages(set, index);
    }

    pub(super) fn rebase_budget(&self) {
        if self.remap {
            self.inner.lock().fit.rebase_touched_peak();
        }
    }

    fn reclaim_chunks(&self, want: usize) -> usize {
        let mut given = 0;
        while given < want {
            let taken = {
                let mut inner = self.inner.lock();
                if inner.shut_down {
                    return given;
                }
                let c = inner.fit.take_free_chunk_fitting(0, 0);
                if c.is_some() {
                    inner.fit.stats_mut().upstream_frees += 1;
                }
                c
            };
            let Some((chunk, _)) = taken else { break };
            if self.upstream.deallocate_chunk(chunk).is_err() {
                // Dropped from the pool (never reused), as release_cached
                // does with a chunk it can't give back.
                break;
            }
            given += chunk.size;
        }
        given
    }

    fn reclaim_pages(&self, want: usize) -> usize {
        let Some(_remap) = try_lock(&self.remap_lock) else { return 0 };
        // Kept memory first: it is held and has no address.
        let kept = self.upstream.kept();
        let mut given = kept.min(want);
        if given > 0 {
            self.upstream.trim_kept(kept - given);
            given = kept - self.upstream.kept();
        }
        let rest = want.saturating_sub(given);
        let spans = {
            let mut inner = self.inner.lock();
            if inner.shut_down {
                return given;
            }
            let kept = self.upstream.kept();
            let Inner { fit, pages, .. } = &mut *inner;
            pages.set_kept(kept);
            if rest == 0 {
                return given;
            }
            // Only memory no queued work may use: the grower would rather
            // make new memory than wait for the device.
            let (mut spans, mut offered) = (Vec::new(), 0usize);
            for (addr, size, tag) in fit.free_blocks_highest_first(pages.page()) {
                if offered >= 2 * rest {
                    break;
                }
                if !fit.tag_settled(tag) {
                    continue;
                }
                for span in pages.mapped_inside(addr, size) {
                    offered += span.size;
                    spans.push(span);
                }
            }
            for span in &spans {
                // Holes while they move: no allocation lands there.
                pages.mark(*span, true);
            }
            spans
        };
        let unmapped = if spans.is_empty() {
            Vec::new()
        } else {
            self.upstream.unmap_within(&spans, rest, false, false).unwrap_or_default()
        };
        let mut inner = self.inner.lock();
        let pages = &mut inner.pages;
        for span in &spans {
            pages.mark(*span, false);
        }
        for piece in &unmapped {
            pages.mark(*piece, true);
            pages.mapped -= piece.size >> pages.shift();
            given += piece.size;
        }
        pages.unmap_calls += unmapped.len() as u64;
        given
    }
}
