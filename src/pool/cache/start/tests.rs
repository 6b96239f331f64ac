use crate::error::PoolKind;
use crate::pool::{Pool, PoolConfig, StreamTag};
use crate::upstream::Host;

fn contended_pool() -> Pool<Host> {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache = true;
    c.cache_when_contended = true;
    Pool::new(Host::new(), c)
}

/// Waits start the caches: a block allocated before goes straight back
/// to the pool (and a second free of it is caught), blocks freed after
/// are parked.
#[test]
fn waits_for_the_lock_start_the_caches() {
    let p = contended_pool();
    let cache = p.cache.as_ref().expect("caches exist");
    let before = p.allocate(4096, 256).unwrap();
    cache.note_wait();
    assert!(!cache.serving(), "one wait started the caches");
    let a = p.allocate(4096, 256).unwrap();
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
    assert_eq!(p.stats().cached, 0, "a block was parked before the caches served");
    // Until 64 waits fall in one window (a thread descheduled past
    // the window starts a new one).
    for _ in 0..100_000 {
        if cache.serving() {
            break;
        }
        cache.note_wait();
    }
    assert!(cache.serving(), "waits never started the caches");
    let b = p.allocate(4096, 256).unwrap();
    p.deallocate(b.addr, StreamTag::NONE).unwrap();
    assert!(p.stats().cached > 0, "serving caches parked nothing");
    p.deallocate(before.addr, StreamTag::NONE).unwrap();
    assert!(p.deallocate(before.addr, StreamTag::NONE).is_err(), "a double free of a block from before");
    assert_eq!(p.stats().live_blocks, 0);
    crate::pool::release_thread_caches();
    p.with_fit(|f| f.check_invariants()).unwrap();
}

/// A cache's budget is its share of an eighth of the pool, between
/// 4 MiB and `thread_cache_bytes`, and what it parks stays within it.
#[test]
fn a_caches_budget_follows_the_pool() {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache = true;
    c.thread_cache_bytes = 256 << 20;
    let p = Pool::new(Host::new(), c);
    let cache = p.cache.as_ref().expect("caches exist");
    let a = p.allocate(1 << 20, 256).unwrap();
    p.deallocate(a.addr, StreamTag::NONE).unwrap();
    cache.note_pool_held(1 << 30);
    assert_eq!(cache.budget(), 128 << 20, "one cache: an eighth of 1 GiB");
    cache.note_pool_held(100 << 30);
    assert_eq!(cache.budget(), 256 << 20, "never above thread_cache_bytes");
    cache.note_pool_held(0);
    assert_eq!(cache.budget(), 4 << 20, "never below 4 MiB");
    let blocks: Vec<_> = (0..8).map(|_| p.allocate(1 << 20, 256).unwrap()).collect();
    for b in blocks {
        p.deallocate(b.addr, StreamTag::NONE).unwrap();
    }
    assert!(p.stats().cached <= 4 << 20, "parked {} B over a 4 MiB budget", p.stats().cached);
    crate::pool::release_thread_caches();
}
