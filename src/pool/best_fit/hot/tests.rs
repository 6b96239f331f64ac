use super::super::{BestFit, FreeError};
use crate::tag::StreamTag;
use crate::upstream::Chunk;

const K: usize = 1024;

/// Four 1 KiB blocks at the front of a 1 MiB chunk, then a free tail.
fn four(hot: bool) -> (BestFit, [usize; 4]) {
    let mut f = BestFit::new();
    f.set_hot_block(hot);
    assert!(f.add_chunk(Chunk { addr: 1 << 20, size: 1 << 20 }));
    let a = [0; 4].map(|_| f.allocate(K, 256, K).unwrap().addr);
    (f, a)
}

/// Random allocations and frees (mixed sizes, frees in any order) give
/// the same addresses with and without the hot block: a hit is taken
/// only where best fit lands anyway.
#[test]
fn placement_is_best_fit_s_with_or_without_the_hot_block() {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    for seed in 0..20 {
        let mut fits = [false, true].map(|hot| {
            let mut f = BestFit::new();
            f.set_hot_block(hot);
            assert!(f.add_chunk(Chunk { addr: 1 << 30, size: 64 << 20 }));
            f
        });
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut live: Vec<usize> = Vec::new();
        let mut last = 256;
        for step in 0..4000 {
            if live.is_empty() || rng.gen_bool(0.5) {
                // Often the size freed or asked last (the hot case).
                let size = if rng.gen_bool(0.5) { last } else { rng.gen_range(1..=64usize) * 256 };
                let a = fits.each_mut().map(|f| f.allocate(size, 256, size).map(|a| a.addr));
                assert_eq!(a[0], a[1], "seed {seed} step {step}");
                live.extend(a[0]);
                last = size;
            } else {
                let addr = live.swap_remove(rng.gen_range(0..live.len()));
                let freed = fits.each_mut().map(|f| f.free(addr, StreamTag::NONE).unwrap().size);
                assert_eq!(freed[0], freed[1]);
                last = freed[0];
            }
            fits[1].check_invariants().unwrap();
        }
        fits[1].flush_hot();
        assert_eq!(fits[0].free_list(), fits[1].free_list(), "seed {seed}");
    }
}

/// A hot hit leaves the free block after it alone: it keeps its own
/// stream tag, where coalescing and splitting again would give it the
/// freed block's tag (an order to wait it does not need).
#[test]
fn a_hot_hit_leaves_the_free_successor_s_tag_alone() {
    for hot in [false, true] {
        let mut f = BestFit::new();
        f.set_hot_block(hot);
        assert!(f.add_chunk(Chunk { addr: 1 << 20, size: 1 << 20 }));
        let tag = StreamTag { stream: 7, seq: 1 };
        let a = f.allocate(K, 256, K).unwrap();
        f.free(a.addr, tag).unwrap();
        let again = f.allocate(K, 256, K).unwrap();
        assert_eq!((again.addr, again.tag), (a.addr, tag), "hot block {hot}");
        let tail_tag = f.free_blocks_highest_first(0)[0].2;
        assert_eq!(tail_tag, if hot { StreamTag::NONE } else { tag }, "hot block {hot}");
    }
}

/// The hot block counts as free at once (statistics), refuses a second
/// free, and is an interior-pointer error inside; a wholly free chunk
/// whose last block is hot is still taken out whole.
#[test]
fn a_hot_block_is_free_for_every_check_and_for_chunk_release() {
    let (mut f, [a, b, c, d]) = four(true);
    f.free(a, StreamTag::NONE).unwrap();
    assert_eq!(f.stats().in_use, 3 * K);
    assert_eq!(f.free(a, StreamTag::NONE), Err(FreeError::DoubleFree));
    assert!(matches!(f.free(a + 256, StreamTag::NONE), Err(FreeError::Interior { .. })));
    assert_eq!(f.block_count(), 5, "3 live, the hot one and the free tail");
    for p in [b, c, d] {
        f.free(p, StreamTag::NONE).unwrap();
    }
    f.check_invariants().unwrap();
    let taken = f.take_free_chunks();
    assert_eq!(taken.len(), 1, "the chunk is wholly free once its hot block is coalesced");
    assert_eq!(f.stats().reserved, 0);
    f.check_invariants().unwrap();
}

/// `BestFit::default()` (public) starts with no hot block, as `new()`
/// does: slot 0 is an ordinary block.
#[test]
fn a_default_allocator_has_no_hot_block() {
    let mut f = BestFit::default();
    assert!(f.add_chunk(Chunk { addr: 1 << 20, size: 1 << 20 }));
    let a = f.allocate(K, 256, K).unwrap();
    let b = f.allocate(2 * K, 256, 2 * K).unwrap();
    f.free(a.addr, StreamTag::NONE).unwrap();
    assert!(f.allocate(4 * K, 256, 4 * K).is_some());
    f.check_invariants().unwrap();
    assert_eq!(f.check_live(b.addr), Ok(2 * K));
}

/// An allocation undone (its pages not mapped yet) is never left hot:
/// the next allocation of that size goes through placement again.
#[test]
fn an_undone_allocation_is_not_left_hot() {
    let (mut f, [a, ..]) = four(true);
    f.free(a, StreamTag::NONE).unwrap();
    let x = f.allocate(4 * K, 256, 4 * K).unwrap();
    f.undo_allocate(&x);
    f.check_invariants().unwrap();
    assert_eq!(f.block_count(), 5, "a free, 3 live, the free tail: nothing hot");
    assert_eq!(f.free_blocks(), 2, "both free blocks are indexed");
}
