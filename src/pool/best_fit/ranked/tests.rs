use super::super::BestFit;
use super::Preferred;
use crate::tag::StreamTag;
use crate::upstream::Chunk;

/// `place_preferring` takes the first of the first `limit` candidates
/// in best-fit order that the predicate accepts; when none does, it
/// leaves the blocks untouched and names the exact best fit, which
/// `allocate_best_fit` then takes where plain best fit would.
#[test]
fn a_look_that_finds_nothing_preferred_changes_nothing() {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    const LIMIT: usize = 4;
    let (mut preferred_seen, mut fallback_seen) = (0, 0);
    for seed in 0..20 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut f = BestFit::new();
        assert!(f.add_chunk(Chunk { addr: 1 << 30, size: 64 << 20 }));
        let mut live: Vec<usize> = Vec::new();
        for step in 0..3000 {
            if live.is_empty() || rng.gen_bool(0.55) {
                let size = rng.gen_range(1..=256usize) * 256;
                // A different set of accepted addresses every time.
                let (m, r) = (rng.gen_range(2..7usize), rng.gen_range(0..7usize));
                let accepts = move |at: usize, _len: usize| (at >> 8) % m == r % m;
                let mut candidates = f.free_list();
                candidates.retain(|&(_, s)| s >= size);
                candidates.sort_by_key(|&(a, s)| (s, a));
                let expected = candidates.iter().take(LIMIT).map(|&(a, _)| a).find(|&a| accepts(a, size));
                // Plain best fit: the smallest block that holds it, the
                // lowest address among equals.
                let plain = candidates.first().map(|&(a, _)| a);
                let before = f.free_list();
                let got = match f.place_preferring(size, 256, size, LIMIT, accepts) {
                    None => None,
                    Some(Preferred::Taken(a)) => {
                        preferred_seen += 1;
                        assert_eq!(Some(a.addr), expected, "seed {seed} step {step}");
                        Some(a.addr)
                    }
                    Some(Preferred::BestFit(at)) => {
                        fallback_seen += 1;
                        assert_eq!(expected, None, "seed {seed} step {step}");
                        assert_eq!(f.free_list(), before, "seed {seed} step {step}: the look changed blocks");
                        Some(f.allocate_best_fit(at, size, size).addr)
                    }
                };
                if expected.is_none() {
                    assert_eq!(got, plain, "seed {seed} step {step}: the fallback is plain best fit");
                }
                live.extend(got);
            } else {
                let addr = live.swap_remove(rng.gen_range(0..live.len()));
                f.free(addr, StreamTag::NONE).unwrap();
                f.flush_hot();
            }
            f.check_invariants().unwrap();
        }
    }
    assert!(preferred_seen > 1000 && fallback_seen > 1000, "{preferred_seen} preferred, {fallback_seen} fallbacks");
}
