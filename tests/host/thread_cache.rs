//! The pool's per-thread caches: statistics stay truthful, bad frees are
//! still caught, blocks cached by other (or exited) threads come back.

use std::sync::Arc;

use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::Host;
use cumem::{Error, PoolKind};

fn pool(cache: bool) -> Pool<Host> {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache = cache;
    Pool::new(Host::new(), c)
}

fn check(p: &Pool<Host>) {
    p.with_fit(|f| f.check_invariants()).unwrap();
}

#[test]
fn hit_reuses_the_block_and_stats_balance() {
    let p = pool(true);
    let a = p.allocate(1000, 256).unwrap();
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
    let s = p.stats();
    assert_eq!((s.in_use, s.requested, s.live_blocks, s.cached), (0, 0, 0, 1024));
    let b = p.allocate(900, 1).unwrap();
    assert_eq!(b.addr, a.addr, "a hit returns the cached block");
    let s = p.stats();
    assert_eq!((s.in_use, s.requested, s.live_blocks, s.cached), (1024, 900, 1, 0));
    assert_eq!((s.allocations, s.frees), (2, 1));
    p.deallocate(b.addr, StreamTag::NONE).unwrap();
    assert!(p.release_cached().unwrap() > 0);
    let s = p.stats();
    assert_eq!((s.in_use, s.requested, s.cached, s.reserved, s.frees), (0, 0, 0, 0, 2));
    check(&p);
}

#[test]
fn classes_round_up_by_at_most_a_sixteenth() {
    let p = pool(true);
    for size in [1, 256, 4096, 4097, 5000, 100_000, 3 << 20, 4 << 20, 40 << 20, 64 << 20] {
        let a = p.allocate(size, 256).unwrap();
        let exact = size.next_multiple_of(256);
        assert!(a.size >= exact && a.size - exact <= exact / 16, "{size} -> {}", a.size);
        p.deallocate(a.addr, StreamTag::NONE).unwrap();
    }
    // Beyond the cached range sizes are exact.
    let a = p.allocate((64 << 20) + 256, 256).unwrap();
    assert_eq!(a.size, (64 << 20) + 256);
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
}

fn exact_pool() -> Pool<Host> {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.cache_exact = true;
    Pool::new(Host::new(), c)
}

#[test]
fn exact_caches_round_nothing_and_hit_only_the_same_size() {
    let p = exact_pool();
    let a = p.allocate(40_000, 256).unwrap();
    assert_eq!(a.size, 40_192, "no class rounding");
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
    assert_eq!(p.stats().cached, 40_192);
    // Same class, other size: a miss, served by the pool.
    let b = p.allocate(40_960, 256).unwrap();
    assert_ne!(b.addr, a.addr);
    assert_eq!(b.size, 40_960);
    // The same rounded size: a hit.
    let c = p.allocate(40_100, 256).unwrap();
    assert_eq!((c.addr, c.size), (a.addr, 40_192));
    for x in [b, c] {
        p.deallocate(x.addr, StreamTag::NONE).unwrap();
    }
    check(&p);
}

#[test]
fn stream_tagged_blocks_are_cached_for_their_own_stream() {
    let p = exact_pool();
    let s7 = StreamTag { stream: 7, seq: 1 };
    let a = p.allocate_for(1 << 16, 256, 7).unwrap();
    p.deallocate(a.addr, s7).unwrap();
    assert_eq!(p.stats().cached, 1 << 16, "a block freed on a stream is cached");
    // Neither another stream nor a stream-less request may take it.
    let other = p.allocate_for(1 << 16, 256, 9).unwrap();
    let none = p.allocate(1 << 16, 256).unwrap();
    assert!(other.addr != a.addr && none.addr != a.addr);
    assert_eq!((other.tag, none.tag), (StreamTag::NONE, StreamTag::NONE));
    // Its own stream takes it, with the tag (no wait needed on stream 7).
    let mine = p.allocate_for(1 << 16, 256, 7).unwrap();
    assert_eq!((mine.addr, mine.tag), (a.addr, s7));
    p.deallocate(mine.addr, StreamTag { stream: 7, seq: 2 }).unwrap();
    // Flushed to the pool, the block keeps its tag there: the pool hands
    // it out naming stream 7, so the caller orders its reuse.
    p.release_cached().unwrap();
    assert_eq!(p.stats().cached, 0);
    let again = p.allocate_for(1 << 16, 256, 9).unwrap();
    assert_eq!((again.addr, again.tag), (a.addr, StreamTag { stream: 7, seq: 2 }));
    for x in [other, none, again] {
        p.deallocate(x.addr, StreamTag::NONE).unwrap();
    }
    let s = p.stats();
    assert_eq!((s.in_use, s.live_blocks), (0, 0));
    check(&p);
}

