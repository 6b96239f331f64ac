//! When a pool's thread caches serve (from the start, or once threads
//! contend for the pool's lock) and how much each may park (a share of
//! the pool); see the module docs of `cache.rs`.

use super::ThreadCaches;
use crate::sync::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Waits for the pool's lock, within [`WAIT_WINDOW_MS`], that start caches
/// which wait for contention: threads that allocate at the same moment
/// again and again, not a stray overlap (a thread reading statistics, the
/// background mapper, a program's two threads taking turns).
pub const WAITS_TO_SERVE: u64 = 64;

/// The window in which [`WAITS_TO_SERVE`] waits must fall, milliseconds.
pub const WAIT_WINDOW_MS: u64 = 10;

/// The caches together park at most this share of what the pool holds
/// (one eighth): a thread's budget is the pool's bytes over this times the
/// threads with caches, so parked blocks raise a pool's peak by about an
/// eighth at most, however many threads come and go.
const POOL_SHARE: usize = 8;

/// A thread's least budget (4 MiB): a small pool still caches a few blocks.
const BUDGET_FLOOR: usize = 4 << 20;

/// Whether the caches serve, the waits counted before they do, and what
/// their budgets are made of.
pub(super) struct Start {
    /// The caches serve allocations and frees. Set at the start, or once
    /// the pool's lock is contended; never cleared, so a free that sees it
    /// unset knows no block was ever lent.
    serving: AtomicBool,
    /// Waits for the pool's lock seen in the current window: the count in
    /// the low 16 bits, the window's start (milliseconds) above.
    waits: AtomicU64,
    /// Caches of live threads, and the bytes the pool held at its last
    /// growth: each cache's budget is a share of the pool.
    live_caches: AtomicUsize,
    pool_held: AtomicUsize,
}

impl Start {
    /// Serving at once, or (`when_contended`) once the lock is contended.
    pub(super) fn new(when_contended: bool) -> Self {
        Start {
            serving: AtomicBool::new(!when_contended),
            waits: AtomicU64::new(0),
            live_caches: AtomicUsize::new(0),
            pool_held: AtomicUsize::new(0),
        }
    }

    /// A thread's cache was made.
    pub(super) fn cache_opened(&self) {
        self.live_caches.fetch_add(1, Ordering::Relaxed);
    }

    /// A thread's cache closed (its thread exited).
    pub(super) fn cache_closed(&self) {
        self.live_caches.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ThreadCaches {
    /// Whether the caches serve now.
    #[inline]
    pub(in crate::pool) fn serving(&self) -> bool {
        self.start.serving.load(Ordering::Acquire)
    }

    /// An allocation waited for the pool's lock: [`WAITS_TO_SERVE`] such
    /// waits within [`WAIT_WINDOW_MS`] start the caches. Only the waiting
    /// path pays for the clock, with the pool's lock let go.
    #[cold]
    pub(in crate::pool) fn note_wait(&self) {
        if self.serving() {
            return;
        }
        let now = now_ms();
        let waits = &self.start.waits;
        let seen = waits.load(Ordering::Relaxed);
        let start = seen >> 16;
        let next = if now.saturating_sub(start) > WAIT_WINDOW_MS { now << 16 | 1 } else { seen + 1 };
        // A lost race loses one count, which only delays the start.
        let _ = waits.compare_exchange(seen, next, Ordering::Relaxed, Ordering::Relaxed);
        if next & 0xffff >= WAITS_TO_SERVE {
            self.start.serving.store(true, Ordering::Release);
        }
    }
}

impl ThreadCaches {
    /// One thread's cache budget: its share of [`POOL_SHARE`] of what the
    /// pool held at its last growth, between [`BUDGET_FLOOR`] and the
    /// configured most (`thread_cache_bytes`).
    #[inline]
    pub(super) fn budget(&self) -> usize {
        let caches = self.start.live_caches.load(Ordering::Relaxed).max(1);
        let share = self.start.pool_held.load(Ordering::Relaxed) / (POOL_SHARE * caches);
        self.max_bytes.min(share.max(BUDGET_FLOOR))
    }

    /// The pool holds `bytes` now (after a growth, or a release).
    pub(in crate::pool) fn note_pool_held(&self, bytes: usize) {
        self.start.pool_held.store(bytes, Ordering::Relaxed);
    }
}

/// Milliseconds since the first call (the contention window's clock).
#[cfg(not(loom))]
fn now_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64
}

/// Under loom every wait falls in one window (no clock in a model).
#[cfg(loom)]
fn now_ms() -> u64 {
    0
}

#[cfg(all(test, not(loom)))]
mod tests;
