//! The model check's runs: random operation sequences (with and without
//! the completion oracle), free pages moving to where memory is needed,
//! and threads allocating beside the background mapper.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cumem::pool::{Pool, StreamTag};

use super::{check, pool, pool_with_slack, random_size, reuse, Model, Rng, World, PAGE};

/// Frees the block at `addr` on a random stream (none a quarter of the
/// time): its last use is work queued there.
fn free_on_a_stream(
    pool: &Pool<Model>,
    model: &Model,
    rng: &mut Rng,
    seqs: &mut HashMap<u64, u64>,
    addr: usize,
    size: usize,
) {
    let stream = rng.below(4);
    let tag = if stream == 0 {
        StreamTag::NONE
    } else {
        let seq = seqs.entry(stream).or_default();
        *seq += 1;
        StreamTag { stream, seq: *seq }
    };
    {
        let mut w = model.world();
        w.live.remove(&addr);
        if tag != StreamTag::NONE {
            for page in World::pages(addr, size) {
                w.queued.insert(page, (tag.stream, tag.seq));
            }
        }
    }
    pool.deallocate(addr, tag).unwrap();
}

/// With `oracle`, the pool knows which frees' work completed (as the
/// device allocator's stream registry tells it), so moving their pages
/// needs no wait; a wrong answer shows as a violation at the unmap.
fn run_seed(seed: u64, steps: usize, oracle: bool) {
    let model = Model::default();
    let pool = pool(&model);
    if oracle {
        let m = model.clone();
        pool.set_tag_oracle(Arc::new(move |t: StreamTag| {
            m.world().complete.get(&t.stream).is_some_and(|&c| c >= t.seq)
        }));
    }
    let mut rng = Rng(seed | 1);
    let mut seqs: HashMap<u64, u64> = HashMap::new();
    let mut held: Vec<(usize, usize)> = Vec::new();
    for step in 0..steps {
        let r = rng.below(100);
        if r < 50 || held.is_empty() {
            let size = random_size(&mut rng);
            let a = pool.allocate(size, 256).expect("the model never runs out of memory");
            reuse(&mut model.world(), &a);
            held.push((a.addr, a.size));
        } else if r < 95 {
            let i = rng.below(held.len() as u64) as usize;
            let (addr, size) = held.swap_remove(i);
            free_on_a_stream(&pool, &model, &mut rng, &mut seqs, addr, size);
        } else if r < 98 {
            // Some stream's work completes.
            let stream = 1 + rng.below(3);
            let upto = seqs.get(&stream).copied().unwrap_or(0);
            model.world().complete.insert(stream, upto);
        } else {
            // The release path (also the first step on out of memory).
            model.world().sync();
            pool.release_cached().unwrap();
        }
        if rng.below(3) == 0 {
            // The background mapper's work, between two operations.
            pool.mapper_step();
        }
        check(&model, &pool, step);
    }
    let w = model.world();
    assert!(w.maps > 0, "seed {seed}: nothing was ever mapped");
    assert!(w.unmaps > 0, "seed {seed}: no page ever moved, the check saw nothing");
}

#[test]
fn random_remaps_keep_live_blocks_mapped_and_stream_order() {
    for seed in [1u64, 2, 3, 5, 8, 13, 21, 34] {
        run_seed(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), 4000, seed % 2 == 0);
    }
}

#[test]
fn free_pages_move_to_where_memory_is_needed() {
    // 32 blocks of 4 pages; every other one freed on a stream (its work
    // may still run), a small long-lived block in the first hole; then one
    // block of 60 pages, which fits in no hole: the range grows, but the
    // holes' memory moves there instead of new memory.
    let model = Model::default();
    let pool = pool(&model);
    let blocks: Vec<_> = (0..32).map(|_| pool.allocate(4 * PAGE, 256).unwrap()).collect();
    assert_eq!(pool.stats().mapped, 128 * PAGE);
    for (i, b) in blocks.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
        pool.deallocate(b.addr, StreamTag { stream: 1, seq: i as u64 }).unwrap();
    }
    let pin = pool.allocate(PAGE / 4, 256).unwrap();
    let big = pool.allocate(60 * PAGE, 256).unwrap();
    let s = pool.stats();
    assert!(s.reserved >= 184 * PAGE, "the address space grew: {}", s.reserved / PAGE);
    assert!(s.peak_mapped <= 129 * PAGE, "physical peak {} pages, expected at most 129", s.peak_mapped / PAGE);
    assert!(s.unmap_calls >= 14, "{} unmap calls", s.unmap_calls);
    let w = model.world();
    assert!(w.syncs > 0, "pages freed on a stream moved without waiting for it");
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    drop(w);
    check(&model, &pool, 0);
    // Steady state: the same requests again move nothing.
    pool.deallocate(big.addr, StreamTag::NONE).unwrap();
    let before = pool.stats();
    let again = pool.allocate(60 * PAGE, 256).unwrap();
    let after = pool.stats();
    assert_eq!(after.map_calls, before.map_calls, "a repeated request mapped memory");
    assert_eq!(after.unmap_calls, before.unmap_calls, "a repeated request unmapped memory");
    for a in [again.addr, pin.addr] {
        pool.deallocate(a, StreamTag::NONE).unwrap();
    }
}

#[test]
fn threads_never_see_an_unmapped_page() {
    // The mapper thread unmaps the old places of lent memory beside the
    // four (the oracle lets moves lend memory whose stream work completed).
    let model = Model::default();
    let pool = Arc::new(pool_with_slack(&model, cumem::pool::DEFAULT_REMAP_SLACK_PPM));
    let m = model.clone();
    pool.set_tag_oracle(Arc::new(move |t: StreamTag| m.world().complete.get(&t.stream).is_some_and(|&c| c >= t.seq)));
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let (pool, model) = (pool.clone(), model.clone());
            std::thread::spawn(move || {
                let mut rng = Rng((t + 1) * 0x2545_F491_4F6C_DD1D);
                let mut held: Vec<(usize, usize)> = Vec::new();
                let mut seq = 0;
                for _ in 0..3000 {
                    if rng.below(2) == 0 || held.is_empty() {
                        let size = 256usize << rng.below(13);
                        let a = pool.allocate(size, 256).unwrap();
                        let mut w = model.world();
                        for page in World::pages(a.addr, a.size) {
                            assert!(w.mapped(page), "thread {t}: fresh block on unmapped page {page:#x}");
                        }
                        w.live.insert(a.addr, a.size);
                        held.push((a.addr, a.size));
                    } else {
                        let i = rng.below(held.len() as u64) as usize;
                        let (addr, size) = held.swap_remove(i);
                        seq += 1;
                        let tag = StreamTag { stream: 10 + t, seq };
                        {
                            let mut w = model.world();
                            w.live.remove(&addr);
                            for page in World::pages(addr, size) {
                                w.queued.insert(page, (tag.stream, tag.seq));
                            }
                        }
                        pool.deallocate(addr, tag).unwrap();
                        if seq % 16 == 0 {
                            model.world().complete.insert(10 + t, seq);
                        }
                    }
                }
                held
            })
        })
        .collect();
    let mut seen = HashSet::new();
    for h in handles {
        for (addr, _) in h.join().unwrap() {
            assert!(seen.insert(addr), "two threads hold the block at {addr:#x}");
        }
    }
    // Shutdown stops the mapper's work before the figures are compared.
    pool.shutdown().unwrap();
    let w = model.world();
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    assert_eq!(pool.stats().mapped, w.held_bytes());
}