#[test]
fn a_hit_prefers_a_usable_block_under_others() {
    let p = exact_pool();
    let mine = p.allocate_for(4096, 256, 3).unwrap();
    let theirs = p.allocate_for(4096, 256, 4).unwrap();
    p.deallocate(mine.addr, StreamTag { stream: 3, seq: 1 }).unwrap();
    p.deallocate(theirs.addr, StreamTag { stream: 4, seq: 1 }).unwrap();
    // Stream 4's block is on top of the bin; stream 3 finds its own below.
    let a = p.allocate_for(4096, 256, 3).unwrap();
    assert_eq!(a.addr, mine.addr);
    let b = p.allocate_for(4096, 256, 4).unwrap();
    assert_eq!(b.addr, theirs.addr);
    for x in [a, b] {
        p.deallocate(x.addr, StreamTag::NONE).unwrap();
    }
    check(&p);
}

#[test]
fn growth_drains_the_caches_first() {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.min_chunk = 1 << 20;
    c.cache_exact = true;
    let p = Pool::new(Host::new(), c);
    let blocks: Vec<_> = (0..16).map(|_| p.allocate(64 << 10, 256).unwrap()).collect();
    assert_eq!(p.stats().reserved, 1 << 20);
    for b in &blocks {
        p.deallocate(b.addr, StreamTag::NONE).unwrap();
    }
    assert_eq!(p.stats().cached, 1 << 20, "the whole chunk sits in the cache");
    // A request the cache can't serve would grow the pool; the cache is
    // flushed first and the chunk serves it.
    let big = p.allocate(1 << 20, 256).unwrap();
    let s = p.stats();
    assert_eq!((s.reserved, s.cached, s.upstream_allocs), (1 << 20, 0, 1));
    p.deallocate(big.addr, StreamTag::NONE).unwrap();
    check(&p);
}

#[test]
fn bad_frees_are_still_caught() {
    let p = pool(true);
    let a = p.allocate(5000, 256).unwrap();
    assert!(matches!(p.deallocate(a.addr + 256, StreamTag::NONE), Err(Error::InteriorPointer { .. })));
    assert!(matches!(p.deallocate(1 << 40, StreamTag::NONE), Err(Error::UnknownPointer { .. })));
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
    // Now cached: a second free is a double free, and does not cache it twice.
    assert!(matches!(p.deallocate(a.addr, StreamTag::NONE), Err(Error::DoubleFree { .. })));
    let x = p.allocate(5000, 256).unwrap();
    let y = p.allocate(5000, 256).unwrap();
    assert_ne!(x.addr, y.addr);
    // A cached block is not the user's: no size, no resizing.
    p.deallocate(x.addr, StreamTag::NONE).unwrap();
    assert_eq!(p.block_size(x.addr), None);
    assert!(!p.grow_in_place(x.addr, 6000));
    assert_eq!(p.block_size(y.addr), Some(y.size));
    p.deallocate(y.addr, StreamTag::NONE).unwrap();
    check(&p);
}

#[test]
fn mixed_tags_bypass_the_cache() {
    let p = pool(true);
    let a = p.allocate(1 << 16, 256).unwrap();
    p.deallocate(a.addr, StreamTag::MIXED).unwrap();
    assert_eq!(p.stats().cached, 0);
    let b = p.allocate(1 << 16, 256).unwrap();
    assert_eq!((b.addr, b.tag), (a.addr, StreamTag::MIXED), "the pool keeps the stream tag");
    p.deallocate(b.addr, StreamTag::NONE).unwrap();
    check(&p);
}

#[test]
fn resizing_a_lent_block_keeps_stats_right() {
    let p = pool(true);
    let a = p.allocate(1000, 256).unwrap();
    assert!(p.shrink_in_place(a.addr, 300));
    let s = p.stats();
    assert_eq!((s.in_use, s.requested), (512, 300));
    assert!(p.grow_in_place(a.addr, 2000));
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
    let s = p.stats();
    assert_eq!((s.in_use, s.requested, s.live_blocks), (0, 0, 0));
    check(&p);
}

#[test]
fn cross_thread_frees_and_exited_threads() {
    let p = Arc::new(pool(true));
    // Blocks allocated here, freed on another thread.
    let blocks: Vec<_> = (0..100).map(|i| p.allocate(256 * (1 + i % 40), 256).unwrap()).collect();
    let q = p.clone();
    std::thread::spawn(move || {
        for b in &blocks {
            q.deallocate(b.addr, StreamTag::NONE).unwrap();
        }
        for b in &blocks {
            assert!(matches!(q.deallocate(b.addr, StreamTag::NONE), Err(Error::DoubleFree { .. })));
        }
    })
    .join()
    .unwrap();
    // Blocks cached by a thread that exited come back; its live blocks are
    // still freeable here.
    let q = p.clone();
    let kept = std::thread::spawn(move || {
        let keep: Vec<_> = (0..50).map(|_| q.allocate(3000, 256).unwrap()).collect();
        for _ in 0..50 {
            let b = q.allocate(70_000, 256).unwrap();
            q.deallocate(b.addr, StreamTag::NONE).unwrap();
        }
        keep
    })
    .join()
    .unwrap();
    for b in &kept {
        p.deallocate(b.addr, StreamTag::NONE).unwrap();
    }
    p.release_cached().unwrap();
    let s = p.stats();
    assert_eq!((s.in_use, s.requested, s.live_blocks, s.cached, s.reserved), (0, 0, 0, 0, 0), "{s:?}");
    assert_eq!(s.allocations, s.frees);
    check(&p);
}

