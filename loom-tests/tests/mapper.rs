//! The background mapper (`pool/mapper.rs`) against a free and an
//! allocation in flight, and against shutdown: the mapper's step unmaps
//! the old mapping of memory a move lent, while another thread frees
//! blocks and allocates again. In every interleaving no page under a live
//! block is unmapped, every block handed out sits on mapped pages, and the
//! pool's count of held memory is the upstream's.

#![cfg(loom)]

use cumem::pool::{Allocation, Pool, PoolConfig, StreamTag};
use cumem::PoolKind;
use cumem_loom_tests::model;
use cumem_loom_tests::pages::{PageUpstream, PAGE};
use loom::sync::Arc;
use loom::thread;

/// A remapping pool with no slack, no thread cache and no mapper thread
/// (the model runs the mapper's step on a thread of its own).
fn pool() -> Pool<PageUpstream> {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache = false;
    c.min_chunk = PAGE;
    c.remap_slack_ppm = 0;
    Pool::new(PageUpstream::default(), c)
}

/// Two blocks of two pages, the first freed: the second (live) is
/// returned.
fn one_freed(pool: &Pool<PageUpstream>) -> Allocation {
    let a = pool.allocate(2 * PAGE, 256).unwrap();
    let b = pool.allocate(2 * PAGE, 256).unwrap();
    pool.upstream().dev().live.insert((b.addr, b.size));
    pool.deallocate(a.addr, StreamTag::NONE).unwrap();
    b
}

/// Frees a live block.
fn free_live(pool: &Pool<PageUpstream>, b: Allocation) {
    pool.upstream().dev().live.remove(&(b.addr, b.size));
    pool.deallocate(b.addr, StreamTag::NONE).unwrap();
}

/// Allocates a block, marks it live and checks that it sits on mapped
/// pages.
fn allocate_live(pool: &Pool<PageUpstream>, size: usize) -> Allocation {
    let c = pool.allocate(size, 256).unwrap();
    pool.upstream().dev().live.insert((c.addr, c.size));
    assert_mapped(pool, c.addr, c.size);
    c
}

/// Runs `user` on one thread and a step of the mapper's work on another;
/// returns the block `user` allocated, checked to sit on mapped pages.
fn beside_a_step(
    pool: &Arc<Pool<PageUpstream>>,
    user: impl FnOnce(&Pool<PageUpstream>) -> Allocation + Send + 'static,
) -> Allocation {
    let p = pool.clone();
    let user = thread::spawn(move || user(&p));
    let p = pool.clone();
    let mapper = thread::spawn(move || {
        p.mapper_step();
    });
    mapper.join().unwrap();
    let c = user.join().unwrap();
    assert_mapped(pool, c.addr, c.size);
    c
}

/// No violation, the pool's held memory is the upstream's, and best
/// fit's invariants hold.
fn check_held(pool: &Pool<PageUpstream>) {
    let d = pool.upstream().dev();
    assert!(d.violations.is_empty(), "{:?}", d.violations);
    let held: usize = d.pieces.values().sum::<usize>() + d.spare.iter().sum::<usize>();
    drop(d);
    assert_eq!(pool.stats().mapped, held, "the pool's held memory drifted from the upstream's");
    pool.with_fit(|f| f.check_invariants()).expect("best-fit invariants");
}

/// Checks that `addr+size`'s pages are all mapped.
fn assert_mapped(pool: &Pool<PageUpstream>, addr: usize, size: usize) {
    pool.upstream().dev().assert_mapped(addr, size);
}

/// The mapper steps while the pool shuts down: once shutdown returns the
/// mapper changes nothing, and the pool holds nothing but what the upstream
/// has mapped.
#[test]
fn a_shutdown_during_a_step_leaves_nothing_kept_or_moving() {
    model(|| {
        let pool = Arc::new(pool());
        let b = one_freed(&pool);
        // No free block holds it and the budget is full: a move lends.
        let x = allocate_live(&pool, 3 * PAGE);
        assert!(!pool.upstream().dev().stale.is_empty(), "the move lent nothing: the model checks nothing");
        let p = pool.clone();
        let mapper = thread::spawn(move || {
            p.mapper_step();
        });
        pool.shutdown().unwrap();
        let after = pool.upstream().dev().pieces.clone();
        mapper.join().unwrap();
        let d = pool.upstream().dev();
        assert_eq!(d.pieces, after, "the mapper moved memory after shutdown returned");
        assert!(d.spare.is_empty(), "memory kept after shutdown");
        assert!(d.violations.is_empty(), "{:?}", d.violations);
        assert!(d.stale.is_empty(), "old mappings left after shutdown");
        d.assert_mapped(b.addr, b.size);
        d.assert_mapped(x.addr, x.size);
        drop(d);
        assert_eq!(pool.stats().kept, 0);
    });
}

/// A move lends free memory (mapped at its new place while the old stays
/// mapped); then, while the mapper's step unmaps the old mapping, another
/// thread frees everything and allocates a block over it (which must wait
/// for that unmap, or unmap the old mapping itself first). In every
/// interleaving no old mapping is unmapped under a live block or with
/// memory mapped over it, and the pool's held memory is the upstream's.
#[test]
fn old_mappings_of_lent_memory_go_behind_a_map_in_flight() {
    model(|| {
        let pool = Arc::new(pool());
        let b = one_freed(&pool);
        // No free block holds it and the budget is full: a's memory moves.
        let x = pool.allocate(3 * PAGE, 256).unwrap();
        assert!(!pool.upstream().dev().stale.is_empty(), "the move lent nothing: the model checks nothing");
        assert_mapped(&pool, x.addr, x.size);
        let c = beside_a_step(&pool, move |p| {
            free_live(p, b);
            free_live(p, x);
            // All of the range: a's old place must be mapped anew.
            allocate_live(p, 7 * PAGE)
        });
        assert!(pool.upstream().dev().stale_busy.is_empty());
        check_held(&pool);
        pool.deallocate(c.addr, StreamTag::NONE).unwrap();
        pool.shutdown().unwrap();
        assert!(pool.upstream().dev().stale.is_empty(), "old mappings left after shutdown");
    });
}
