//! Learned placement (`learn_placement`) over the model upstream: a loop
//! that repeats, departs from itself at random, and frees on streams.
//! Every step is checked as in the other remap models (no live block on
//! an unmapped page, no unmap of memory queued work may use, the pool's
//! books agree with the upstream's), and live blocks never overlap.

use std::collections::HashMap;
use std::sync::Arc;

use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::PoolKind;

use super::{check, free_on_a_stream, reuse, Model, Rng, PAGE};

fn learning_pool(model: &Model) -> Pool<Model> {
    let mut pc = PoolConfig::new(PoolKind::Standalone);
    pc.thread_cache = false;
    pc.min_chunk = PAGE;
    pc.learn_placement = true;
    Pool::new(model.clone(), pc)
}

/// One iteration of a loop: `(size, free after this many more
/// allocations of the iteration)`, the last ones freed at its end.
fn iteration(rng: &mut Rng) -> Vec<(usize, usize)> {
    (0..60)
        .map(|_| {
            let size =
                if rng.below(4) == 0 { (1 + rng.below(6) as usize) * PAGE + 256 } else { 256usize << rng.below(10) };
            (size, rng.below(30) as usize)
        })
        .collect()
}

/// Runs `iterations` of one loop (changed for a new one halfway when
/// `change`), departing with probability `depart` percent per allocation
/// (an extra block, a block of another size, or one skipped); checks
/// every step; returns the learner's counts.
fn run(seed: u64, iterations: usize, depart: u64, change: bool) -> cumem::pool::LearnStats {
    let model = Model::default();
    let pool = learning_pool(&model);
    let m = model.clone();
    pool.set_tag_oracle(Arc::new(move |t: StreamTag| m.world().complete.get(&t.stream).is_some_and(|&c| c >= t.seq)));
    let mut rng = Rng(seed | 1);
    let mut body = iteration(&mut rng);
    let mut seqs: HashMap<u64, u64> = HashMap::new();
    let mut step = 0;
    for it in 0..iterations {
        if change && it == iterations / 2 {
            body = iteration(&mut rng);
        }
        // (free at allocation index, addr, size) of this iteration's blocks.
        let mut pending: Vec<(usize, usize, usize)> = Vec::new();
        let mut i = 0;
        for &(size, life) in &body {
            let size = match rng.below(100) {
                r if r < depart / 3 => continue,
                r if r < 2 * depart / 3 => size + 512,
                r if r < depart => {
                    let extra = allocate(&pool, &model, 4096, step);
                    pending.push((i + 2, extra, 4096));
                    size
                }
                _ => size,
            };
            let addr = allocate(&pool, &model, size, step);
            pending.push((i + life, addr, size));
            i += 1;
            pending.sort_by_key(|p| std::cmp::Reverse(p.0));
            while pending.last().is_some_and(|p| p.0 <= i) {
                let (_, addr, size) = pending.pop().unwrap();
                free_on_a_stream(&pool, &model, &mut rng, &mut seqs, addr, size);
            }
            step += 1;
            check(&model, &pool, step);
        }
        for (_, addr, size) in pending {
            free_on_a_stream(&pool, &model, &mut rng, &mut seqs, addr, size);
        }
        // Some streams' work completes now and then.
        if rng.below(2) == 0 {
            let stream = 1 + rng.below(3);
            let upto = seqs.get(&stream).copied().unwrap_or(0);
            model.world().complete.insert(stream, upto);
        }
        check(&model, &pool, step);
        if it == iterations / 4 {
            // A plan is made on a thread of its own: let the first finish.
            for _ in 0..2000 {
                if pool.learn_stats().unwrap().plans > 0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
    pool.learn_stats().unwrap()
}

fn allocate(pool: &Pool<Model>, model: &Model, size: usize, step: usize) -> usize {
    let a = pool.allocate(size, 256).expect("the model never runs out of memory");
    let mut w = model.world();
    // No live block overlaps another.
    let before = w.live.range(..a.addr + a.size).next_back().map(|(&s, &l)| (s, l));
    assert!(before.is_none_or(|(s, l)| s + l <= a.addr), "step {step}: {:#x}+{} overlaps {before:x?}", a.addr, a.size);
    reuse(&mut w, &a);
    a.addr
}

/// A loop that repeats exactly is planned and followed: most of its
/// allocations land where the plan put them.
#[test]
fn a_repeating_loop_is_planned_and_followed() {
    for seed in 1..4 {
        let s = run(seed, 40, 0, false);
        println!("seed {seed}: {s:?}");
        assert!(s.plans >= 1, "seed {seed}: {s:?}");
        assert!(s.planned > s.missed, "seed {seed}: {s:?}");
    }
}

/// Departures at random, and a loop that changes halfway: placement stays
/// correct (every step checked), the learner departs and plans again.
#[test]
fn random_departures_and_a_changed_loop_keep_every_block_whole() {
    for seed in 1..6 {
        let s = run(seed, 40, 10, seed % 2 == 0);
        println!("seed {seed}: {s:?}");
        assert!(s.departures > 0, "seed {seed}: {s:?}");
    }
}
