//! A pool's answers about blocks, resizing in place, statistics and peaks.

use super::{round_size, Allocation, BestFit, FreeError, Pool, PoolStats};
use crate::error::{Error, Result};
use crate::upstream::Upstream;

impl<U: Upstream> Pool<U> {
    /// The size of the live block at `addr`, if there is one.
    pub fn block_size(&self, addr: usize) -> Option<usize> {
        if let Some(lent) = self.cache.as_ref().and_then(|c| c.lent_size(addr)) {
            return lent;
        }
        self.inner.lock().fit.block_size(addr)
    }

    /// The bytes asked for the live block at `addr` (at most its
    /// [`block_size`](Self::block_size)), if there is one.
    pub fn requested_size(&self, addr: usize) -> Option<usize> {
        if let Some(lent) = self.cache.as_ref().and_then(|c| c.lent_requested(addr)) {
            return lent;
        }
        self.inner.lock().fit.requested_of(addr)
    }

    /// Whether `addr` lies in one of the pool's chunks.
    pub fn contains(&self, addr: usize) -> bool {
        self.inner.lock().fit.contains(addr)
    }

    /// The size of the live block at `addr`, or the error freeing it would
    /// give ([`Error::DoubleFree`], [`Error::InteriorPointer`],
    /// [`Error::UnknownPointer`]). Changes nothing.
    ///
    /// # Errors
    /// As described.
    pub fn check_live(&self, addr: usize) -> Result<usize> {
        match self.cache.as_ref().and_then(|c| c.lent_size(addr)) {
            Some(Some(size)) => return Ok(size),
            // A thread cache owns the block and it is not lent: it is free.
            Some(None) => return Err(self.free_error(addr, FreeError::DoubleFree)),
            None => {}
        }
        let r = self.inner.lock().fit.check_live(addr);
        r.map_err(|e| self.free_error(addr, e))
    }

    /// Allocates `size` bytes at `addr`, in one free block (nothing grows):
    /// a block put back where it was (a graph pool's checkpoint).
    ///
    /// # Errors
    /// [`Error::InvalidSize`]; [`Error::InvalidState`] when the range is
    /// not free in one block, or the pool remaps pages; [`Error::ShutDown`].
    pub fn allocate_at(&self, addr: usize, size: usize) -> Result<Allocation> {
        let rounded = super::validate(size, crate::upstream::BLOCK_ALIGN)?;
        if self.remap {
            return Err(Error::InvalidState("a pool that remaps pages can't allocate at a given address".into()));
        }
        let mut inner = self.inner.lock();
        if inner.shut_down {
            return Err(Error::ShutDown("allocation"));
        }
        inner.used = true;
        inner.fit.allocate_at(addr, rounded, size).ok_or_else(|| {
            Error::InvalidState(format!("{rounded} B at {addr:#x} are not free in one block of the pool"))
        })
    }

    /// Grows the live block at `addr` to hold `new_size` bytes without
    /// moving it, when the block after it is free and large enough.
    pub fn grow_in_place(&self, addr: usize, new_size: usize) -> bool {
        let Some(rounded) = round_size(new_size) else { return false };
        if self.cache.as_ref().is_some_and(|c| !c.unlend(addr)) {
            return false;
        }
        let mut inner = self.inner.lock();
        if self.remap && !inner.pages.clear(addr, rounded) {
            // The space after the block has no memory mapped.
            return false;
        }
        let ok = inner.fit.grow_in_place(addr, rounded);
        if ok {
            inner.fit.set_requested(addr, new_size);
        }
        ok
    }

    /// Shrinks the live block at `addr` to `new_size` bytes (non-zero) in
    /// place, freeing its tail.
    pub fn shrink_in_place(&self, addr: usize, new_size: usize) -> bool {
        let Some(rounded) = round_size(new_size) else { return false };
        if self.cache.as_ref().is_some_and(|c| !c.unlend(addr)) {
            return false;
        }
        let mut inner = self.inner.lock();
        let ok = inner.fit.shrink_in_place(addr, rounded);
        if ok {
            inner.fit.set_requested(addr, new_size);
        }
        ok
    }

    /// Marks every free block as having no pending stream work (see
    /// [`BestFit::clear_tags`]). Blocks parked in thread caches keep their
    /// tags: use it on pools without caches.
    pub fn clear_tags(&self) {
        debug_assert!(self.cache.is_none(), "clear_tags does not reach thread caches");
        self.inner.lock().fit.clear_tags();
    }

    /// Statistics.
    pub fn stats(&self) -> PoolStats {
        let mut s = {
            let mut inner = self.inner.lock();
            inner.fit.flush_hot();
            let mut s = inner.fit.stats();
            inner.pages.fill_stats(&mut s, self.remap);
            s
        };
        if let Some(cache) = &self.cache {
            cache.adjust(&mut s);
        }
        s
    }

    /// The physical bytes the pool holds (mapped and kept pages with
    /// remapping, else its chunks): one look under the lock, leaving the
    /// hot block and the thread caches as they are.
    pub(super) fn held_bytes(&self) -> usize {
        let mut inner = self.inner.lock();
        if self.remap {
            inner.pages.physical() << inner.pages.shift()
        } else {
            inner.fit.stats_mut().reserved
        }
    }

    /// Sets every peak to its current value.
    pub fn reset_peaks(&self) {
        let mut inner = self.inner.lock();
        inner.fit.stats_mut().reset_peaks();
        inner.fit.reset_touched_peak();
        inner.pages.peak = inner.pages.physical();
    }

    /// Runs `f` on the allocator under the lock (tests, summaries).
    pub fn with_fit<R>(&self, f: impl FnOnce(&BestFit) -> R) -> R {
        let mut inner = self.inner.lock();
        inner.fit.flush_hot();
        f(&inner.fit)
    }

    /// Checks the allocator's invariants ([`BestFit::check_invariants`]).
    ///
    /// # Errors
    /// The first broken invariant.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.with_fit(BestFit::check_invariants)
    }
}
