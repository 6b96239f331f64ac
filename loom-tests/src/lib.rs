//! Loom models of cumem: run with
//! `RUSTFLAGS="--cfg loom" cargo test -p cumem-loom-tests --release`.
//!
//! Under `cfg(loom)` cumem's `sync` shim uses loom's locks and atomics, so
//! the models in `tests/` exercise the real pool, thread caches and
//! initialisation code. This library holds what the models share.

#![cfg(loom)]

pub mod pages;

use std::sync::atomic::{AtomicUsize, Ordering};

use cumem::pool::{Pool, PoolConfig};
use cumem::upstream::{Chunk, Upstream};
use cumem::PoolKind;

/// Where the fake address ranges start.
pub const BASE: usize = 1 << 30;

/// The pools' chunk size in the models.
pub const CHUNK: usize = 1 << 16;

/// The distance between the starts of consecutive fake chunks.
pub const CHUNK_STRIDE: usize = CHUNK + (1 << 20);

/// An upstream that hands out fake address ranges: the pool never touches
/// the memory it manages, so nothing is mapped. A bump pointer, not part of
/// what is modelled (a std atomic, one per model run).
#[derive(Debug)]
pub struct FakeUpstream {
    next: AtomicUsize,
}

impl Default for FakeUpstream {
    fn default() -> Self {
        FakeUpstream::at(BASE)
    }
}

impl FakeUpstream {
    /// An upstream whose fake chunks start at `base` (upstreams of one
    /// model need disjoint ranges, as real ones have).
    pub fn at(base: usize) -> Self {
        FakeUpstream { next: AtomicUsize::new(base) }
    }
}

impl Upstream for FakeUpstream {
    fn allocate_chunk(&self, size: usize) -> cumem::Result<Chunk> {
        // Leave a gap so chunks are never neighbours by accident.
        assert_eq!(size, CHUNK, "the models allocate small blocks only");
        let addr = self.next.fetch_add(CHUNK_STRIDE, Ordering::Relaxed);
        Ok(Chunk { addr, size })
    }
    fn deallocate_chunk(&self, _chunk: Chunk) -> cumem::Result<()> {
        Ok(())
    }
    fn name(&self) -> &'static str {
        "fake"
    }
    fn host_accessible(&self) -> bool {
        false
    }
}

/// A pool over a [`FakeUpstream`], with or without thread caches; with
/// `budget`, each cache holds at most that many bytes (small budgets make
/// flushes happen in tiny models).
pub fn fake_pool(thread_cache: bool, budget: Option<usize>) -> Pool<FakeUpstream> {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache = thread_cache;
    c.thread_cache_bytes = budget.unwrap_or(c.thread_cache_bytes);
    c.min_chunk = CHUNK;
    Pool::new(FakeUpstream::default(), c)
}

/// Runs `f` under loom with a small preemption bound: each model takes seconds.
pub fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// Checks that a pool is back to nothing live and nothing cached, and
/// that its allocator's invariants hold. Ends with this thread's caches
/// released (loom can't run thread-local destructors that use loom
/// objects, so every model thread releases its caches before it ends).
pub fn assert_balanced<U: Upstream>(pool: &Pool<U>) {
    pool.with_fit(|f| f.check_invariants()).expect("best-fit invariants");
    let s = pool.stats();
    assert_eq!((s.in_use, s.requested, s.live_blocks), (0, 0, 0), "{s:?}");
    assert_eq!(s.allocations, s.frees, "{s:?}");
    pool.release_cached().expect("release");
    let s = pool.stats();
    assert_eq!((s.cached, s.reserved), (0, 0), "{s:?}");
    cumem::pool::release_thread_caches();
}
