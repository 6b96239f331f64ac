//! CUDA graphs: memory that captured work uses belongs to the graph.
//!
//! These run everywhere: on the host fallback a capture records nothing,
//! but cumem routes and holds memory exactly as on a GPU, so the memory
//! rules are checked here; on a GPU the same tests capture real (empty of
//! kernels) graphs. `tests/gpu/gpu_graphs.rs` adds kernels and replays.

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

// Captures cumem is not told of (begun on a host queue with
// `begin_host_capture`, the model of cudarc's `CudaStream::begin_capture`):
// the first call in the capture starts a private pool tied to the "graph".

use cumem::device::HostGraph;

fn host_capture(s: &Stream) {
    s.begin_host_capture().expect("a host queue begins a capture");
}

fn end_host_capture(s: &Stream) -> HostGraph {
    s.end_host_capture(false).unwrap().expect("a graph")
}

/// Whether the manager runs on the host fallback (the models below need
/// host queues; on a GPU, tests/gpu/gpu_graphs.rs checks the same rules).
fn on_host(_mm: &MemoryManager) -> bool {
    let host = Stream::new().unwrap().is_host();
    if !host {
        eprintln!("skipped: the host-queue model of captures needs the host fallback (gpu_graphs.rs covers CUDA)");
    }
    host
}

#[test]
fn an_unregistered_capture_keeps_its_memory_until_the_graph_and_its_executables_are_gone() {
    let _serial = serial();
    for mode in cumem::DeviceAllocatorMode::ALL {
        let mm = MemoryManager::new(config().mode(mode)).unwrap();
        if !on_host(&mm) {
            return;
        }
        let (s, t) = (Stream::new().unwrap(), Stream::new().unwrap());
        let before = mm.allocate_device_on(8 * MIB, &s).unwrap();
        host_capture(&s);
        let tmp = mm.allocate_device_on(4 * MIB, &s).unwrap();
        mm.free_device_on(tmp, &s).unwrap();
        mm.free_device_on(before, &s).unwrap(); // made outside: the graph keeps it
        assert!(matches!(mm.free_device_on(before, &s), Err(Error::DoubleFree { .. })), "{mode}");
        let graph = end_host_capture(&s);
        let exec = graph.instantiate();
        let check = |what: &str| {
            for stream in [&t, &s] {
                for (size, theirs) in [(4 * MIB, tmp), (8 * MIB, before)] {
                    let other = mm.allocate_device_on(size, stream).unwrap();
                    assert!(!overlaps((other, size), (theirs, size)), "{mode} {what}: {other:#x} overlaps {theirs:#x}");
                    mm.free_device_on(other, stream).unwrap();
                }
            }
        };
        check("graph and exec alive");
        let st = graph_stats(&mm);
        assert_eq!((st.pools, st.reserved, st.held), (1, 4 * MIB, 8 * MIB), "{mode}: {st:?}");
        drop(graph);
        check("exec alive");
        assert_eq!(graph_stats(&mm).pools, 1, "{mode}: the executable keeps the memory");
        drop(exec);
        let st = graph_stats(&mm);
        assert_eq!((st.pools, st.reserved, st.held), (0, 0, 0), "{mode}: everything went back: {st:?}");
        // The held block is the device pool's again: best fit finds it.
        let again = mm.allocate_device_on(8 * MIB, &t).unwrap();
        assert_eq!(again, before, "{mode}: the held block came back and is reused");
        mm.free_device_on(again, &t).unwrap();
    }
}

#[test]
fn control_with_the_promise_an_unregistered_capture_shares_its_memory() {
    let _serial = serial();
    // What detection prevents: with `promise_registered_captures` cumem
    // does not ask, and the captured scratch is the next caller's block.
    let mm = MemoryManager::new(config().promise_registered_captures(true)).unwrap();
    if !on_host(&mm) {
        return;
    }
    let (s, t) = (Stream::new().unwrap(), Stream::new().unwrap());
    host_capture(&s);
    let tmp = mm.allocate_device_on(4 * MIB, &s).unwrap();
    mm.free_device_on(tmp, &s).unwrap();
    let graph = end_host_capture(&s);
    let other = mm.allocate_device_on(4 * MIB, &t).unwrap();
    assert_eq!(other, tmp, "control: without detection the graph's scratch is handed out");
    mm.free_device_on(other, &t).unwrap();
    drop(graph);
    // The same program without the promise keeps it apart.
    let mm = manager();
    host_capture(&s);
    let tmp = mm.allocate_device_on(4 * MIB, &s).unwrap();
    mm.free_device_on(tmp, &s).unwrap();
    let graph = end_host_capture(&s);
    let other = mm.allocate_device_on(4 * MIB, &t).unwrap();
    assert!(!overlaps((other, 4 * MIB), (tmp, 4 * MIB)));
    mm.free_device_on(other, &t).unwrap();
    drop(graph);
}

