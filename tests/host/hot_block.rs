//! The device pools' hot block (`Config::hot_block`, on by default),
//! through the manager on the host fallback: placement and statistics are
//! as without it.

use cumem::{BackendChoice, Config, MemoryManager, Stream};

const K: usize = 1024;

fn manager(hot: bool) -> MemoryManager {
    MemoryManager::new(Config::new().backend(BackendChoice::Host).hot_block(hot)).unwrap()
}

/// The same steps give the same addresses with and without it (a hit is
/// taken only where best fit lands anyway); the frees count at once; a
/// second free of the hot block is refused and changes nothing.
#[test]
fn the_hot_block_changes_no_placement_and_no_statistics() {
    let run = |hot: bool| {
        let mm = manager(hot);
        let s = Stream::host();
        let mut seen = Vec::new();
        let p: Vec<u64> = (0..4).map(|_| mm.allocate_device_on(K, &s).unwrap()).collect();
        mm.free_device_on(p[0], &s).unwrap();
        mm.free_device_on(p[2], &s).unwrap();
        let again = mm.allocate_device_on(K, &s).unwrap();
        seen.push(again);
        mm.free_device_on(again, &s).unwrap();
        assert!(mm.free_device_on(again, &s).is_err(), "double free of the block freed last");
        assert_eq!(mm.device_stats(0).unwrap().pool.in_use, 2 * K, "hot block {hot}");
        // A pair on the free tail, then a larger request.
        for _ in 0..3 {
            let x = mm.allocate_device_on(64 * K, &s).unwrap();
            seen.push(x);
            mm.free_device_on(x, &s).unwrap();
        }
        let big = mm.allocate_device_on(2 * K, &s).unwrap();
        seen.push(big);
        for x in [p[1], p[3], big] {
            mm.free_device_on(x, &s).unwrap();
        }
        let st = mm.device_stats(0).unwrap().pool;
        assert_eq!((st.in_use, st.live_blocks), (0, 0), "hot block {hot}");
        mm.default_device().unwrap().pool().check_invariants().unwrap();
        assert!(mm.release_cached().is_ok());
        (p, seen)
    };
    let (cold, hot) = (run(false), run(true));
    let offsets = |(p, seen): (Vec<u64>, Vec<u64>)| seen.iter().map(|x| x - p[0]).collect::<Vec<_>>();
    assert_eq!(offsets(cold), offsets(hot));
}