#[test]
fn release_cached_drains_other_threads_caches() {
    let p = Arc::new(pool(true));
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let q = p.clone();
    let t = std::thread::spawn(move || {
        let b = q.allocate(8192, 256).unwrap();
        q.deallocate(b.addr, StreamTag::NONE).unwrap();
        done_tx.send(()).unwrap();
        rx.recv().unwrap(); // stay alive: the cache is not flushed by exit
    });
    done_rx.recv().unwrap();
    assert_eq!(p.stats().cached, 8192);
    p.release_cached().unwrap();
    let s = p.stats();
    assert_eq!((s.cached, s.reserved), (0, 0));
    tx.send(()).unwrap();
    t.join().unwrap();
}

#[test]
fn shutdown_closes_the_caches() {
    let p = pool(true);
    let a = p.allocate(512, 256).unwrap();
    let b = p.allocate(512, 256).unwrap();
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
    let live = p.shutdown().unwrap();
    assert_eq!(live.len(), 1);
    assert!(matches!(p.allocate(512, 256), Err(Error::ShutDown(_))));
    p.deallocate(b.addr, StreamTag::NONE).unwrap();
    let s = p.stats();
    assert_eq!((s.in_use, s.cached, s.reserved), (0, 0, 0), "{s:?}");
}

#[test]
fn caches_are_bounded_and_drained_on_out_of_memory() {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache_bytes = 1 << 20;
    c.max_size = Some(8 << 20);
    c.min_chunk = 1 << 20;
    let p = Pool::new(Host::new(), c);
    let blocks: Vec<_> = (0..60).map(|_| p.allocate(64 << 10, 256).unwrap()).collect();
    for b in &blocks {
        p.deallocate(b.addr, StreamTag::NONE).unwrap();
    }
    assert!(p.stats().cached <= 1 << 20);
    // Everything is free or cached: one allocation of nearly the limit must
    // succeed by draining the cache.
    let big = p.allocate(7 << 20, 256).unwrap();
    p.deallocate(big.addr, StreamTag::NONE).unwrap();
    check(&p);
}

#[test]
fn blocks_no_hit_takes_go_back_within_a_few_looks() {
    use cumem::pool::LOOK_EVERY;
    let p = pool(true);
    // Twenty blocks of one size, parked and never asked for again.
    let idle: Vec<_> = (0..20).map(|_| p.allocate(100_000, 256).unwrap()).collect();
    let idle_size = idle[0].size;
    for b in &idle {
        p.deallocate(b.addr, StreamTag::NONE).unwrap();
    }
    assert_eq!(p.stats().cached, 20 * idle_size);
    // Another size, taken and freed again and again: always the same block.
    let busy = p.allocate(30_000, 256).unwrap();
    p.deallocate(busy.addr, StreamTag::NONE).unwrap();
    for _ in 0..3 * LOOK_EVERY {
        let b = p.allocate(30_000, 256).unwrap();
        assert_eq!(b.addr, busy.addr, "the block in use stays cached");
        p.deallocate(b.addr, StreamTag::NONE).unwrap();
    }
    let cached = p.stats().cached - busy.size;
    assert!(cached <= 2 * idle_size, "{} idle blocks still cached after three looks", cached / idle_size);
    check(&p);
}

#[test]
fn off_means_exact_sizes_and_no_cache() {
    let p = pool(false);
    let a = p.allocate(5000, 256).unwrap();
    assert_eq!(a.size, 5120);
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
    assert_eq!(p.stats().cached, 0);
}

#[test]
fn pinned_vectors_grow_and_shrink_through_the_caches() {
    use cumem::{MemoryManager, PinnedAlloc, PinnedVec};
    // The global manager's pinned pool has thread caches on by default.
    let mm = MemoryManager::global().unwrap();
    assert!(mm.pinned_pool().config().thread_cache);
    let before = mm.pinned_stats();
    for round in 0..3u32 {
        let mut v: PinnedVec<u32> = PinnedVec::new_in(PinnedAlloc);
        for i in 0..50_000u32 {
            v.push(i ^ round);
        }
        v.truncate(1000);
        v.shrink_to_fit();
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32 ^ round));
    }
    let after = mm.pinned_stats();
    assert_eq!((after.in_use, after.live_blocks), (before.in_use, before.live_blocks), "{after:?}");
}

