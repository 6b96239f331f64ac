//! How a [`Pool`] grows and gives memory back: planning growth against the
//! size limit, asking the upstream outside the pool's lock, releasing free
//! chunks, and giving free tails back to expandable upstreams.

use super::{Inner, Pool};

use crate::upstream::{Chunk, Upstream, BLOCK_ALIGN};

use crate::error::{Error, OomState, Result};

use crate::sync::lock;

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl<U: Upstream> Pool<U> {
    /// Flushes every thread's cache, then returns every wholly free chunk
    /// to the upstream; returns the bytes released.
    ///
    /// # Errors
    /// The first upstream error; chunks it could not return are dropped
    /// from the pool (leaked), never reused.
    pub fn release_cached(&self) -> Result<usize> {
        if let Some(cache) = &self.cache {
            cache.drain_all(false);
            // Budgets follow the pool down again at its next growth.
            cache.note_pool_held(0);
        }
        let _remap = self.remap.then(|| lock(&self.remap_lock));
        let chunks = {
            let mut inner = self.inner.lock();
            let chunks = inner.fit.take_free_chunks();
            inner.fit.stats_mut().upstream_frees += chunks.len() as u64;
            if self.remap {
                for (chunk, _) in &chunks {
                    inner.pages.forget(chunk.addr, chunk.size);
                }
            }
            chunks
        };
        let mut released = 0;
        let mut first_err = None;
        for (chunk, _) in chunks {
            match self.upstream.deallocate_chunk(chunk) {
                Ok(()) => released += chunk.size,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        // With page remapping, free tails are unmapped piece by piece below
        // (a tail need not end on a piece's edge); their address space stays.
        if self.upstream.can_extend() && !self.remap {
            match self.release_free_tails() {
                Ok(bytes) => released += bytes,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if self.remap {
            match self.unmap_free_pages() {
                Ok(bytes) => released += bytes,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }

    /// Decides how to grow for a request of `rounded` bytes; books the
    /// growth against the limit. `Err(true)` when the limit forbids it.
    pub(super) fn plan_growth(&self, inner: &mut Inner, rounded: usize, align: usize) -> Result<Growth, bool> {
        // With page remapping, chunks grow by whole pages (each in one chunk).
        let gran = if self.remap { self.remap_page } else { self.upstream.granularity().max(BLOCK_ALIGN) };
        // Room for alignment padding beyond what the upstream guarantees.
        let need = rounded + align.saturating_sub(gran.min(4096)).min(align);
        let stats = inner.fit.stats();
        let growth = if self.config.expandable && self.upstream.can_extend() {
            inner.fit.last_chunk().map(|(chunk, free_tail)| {
                let extra = round_up(need.saturating_sub(free_tail).max(1), gran);
                // Grow at least by the minimum chunk so mapping stays rare.
                let extra = extra.max(round_up(self.config.min_chunk, gran));
                Growth::Extend { chunk, extra, need }
            })
        } else {
            None
        };
        let growth = growth.unwrap_or_else(|| {
            let mut bytes = need.max(self.config.min_chunk);
            if stats.reserved == 0 && inner.pending_growth == 0 && stats.upstream_allocs == 0 {
                bytes = bytes.max(inner.initial_size.unwrap_or(self.config.initial_size));
            }
            Growth::New { bytes: round_up(bytes, gran) }
        });
        if let Some(max) = self.config.max_size {
            let total = stats.reserved + inner.pending_growth + growth.bytes();
            if total > max {
                // Try the smallest growth that would do before giving up.
                let minimal = match growth {
                    Growth::Extend { chunk, .. } => {
                        let free_tail = inner.fit.last_chunk().map_or(0, |(_, t)| t);
                        let extra = round_up(need.saturating_sub(free_tail).max(1), gran);
                        Growth::Extend { chunk, extra, need }
                    }
                    Growth::New { .. } => Growth::New { bytes: round_up(need, gran) },
                };
                if stats.reserved + inner.pending_growth + minimal.bytes() > max {
                    return Err(true);
                }
                inner.pending_growth += minimal.bytes();
                return Ok(minimal);
            }
        }
        inner.pending_growth += growth.bytes();
        Ok(growth)
    }

    /// Gets the planned memory from the upstream (no lock held), adds it.
    pub(super) fn grow(&self, plan: Growth) -> Result<()> {
        match plan {
            Growth::Extend { chunk, extra, need } => {
                // With page remapping the pool grows by address space only;
                // pages are mapped where allocations land (remap.rs). The
                // remap lock keeps page moves off while the chunk grows;
                // the chunk must still be the pool's last, as planned.
                let remapping = self.remap.then(|| lock(&self.remap_lock));
                let extended = if self.remap {
                    let still = self.inner.lock().fit.last_chunk().is_some_and(|(c, _)| c == chunk);
                    still && self.upstream.try_extend_reserved(chunk, extra)?
                } else {
                    self.upstream.try_extend(chunk, extra)?
                };
                if extended {
                    let mut inner = self.inner.lock();
                    inner.pending_growth -= extra;
                    let added = inner.fit.extend_chunk(chunk, extra);
                    debug_assert!(added, "the upstream extended a chunk the pool does not hold");
                    if self.remap {
                        inner.pages.add_unmapped(chunk.end(), extra);
                    }
                    inner.fit.stats_mut().upstream_allocs += 1;
                    return Ok(());
                }
                drop(remapping);
                // The upstream can't extend (another thread of this pool
                // extended the chunk first, or the reservation is full):
                // take a new chunk instead, in whole pages when the pool
                // remaps, so that no page straddles two chunks (a chunk
                // given back would cut a piece mapped across the boundary,
                // and the upstream would refuse it).
                let gran = if self.remap { self.remap_page } else { self.upstream.granularity() };
                let bytes = round_up(need.max(self.config.min_chunk), gran);
                {
                    let mut inner = self.inner.lock();
                    let total = inner.fit.stats().reserved + inner.pending_growth - extra + bytes;
                    if self.config.max_size.is_some_and(|max| total > max) {
                        return Err(Error::OutOfMemory {
                            pool: self.config.kind,
                            requested: need,
                            state: Box::new(OomState {
                                upstream: Some(format!("{} can't extend the pool in place", self.upstream.name())),
                                ..Default::default()
                            }),
                        });
                    }
                    inner.pending_growth = inner.pending_growth - extra + bytes;
                }
                self.grow(Growth::New { bytes }).inspect_err(|_| {
                    // `allocate` un-books `plan.bytes()` (= extra); un-book
                    // the difference here.
                    let mut inner = self.inner.lock();
                    inner.pending_growth = inner.pending_growth + extra - bytes;
                })
            }
            Growth::New { bytes } => {
                let chunk = if self.remap {
                    self.upstream.reserve_chunk(bytes)?
                } else {
                    self.upstream.allocate_chunk(bytes)?
                };
                let mut inner = self.inner.lock();
                inner.pending_growth -= bytes;
                inner.fit.stats_mut().upstream_allocs += 1;
                let added = inner.fit.add_chunk(chunk);
                if added && self.remap {
                    inner.pages.add_unmapped(chunk.addr, chunk.size);
                    // The first chunk of a sized pool: mapped now and held.
                    let initial = inner.initial_size.unwrap_or(self.config.initial_size);
                    if inner.fit.stats().upstream_allocs == 1 && initial > 0 {
                        drop(inner);
                        return self.map_initial(chunk, initial);
                    }
                }
                if !added {
                    drop(inner);
                    // An upstream that hands out misaligned or overlapping
                    // memory is broken; give the chunk back and say so.
                    let _ = self.upstream.deallocate_chunk(chunk);
                    return Err(Error::InvalidState(format!(
                        "upstream {} returned an unusable chunk {:#x}+{}",
                        self.upstream.name(),
                        chunk.addr,
                        chunk.size
                    )));
                }
                Ok(())
            }
        }
    }

    /// Gives the free tails of grown chunks back to an expandable upstream
    /// (whole granules only; not used with page remapping); returns the
    /// bytes released.
    pub(super) fn release_free_tails(&self) -> Result<usize> {
        let gran = self.upstream.granularity();
        let cuts: Vec<(Chunk, usize)> = {
            let mut inner = self.inner.lock();
            let tails = inner.fit.free_tails();
            tails
                .into_iter()
                .filter_map(|(chunk, tail)| {
                    let amount = tail / gran * gran;
                    (amount > 0 && inner.fit.shrink_chunk(chunk, amount)).then_some((chunk, amount))
                })
                .collect()
        };
        let mut released = 0;
        for (chunk, amount) in cuts {
            let shrunk = Chunk { addr: chunk.addr, size: chunk.size - amount };
            match self.upstream.try_shrink(chunk, amount) {
                Ok(true) => {
                    released += amount;
                    self.inner.lock().fit.stats_mut().upstream_frees += 1;
                }
                other => {
                    // The upstream kept the memory: hand it back to the pool.
                    self.inner.lock().fit.extend_chunk(shrunk, amount);
                    other?;
                }
            }
        }
        Ok(released)
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Growth {
    Extend { chunk: Chunk, extra: usize, need: usize },
    New { bytes: usize },
}

impl Growth {
    pub(super) fn bytes(&self) -> usize {
        match *self {
            Growth::Extend { extra, .. } => extra,
            Growth::New { bytes } => bytes,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
