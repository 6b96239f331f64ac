//! CUDA graphs: memory that captured work uses belongs to the graph.
//!
//! These run everywhere: on the host fallback a capture records nothing,
//! but cumem routes and holds memory exactly as on a GPU, so the memory
//! rules are checked here; on a GPU the same tests capture real (empty of
//! kernels) graphs. `tests/gpu_graphs.rs` adds kernels and replays.

use std::collections::HashSet;
use std::sync::{Arc, Barrier};

use cumem::{CapturedGraph, Config, Error, MemoryManager, Stream};

const MIB: usize = 1 << 20;

/// One test at a time: on a GPU every manager here shares the device's
/// context, and a context-wide synchronisation by one test (releasing a
/// graph pool, unmapping) would invalidate another test's capture. A
/// program's single manager coordinates its own captures.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The configuration from `CUMEM_CONF` (the suite also runs with another
/// default device), so managers and `Stream::new()` agree on the device.
fn config() -> Config {
    Config::from_env().expect("CUMEM_CONF parses")
}

fn manager() -> MemoryManager {
    MemoryManager::new(config()).expect("a manager")
}

fn graph_stats(mm: &MemoryManager) -> cumem::GraphStats {
    mm.device_stats(mm.config().device).unwrap().graphs
}

fn overlaps(a: (u64, usize), b: (u64, usize)) -> bool {
    a.0 < b.0 + b.1 as u64 && b.0 < a.0 + a.1 as u64
}

#[test]
fn control_without_a_capture_the_freed_block_is_reused_at_once() {
    let _serial = serial();
    // The contract the graph tests rely on to be able to fail: outside a
    // capture a block freed on a stream is the next block of its size.
    let mm = manager();
    let s = Stream::new().unwrap();
    let a = mm.allocate_device_on(4 * MIB, &s).unwrap();
    mm.free_device_on(a, &s).unwrap();
    let b = mm.allocate_device_on(4 * MIB, &s).unwrap();
    assert_eq!(a, b);
    mm.free_device_on(b, &s).unwrap();
}

#[test]
fn memory_allocated_and_freed_in_a_capture_is_never_handed_out() {
    let _serial = serial();
    let mm = manager();
    let (s, t) = (Stream::new().unwrap(), Stream::new().unwrap());
    let pool = mm.graph_pool().unwrap();
    let capture = mm.begin_capture(&s, &pool).unwrap();
    let tmp = mm.allocate_device_on(4 * MIB, &s).unwrap();
    mm.free_device_on(tmp, &s).unwrap();
    let graph = capture.end().unwrap();
    // Another caller, same size, another stream and the same stream.
    for stream in [&t, &s] {
        let other = mm.allocate_device_on(4 * MIB, stream).unwrap();
        assert!(!overlaps((other, 4 * MIB), (tmp, 4 * MIB)), "{other:#x} overlaps the graph's {tmp:#x}");
        mm.free_device_on(other, stream).unwrap();
    }
    let other = mm.allocate_device(4 * MIB).unwrap();
    assert!(!overlaps((other, 4 * MIB), (tmp, 4 * MIB)));
    mm.free_device(other).unwrap();
    assert_eq!(graph.pool().stats().reserved, 4 * MIB, "the graph keeps its memory");
    assert!(mm.memory_summary().contains("1 private pool(s), reserved 4.00 MiB"), "{}", mm.memory_summary());
    s.synchronize().unwrap();
}