#[test]
fn an_abandoned_capture_releases_its_pool() {
    let _serial = serial();
    let mm = manager();
    if !on_host(&mm) {
        return;
    }
    let s = Stream::new().unwrap();
    let before = mm.allocate_device_on(2 * MIB, &s).unwrap();
    host_capture(&s);
    let tmp = mm.allocate_device_on(4 * MIB, &s).unwrap();
    mm.free_device_on(tmp, &s).unwrap();
    mm.free_device_on(before, &s).unwrap();
    assert_eq!(graph_stats(&mm).pools, 1);
    assert!(s.end_host_capture(true).unwrap().is_none(), "the capture failed: no graph");
    let st = graph_stats(&mm);
    assert_eq!((st.pools, st.reserved, st.held), (0, 0, 0), "{st:?}");
    let again = mm.allocate_device_on(2 * MIB, &s).unwrap();
    assert_eq!(again, before);
    mm.free_device_on(again, &s).unwrap();
}

#[test]
fn a_graph_dropped_on_another_thread_is_released_by_the_next_call() {
    let _serial = serial();
    let mm = manager();
    if !on_host(&mm) {
        return;
    }
    let s = Stream::new().unwrap();
    host_capture(&s);
    let tmp = mm.allocate_device_on(4 * MIB, &s).unwrap();
    mm.free_device_on(tmp, &s).unwrap();
    let graph = end_host_capture(&s);
    let exec = graph.instantiate();
    // The destructor runs where the last reference goes: another thread.
    std::thread::spawn(move || drop((graph, exec))).join().unwrap();
    let t = Stream::new().unwrap();
    let p = mm.allocate_device_on(MIB, &t).unwrap(); // any call settles it
    assert_eq!(graph_stats(&mm).pools, 0);
    mm.free_device_on(p, &t).unwrap();
}

#[test]
fn graph_outputs_of_an_unregistered_capture_stay_the_graphs_after_they_are_freed() {
    let _serial = serial();
    let mm = manager();
    if !on_host(&mm) {
        return;
    }
    let (s, t) = (Stream::new().unwrap(), Stream::new().unwrap());
    host_capture(&s);
    let out = mm.allocate_device_on(2 * MIB, &s).unwrap();
    let graph = end_host_capture(&s);
    mm.free_device_on(out, &t).unwrap(); // an eager user frees the output
    let other = mm.allocate_device_on(2 * MIB, &t).unwrap();
    assert!(!overlaps((other, 2 * MIB), (out, 2 * MIB)), "the graph still writes its output");
    mm.free_device_on(other, &t).unwrap();
    assert_eq!(graph_stats(&mm).pools, 1);
    drop(graph);
    assert_eq!(graph_stats(&mm).pools, 0);
}

#[test]
fn two_unregistered_captures_on_two_threads_get_two_pools() {
    let _serial = serial();
    let mm = Arc::new(manager());
    if !on_host(&mm) {
        return;
    }
    let start = Arc::new(Barrier::new(2));
    let workers: Vec<_> = (0..2)
        .map(|i| {
            let (mm, start) = (mm.clone(), start.clone());
            std::thread::spawn(move || {
                let s = Stream::new().unwrap();
                host_capture(&s);
                start.wait();
                let mut blocks = Vec::new();
                for round in 0..50 {
                    let size = ((i * 5 + round) % 8 + 1) * 256 * 1024;
                    let p = mm.allocate_device_on(size, &s).unwrap();
                    blocks.push((p, size));
                    mm.free_device_on(p, &s).unwrap();
                }
                (end_host_capture(&s), blocks)
            })
        })
        .collect();
    let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    assert_eq!(graph_stats(&mm).pools, 2);
    for a in &results[0].1 {
        for b in &results[1].1 {
            assert!(!overlaps(*a, *b), "the two graphs share {:#x}", a.0);
        }
    }
    let t = Stream::new().unwrap();
    for (p, size) in results.iter().flat_map(|r| r.1.iter()).copied() {
        let other = mm.allocate_device_on(size, &t).unwrap();
        assert!(!overlaps((other, size), (p, size)));
        mm.free_device_on(other, &t).unwrap();
    }
    drop(results);
    assert_eq!(graph_stats(&mm).pools, 0);
}

#[test]
fn the_promise_and_the_former_key_parse() {
    let c = "promise_registered_captures=true".parse::<Config>().unwrap();
    assert!(c.promise_registered_captures);
    assert!(!Config::new().promise_registered_captures, "detection is the default");
    assert!(matches!("capture_check=registered".parse::<Config>(), Err(Error::Config(_))));
}