#[test]
fn a_miss_may_take_a_slightly_larger_block_which_returns_to_its_own_bin() {
    let p = pool(true);
    let a = p.allocate(9216, 256).unwrap();
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
    // 8704 B is the class below 9216 B: served by the cached 9216 B block.
    let b = p.allocate(8600, 256).unwrap();
    assert_eq!((b.addr, b.size), (a.addr, 9216));
    assert_eq!(p.stats().in_use, 9216);
    p.deallocate(b.addr, StreamTag::NONE).unwrap();
    // Back in its own bin: a 9216 B request hits it.
    let c = p.allocate(9216, 256).unwrap();
    assert_eq!(c.addr, a.addr);
    p.deallocate(c.addr, StreamTag::NONE).unwrap();
    // Small classes never take a larger block.
    let d = p.allocate(512, 256).unwrap();
    p.deallocate(d.addr, StreamTag::NONE).unwrap();
    assert_eq!(p.allocate(256, 256).unwrap().size, 256);
}

#[test]
fn a_finished_streams_tag_leaves_a_merge_when_the_pool_can_ask() {
    // Two neighbours freed on different streams, the first stream's work
    // known complete: the merged block carries only the second's tag.
    let old = StreamTag { stream: 7, seq: 3 };
    let new = StreamTag { stream: 9, seq: 1 };
    for oracle in [false, true] {
        let p = pool(false);
        if oracle {
            p.set_tag_oracle(Arc::new(move |t: StreamTag| t.stream == old.stream));
        }
        let a = p.allocate(1 << 20, 256).unwrap();
        let b = p.allocate(1 << 20, 256).unwrap();
        let keep = p.allocate(1 << 20, 256).unwrap();
        assert_eq!(b.addr, a.addr + a.size, "neighbours");
        p.deallocate(a.addr, old).unwrap();
        p.deallocate(b.addr, new).unwrap();
        let m = p.allocate(2 << 20, 256).unwrap();
        assert_eq!(m.addr, a.addr, "the merged block");
        let want = if oracle { new } else { StreamTag::MIXED };
        assert_eq!(m.tag, want, "oracle {oracle}");
        p.deallocate(m.addr, StreamTag::NONE).unwrap();
        p.deallocate(keep.addr, StreamTag::NONE).unwrap();
        check(&p);
    }
}

/// What an IPC handle reports as its size: the bytes asked for, not the
/// block's rounded size (an importer reading `size()` bytes would read past
/// the exporter's data), whether a thread cache or the shared pool lent it.
#[test]
fn the_requested_size_of_a_live_block_is_what_was_asked() {
    for cache in [false, true] {
        let p = pool(cache);
        let a = p.allocate(1000, 256).unwrap();
        assert_eq!(p.block_size(a.addr), Some(1024), "cache {cache}");
        assert_eq!(p.requested_size(a.addr), Some(1000), "cache {cache}");
        // A cached block lent again reports the new request.
        p.deallocate(a.addr, StreamTag::NONE).unwrap();
        assert_eq!(p.requested_size(a.addr), None, "cache {cache}: a free block");
        let b = p.allocate(900, 1).unwrap();
        assert_eq!(p.requested_size(b.addr), Some(900), "cache {cache}");
        p.deallocate(b.addr, StreamTag::NONE).unwrap();
        check(&p);
    }
}

fn contended_pool() -> Pool<Host> {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache = true;
    c.cache_when_contended = true;
    Pool::new(Host::new(), c)
}

/// Caches that wait for contention park nothing while one thread (or
/// threads taking turns) allocates: the pool stays one exact best fit.
#[test]
fn caches_that_wait_for_contention_park_nothing_for_threads_taking_turns() {
    let p = Arc::new(contended_pool());
    for round in 0..4 {
        let p2 = p.clone();
        // One thread at a time, each joined before the next starts.
        std::thread::spawn(move || {
            for i in 0..20_000usize {
                let a = p2.allocate(256 * (1 + (i + round) % 64), 256).unwrap();
                p2.deallocate(a.addr, StreamTag::NONE).unwrap();
            }
        })
        .join()
        .unwrap();
        assert_eq!(p.stats().cached, 0, "round {round}: a block was parked in a thread cache");
    }
    check(&p);
    // The control: the same pool with caches from the start parks blocks.
    let q = pool(true);
    let a = q.allocate(1000, 256).unwrap();
    q.deallocate(a.addr, StreamTag::NONE).unwrap();
    assert_eq!(q.stats().cached, 1024, "the control's cache must park the block");
}
