use super::*;

#[test]
fn classes_are_ordered_like_sizes() {
    let mut prev = 0;
    let mut size = 256usize;
    while size < 1 << 50 {
        let c = class_of(size);
        assert!(c >= prev && c < CLASSES, "size {size}: class {c} after {prev}");
        prev = c;
        size += (size / 97).next_multiple_of(256).max(256);
    }
    assert!(class_of(usize::MAX & !255) < CLASSES);
}

#[test]
fn best_fit_crosses_bins() {
    let mut ix = FreeIndex::default();
    for (i, size) in [1 << 20, 256, 3 << 20, 4096, 1 << 20].into_iter().enumerate() {
        assert!(ix.insert((size, 1000 * i + 4096, i as u32)));
    }
    assert_eq!(ix.best_fit(512).map(|k| k.0), Some(4096));
    assert_eq!(ix.best_fit(1 << 20), Some((1 << 20, 4096, 0)), "ties go to the lowest address");
    assert_eq!(ix.best_fit((1 << 20) + 256).map(|k| k.0), Some(3 << 20));
    assert_eq!(ix.best_fit(4 << 20), None);
    assert_eq!(ix.last().map(|k| k.0), Some(3 << 20));
    let sizes: Vec<usize> = ix.iter().map(|k| k.0).collect();
    assert_eq!(sizes, [256, 4096, 1 << 20, 1 << 20, 3 << 20]);
    assert!(ix.remove(&(3 << 20, 6096, 2)));
    assert_eq!(ix.last().map(|k| k.0), Some(1 << 20));
    assert_eq!(ix.len(), 4);
}

#[test]
fn bins_switch_between_vector_and_set_and_stay_ordered() {
    let mut ix = FreeIndex::default();
    // Many blocks of one exact class, inserted out of order.
    let keys: Vec<Key> = (0..200u32).map(|i| (4096, ((i * 7919) % 200) as usize * 8192, i)).collect();
    for &k in &keys {
        assert!(ix.insert(k));
        assert!(!ix.insert(k), "no duplicates");
    }
    assert!(matches!(ix.bins[class_of(4096)], Bin::Large(_)));
    let addrs: Vec<usize> = ix.iter().map(|k| k.1).collect();
    assert!(addrs.windows(2).all(|w| w[0] < w[1]), "ordered by address within a size");
    assert_eq!(ix.best_fit(4096).map(|k| k.1), Some(0));
    for &k in &keys[..190] {
        assert!(ix.remove(&k));
        assert!(!ix.contains(&k));
    }
    assert!(matches!(ix.bins[class_of(4096)], Bin::Small(_)));
    assert_eq!(ix.len(), 10);
    let addrs: Vec<usize> = ix.iter().map(|k| k.1).collect();
    assert!(addrs.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(ix.best_fit(4096).map(|k| k.1), addrs.first().copied());
}

/// `best_fit_except` is the first block of the ordered walk from
/// `size` on that is not the one passed over, in small bins, large
/// bins (one size class holding over `SMALL_BIN` blocks) and across
/// classes.
#[test]
fn best_fit_except_passes_over_one_block() {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    let mut large = false;
    for seed in 0..20 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut ix = FreeIndex::default();
        let mut keys = Vec::new();
        for slot in 0..rng.gen_range(0..300u32) {
            // Sizes from a few classes, often equal (ties by address).
            let size = [256, 4096, 40 << 10, 1 << 20, 3 << 20][rng.gen_range(0..5)] + 256 * rng.gen_range(0..2);
            let key = (size, rng.gen_range(0..1 << 20) * 256, slot);
            if ix.insert(key) {
                keys.push(key);
            }
        }
        for _ in 0..200 {
            let size = rng.gen_range(1..(4usize << 12)) * 256;
            let skip =
                if keys.is_empty() || rng.gen_bool(0.2) { None } else { Some(keys[rng.gen_range(0..keys.len())]) };
            let walk = ix.at_least(size).find(|&&k| Some(k) != skip).copied();
            assert_eq!(ix.best_fit_except(size, skip), walk, "seed {seed}, size {size}, skip {skip:?}");
        }
        let mut backwards: Vec<Key> = ix.iter().copied().collect();
        backwards.reverse();
        assert!(ix.largest_first().copied().eq(backwards), "seed {seed}: largest first is the walk reversed");
        large |= ix.bins.iter().any(|b| matches!(b, Bin::Large(_)));
    }
    assert!(large, "some seed fills a bin past SMALL_BIN");
}
