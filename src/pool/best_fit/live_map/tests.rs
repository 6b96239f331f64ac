use super::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Random inserts, replacements and removals agree with a `HashMap`,
/// with addresses that crowd a few home entries (long probe runs that
/// wrap around the table's end) and addresses spread wide.
#[test]
fn agrees_with_a_hash_map() {
    for (seed, spread) in [(1u64, 64usize), (2, 1 << 20), (3, 4096), (4, 1 << 40)] {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut map = LiveMap::default();
        let mut model: HashMap<usize, u32> = HashMap::new();
        let mut keys: Vec<usize> = Vec::new();
        for step in 0..50_000u32 {
            let grow = keys.is_empty() || rng.gen_bool(if step < 25_000 { 0.6 } else { 0.4 });
            if grow {
                let addr = (1 << 30) + rng.gen_range(0..spread) * 256;
                map.insert(addr, step);
                if model.insert(addr, step).is_none() {
                    keys.push(addr);
                }
            } else {
                let addr = keys.swap_remove(rng.gen_range(0..keys.len()));
                assert_eq!(map.remove(addr), model.remove(&addr), "remove {addr:#x} at step {step}");
                assert_eq!(map.remove(addr), None);
            }
            assert_eq!(map.len(), model.len());
            if step % 97 == 0 {
                for (&k, &v) in &model {
                    assert_eq!(map.get(k), Some(v), "get {k:#x} at step {step}");
                }
                let absent = (1 << 30) + rng.gen_range(0..spread) * 256;
                assert_eq!(map.contains(absent), model.contains_key(&absent));
            }
        }
    }
}

#[test]
fn an_empty_map_finds_nothing() {
    let mut map = LiveMap::default();
    assert_eq!(map.get(4096), None);
    assert_eq!(map.remove(4096), None);
    assert!(!map.contains(0));
    map.insert(0, 7);
    assert_eq!(map.get(0), Some(7));
    assert_eq!(map.remove(0), Some(7));
    assert_eq!(map.len(), 0);
}
