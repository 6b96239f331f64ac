//! The device pools' hot block (`Config::hot_block`, off by default),
//! through the manager on the host fallback: an allocation of the size
//! freed last takes that block back, statistics see it free at once, and
//! every other request sees the pool as without it.

use cumem::{BackendChoice, Config, MemoryManager, Stream};

const K: usize = 1024;

fn manager(hot: bool) -> MemoryManager {
    MemoryManager::new(Config::new().backend(BackendChoice::Host).arenas(1).hot_block(hot)).unwrap()
}

/// Four 1 KiB blocks; the first and the third freed, then 1 KiB asked:
/// best fit alone takes the lowest address (the first), the hot block the
/// third, freed last. Fails without the hot block.
#[test]
fn the_block_freed_last_serves_the_next_request_of_its_size() {
    for hot in [false, true] {
        let mm = manager(hot);
        let s = Stream::host();
        let p: Vec<u64> = (0..4).map(|_| mm.allocate_device_on(K, &s).unwrap()).collect();
        mm.free_device_on(p[0], &s).unwrap();
        mm.free_device_on(p[2], &s).unwrap();
        let again = mm.allocate_device_on(K, &s).unwrap();
        assert_eq!(again, if hot { p[2] } else { p[0] }, "hot block {hot}");
        mm.free_device_on(again, &s).unwrap();
        // Reading the statistics coalesces the hot block (it counts as
        // free at once); best fit then decides as without it.
        assert_eq!(mm.device_stats(0).unwrap().pool.in_use, 2 * K, "the frees count at once");
        let again = mm.allocate_device_on(K, &s).unwrap();
        assert_eq!(again, p[0], "hot block {hot}: after the statistics, the lowest address");
        // A second free of the block freed last is refused, and changes
        // nothing.
        mm.free_device_on(again, &s).unwrap();
        assert!(mm.free_device_on(again, &s).is_err(), "double free of the hot block");
        assert_eq!(mm.device_stats(0).unwrap().pool.in_use, 2 * K);
        // Another size: the hot block coalesces first, so 2 KiB fits where
        // the third block and nothing else was free only if merged with a
        // free neighbour; here its neighbours are live, so it goes past
        // the four blocks, as without the hot block.
        let big = mm.allocate_device_on(2 * K, &s).unwrap();
        assert!(big > p[3], "hot block {hot}");
        for x in [p[1], p[3], big] {
            mm.free_device_on(x, &s).unwrap();
        }
        let st = mm.device_stats(0).unwrap().pool;
        assert_eq!((st.in_use, st.live_blocks), (0, 0), "hot block {hot}");
        mm.default_device().unwrap().pool().check_invariants().unwrap();
        assert!(mm.release_cached().is_ok());
    }
}