#[test]
fn a_block_freed_during_a_capture_stays_the_graphs_until_it_is_dropped() {
    let _serial = serial();
    let mm = manager();
    let (s, t) = (Stream::new().unwrap(), Stream::new().unwrap());
    let before = mm.allocate_device_on(8 * MIB, &s).unwrap();
    let pool = mm.graph_pool().unwrap();
    let capture = mm.begin_capture(&s, &pool).unwrap();
    mm.free_device_on(before, &s).unwrap(); // captured work used it
                                            // A second free of the held block is a double free, wherever it comes from.
    assert!(matches!(mm.free_device_on(before, &s), Err(Error::DoubleFree { .. })));
    let graph = capture.end().unwrap();
    assert!(matches!(mm.free_device(before), Err(Error::DoubleFree { .. })));
    assert_eq!(graph.pool().stats().held, 8 * MIB);
    let other = mm.allocate_device_on(8 * MIB, &t).unwrap();
    assert_ne!(other, before, "a held block was handed out while the graph lives");
    mm.free_device_on(other, &t).unwrap();
    drop(graph);
    // The pool handle still holds it.
    let other = mm.allocate_device_on(8 * MIB, &t).unwrap();
    assert_ne!(other, before);
    mm.free_device_on(other, &t).unwrap();
    drop(pool);
    assert_eq!(graph_stats(&mm).held, 0);
    // Now it is the device pool's again: best fit finds it.
    t.synchronize().unwrap();
    let again = mm.allocate_device(8 * MIB).unwrap();
    assert_eq!(again, before, "the block came back when the graph went");
    mm.free_device(again).unwrap();
}

#[test]
fn graphs_that_share_a_pool_cost_the_largest_not_the_sum() {
    let _serial = serial();
    let mm = manager();
    let s = Stream::new().unwrap();
    fn step<'a>(mm: &'a MemoryManager, s: &Stream, pool: &cumem::GraphPool<'a>, mib: usize) -> CapturedGraph<'a> {
        let capture = mm.begin_capture(s, pool).unwrap();
        let a = mm.allocate_device_on(mib * MIB, s).unwrap();
        let b = mm.allocate_device_on(mib * MIB, s).unwrap();
        mm.free_device_on(a, s).unwrap();
        mm.free_device_on(b, s).unwrap();
        capture.end().unwrap()
    }
    let shared = mm.graph_pool().unwrap();
    let graphs: Vec<_> = [16, 8, 16, 4].into_iter().map(|mib| step(&mm, &s, &shared, mib)).collect();
    assert_eq!(shared.stats().reserved, 32 * MIB, "shared: the largest graph's memory");
    let separate: Vec<_> = [16, 8].into_iter().map(|mib| step(&mm, &s, &mm.graph_pool().unwrap(), mib)).collect();
    let sum: usize = separate.iter().map(|g| g.pool().stats().reserved).sum();
    assert_eq!(sum, 48 * MIB, "separate pools: the sum");
    drop((graphs, separate, shared));
    s.synchronize().unwrap();
    let st = graph_stats(&mm);
    assert_eq!((st.pools, st.reserved), (0, 0), "every private pool went back: {st:?}");
}

