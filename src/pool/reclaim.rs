//! Memory an idle shard gives up for a shard that grows: the free memory
//! of a pool whose threads are gone goes back to the upstream, so that the
//! shard that needs memory now makes new memory without raising what the
//! set holds (see the `shards` module docs, "Idle shards").
//!
//! # Implementation details
//!
//! - **Remapping pools** give their kept memory first, then whole pieces
//!   lying in free blocks, highest first (as the pool's own moves pick
//!   them), work known complete first; pieces whose stream work may still
//!   run go only after the upstream waited for the device, and only when
//!   the rest gave too little. The order is the pool's own move order: the
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

use super::page_map::budget;
use super::{Inner, Pool};
use crate::sync::try_lock;
use crate::upstream::{Chunk, Upstream};

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
        let (settled, pending) = {
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
            let (mut settled, mut pending, mut offered) = (Vec::new(), Vec::new(), 0usize);
            for (addr, size, tag) in fit.free_blocks_highest_first(pages.page()) {
                if offered >= 2 * rest {
                    break;
                }
                let spans = if fit.tag_settled(tag) { &mut settled } else { &mut pending };
                for span in pages.mapped_inside(addr, size) {
                    offered += span.size;
                    spans.push(span);
                }
            }
            for span in settled.iter().chain(&pending) {
                // Holes while they move: no allocation lands there.
                pages.mark(*span, true);
            }
            (settled, pending)
        };
        let mut unmapped: Vec<Chunk> = Vec::new();
        for (spans, waits) in [(&settled, false), (&pending, true)] {
            let got: usize = unmapped.iter().map(|c| c.size).sum();
            if got >= rest || spans.is_empty() {
                continue;
            }
            match self.upstream.unmap_within(spans, rest - got, waits, false) {
                Ok(v) => unmapped.extend(v),
                Err(_) => break,
            }
        }
        let mut inner = self.inner.lock();
        let pages = &mut inner.pages;
        for span in settled.iter().chain(&pending) {
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
