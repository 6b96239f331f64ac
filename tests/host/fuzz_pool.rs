//! A randomized "fuzz" run over the whole pool (growth from a real host
//! upstream, limits, trims, in-place resizes, invalid frees of every kind),
//! writing a pattern into every live block and checking it before the
//! block is freed, so overlapping blocks or lost memory show up as data
//! corruption. After every operation the allocator's invariants are checked
//! and the statistics must balance with what the test holds.
//!
//! `CUMEM_FUZZ_SECS=N` runs it for N seconds instead of the fixed budget.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cumem::pool::{Pool, PoolConfig};
use cumem::upstream::Host;
use cumem::{Error, PoolKind};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

struct Live {
    size: usize,
    requested: usize,
    pattern: u8,
}

fn pattern_ok(addr: usize, len: usize, pattern: u8) -> bool {
    // SAFETY: the block at `addr` is live host memory of at least `len`
    // bytes, owned by this test.
    let s = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
    s.iter().all(|&b| b == pattern)
}

fn write_pattern(addr: usize, len: usize, pattern: u8) {
    // SAFETY: as above; nothing else uses the block.
    unsafe { std::ptr::write_bytes(addr as *mut u8, pattern, len) };
}

fn fuzz(seed: u64, deadline: Instant, max_ops: usize) -> usize {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut config = PoolConfig::new(PoolKind::Standalone);
    config.min_chunk = [64 << 10, 1 << 20, 4 << 20][rng.gen_range(0..3)];
    config.max_size = rng.gen_bool(0.5).then(|| rng.gen_range(8usize..64) << 20);
    config.initial_size = if rng.gen_bool(0.3) { 2 << 20 } else { 0 };
    let pool = Pool::new(Host::new(), config);
    let mut live: HashMap<usize, Live> = HashMap::new();
    let mut ops = 0;
    while ops < max_ops && Instant::now() < deadline {
        ops += 1;
        let ctx = || format!("seed {seed}, op {ops}");
        match rng.gen_range(0..100) {
            0..=49 => {
                let size = if rng.gen_bool(0.8) { rng.gen_range(1..=8192) } else { rng.gen_range(1..=4 << 20) };
                let align = 1usize << rng.gen_range(0..14);
                match pool.allocate(size, align) {
                    Ok(a) => {
                        assert_eq!(a.addr % align.max(256), 0, "{}", ctx());
                        assert!(a.size >= size);
                        let pattern = rng.r#gen::<u8>() | 1;
                        write_pattern(a.addr, size, pattern);
                        assert!(live.insert(a.addr, Live { size: a.size, requested: size, pattern }).is_none());
                    }
                    Err(Error::OutOfMemory { state, .. }) => {
                        assert!(state.limit.is_some(), "only the limit can refuse here ({})", ctx());
                    }
                    Err(e) => panic!("unexpected error {e} ({})", ctx()),
                }
            }
            50..=84 if !live.is_empty() => {
                let addr = *live.keys().nth(rng.gen_range(0..live.len())).unwrap();
                let l = live.remove(&addr).unwrap();
                assert!(pattern_ok(addr, l.requested, l.pattern), "block {addr:#x} was overwritten ({})", ctx());
                let freed = pool.deallocate(addr, cumem::pool::StreamTag::NONE).unwrap();
                assert_eq!(freed.size, l.size);
            }
            85..=92 => {
                // Invalid frees: each must fail with the right error and change nothing.
                let before = pool.stats();
                let (addr, interior) = match (rng.gen_range(0..3), live.iter().find(|(_, l)| l.size > 256)) {
                    (0, Some((&a, l))) => (a + 256 * rng.gen_range(1..l.size / 256), true),
                    (1, _) => (rng.gen_range(1..1usize << 20) * 4096, false),
                    _ => (0x10, false),
                };
                if live.contains_key(&addr) {
                    continue;
                }
                let e = pool.deallocate(addr, cumem::pool::StreamTag::NONE).unwrap_err();
                if interior {
                    assert!(matches!(e, Error::InteriorPointer { .. }), "{e} ({})", ctx());
                } else {
                    assert!(
                        matches!(
                            e,
                            Error::UnknownPointer { .. } | Error::DoubleFree { .. } | Error::InteriorPointer { .. }
                        ),
                        "{e} ({})",
                        ctx()
                    );
                }
                assert_eq!(pool.stats().in_use, before.in_use, "a bad free changed the pool ({})", ctx());
            }
            93..=96 if !live.is_empty() => {
                let addr = *live.keys().nth(rng.gen_range(0..live.len())).unwrap();
                let l = live.get_mut(&addr).unwrap();
                if rng.gen_bool(0.5) {
                    let new = l.requested + rng.gen_range(1..=64 << 10);
                    if pool.grow_in_place(addr, new) {
                        l.size = pool.block_size(addr).unwrap();
                        write_pattern(addr, new, l.pattern);
                        l.requested = new;
                    }
                } else if l.requested > 1 {
                    let new = rng.gen_range(1..l.requested);
                    assert!(pool.shrink_in_place(addr, new), "{}", ctx());
                    l.size = pool.block_size(addr).unwrap();
                    l.requested = new;
                }
            }
            _ => {
                pool.release_cached().unwrap();
            }
        }
        pool.with_fit(|f| f.check_invariants()).unwrap_or_else(|e| panic!("{e} ({})", ctx()));
        let s = pool.stats();
        assert_eq!(s.in_use, live.values().map(|l| l.size).sum::<usize>(), "in_use ({})", ctx());
        assert_eq!(s.requested, live.values().map(|l| l.requested).sum::<usize>(), "requested ({})", ctx());
        assert_eq!(s.live_blocks, live.len());
        if let Some(max) = pool.config().max_size {
            assert!(s.reserved <= max, "reserved {} over the limit {max} ({})", s.reserved, ctx());
        }
    }
    for (addr, l) in live.drain() {
        assert!(pattern_ok(addr, l.requested, l.pattern));
        pool.deallocate(addr, cumem::pool::StreamTag::NONE).unwrap();
    }
    pool.release_cached().unwrap();
    assert_eq!(pool.stats().reserved, 0, "everything went back to the upstream");
    ops
}

#[test]
fn fuzz_the_pool() {
    let secs: u64 = std::env::var("CUMEM_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    let (deadline, per_seed) = if secs > 0 {
        (Instant::now() + Duration::from_secs(secs), usize::MAX)
    } else {
        (Instant::now() + Duration::from_secs(3600), 4_000)
    };
    let base: u64 = std::env::var("CUMEM_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| SmallRng::from_entropy().r#gen());
    println!("fuzz base seed {base} (rerun with CUMEM_FUZZ_SEED={base})");
    let mut total = 0;
    let seeds = if secs > 0 { u64::MAX } else { 12 };
    for i in 0..seeds {
        if Instant::now() >= deadline {
            break;
        }
        let seed = base.wrapping_add(i);
        let r = std::panic::catch_unwind(|| fuzz(seed, deadline, if secs > 0 { 50_000 } else { per_seed }));
        match r {
            Ok(n) => total += n,
            Err(e) => {
                eprintln!("fuzz failed with seed {seed}: rerun with CUMEM_FUZZ_SEED={seed}");
                std::panic::resume_unwind(e);
            }
        }
    }
    println!("fuzzed {total} operations");
}
