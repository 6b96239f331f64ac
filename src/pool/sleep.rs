//! Putting a remapping pool's memory to sleep and waking it: every page
//! unmapped while the address space stays the pool's, then new pages
//! mapped under the live blocks at the same addresses (the device layer's
//! memory tags, `device/tags.rs`, use them; the manager copies contents).
//!
//! # Implementation details
//!
//! - **Sleep** ([`Pool::unmap_all`]) takes the remap lock, marks every
//!   mapped page of every chunk a hole under the pool lock, then, with no
//!   pool lock held, releases the upstream's kept memory and unmaps every
//!   piece inside the chunks. The caller has made sure no work queued on a
//!   stream still uses the memory (it synchronised the device), so the
//!   upstream is told nothing is pending. Live blocks stay live: their
//!   addresses are still theirs; only their pages are gone. A sleep that
//!   copies contents out gives pages back in parts while its copies run:
//!   [`Pool::unmap_free`] (the free space) and [`Pool::unmap_ranges`] (the
//!   pieces wholly inside given blocks), then `unmap_all` for the rest.
//! - **Wake** ([`Pool::map_ranges`]) takes the remap lock, collects the
//!   holes under the given ranges (merged: neighbouring blocks share
//!   pages), and maps them with one [`Upstream::map_runs`] call, which
//!   leaves nothing mapped when it fails: a wake that runs out of memory
//!   changes nothing.
//! - Both keep the pool's figures true: mapped pages, map and unmap calls.

use super::Pool;
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::upstream::{Chunk, Upstream};

impl<U: Upstream> Pool<U> {
    /// Unmaps every page of the pool (live blocks' included) and releases
    /// the upstream's kept memory; returns the bytes of physical memory
    /// given back. The pool's chunks (its address space) and its blocks
    /// stay; the live blocks' contents are lost.
    ///
    /// The caller guarantees that no work queued on any stream still uses
    /// the pool's memory, and that nothing allocates from the pool
    /// meanwhile (an allocation would map pages again).
    ///
    /// # Errors
    /// [`Error::InvalidState`] for a pool that does not remap pages; an
    /// upstream error (pieces it unmapped before stay unmapped and are
    /// counted; the others stay mapped).
    pub fn unmap_all(&self) -> Result<usize> {
        self.require_remap("unmap its live blocks' memory")?;
        let _remap = lock(&self.remap_lock);
        let kept = self.upstream.kept();
        self.upstream.release_kept();
        self.inner.lock().pages.set_kept(0);
        // The caller synchronised the device: nothing is pending.
        let unmapped = self.unmap_spans(|fit, pages| {
            (fit.chunks().iter().flat_map(|c| pages.mapped_inside(c.addr, c.size)).collect(), false)
        })?;
        Ok(unmapped + kept)
    }

    /// Unmaps the pieces of memory lying wholly inside `ranges`
    /// (`(addr, size)`, live blocks included), as [`unmap_all`](Self::unmap_all)
    /// does for the whole pool: a sleep gives back the pages of the blocks
    /// whose contents are copied out while later blocks still copy.
    /// Returns the bytes unmapped. Neighbouring ranges are merged first, so
    /// a piece under several blocks goes when all of them are given.
    ///
    /// As for [`unmap_all`](Self::unmap_all), for these ranges.
    ///
    /// # Errors
    /// As [`unmap_all`](Self::unmap_all).
    pub fn unmap_ranges(&self, ranges: &[(usize, usize)]) -> Result<usize> {
        self.require_remap("unmap its live blocks' memory")?;
        let runs = merge(ranges.iter().filter(|r| r.1 > 0).map(|&(addr, size)| Chunk { addr, size }).collect());
        let _remap = lock(&self.remap_lock);
        self.unmap_spans(|_, pages| (runs.iter().flat_map(|r| pages.mapped_inside(r.addr, r.size)).collect(), false))
    }

    /// Unmaps every piece of memory lying wholly in free blocks and
    /// releases the kept memory (what [`release_cached`](Self::release_cached)
    /// does to pages, without giving chunks back); the bytes released.
    ///
    /// # Errors
    /// As [`unmap_all`](Self::unmap_all).
    pub fn unmap_free(&self) -> Result<usize> {
        self.require_remap("unmap its free pages")?;
        let _remap = lock(&self.remap_lock);
        self.unmap_free_pages()
    }

    fn require_remap(&self, what: &str) -> Result<()> {
        if self.remap {
            Ok(())
        } else {
            Err(Error::InvalidState(format!("only a pool that remaps pages can {what}")))
        }
    }

    /// Maps memory under every page of `ranges` (`(addr, size)`, inside the
    /// pool's chunks) that has none; returns the bytes mapped. On an error
    /// nothing new stays mapped.
    ///
    /// # Errors
    /// [`Error::InvalidState`] for a pool that does not remap pages or a
    /// range outside its chunks; [`Error::OutOfMemory`] or a driver error
    /// from the upstream.
    pub fn map_ranges(&self, ranges: &[(usize, usize)]) -> Result<usize> {
        self.require_remap("map pages under its blocks")?;
        let _remap = lock(&self.remap_lock);
        let runs = {
            let inner = self.inner.lock();
            let mut runs = Vec::new();
            for &(addr, size) in ranges.iter().filter(|r| r.1 > 0) {
                if !inner.fit.contains(addr) || !inner.fit.contains(addr + size - 1) {
                    return Err(Error::InvalidState(format!(
                        "range {addr:#x}+{size} lies outside the pool's address space"
                    )));
                }
                runs.extend(inner.pages.holes_in(addr, size));
            }
            merge(runs)
        };
        if runs.is_empty() {
            return Ok(0);
        }
        let mapped = self.upstream.map_runs(&runs);
        let kept = self.upstream.kept();
        let mut inner = self.inner.lock();
        let pages = &mut inner.pages;
        pages.set_kept(kept);
        let calls = mapped?;
        let mut bytes = 0;
        for run in &runs {
            pages.mapped += pages.mark(*run, false);
            bytes += run.size;
        }
        pages.map_calls += calls;
        pages.peak = pages.peak.max(pages.physical());
        Ok(bytes)
    }

    /// Every live block as `(addr, size, requested)`, in address order
    /// (blocks parked in thread caches are free, not live).
    pub fn live_blocks(&self) -> Vec<(usize, usize, usize)> {
        if let Some(cache) = &self.cache {
            cache.drain_all(false);
        }
        self.inner.lock().fit.live_blocks()
    }
}

/// Page runs sorted and merged where they overlap or touch.
fn merge(mut runs: Vec<Chunk>) -> Vec<Chunk> {
    runs.sort_by_key(|r| r.addr);
    let mut out: Vec<Chunk> = Vec::with_capacity(runs.len());
    for r in runs {
        match out.last_mut() {
            Some(last) if r.addr <= last.end() => {
                let end = last.end().max(r.end());
                last.size = end - last.addr;
            }
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::merge;
    use crate::upstream::Chunk;

    #[test]
    fn runs_that_share_pages_are_mapped_once() {
        let c = |addr, size| Chunk { addr, size };
        let merged = merge(vec![c(4096, 4096), c(0, 4096), c(4096, 8192), c(20480, 4096)]);
        assert_eq!(merged, vec![c(0, 12288), c(20480, 4096)]);
    }
}
