//! Geometric growth: an upstream wrapper whose chunks grow with what was
//! already taken, so a pool reaches a large size in few upstream calls.
//!
//! # Implementation details
//!
//! A request for `size` bytes becomes a chunk of
//! `max(size, taken / DIVISOR)` bytes (rounded to the granularity), where
//! `taken` counts the bytes the upstream holds now. With `DIVISOR = 4`
//! the total grows by at least a quarter per call: from 16 MiB to 10 GiB
//! in about 30 calls, where fixed 2–4 MiB chunks take thousands, and the
//! memory held beyond what was asked stays under a quarter of the total.
//! Threads asking at the same time (the pool grows with no lock held)
//! split the extra between them. A limit (the pool's `max_size`) caps the
//! extra, never the request. `cuMemHostAlloc` pins page by page, so its
//! time grows with the size whatever the chunking; what this cuts is the
//! number of calls, each a driver round trip that serialises other
//! threads' growth, and the chunk boundaries blocks can't coalesce
//! across.
//!
//! **Growth after a quiet spell starts small.** An upstream that has not
//! grown for [`QUIET`] serves a pool at its working size: a request that
//! finds no room then is a shortfall (a peak a little above the last),
//! not a ramp, and pinning a quarter of a large pool for it would stall
//! the thread for a third of a second. The first chunk after a quiet
//! spell is at most [`RESTART`]; each chunk that follows closely may
//! double the last, up to the quarter, so a new ramp still reaches its
//! size in few calls.

use std::time::{Duration, Instant};

use super::{Chunk, Upstream};
use crate::error::Result;
use crate::sync::{lock, AtomicUsize, Mutex, Ordering};

/// How long without growth makes the next chunk start small again.
pub const QUIET: Duration = Duration::from_millis(250);

/// The largest extra chunk after a quiet spell (pinned: about 11 ms).
pub const RESTART: usize = 32 << 20;

/// The total divided by this is the smallest chunk asked for.
pub const DIVISOR: usize = 4;

/// The largest extra chunk (a request larger than this is still served
/// whole): pinning costs about 0.35 ms per MiB, so one call stays under
/// about 0.4 s. 10 GiB still takes under 40 calls.
pub const MAX_CHUNK: usize = 1 << 30;

/// An upstream whose chunks grow geometrically (see the module docs).
pub struct Geometric {
    inner: Box<dyn Upstream>,
    /// The bytes held now.
    taken: AtomicUsize,
    /// How many threads are asking for a chunk right now.
    growing: AtomicUsize,
    limit: Option<usize>,
    /// When this upstream last had a chunk, and its size.
    last: Mutex<Option<(Instant, usize)>>,
}

impl std::fmt::Debug for Geometric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Geometric").field("inner", &self.inner.name()).field("taken", &self.taken()).finish()
    }
}

impl Geometric {
    /// Wraps `inner`; `limit` caps the total the extra may bring it to.
    pub fn new(inner: Box<dyn Upstream>, limit: Option<usize>) -> Self {
        Geometric { inner, taken: AtomicUsize::new(0), growing: AtomicUsize::new(0), limit, last: Mutex::new(None) }
    }

    /// The bytes held now.
    pub fn taken(&self) -> usize {
        self.taken.load(Ordering::Relaxed)
    }

    /// The most extra a chunk may bring now: [`RESTART`] after a quiet
    /// spell of this upstream (or before its first chunk), else twice its
    /// last chunk (and at least [`RESTART`]).
    fn extra_cap(&self, now: Instant) -> usize {
        match *lock(&self.last) {
            Some((at, size)) if now.saturating_duration_since(at) < QUIET => size.saturating_mul(2).max(RESTART),
            _ => RESTART,
        }
    }

    fn record(&self, at: Instant, size: usize) {
        *lock(&self.last) = Some((at, size));
    }

    /// The chunk size asked of the inner upstream for a request of `size`
    /// while `growing` threads (this one included) ask at once: they split
    /// the extra, so growing together does not overshoot.
    pub fn chunk_size(&self, size: usize, growing: usize) -> usize {
        self.chunk_size_at(size, growing, Instant::now())
    }

    fn chunk_size_at(&self, size: usize, growing: usize, now: Instant) -> usize {
        let gran = self.inner.granularity().max(1);
        let taken = self.taken();
        let cap = MAX_CHUNK.min(self.extra_cap(now));
        let want = (taken / (DIVISOR * growing.max(1))).min(cap).div_ceil(gran) * gran;
        let mut bytes = size.max(want);
        if let Some(limit) = self.limit {
            // The extra may not take the total past the limit.
            let room = limit.saturating_sub(taken).max(size) / gran * gran;
            bytes = bytes.min(room.max(size));
        }
        bytes
    }
}

impl Upstream for Geometric {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        let growing = self.growing.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        let bytes = self.chunk_size_at(size, growing, now);
        let r = match self.inner.allocate_chunk(bytes) {
            // The larger chunk could not be had: the request alone may.
            Err(_) if bytes > size => self.inner.allocate_chunk(size),
            r => r,
        };
        self.growing.fetch_sub(1, Ordering::Relaxed);
        let chunk = r?;
        self.taken.fetch_add(chunk.size, Ordering::Relaxed);
        self.record(now, chunk.size);
        Ok(chunk)
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        self.inner.deallocate_chunk(chunk)?;
        self.taken.fetch_sub(chunk.size, Ordering::Relaxed);
        Ok(())
    }
    fn inner(&self) -> Option<&dyn Upstream> {
        Some(&*self.inner)
    }
    // Whatever adds or removes memory is counted, so that the next chunk
    // is sized from, and the limit holds for, all the memory held.
    fn try_extend(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        let grown = self.inner.try_extend(chunk, extra)?;
        if grown {
            self.taken.fetch_add(extra, Ordering::Relaxed);
        }
        Ok(grown)
    }
    fn try_shrink(&self, chunk: Chunk, amount: usize) -> Result<bool> {
        let shrunk = self.inner.try_shrink(chunk, amount)?;
        if shrunk {
            self.taken.fetch_sub(amount, Ordering::Relaxed);
        }
        Ok(shrunk)
    }
    fn map_runs(&self, runs: &[Chunk]) -> Result<u64> {
        let calls = self.inner.map_runs(runs)?;
        self.taken.fetch_add(runs.iter().map(|r| r.size).sum(), Ordering::Relaxed);
        Ok(calls)
    }
    fn unmap_within(&self, spans: &[Chunk], want: usize, pending: bool, keep: bool) -> Result<Vec<Chunk>> {
        let unmapped = self.inner.unmap_within(spans, want, pending, keep)?;
        self.taken.fetch_sub(unmapped.iter().map(|c| c.size).sum(), Ordering::Relaxed);
        Ok(unmapped)
    }
}

#[cfg(test)]
mod tests;
