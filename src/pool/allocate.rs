//! The pool's allocation: [`Pool::allocate_for`] over two paths, the
//! common case with no error to carry ([`Pool::allocate_quick`]: the
//! thread cache, or a placement in memory the pool holds), and the rest
//! ([`Pool::allocate_past_quick`]: errors, growth, page maps, retries out
//! of memory). The device allocator calls the two itself, so that it can
//! register the requesting stream before the rest (a page move's fence
//! needs it) and keep the common case free of that.

use super::cache::ThreadCaches;
use super::{classes, remap, validate, Allocation, Inner, Pool};
use crate::error::{Error, OomState, Result};
use crate::upstream::{Upstream, BLOCK_ALIGN};

/// The thread cache's class of a validated request and the size of the
/// block a hit returns and a miss allocates (`None`: not cached).
#[inline]
fn cache_class(cache: &ThreadCaches, rounded: usize, align: usize) -> Option<(usize, usize)> {
    let (class, class_size) = if align <= BLOCK_ALIGN { classes::class_of(rounded) } else { None }?;
    Some((class, if cache.exact() { rounded } else { class_size }))
}

impl<U: Upstream> Pool<U> {
    /// Allocates `size` bytes aligned to `align`. The returned
    /// [`Allocation::tag`] names the stream whose work, queued before the
    /// block was freed, may still use it; a caller on another stream orders
    /// its work after that (an event) before using the block.
    ///
    /// # Errors
    /// Invalid size or alignment; [`Error::ShutDown`] after
    /// [`shutdown`](Pool::shutdown); [`Error::OutOfMemory`] when neither the
    /// pool nor the upstream (after cached chunks were released) can serve.
    pub fn allocate(&self, size: usize, align: usize) -> Result<Allocation> {
        self.allocate_for(size, align, 0)
    }

    /// [`allocate`](Pool::allocate) for work on the stream with id `stream`
    /// (0: none): a thread cache may then also hand out a block freed on
    /// that stream, whose [`Allocation::tag`] names it.
    ///
    /// # Errors
    /// As [`allocate`](Pool::allocate).
    #[inline(always)]
    pub fn allocate_for(&self, size: usize, align: usize, stream: u64) -> Result<Allocation> {
        match self.allocate_quick(size, align, stream) {
            Some(a) => Ok(a),
            None => self.allocate_past_quick(size, align, stream),
        }
    }

    /// The common case of [`allocate_for`](Pool::allocate_for), with no
    /// error to carry: a valid request served by the thread cache or
    /// placed in memory the pool holds, with nothing to grow, map, move
    /// or release. `None` leaves the request to
    /// [`allocate_past_quick`](Self::allocate_past_quick), which reports
    /// what is wrong with it or does the rest.
    #[inline(always)]
    pub(crate) fn allocate_quick(&self, size: usize, align: usize, stream: u64) -> Option<Allocation> {
        let rounded = validate(size, align).ok()?;
        let Some(cache) = self.serving_cache() else {
            return self.place_in_held(rounded, align, size);
        };
        // The thread cache (cache.rs): a hit takes no pool lock; a miss
        // allocates the class size (or the exact size) here and lends the
        // block to the cache.
        let Some((class, block_size)) = cache_class(cache, rounded, align) else {
            return self.place_in_held(rounded, align, size);
        };
        if let Some(a) = ThreadCaches::allocate(cache, class, block_size, size, stream) {
            return Some(a);
        }
        let a = self.place_in_held(block_size, align, size)?;
        ThreadCaches::lend(cache, &a, size);
        Some(a)
    }

    /// [`allocate_for`](Pool::allocate_for) after
    /// [`allocate_quick`](Self::allocate_quick) gave `None`: validation's
    /// error, the placement again, growth and the retries out of memory.
    ///
    /// # Errors
    /// As [`allocate`](Pool::allocate).
    #[inline(never)]
    pub(crate) fn allocate_past_quick(&self, size: usize, align: usize, stream: u64) -> Result<Allocation> {
        let rounded = validate(size, align)?;
        let Some(cache) = self.serving_cache() else {
            return self.allocate_slow(rounded, align, size, stream);
        };
        // The cache missed, or the class is not cached: no second look.
        let class = cache_class(cache, rounded, align);
        let exact = class.map_or(rounded, |(_, block_size)| block_size);
        let a = match self.allocate_slow(exact, align, size, stream) {
            // Memory parked in thread caches counts as used: flush, retry.
            Err(Error::OutOfMemory { .. }) if cache.drain_all(false) > 0 => {
                self.allocate_slow(exact, align, size, stream)?
            }
            r => r?,
        };
        if class.is_some() {
            ThreadCaches::lend(cache, &a, size);
        }
        // The pool may have grown: the caches' budgets follow its size.
        cache.note_pool_held(self.held_bytes());
        Ok(a)
    }

