//! Moves that lend memory behind a fence on the stream whose work may
//! use it: the model upstream lends (old mappings stay until unmapped),
//! and the pool gets a fence maker, as a device allocator gives it one.
//!
//! Checked by the model: no memory is lent while work on a stream other
//! than the fence's (or past its point) may use it; every fence orders
//! the requesting stream after it; no old mapping is unmapped while work
//! may use it (the mapper passes over it, a map over it waits for its
//! fence).

use std::collections::HashMap;
use std::sync::Arc;

use cumem::pool::{Pool, StreamTag};

use super::{check, pool_with_slack, random_size, reuse, Model, ModelFence, Rng, World, PAGE};

/// A pool over a lending model with no slack, the tag oracle and a fence
/// maker on the model's streams.
fn lending_pool(model: &Model) -> Pool<Model> {
    model.world().lends = true;
    let pool = pool_with_slack(model, 0);
    let m = model.clone();
    pool.set_tag_oracle(Arc::new(move |t: StreamTag| m.world().complete.get(&t.stream).is_some_and(|&c| c >= t.seq)));
    let m = model.clone();
    pool.set_fence_maker(Arc::new(move |on, then| {
        let mut w = m.world();
        // MIXED's stream: every stream that has freed (as the device
        // allocator fences every stream with frees not known complete).
        let points: Vec<(u64, u64)> = if on == StreamTag::MIXED.stream {
            w.freed.iter().map(|(&s, &p)| (s, p)).collect()
        } else {
            vec![(on, w.freed.get(&on).copied().unwrap_or(0))]
        };
        let fence = Arc::new(ModelFence { world: m.0.clone(), points: points.clone() });
        w.last_fence = Some((points.clone(), then));
        w.fences.insert(Arc::as_ptr(&fence) as usize, (points, then));
        Some(fence as Arc<dyn cumem::pool::Fence>)
    }));
    pool
}

/// Allocates `size` bytes for `stream`, the block taken into use there.
fn allocate(pool: &Pool<Model>, model: &Model, size: usize, stream: u64) -> cumem::pool::Allocation {
    {
        let mut w = model.world();
        w.requesting = stream;
        w.last_fence = None;
    }
    let a = pool.allocate_for(size, 256, stream).expect("the model never runs out of memory");
    reuse(&mut model.world(), &a);
    a
}

/// Frees the block at `addr` on `stream` (0: none): its last use is work
/// queued there.
fn free(pool: &Pool<Model>, model: &Model, addr: usize, size: usize, stream: u64) {
    let tag = {
        let mut w = model.world();
        w.live.remove(&addr);
        if stream == 0 {
            StreamTag::NONE
        } else {
            let seq = w.freed.entry(stream).or_default();
            *seq += 1;
            let tag = StreamTag { stream, seq: *seq };
            for page in World::pages(addr, size) {
                w.queued.insert(page, (stream, tag.seq));
            }
            tag
        }
    };
    pool.deallocate(addr, tag).unwrap();
}

/// 32 blocks of 4 pages for stream 1, every other one freed there (its
/// work not complete).
fn half_freed() -> (Model, Pool<Model>) {
    let model = Model::default();
    let pool = lending_pool(&model);
    let blocks: Vec<_> = (0..32).map(|_| allocate(&pool, &model, 4 * PAGE, 1)).collect();
    for b in blocks.iter().skip(1).step_by(2) {
        free(&pool, &model, b.addr, b.size, 1);
    }
    (model, pool)
}

/// The mapper's steps wait until the pool has made no move for a while.
fn after_the_quiet() {
    std::thread::sleep(std::time::Duration::from_millis(10));
}

#[test]
fn memory_freed_on_the_requesting_stream_moves_with_no_wait() {
    let (model, pool) = half_freed();
    // 60 pages fit in no hole: the holes' memory moves there, behind a
    // fence on stream 1, with no wait for the device.
    let big = allocate(&pool, &model, 60 * PAGE, 1);
    {
        let w = model.world();
        assert_eq!(w.syncs, 0, "a move of stream 1's memory for stream 1 waited for the device");
        assert_eq!(pool.stats().move_waits, 0, "the pool counted a wait");
        assert!(w.fenced >= 14 && w.lent == w.fenced, "{} pieces lent, {} behind a fence", w.lent, w.fenced);
        assert!(w.stale.values().all(|(_, f)| f.is_some()), "an old mapping without its fence");
        assert!(pool.stats().peak_mapped <= 129 * PAGE, "physical peak {} pages", pool.stats().peak_mapped / PAGE);
    }
    check(&model, &pool, 0);
    // Stream 1's work may still use the old mappings: the mapper leaves them.
    after_the_quiet();
    assert!(!pool.mapper_step());
    let stale = model.world().stale.len();
    assert!(stale > 0, "the mapper unmapped old mappings before their fence passed");
    // The work completes: the mapper unmaps them all, with no wait.
    model.world().complete.insert(1, u64::MAX);
    after_the_quiet();
    while pool.mapper_step() {}
    let w = model.world();
    assert!(w.stale.is_empty(), "{} old mappings left", w.stale.len());
    assert_eq!((w.syncs, w.fence_waits), (0, 0));
    drop(w);
    check(&model, &pool, 1);
    free(&pool, &model, big.addr, big.size, 1);
    pool.shutdown().unwrap();
    assert!(model.world().violations.is_empty());
}

#[test]
fn memory_freed_on_another_stream_moves_behind_a_fence_there() {
    let (model, pool) = half_freed();
    // The same move for stream 2: the fence is on stream 1, whose work may
    // use the memory, and stream 2 is ordered after it.
    let big = allocate(&pool, &model, 60 * PAGE, 2);
    moved_behind(&model, &pool, &[1], 2);
    finish(model, pool, big, 2);
}