#[test]
fn registering_a_capture_that_already_has_its_own_pool_is_refused() {
    let _serial = serial();
    let mm = manager();
    if !on_host(&mm) {
        return;
    }
    let s = Stream::new().unwrap();
    host_capture(&s);
    let tmp = mm.allocate_device_on(MIB, &s).unwrap(); // the implicit pool starts here
    let pool = mm.graph_pool().unwrap();
    assert!(matches!(mm.capture_into(&s, &pool), Err(Error::Capture(_))));
    mm.free_device_on(tmp, &s).unwrap();
    drop(end_host_capture(&s));
    assert_eq!(graph_stats(&mm).pools, 1, "only the shared pool is left");
    drop(pool);
    assert_eq!(graph_stats(&mm).pools, 0);
}

#[test]
fn a_manager_dropped_before_the_graph_leaves_the_graphs_memory_alone() {
    let _serial = serial();
    let s = Stream::new().unwrap();
    if !s.is_host() {
        eprintln!("skipped: the host-queue model of captures needs the host fallback");
        return;
    }
    // The private pool's memory stays mapped: the graph may replay into it
    // after the manager is gone. (Its memory is leaked, never reused.)
    let mm = manager();
    host_capture(&s);
    let tmp = mm.allocate_device_on(MIB, &s).unwrap();
    mm.free_device_on(tmp, &s).unwrap();
    let graph = end_host_capture(&s);
    drop(mm);
    // SAFETY: on the host fallback device memory is host memory; the
    // private pool's chunk must still be mapped for this write not to fault.
    unsafe { std::ptr::write_bytes(tmp as *mut u8, 0xAB, MIB) };
    drop(graph); // its destructor posts to a queue nobody reads: harmless
}

#[test]
fn a_shared_pool_outlives_its_handles_until_the_graphs_captured_into_it_are_gone() {
    let _serial = serial();
    let mm = manager();
    if !on_host(&mm) {
        return;
    }
    let (s, t) = (Stream::new().unwrap(), Stream::new().unwrap());
    let pool = mm.graph_pool().unwrap();
    host_capture(&s);
    let scope = mm.capture_into(&s, &pool).unwrap();
    let tmp = mm.allocate_device_on(4 * MIB, &s).unwrap();
    mm.free_device_on(tmp, &s).unwrap();
    let graph = end_host_capture(&s);
    drop(scope);
    let exec = graph.instantiate();
    // Every handle of the pool is gone; the graph and its executable are
    // not: the pool's memory stays theirs.
    drop((pool, graph));
    for _ in 0..3 {
        let other = mm.allocate_device_on(4 * MIB, &t).unwrap();
        assert!(!overlaps((other, 4 * MIB), (tmp, 4 * MIB)), "the executable still writes its scratch");
        mm.free_device_on(other, &t).unwrap();
    }
    assert_eq!(graph_stats(&mm).pools, 1);
    // The executable's destructor (on another thread) hands it back.
    std::thread::spawn(move || drop(exec)).join().unwrap();
    assert_eq!(graph_stats(&mm).pools, 0);
}

/// A pool handed out directly (a program that routes its captures itself,
/// as PyTorch does): its blocks never reach eager work, even once freed;
/// dropped with a block still live, it gives its memory back once that
/// block is freed through the manager.
#[test]
fn a_graph_pool_used_directly_keeps_its_memory_and_gives_it_back_after_its_last_block() {
    let _serial = serial();
    let mm = manager();
    let reserved_before = graph_stats(&mm).reserved;
    let pool = mm.graph_pool().unwrap();
    let a = pool.allocate(3 * MIB).unwrap();
    let b = pool.allocate(MIB).unwrap();
    pool.free(a).unwrap();
    assert_eq!(pool.free_blocks().first().map(|f| f.0), Some(a), "a's space is the pool's, free");
    let eager = mm.allocate_device(3 * MIB).unwrap();
    assert!(!overlaps((eager, 3 * MIB), (a, 3 * MIB)), "a block freed into the pool reached eager work");
    mm.free_device(eager).unwrap();
    // a's space serves the pool again, and a piece of it is taken where
    // it was (a checkpoint restored).
    let c = pool.allocate(3 * MIB).unwrap();
    assert_eq!(c, a);
    pool.free(c).unwrap();
    pool.allocate_at(a + MIB as u64, MIB).unwrap();
    assert!(pool.allocate_at(a + MIB as u64, MIB).is_err(), "the range is taken");
    assert!(matches!(pool.free(a + MIB as u64 + 256), Err(Error::InteriorPointer { .. })));
    pool.free(a + MIB as u64).unwrap();
    assert!(matches!(pool.free(a + MIB as u64), Err(Error::DoubleFree { .. })));
    assert!(graph_stats(&mm).reserved > reserved_before);
    drop(pool);
    assert!(graph_stats(&mm).reserved > reserved_before, "b is live: the pool stays");
    mm.free_device(b).unwrap();
    assert_eq!(graph_stats(&mm).reserved, reserved_before, "the last block's free gave the pool's memory back");
}
