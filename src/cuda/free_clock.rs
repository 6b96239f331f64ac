//! The sequence numbers of a stream's frees, sharded by thread.
//!
//! # Implementation details
//!
//! A block freed on a stream is tagged with a sequence number; once the
//! host has synchronised the stream after that free, the block needs no
//! wait any more. A single counter per stream made every free on a stream
//! shared by many threads an atomic increment of one cache line, which
//! serialised those threads. Here each thread counts on its own shard (a
//! cache line of its own, chosen by the thread's slot): a number is
//! `shard << 48 | count`. A synchronisation reads every shard's count
//! before it waits and then records each as complete, so a free counts as
//! complete only if the synchronisation saw its increment (the increment
//! happened before the read, and the free's work was queued before the
//! increment). Two frees on one stream from different shards merge to
//! [`PENDING`], which never counts as complete: reuse on another stream then
//! always waits for the stream's work (an event), which is correct, only
//! sometimes more than needed.

use crossbeam::utils::CachePadded;

use crate::sync::{AtomicU64, Ordering};

/// Shards per stream.
#[cfg(not(loom))]
const SHARDS: usize = 64;
#[cfg(loom)]
const SHARDS: usize = 4;

const COUNT_BITS: u32 = 48;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// A sequence number that never counts as complete (see the module docs).
pub const PENDING: u64 = u64::MAX;

/// One stream's free counters (public for the loom models only).
#[doc(hidden)]
pub struct FreeClock {
    /// Frees counted per shard.
    freed: Box<[CachePadded<AtomicU64>]>,
    /// Per shard, every free up to this count is known complete.
    synced: Box<[AtomicU64]>,
}

impl Default for FreeClock {
    fn default() -> Self {
        FreeClock::new()
    }
}

impl FreeClock {
    /// Counters at 0.
    pub fn new() -> Self {
        FreeClock {
            freed: (0..SHARDS).map(|_| CachePadded::new(AtomicU64::new(0))).collect(),
            synced: (0..SHARDS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The sequence number of a free on the calling thread now (never 0).
    #[inline]
    pub fn tick(&self) -> u64 {
        let shard = crate::sync::thread_slot() % SHARDS;
        let count = self.freed[shard].fetch_add(1, Ordering::AcqRel) + 1;
        (shard as u64) << COUNT_BITS | (count & COUNT_MASK)
    }

    /// Whether the free numbered `seq` is known complete.
    pub fn completed(&self, seq: u64) -> bool {
        if seq == PENDING {
            return false;
        }
        let shard = (seq >> COUNT_BITS) as usize;
        self.synced.get(shard).is_some_and(|s| s.load(Ordering::Acquire) >= seq & COUNT_MASK)
    }

    /// Whether every free counted so far is known complete.
    pub fn all_complete(&self) -> bool {
        self.freed.iter().zip(self.synced.iter()).all(|(f, s)| s.load(Ordering::Acquire) >= f.load(Ordering::Acquire))
    }

    /// Every shard's count now (read before the host waits for the stream).
    pub fn seen(&self) -> Vec<u64> {
        self.freed.iter().map(|f| f.load(Ordering::Acquire)).collect()
    }

    /// Whether the free numbered `seq` was counted in `seen` (a
    /// [`seen`](Self::seen) read, or the largest of several).
    pub fn counted_in(seen: &[u64], seq: u64) -> bool {
        if seq == PENDING {
            return false;
        }
        let shard = (seq >> COUNT_BITS) as usize;
        seen.get(shard).is_some_and(|&n| n >= seq & COUNT_MASK)
    }

    /// Whether every free counted so far was counted in `seen`.
    pub fn all_counted_in(&self, seen: &[u64]) -> bool {
        self.freed.iter().zip(seen).all(|(f, &n)| f.load(Ordering::Acquire) <= n)
    }

    /// Records [`seen`](Self::seen)'s counts complete (the host waited).
    pub fn mark_complete(&self, seen: &[u64]) {
        for (s, &n) in self.synced.iter().zip(seen).filter(|&(_, &n)| n > 0) {
            s.fetch_max(n, Ordering::AcqRel);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