#[test]
fn graph_outputs_outlive_the_capture_and_come_back_to_its_pool() {
    let _serial = serial();
    let mm = manager();
    let (s, t) = (Stream::new().unwrap(), Stream::new().unwrap());
    let pool = mm.graph_pool().unwrap();
    let capture = mm.begin_capture(&s, &pool).unwrap();
    let out = mm.allocate_device_on(2 * MIB, &s).unwrap();
    let graph = capture.end().unwrap();
    assert_eq!(pool.stats().in_use, 2 * MIB);
    // Read by eager work on another stream, then freed there.
    mm.free_device_on(out, &t).unwrap();
    assert_eq!(pool.stats().in_use, 0);
    assert!(matches!(mm.free_device_on(out, &t), Err(Error::DoubleFree { .. })));
    // The next capture into the pool first waits for `t`, then reuses it.
    let capture = mm.begin_capture(&s, &pool).unwrap();
    let again = mm.allocate_device_on(2 * MIB, &s).unwrap();
    assert_eq!(again, out);
    let graph2 = capture.end().unwrap();
    drop((graph, graph2, pool));
    // Outputs still live keep the private pool; freeing the last retires it.
    assert_eq!(graph_stats(&mm).pools, 1);
    mm.free_device_on(again, &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(graph_stats(&mm).pools, 0);
}

#[test]
fn bad_frees_during_a_capture_are_errors_and_change_nothing() {
    let _serial = serial();
    let mm = manager();
    let s = Stream::new().unwrap();
    let pool = mm.graph_pool().unwrap();
    let live = mm.allocate_device(MIB).unwrap();
    let capture = mm.begin_capture(&s, &pool).unwrap();
    let tmp = mm.allocate_device_on(MIB, &s).unwrap();
    assert!(matches!(mm.free_device_on(0xdead_0000, &s), Err(Error::UnknownPointer { .. })));
    assert!(matches!(mm.free_device_on(tmp + 256, &s), Err(Error::InteriorPointer { .. })));
    assert!(matches!(mm.free_device_on(live + 256, &s), Err(Error::InteriorPointer { .. })));
    mm.free_device_on(tmp, &s).unwrap();
    assert!(matches!(mm.free_device_on(tmp, &s), Err(Error::DoubleFree { .. })));
    // Nothing may synchronise capturing streams meanwhile.
    assert!(matches!(mm.release_cached(), Err(Error::Capture(_))));
    // One capture per pool at a time.
    let s2 = Stream::new().unwrap();
    assert!(matches!(mm.begin_capture(&s2, &pool), Err(Error::Capture(_))));
    let graph = capture.end().unwrap();
    assert_eq!(graph.pool().stats().in_use, 0);
    mm.free_device(live).unwrap();
    s.synchronize().unwrap();
    mm.release_cached().unwrap();
}

#[test]
fn other_threads_allocating_during_a_capture_never_touch_the_graphs_memory() {
    let _serial = serial();
    let mm = Arc::new(manager());
    let s = Stream::new().unwrap();
    let pool = mm.graph_pool().unwrap();
    let threads = 4;
    let start = Arc::new(Barrier::new(threads + 1));
    let capture = mm.begin_capture(&s, &pool).unwrap();
    let workers: Vec<_> = (0..threads)
        .map(|i| {
            let (mm, start) = (mm.clone(), start.clone());
            std::thread::spawn(move || {
                let t = Stream::new().unwrap();
                let mut seen = Vec::new();
                start.wait();
                for round in 0..300 {
                    let size = ((i * 7 + round * 13) % 16 + 1) * 256 * 1024;
                    let p = mm.allocate_device_on(size, &t).unwrap();
                    seen.push((p, size));
                    if round % 3 != 0 {
                        mm.free_device_on(p, &t).unwrap();
                    }
                }
                t.synchronize().unwrap();
                seen
            })
        })
        .collect();
    start.wait();
    let mut graph_blocks = Vec::new();
    for round in 0..300 {
        let size = (round % 16 + 1) * 256 * 1024;
        let p = mm.allocate_device_on(size, &s).unwrap();
        graph_blocks.push((p, size));
        mm.free_device_on(p, &s).unwrap();
    }
    let seen: Vec<(u64, usize)> = workers.into_iter().flat_map(|w| w.join().unwrap()).collect();
    let graph = capture.end().unwrap();
    let graph_set: HashSet<u64> = graph_blocks.iter().map(|b| b.0).collect();
    for b in &seen {
        assert!(!graph_set.contains(&b.0));
        for g in &graph_blocks {
            assert!(!overlaps(*b, *g), "worker block {:#x}+{} overlaps graph block {:#x}+{}", b.0, b.1, g.0, g.1);
        }
    }
    drop(graph);
}

#[test]
fn stream_ordered_modes_route_captures_too() {
    let _serial = serial();
    // On a GPU the driver turns these into graph memory nodes; on the host
    // fallback the mode is the sync pool and the rules above apply.
    for mode in cumem::DeviceAllocatorMode::ALL {
        let mm = MemoryManager::new(config().mode(mode)).unwrap();
        let (s, t) = (Stream::new().unwrap(), Stream::new().unwrap());
        let before = mm.allocate_device_on(MIB, &s).unwrap();
        let pool = mm.graph_pool().unwrap();
        let capture = mm.begin_capture(&s, &pool).unwrap();
        let tmp = mm.allocate_device_on(MIB, &s).unwrap();
        mm.free_device_on(tmp, &s).unwrap();
        mm.free_device_on(before, &s).unwrap(); // made outside: held
        let graph = capture.end().unwrap();
        assert!(matches!(mm.free_device_on(before, &t), Err(Error::DoubleFree { .. })), "{mode}");
        drop((graph, pool));
        s.synchronize().unwrap();
        assert_eq!(graph_stats(&mm).held, 0, "{mode}");
    }
}