#[test]
fn memory_of_blocks_freed_on_two_streams_moves_behind_a_fence_on_both() {
    let model = Model::default();
    let pool = lending_pool(&model);
    let blocks: Vec<_> = (0..32).map(|_| allocate(&pool, &model, 4 * PAGE, 1)).collect();
    // Neighbours freed on streams 1 and 2 merge into free blocks of 8
    // pages whose tag names neither stream.
    for pair in blocks.chunks(4) {
        free(&pool, &model, pair[1].addr, pair[1].size, 1);
        free(&pool, &model, pair[2].addr, pair[2].size, 2);
    }
    let big = allocate(&pool, &model, 60 * PAGE, 3);
    moved_behind(&model, &pool, &[1, 2], 3);
    finish(model, pool, big, 3);
}

#[test]
fn a_request_on_no_stream_waits_for_the_device() {
    let (model, pool) = half_freed();
    // The control: a request on no stream can't be ordered after stream
    // 1's work on the device, so the move waits for it and makes no fence.
    let big = allocate(&pool, &model, 60 * PAGE, 0);
    let w = model.world();
    assert!(w.syncs > 0, "stream 1's memory moved with no wait for a request on no stream");
    assert!(pool.stats().move_waits > 0, "the pool counted no wait");
    assert_eq!(w.fenced, 0, "a fence for a request on no stream");
    assert!(w.lent >= 14, "{} pieces lent", w.lent);
    drop(w);
    finish(model, pool, big, 0);
}

/// Checks that the move just made lent every piece behind the last fence,
/// made on `streams` for stream `then`, with no wait for the device.
fn moved_behind(model: &Model, pool: &Pool<Model>, streams: &[u64], then: u64) {
    let w = model.world();
    assert_eq!(w.syncs, 0, "the move waited for the device");
    assert_eq!(pool.stats().move_waits, 0, "the pool counted a wait");
    let made = w.last_fence.as_ref().map(|(points, then)| {
        let mut on: Vec<u64> = points.iter().map(|p| p.0).collect();
        on.sort_unstable();
        (on, *then)
    });
    assert_eq!(made, Some((streams.to_vec(), then)), "the fence is not on {streams:?} for stream {then}");
    assert!(w.fenced >= 14 && w.lent == w.fenced, "{} pieces lent, {} behind a fence", w.lent, w.fenced);
}

/// Checks the pool, frees `big` on `stream` and shuts the pool down.
fn finish(model: Model, pool: Pool<Model>, big: cumem::pool::Allocation, stream: u64) {
    check(&model, &pool, 0);
    free(&pool, &model, big.addr, big.size, stream);
    pool.shutdown().unwrap();
}

#[test]
fn a_map_over_an_old_mapping_waits_for_its_fence() {
    let (model, pool) = half_freed();
    let big = allocate(&pool, &model, 60 * PAGE, 1);
    assert!(!model.world().stale.is_empty());
    // The holes fill again while stream 1's work may still run: each map
    // over an old mapping waits for its fence first.
    let refill: Vec<_> = (0..16).map(|_| allocate(&pool, &model, 4 * PAGE, 1)).collect();
    let w = model.world();
    assert!(w.fence_waits > 0, "no map waited for a fence");
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    drop(w);
    check(&model, &pool, 0);
    for a in refill.into_iter().chain([big]) {
        free(&pool, &model, a.addr, a.size, 1);
    }
    pool.shutdown().unwrap();
    assert!(model.world().stale.is_empty(), "shutdown left old mappings");
}

/// Random allocations for random streams, frees on random streams, work
/// completing now and then, the mapper's steps and the release path.
fn run_seed(seed: u64, steps: usize) -> (u64, u64) {
    let model = Model::default();
    let pool = lending_pool(&model);
    // Pieces of 4 pages: moves take part of a free block.
    model.world().piece_cap = 4 * PAGE;
    let mut rng = Rng(seed | 1);
    let mut held: Vec<(usize, usize)> = Vec::new();
    for step in 0..steps {
        let r = rng.below(100);
        if r < 50 || held.is_empty() {
            let size = random_size(&mut rng);
            let a = allocate(&pool, &model, size, rng.below(4));
            held.push((a.addr, a.size));
        } else if r < 98 {
            let i = rng.below(held.len() as u64) as usize;
            let (addr, size) = held.swap_remove(i);
            free(&pool, &model, addr, size, rng.below(4));
        } else if r < 99 {
            let stream = 1 + rng.below(3);
            let upto = model.world().freed.get(&stream).copied().unwrap_or(0);
            model.world().complete.insert(stream, upto);
        } else if rng.below(4) == 0 {
            model.world().sync();
            pool.release_cached().unwrap();
        }
        if rng.below(3) == 0 {
            pool.mapper_step();
        }
        check(&model, &pool, step);
    }
    pool.shutdown().unwrap();
    let w = model.world();
    assert!(w.violations.is_empty(), "seed {seed}: {:?}", w.violations);
    assert!(w.stale.is_empty(), "seed {seed}: shutdown left old mappings");
    (w.fenced, w.lent)
}

#[test]
fn random_moves_behind_fences_keep_stream_order() {
    let mut totals: HashMap<&str, u64> = HashMap::new();
    for seed in [3u64, 7, 11, 19, 23, 29] {
        let (fenced, lent) = run_seed(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), 3000);
        *totals.entry("fenced").or_default() += fenced;
        *totals.entry("lent").or_default() += lent;
    }
    // Both kinds of move happen, so both are checked.
    assert!(totals["fenced"] > 0, "no piece lent behind a fence: the check saw nothing, {totals:?}");
    assert!(totals["lent"] > totals["fenced"], "no piece lent without a fence, {totals:?}");
}