    /// The common case of [`allocate_quick`](Self::allocate_quick): a placement in memory the
    /// pool holds (for a remapping pool, on mapped pages:
    /// [`remap::place_mapped`]), with nothing to map, move or
    /// release. `None` leaves the request to the full path, which grows or
    /// maps (and looks again first). Inlined, so that its result reaches
    /// the caller in registers rather than through memory.
    #[inline(always)]
    fn place_in_held(&self, rounded: usize, align: usize, size: usize) -> Option<Allocation> {
        let (mut inner, waited) = self.inner.lock_noting_wait();
        if waited {
            if let Some(cache) = self.cache.as_ref().filter(|c| !c.serving()) {
                // Counted with the lock let go (the count reads a clock).
                drop(inner);
                cache.note_wait();
                inner = self.inner.lock();
            }
        }
        if inner.shut_down {
            return None;
        }
        inner.used = true;
        if !self.remap {
            return inner.fit.allocate(rounded, align, size);
        }
        let Inner { fit, pages, .. } = &mut *inner;
        match remap::place_mapped(fit, pages, self.config.remap_slack_ppm, rounded, align, size) {
            remap::Placed::Mapped(a) => Some(a),
            remap::Placed::NoFit | remap::Placed::NeedsMap => None,
        }
    }

    /// An allocation of `rounded` bytes (validated) past its common case
    /// ([`place_in_held`](Self::place_in_held)): the placement again, page
    /// maps, growth and the retries out of memory.
    #[inline(never)]
    fn allocate_slow(&self, rounded: usize, align: usize, size: usize, stream: u64) -> Result<Allocation> {
        let mut released_once = false;
        let mut drained = false;
        loop {
            if self.remap {
                match self.allocate_remapping(rounded, align, size, stream) {
                    Ok(Some(a)) => return Ok(a),
                    Ok(None) => {}
                    Err(Error::OutOfMemory { .. }) if !released_once => {
                        // Unmapping free pages is the first step.
                        released_once = true;
                        self.count_retry();
                        self.release_cached()?;
                        continue;
                    }
                    Err(e) => {
                        let mut inner = self.inner.lock();
                        inner.fit.stats_mut().failed_allocations += 1;
                        return Err(match e {
                            Error::OutOfMemory { state, .. } => self.oom(&inner, size, false, state.upstream),
                            other => other,
                        });
                    }
                }
            }
            let plan = {
                let mut inner = self.inner.lock();
                if inner.shut_down {
                    return Err(Error::ShutDown("allocation"));
                }
                inner.used = true;
                if !self.remap {
                    if let Some(a) = inner.fit.allocate(rounded, align, size) {
                        return Ok(a);
                    }
                } else if inner.fit.flush_hot_then(|f| f.largest_free() >= rounded + align.saturating_sub(BLOCK_ALIGN))
                {
                    // Memory was freed since the placement failed (a hot
                    // block is coalesced first, for this look and for the
                    // growth below, which looks at the free tail).
                    continue;
                }
                // Before the pool grows, the blocks this thread's cache
                // parked go back and coalesce, so one thread's cache never
                // makes the pool larger. (Other threads' caches are drained
                // only when the upstream is out of memory: draining them on
                // every growth would stall them all while they fill up.)
                if let (false, Some(cache)) = (drained, &self.cache) {
                    drop(inner);
                    drained = true;
                    ThreadCaches::drain_local(cache);
                    continue;
                }
                match self.plan_growth(&mut inner, rounded, align) {
                    Ok(plan) => plan,
                    Err(over_limit) => {
                        if !released_once && !self.config.keep_chunks && inner.fit.stats().free() > 0 {
                            drop(inner);
                            released_once = true;
                            self.count_retry();
                            self.release_cached()?;
                            continue;
                        }
                        inner.fit.stats_mut().failed_allocations += 1;
                        return Err(self.oom(&inner, size, over_limit, None));
                    }
                }
            };
            match self.grow(plan) {
                Ok(()) => continue,
                Err(e) => {
                    let mut inner = self.inner.lock();
                    inner.pending_growth -= plan.bytes();
                    let can_release = !self.config.keep_chunks && inner.fit.stats().free() > 0;
                    if !released_once && can_release {
                        drop(inner);
                        released_once = true;
                        self.count_retry();
                        self.release_cached()?;
                        continue;
                    }
                    inner.fit.stats_mut().failed_allocations += 1;
                    return Err(match e {
                        Error::OutOfMemory { state, .. } => self.oom(&inner, size, false, state.upstream),
                        other => other,
                    });
                }
            }
        }
    }

    fn count_retry(&self) {
        self.inner.lock().fit.stats_mut().oom_retries += 1;
    }

    fn oom(&self, inner: &Inner, requested: usize, over_limit: bool, upstream: Option<String>) -> Error {
        let s = inner.fit.stats();
        let hint = if over_limit {
            Some("raise max_pool_size, or free blocks you hold")
        } else if s.free() > s.largest_free && s.largest_free < requested {
            Some("free memory is fragmented across blocks; enable expandable segments (expandable=true)")
        } else {
            None
        };
        Error::OutOfMemory {
            pool: self.config.kind,
            requested,
            state: Box::new(OomState {
                in_use: s.in_use,
                reserved_free: s.free(),
                largest_free: s.largest_free,
                limit: self.config.max_size,
                device_free: self.upstream.device_free(),
                upstream,
                hint,
                device: None,
            }),
        }
    }
}
