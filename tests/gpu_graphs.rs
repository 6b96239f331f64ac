//! CUDA graphs on a GPU: captured kernels replayed many times must never
//! overwrite memory that anyone outside the graph holds, in every mode.
//! Each test skips with a printed reason without a GPU and fails instead
//! under `CUMEM_REQUIRE_GPU=1`.

use std::sync::{Arc, Barrier, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::{Config, DeviceAllocatorMode, Error, MemoryManager, Stream};

const KERNELS: &str = r#"
extern "C" __global__ void fill(unsigned int* p, unsigned int v, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
extern "C" __global__ void add_copy(unsigned int* dst, const unsigned int* src, unsigned int k, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] + k;
}
"#;

const N: usize = 1 << 20; // 4 MiB of u32
const REPLAYS: usize = 10;

struct Kernels {
    fill: CudaFunction,
    add_copy: CudaFunction,
    _module: Arc<CudaModule>,
}

fn kernels(ctx: &Arc<CudaContext>) -> Kernels {
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernels");
    let module = ctx.load_module(ptx).expect("the module loads");
    Kernels {
        fill: module.load_function("fill").unwrap(),
        add_copy: module.load_function("add_copy").unwrap(),
        _module: module,
    }
}

/// The configuration from `CUMEM_CONF` (the suite also runs with another
/// default device), so managers and the test's context agree.
fn config() -> Config {
    Config::from_env().expect("CUMEM_CONF parses")
}

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

fn fill(k: &Kernels, s: &Stream, p: u64, v: u32, n: usize) {
    let nn = n as u64;
    let cs = s.cudarc().unwrap();
    let mut l = cs.launch_builder(&k.fill);
    l.arg(&p).arg(&v).arg(&nn);
    // SAFETY: the arguments match the kernel; `p` holds at least `n` u32.
    unsafe { l.launch(cfg(n)) }.unwrap();
}

fn add_copy(k: &Kernels, s: &Stream, dst: u64, src: u64, add: u32, n: usize) {
    let nn = n as u64;
    let cs = s.cudarc().unwrap();
    let mut l = cs.launch_builder(&k.add_copy);
    l.arg(&dst).arg(&src).arg(&add).arg(&nn);
    // SAFETY: the arguments match the kernel; both hold at least `n` u32.
    unsafe { l.launch(cfg(n)) }.unwrap();
}

fn read(p: u64, n: usize) -> Vec<u32> {
    let mut v = vec![0u32; n];
    // SAFETY: `v` holds `n` u32; `p` is a device allocation of at least that
    // size and the streams that write it were synchronised.
    unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), p, n * 4) }.result().unwrap();
    v
}

/// How a test captures: through cumem's guard, the raw form (cudarc's
/// capture, registered with cumem), or a raw capture cumem is not told of.
#[derive(Clone, Copy, PartialEq, Debug)]
enum How {
    Guard,
    Raw,
    Unregistered,
}

/// The first finding's scenario: a captured step takes a temporary buffer,
/// fills it, copies it (plus one) to an output, frees it; then another
/// caller allocates the same size on another stream and fills it; the graph
/// replays ten times. Returns (the other caller's values intact, the
/// output right).
fn scenario(ctx: &Arc<CudaContext>, mode: DeviceAllocatorMode, how: How) -> (bool, bool) {
    let k = kernels(ctx);
    let mm = MemoryManager::new(config().mode(mode).promise_registered_captures(how == How::Unregistered)).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let pool = mm.graph_pool().unwrap();
    let cs = s.cudarc().unwrap().clone();
    let mode_raw = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    let (guard, scope) = match how {
        How::Guard => (Some(mm.begin_capture(&s, &pool).unwrap()), None),
        How::Raw => {
            s.synchronize().unwrap();
            cs.begin_capture(mode_raw).unwrap();
            (None, Some(mm.capture_into(&s, &pool).unwrap()))
        }
        How::Unregistered => {
            s.synchronize().unwrap();
            cs.begin_capture(mode_raw).unwrap();
            (None, None)
        }
    };
    let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, tmp, 0x600D, N);
    add_copy(&k, &s, out, tmp, 1, N);
    mm.free_device_on(tmp, &s).unwrap();
    let (graph, raw_graph) = match guard {
        Some(g) => (Some(g.end().unwrap()), None),
        None => {
            let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
            drop(scope);
            (None, Some(g))
        }
    };
    let other = mm.allocate_device_on(N * 4, &t).unwrap();
    fill(&k, &t, other, 0x0BAD, N);
    t.synchronize().unwrap();
    for _ in 0..REPLAYS {
        match (&graph, &raw_graph) {
            (Some(g), _) => g.launch(&s).unwrap(),
            (_, Some(g)) => g.launch().unwrap(),
            _ => unreachable!(),
        }
    }
    s.synchronize().unwrap();
    let intact = read(other, N).iter().all(|&v| v == 0x0BAD);
    let right = read(out, N).iter().all(|&v| v == 0x600E);
    if let Some(g) = &graph {
        assert!(g.pool().stats().reserved > 0 || mode != DeviceAllocatorMode::SyncPool, "the graph holds memory");
    }
    mm.free_device_on(other, &t).unwrap();
    t.synchronize().unwrap();
    drop((graph, raw_graph, pool));
    mm.free_device(out).unwrap();
    (intact, right)
}

#[test]
fn captured_step_never_overwrites_another_callers_memory_in_any_mode() {
    let Some(ctx) = gpu_for_test("captured_step_never_overwrites_another_callers_memory_in_any_mode") else {
        return;
    };
    let _serial = serial();
    for mode in DeviceAllocatorMode::ALL {
        for how in [How::Guard, How::Raw] {
            let (intact, right) = scenario(&ctx, mode, how);
            assert!(intact, "{mode} {how:?}: the graph's replays overwrote another caller's memory");
            assert!(right, "{mode} {how:?}: the graph's output is wrong");
        }
    }
}

#[test]
fn control_an_unregistered_capture_in_the_sync_pool_does_corrupt() {
    // Without telling cumem, and with the promise that switches detection
    // off, the sync pool hands the captured temporary to the next caller and
    // every replay overwrites it: the check above can fail. (The
    // stream-ordered modes are safe even then: the driver makes graph
    // memory nodes.)
    let Some(ctx) = gpu_for_test("control_an_unregistered_capture_in_the_sync_pool_does_corrupt") else { return };
    let _serial = serial();
    let (intact, _) = scenario(&ctx, DeviceAllocatorMode::SyncPool, How::Unregistered);
    assert!(!intact, "control: the unregistered capture should have shared its memory");
    for mode in [DeviceAllocatorMode::AsyncStreamOrdered, DeviceAllocatorMode::CudaAsyncPool] {
        let (intact, right) = scenario(&ctx, mode, How::Unregistered);
        assert!(intact && right, "{mode}: graph memory nodes keep the graph's memory apart");
    }
}

#[test]
fn the_promise_refuses_an_unregistered_capture_and_keeps_it_intact() {
    let Some(ctx) = gpu_for_test("the_promise_refuses_an_unregistered_capture_and_keeps_it_intact") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    // With the promise, routing is off outside registered captures; while
    // one is under way, an unregistered capture is refused.
    let mm = MemoryManager::new(config().promise_registered_captures(true)).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let r = Stream::from_cudarc(ctx.new_stream().unwrap());
    let pool = mm.graph_pool().unwrap();
    let registered = mm.begin_capture(&r, &pool).unwrap();
    let out = mm.allocate_device(N * 4).unwrap();
    let cs = s.cudarc().unwrap().clone();
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let e = mm.allocate_device_on(N * 4, &s).unwrap_err();
    assert!(matches!(e, Error::Capture(_)), "{e}");
    // The capture is still valid: record a kernel and replay it.
    fill(&k, &s, out, 7, N);
    // cumem ends its capture first: cudarc instantiates in this thread's
    // own capture mode, which the registered capture would forbid.
    drop(registered.end().unwrap());
    let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
    g.launch().unwrap();
    s.synchronize().unwrap();
    assert!(read(out, N).iter().all(|&v| v == 7));
    mm.free_device(out).unwrap();
}

#[test]
fn a_dropped_graphs_memory_is_reused_and_stays_with_its_new_owner() {
    let Some(ctx) = gpu_for_test("a_dropped_graphs_memory_is_reused_and_stays_with_its_new_owner") else { return };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let before = mm.allocate_device_on(N * 4, &s).unwrap();
    let pool = mm.graph_pool().unwrap();
    let cap = mm.begin_capture(&s, &pool).unwrap();
    fill(&k, &s, before, 3, N);
    add_copy(&k, &s, out, before, 1, N);
    mm.free_device_on(before, &s).unwrap(); // held by the graph
    let g = cap.end().unwrap();
    for _ in 0..REPLAYS {
        g.launch(&s).unwrap();
    }
    // The driver destroys the graph after its replays; the next cumem
    // call then gives `before` back.
    drop((g, pool));
    assert_eq!(wait_released(&mm).pools, 0, "the pool is released once the graph is gone");
    let again = mm.allocate_device_on(N * 4, &t).unwrap();
    assert_eq!(again, before, "best fit hands the returned block out again");
    fill(&k, &t, again, 0xABC, N);
    t.synchronize().unwrap();
    s.synchronize().unwrap();
    assert!(read(again, N).iter().all(|&v| v == 0xABC), "nothing of the dropped graph wrote afterwards");
    assert!(read(out, N).iter().all(|&v| v == 4));
    mm.free_device_on(again, &t).unwrap();
    t.synchronize().unwrap();
    mm.free_device(out).unwrap();
}

#[test]
fn two_graphs_share_a_private_pool() {
    let Some(ctx) = gpu_for_test("two_graphs_share_a_private_pool") else { return };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let outs = [mm.allocate_device(N * 4).unwrap(), mm.allocate_device(N * 4).unwrap()];
    let pool = mm.graph_pool().unwrap();
    let graphs: Vec<_> = outs
        .iter()
        .enumerate()
        .map(|(i, &out)| {
            let cap = mm.begin_capture(&s, &pool).unwrap();
            let a = mm.allocate_device_on(N * 4, &s).unwrap();
            let b = mm.allocate_device_on(N * 4, &s).unwrap();
            fill(&k, &s, a, 100 * (i as u32 + 1), N);
            add_copy(&k, &s, b, a, 1, N);
            add_copy(&k, &s, out, b, 1, N);
            mm.free_device_on(a, &s).unwrap();
            mm.free_device_on(b, &s).unwrap();
            cap.end().unwrap()
        })
        .collect();
    assert_eq!(pool.stats().reserved, 8 << 20, "two graphs of 8 MiB each share 8 MiB");
    for _ in 0..REPLAYS {
        for g in &graphs {
            g.launch(&s).unwrap(); // one stream: replays never overlap
        }
    }
    s.synchronize().unwrap();
    assert!(read(outs[0], N).iter().all(|&v| v == 102));
    assert!(read(outs[1], N).iter().all(|&v| v == 202));
    drop((graphs, pool));
    for o in outs {
        mm.free_device(o).unwrap();
    }
}

#[test]
fn threads_allocating_on_their_streams_during_a_capture_keep_their_data() {
    let Some(ctx) = gpu_for_test("threads_allocating_on_their_streams_during_a_capture_keep_their_data") else {
        return;
    };
    let _serial = serial();
    let k = Arc::new(kernels(&ctx));
    let mm = Arc::new(MemoryManager::new(config()).unwrap());
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let pool = mm.graph_pool().unwrap();
    let threads = 4;
    let go = Arc::new(Barrier::new(threads + 1));
    let cap = mm.begin_capture(&s, &pool).unwrap();
    let workers: Vec<_> = (0..threads)
        .map(|i| {
            let (mm, k, go, ctx) = (mm.clone(), k.clone(), go.clone(), ctx.clone());
            std::thread::spawn(move || {
                let t = Stream::from_cudarc(ctx.new_stream().unwrap());
                go.wait();
                let mut kept = Vec::new();
                for round in 0..64usize {
                    let n = (round % 8 + 1) * (N / 8);
                    let p = mm.allocate_device_on(n * 4, &t).unwrap();
                    let v = (i * 1000 + round) as u32;
                    fill(&k, &t, p, v, n);
                    if round % 2 == 0 {
                        kept.push((p, n, v));
                    } else {
                        mm.free_device_on(p, &t).unwrap();
                    }
                }
                t.synchronize().unwrap();
                (t, kept)
            })
        })
        .collect();
    go.wait();
    for round in 0..32u32 {
        let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
        fill(&k, &s, tmp, 0xDEAD_0000 + round, N);
        add_copy(&k, &s, out, tmp, 0, N);
        mm.free_device_on(tmp, &s).unwrap();
    }
    let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let g = cap.end().unwrap();
    for _ in 0..REPLAYS {
        g.launch(&s).unwrap();
    }
    s.synchronize().unwrap();
    assert!(read(out, N).iter().all(|&v| v == 0xDEAD_0000 + 31));
    for (t, kept) in results {
        for (p, n, v) in kept {
            assert!(read(p, n).iter().all(|&x| x == v), "a worker's block at {p:#x} was overwritten");
            mm.free_device_on(p, &t).unwrap();
        }
        t.synchronize().unwrap();
    }
    drop((g, pool));
    mm.free_device(out).unwrap();
}

// Captures made with cudarc's API only: cumem is told nothing.

fn graph_stats(mm: &MemoryManager) -> cumem::GraphStats {
    mm.device_stats(mm.config().device).unwrap().graphs
}

/// Waits (up to 10 s) until the device's private pools are gone: the
/// driver runs the user objects' destructors on a thread of its own, a
/// moment after the last graph or executable is destroyed.
fn wait_released(mm: &MemoryManager) -> cumem::GraphStats {
    let start = std::time::Instant::now();
    loop {
        let st = graph_stats(mm);
        if st.pools == 0 || start.elapsed() > std::time::Duration::from_secs(10) {
            return st;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

fn overlaps(a: (u64, usize), b: (u64, usize)) -> bool {
    a.0 < b.0 + b.1 as u64 && b.0 < a.0 + a.1 as u64
}

/// One capture with cudarc's API on `s` (global capture mode): scratch
/// `tmp` filled and copied (plus one) into `out`, then freed; `before`
/// (made outside) freed in the capture too. Then 100 rounds of: replay,
/// an eager allocation of the same size on `t` filled there, replay again,
/// check. Returns (eager blocks never overlapped the graph's and kept their
/// values, outputs right, the scratch address, `before`).
fn cudarc_scenario(ctx: &Arc<CudaContext>, k: &Kernels, mm: &MemoryManager) -> (bool, bool, u64, u64) {
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let before = mm.allocate_device_on(N * 4, &s).unwrap();
    s.synchronize().unwrap();
    let cs = s.cudarc().unwrap().clone();
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(k, &s, tmp, 0x600D, N);
    fill(k, &s, before, 5, N);
    add_copy(k, &s, out, tmp, 1, N);
    mm.free_device_on(tmp, &s).unwrap();
    mm.free_device_on(before, &s).unwrap();
    let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
    let (mut apart, mut right) = (true, true);
    for round in 0..100u32 {
        g.launch().unwrap();
        let other = mm.allocate_device_on(N * 4, &t).unwrap();
        apart &= !overlaps((other, N * 4), (tmp, N * 4)) && !overlaps((other, N * 4), (before, N * 4));
        fill(k, &t, other, 0x0BAD + round, N);
        t.synchronize().unwrap();
        g.launch().unwrap();
        s.synchronize().unwrap();
        apart &= read(other, N).iter().all(|&v| v == 0x0BAD + round);
        right &= read(out, N).iter().all(|&v| v == 0x600E);
        mm.free_device_on(other, &t).unwrap();
    }
    t.synchronize().unwrap();
    drop(g);
    mm.free_device(out).unwrap();
    (apart, right, tmp, before)
}

#[test]
fn a_cudarc_capture_keeps_its_memory_in_every_mode_until_the_graph_is_gone() {
    let Some(ctx) = gpu_for_test("a_cudarc_capture_keeps_its_memory_in_every_mode_until_the_graph_is_gone") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    for mode in DeviceAllocatorMode::ALL {
        let mm = MemoryManager::new(config().mode(mode)).unwrap();
        let (apart, right, _, before) = cudarc_scenario(&ctx, &k, &mm);
        assert!(apart, "{mode}: an eager allocation got the graph's memory");
        assert!(right, "{mode}: the graph's output is wrong");
        let st = wait_released(&mm);
        assert_eq!((st.pools, st.reserved, st.held), (0, 0, 0), "{mode}: the graph's memory came back: {st:?}");
        if mode == DeviceAllocatorMode::SyncPool {
            // The block the graph held is free again: a few allocations of
            // its size reach it (best fit takes exact holes first; the
            // eager rounds left one more hole of that size beside it).
            let t = Stream::from_cudarc(ctx.new_stream().unwrap());
            let again: Vec<u64> = (0..3).map(|_| mm.allocate_device_on(N * 4, &t).unwrap()).collect();
            assert!(again.contains(&before), "the block the graph held is reused once it is gone");
            for &p in &again {
                fill(&k, &t, p, 9, N);
            }
            t.synchronize().unwrap();
            assert!(read(before, N).iter().all(|&v| v == 9), "nothing of the dropped graph wrote afterwards");
            for p in again {
                mm.free_device_on(p, &t).unwrap();
            }
            t.synchronize().unwrap();
        }
    }
}

#[test]
fn control_without_detection_a_cudarc_capture_shares_its_scratch() {
    let Some(ctx) = gpu_for_test("control_without_detection_a_cudarc_capture_shares_its_scratch") else { return };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config().promise_registered_captures(true)).unwrap();
    let (apart, _, _, _) = cudarc_scenario(&ctx, &k, &mm);
    assert!(!apart, "control: with detection off the eager caller should have got the graph's scratch");
}

#[test]
fn the_executable_keeps_the_memory_after_the_graph_is_destroyed() {
    let Some(ctx) = gpu_for_test("the_executable_keeps_the_memory_after_the_graph_is_destroyed") else { return };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let cs = s.cudarc().unwrap().clone();
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, tmp, 41, N);
    add_copy(&k, &s, out, tmp, 1, N);
    mm.free_device_on(tmp, &s).unwrap();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: `s` captures (begun above); `graph` is a valid out-location.
    unsafe { sys::cuStreamEndCapture(cs.cu_stream(), &mut graph) }.result().unwrap();
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` is the live graph just captured.
    unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result().unwrap();
    // SAFETY: the graph is destroyed once; the executable stays valid.
    unsafe { sys::cuGraphDestroy(graph) }.result().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(graph_stats(&mm).pools, 1, "the executable keeps the graph's pool");
    for round in 0..10u32 {
        // SAFETY: `exec` is alive and belongs to this context.
        unsafe { sys::cuGraphLaunch(exec, cs.cu_stream()) }.result().unwrap();
        let other = mm.allocate_device_on(N * 4, &t).unwrap();
        assert!(!overlaps((other, N * 4), (tmp, N * 4)), "round {round}: the executable's scratch was handed out");
        mm.free_device_on(other, &t).unwrap();
    }
    s.synchronize().unwrap();
    assert!(read(out, N).iter().all(|&v| v == 42));
    assert_eq!(graph_stats(&mm).pools, 1);
    // SAFETY: destroyed once; its launches were synchronised.
    unsafe { sys::cuGraphExecDestroy(exec) }.result().unwrap();
    let st = wait_released(&mm);
    assert_eq!((st.pools, st.reserved), (0, 0), "{st:?}");
    t.synchronize().unwrap();
    mm.free_device(out).unwrap();
}

/// A graph made on one thread and replayed on another.
struct SendGraph(cudarc::driver::CudaGraph);

// SAFETY: the driver's graph and executable handles may be used from any
// thread; the wrapper is moved once, after the capture ended, and used by
// one thread at a time.
unsafe impl Send for SendGraph {}

#[test]
fn two_cudarc_captures_at_once_on_two_threads() {
    let Some(ctx) = gpu_for_test("two_cudarc_captures_at_once_on_two_threads") else { return };
    let _serial = serial();
    let k = Arc::new(kernels(&ctx));
    let mm = Arc::new(MemoryManager::new(config()).unwrap());
    let go = Arc::new(Barrier::new(2));
    let workers: Vec<_> = (0..2u32)
        .map(|i| {
            let (mm, k, go, ctx) = (mm.clone(), k.clone(), go.clone(), ctx.clone());
            std::thread::spawn(move || {
                let s = Stream::from_cudarc(ctx.new_stream().unwrap());
                let out = mm.allocate_device(N * 4).unwrap();
                let cs = s.cudarc().unwrap().clone();
                cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
                go.wait();
                let mut scratch = Vec::new();
                for round in 0..8u32 {
                    let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
                    fill(&k, &s, tmp, 1000 * (i + 1) + round, N);
                    add_copy(&k, &s, out, tmp, 1, N);
                    mm.free_device_on(tmp, &s).unwrap();
                    scratch.push(tmp);
                }
                let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
                (s, SendGraph(g), out, scratch)
            })
        })
        .collect();
    let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    assert_eq!(graph_stats(&mm).pools, 2, "one private pool per capture");
    for a in &results[0].3 {
        for b in &results[1].3 {
            assert!(!overlaps((*a, N * 4), (*b, N * 4)), "the two graphs share {a:#x}");
        }
    }
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    for _ in 0..REPLAYS {
        for (_, g, _, scratch) in &results {
            g.0.launch().unwrap();
            let other = mm.allocate_device_on(N * 4, &t).unwrap();
            assert!(scratch.iter().all(|&p| !overlaps((other, N * 4), (p, N * 4))));
            mm.free_device_on(other, &t).unwrap();
        }
    }
    for (i, (s, _, out, _)) in results.iter().enumerate() {
        s.synchronize().unwrap();
        assert!(read(*out, N).iter().all(|&v| v == 1000 * (i as u32 + 1) + 7 + 1));
    }
    t.synchronize().unwrap();
    let outs: Vec<u64> = results.iter().map(|r| r.2).collect();
    drop(results);
    let st = wait_released(&mm);
    assert_eq!(st.pools, 0, "{st:?}");
    for o in outs {
        mm.free_device(o).unwrap();
    }
}

#[test]
fn a_failed_cudarc_capture_releases_its_pool() {
    let Some(ctx) = gpu_for_test("a_failed_cudarc_capture_releases_its_pool") else { return };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let cs = s.cudarc().unwrap().clone();
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, tmp, 1, N);
    mm.free_device_on(tmp, &s).unwrap();
    assert_eq!(graph_stats(&mm).pools, 1);
    // Something illegal during the capture invalidates it.
    // SAFETY: the stream is alive; synchronising a capturing stream is
    // refused by the driver (and invalidates the capture), nothing else.
    let illegal = unsafe { sys::cuStreamSynchronize(cs.cu_stream()) };
    assert_ne!(illegal, sys::CUresult::CUDA_SUCCESS);
    assert!(matches!(mm.allocate_device_on(N * 4, &s), Err(Error::Capture(_))), "an invalidated capture");
    assert!(cs.end_capture(sys::CUgraphInstantiate_flags(0)).is_err(), "ending an invalidated capture fails");
    let st = wait_released(&mm);
    assert_eq!((st.pools, st.reserved), (0, 0), "the failed capture's pool is released: {st:?}");
    let p = mm.allocate_device_on(N * 4, &s).unwrap();
    mm.free_device_on(p, &s).unwrap();
    s.synchronize().unwrap();
}

/// A block freed on `s` with its work still queued, then `s` begins a
/// capture cumem is not told of (`mode`). Callers of the same size on
/// another stream `t` (and, with `unordered`, with no stream: what
/// PyTorch's backend asks for its graph pools) can't be ordered after `s`
/// (a wait would join or break the capture): each gets another block, and
/// the capture stays valid; the graph and the callers' data check out.
fn pending_block_under_capture(
    ctx: &Arc<CudaContext>,
    mm: &MemoryManager,
    mode: sys::CUstreamCaptureMode,
    unordered: bool,
) {
    let k = kernels(ctx);
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let x = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, x, 1, N);
    mm.free_device_on(x, &s).unwrap();
    let cs = s.cudarc().unwrap().clone();
    cs.begin_capture(mode).unwrap();
    let host = unordered.then(|| mm.allocate_device(N * 4).expect("an unordered allocation during the capture"));
    let y = mm.allocate_device_on(N * 4, &t).expect("an allocation on another stream during the capture");
    assert_ne!(y, x);
    assert_ne!(host, Some(x));
    fill(&k, &s, out, 2, N);
    let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).expect("the capture stays valid").expect("a graph");
    fill(&k, &t, y, 3, N);
    g.launch().unwrap();
    s.synchronize().unwrap();
    t.synchronize().unwrap();
    assert!(read(y, N).iter().all(|&v| v == 3));
    assert!(read(out, N).iter().all(|&v| v == 2));
    mm.free_device_on(y, &t).unwrap();
    t.synchronize().unwrap();
    drop(g);
    if let Some(h) = host {
        mm.free_device(h).unwrap();
    }
    mm.free_device(out).unwrap();
}

#[test]
fn an_eager_caller_never_gets_a_block_whose_last_use_waits_on_a_capturing_stream() {
    let Some(ctx) = gpu_for_test("an_eager_caller_never_gets_a_block_whose_last_use_waits_on_a_capturing_stream")
    else {
        return;
    };
    let _serial = serial();
    let mm = MemoryManager::new(config()).unwrap();
    pending_block_under_capture(&ctx, &mm, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, false);
}

#[test]
fn with_the_promise_an_unregistered_capture_is_never_waited_on() {
    // PyTorch's backend promises to register captures and keeps its graph
    // pools itself, so cumem is not told of PyTorch's captures; memory for
    // those pools comes from cumem with no stream order while the capture
    // runs. A block whose last use is queued on the capturing stream must
    // not be synchronised (that breaks the capture): the caller gets another.
    let Some(ctx) = gpu_for_test("with_the_promise_an_unregistered_capture_is_never_waited_on") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config().promise_registered_captures(true)).unwrap();
    pending_block_under_capture(&ctx, &mm, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED, true);
}

#[test]
fn a_stream_that_joins_a_cudarc_capture_uses_its_pool() {
    let Some(ctx) = gpu_for_test("a_stream_that_joins_a_cudarc_capture_uses_its_pool") else { return };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    let u = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let (cs, ct) = (s.cudarc().unwrap().clone(), t.cudarc().unwrap().clone());
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let a = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, a, 5, N);
    ct.join(&cs).unwrap(); // `t` joins the capture
    let b = mm.allocate_device_on(N * 4, &t).unwrap();
    add_copy(&k, &t, b, a, 1, N);
    add_copy(&k, &t, out, b, 1, N);
    mm.free_device_on(b, &t).unwrap();
    mm.free_device_on(a, &t).unwrap();
    cs.join(&ct).unwrap(); // and rejoins `s`
    assert_eq!(graph_stats(&mm).pools, 1, "one capture, one private pool, whichever stream asks");
    let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
    for _ in 0..REPLAYS {
        g.launch().unwrap();
        let other = mm.allocate_device_on(N * 4, &u).unwrap();
        assert!(!overlaps((other, N * 4), (a, N * 4)) && !overlaps((other, N * 4), (b, N * 4)));
        mm.free_device_on(other, &u).unwrap();
    }
    s.synchronize().unwrap();
    assert!(read(out, N).iter().all(|&v| v == 7));
    drop(g);
    let st = wait_released(&mm);
    assert_eq!((st.pools, st.reserved), (0, 0), "{st:?}");
    u.synchronize().unwrap();
    mm.free_device(out).unwrap();
}

#[test]
fn releasing_a_shared_pool_never_breaks_a_capture_cumem_is_not_told_of() {
    let Some(ctx) = gpu_for_test("releasing_a_shared_pool_never_breaks_a_capture_cumem_is_not_told_of") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let x = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let pool = mm.graph_pool().unwrap();
    let cap = mm.begin_capture(&s, &pool).unwrap();
    let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, tmp, 1, N);
    mm.free_device_on(tmp, &s).unwrap();
    let g = cap.end().unwrap();
    g.launch(&s).unwrap();
    s.synchronize().unwrap();
    // Another part of the program captures on `x` and never calls cumem in
    // the capture...
    let cx = x.cudarc().unwrap().clone();
    cx.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    fill(&k, &x, out, 9, N);
    // ...while the shared pool and its graph go, and cumem is called
    // eagerly. A device-wide wait here would invalidate the capture.
    drop((g, pool));
    for _ in 0..3 {
        let p = mm.allocate_device_on(N * 4, &s).unwrap();
        mm.free_device_on(p, &s).unwrap();
    }
    let gx = cx.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("the capture is intact");
    gx.launch().unwrap();
    x.synchronize().unwrap();
    assert!(read(out, N).iter().all(|&v| v == 9));
    s.synchronize().unwrap();
    assert_eq!(wait_released(&mm).pools, 0, "the pool goes once its graph is gone");
    drop(gx);
    mm.free_device(out).unwrap();
}

// Captures broken from outside: another thread's calls during a capture.

const CAPTURE_MODES: [sys::CUstreamCaptureMode; 3] = [
    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
];

/// This thread captures `fill(out, 5)` on a new stream with cudarc's API in
/// `mode` while another thread runs `during` (between the capture's first
/// kernel and its end); `before` runs on that thread before the capture
/// begins and hands `during` its state. Returns whether the capture ended
/// with a graph, and whether that graph's replay wrote `out`.
fn capture_around<S: Send>(
    ctx: &Arc<CudaContext>,
    k: &Kernels,
    mode: sys::CUstreamCaptureMode,
    out: u64,
    before: impl FnOnce() -> S + Send,
    during: impl FnOnce(S) + Send,
) -> (bool, bool) {
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let cs = s.cudarc().unwrap().clone();
    let step = &Barrier::new(2);
    let graph = std::thread::scope(|scope| {
        scope.spawn(move || {
            let state = before();
            step.wait(); // the capture may begin
            step.wait(); // it began
            during(state);
            step.wait(); // done
        });
        step.wait();
        cs.begin_capture(mode).unwrap();
        fill(k, &s, out, 5, N);
        step.wait();
        step.wait();
        cs.end_capture(sys::CUgraphInstantiate_flags(0))
    });
    match graph {
        Ok(Some(g)) => {
            g.launch().unwrap();
            s.synchronize().unwrap();
            (true, read(out, N).iter().all(|&v| v == 5))
        }
        other => {
            println!("{mode:?}: the capture ended with {:?}", other.map(|g| g.is_some()));
            (false, false)
        }
    }
}

/// A `DeviceBuffer` made without a stream and used through cudarc (so it
/// has events to wait for) is dropped by another thread while this one
/// captures, in every capture mode: the capture ends with its graph, and
/// the buffer's memory goes back. Control: before the fix the drop
/// synchronised the legacy stream (`control_a_legacy_stream_sync_...`
/// below shows what that does to a capture); the same test run against
/// main's build is recorded in the commit.
#[test]
fn dropping_a_streamless_buffer_never_breaks_another_threads_capture() {
    let Some(ctx) = gpu_for_test("dropping_a_streamless_buffer_never_breaks_another_threads_capture") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::global().unwrap();
    let out = mm.allocate_device(N * 4).unwrap();
    let t = ctx.new_stream().unwrap();
    let device = mm.config().device;
    let live = || mm.device_stats(device).unwrap().pool.live_blocks;
    for mode in CAPTURE_MODES {
        let live_before = live();
        let made = || {
            let mut buf = cumem::DeviceBuffer::<u32>::new(N).unwrap();
            t.memcpy_htod(&vec![3u32; N], &mut buf).unwrap(); // tracked by cudarc's events
            t.synchronize().unwrap();
            buf
        };
        let (ended, replayed) = capture_around(&ctx, &k, mode, out, made, drop);
        assert!(ended, "{mode:?}: the capture broke when another thread dropped a buffer");
        assert!(replayed, "{mode:?}: the graph's replay is wrong");
        assert_eq!(live(), live_before, "{mode:?}: the dropped buffer's block went back");
    }
    mm.free_device(out).unwrap();
}

/// Control for the test above: what the drop did before the fix (a host
/// wait on the legacy stream) invalidates another thread's capture made
/// in the global mode (the default of cudarc and CUDA).
#[test]
fn control_a_legacy_stream_sync_breaks_another_threads_global_capture() {
    let Some(ctx) = gpu_for_test("control_a_legacy_stream_sync_breaks_another_threads_global_capture") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let out = mm.allocate_device(N * 4).unwrap();
    let legacy = ctx.default_stream();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    let (ended, _) = capture_around(
        &ctx,
        &k,
        mode,
        out,
        || (),
        |()| {
            let r = legacy.synchronize();
            println!("control: cuStreamSynchronize(legacy) during the capture: {r:?}");
        },
    );
    assert!(!ended, "control: a legacy-stream sync during a global capture should have broken it");
    mm.free_device(out).unwrap();
}

/// A block exported over IPC that another thread frees on the capturing
/// stream during a capture (captured work writes it) belongs to the graph
/// like any block freed during a capture: releasing the export while the
/// graph lives frees nothing, eager allocations of its size never get it
/// while the graph replays, and it comes back once the graph is gone.
/// Control: before the fix the release freed it eagerly and the first
/// eager allocation of its size got it (recorded in the commit; the host
/// model `device::exports` test shows the same).
#[test]
fn an_exported_block_freed_during_a_capture_stays_the_graphs_after_its_release() {
    let Some(ctx) = gpu_for_test("an_exported_block_freed_during_a_capture_stays_the_graphs_after_its_release") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let (s, t) = (Stream::from_cudarc(ctx.new_stream().unwrap()), Stream::from_cudarc(ctx.new_stream().unwrap()));
    let out = mm.allocate_device(N * 4).unwrap();
    let e = mm.allocate_device_on(N * 4, &s).unwrap();
    let export = match mm.export_device(e) {
        Ok(x) => x,
        Err(err) => panic!("the sync pool's block can be exported on this GPU: {err}"),
    };
    s.synchronize().unwrap();
    let cs = s.cudarc().unwrap().clone();
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    fill(&k, &s, e, 0x600D, N);
    add_copy(&k, &s, out, e, 1, N);
    std::thread::scope(|scope| scope.spawn(|| mm.free_device_on(e, &s)).join().unwrap()).unwrap();
    let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("the capture ends with a graph");
    export.release().unwrap();
    let (mut apart, mut right) = (true, true);
    for round in 0..20u32 {
        g.launch().unwrap();
        let other = mm.allocate_device_on(N * 4, &t).unwrap();
        apart &= !overlaps((other, N * 4), (e, N * 4));
        fill(&k, &t, other, 0x0BAD + round, N);
        t.synchronize().unwrap();
        g.launch().unwrap();
        s.synchronize().unwrap();
        apart &= read(other, N).iter().all(|&v| v == 0x0BAD + round);
        right &= read(out, N).iter().all(|&v| v == 0x600E);
        mm.free_device_on(other, &t).unwrap();
    }
    assert!(apart, "an eager allocation got the exported block the graph still uses");
    assert!(right, "the graph's output is wrong");
    t.synchronize().unwrap();
    drop(g);
    let st = wait_released(&mm);
    assert_eq!((st.pools, st.held), (0, 0), "the graph's memory came back: {st:?}");
    let again: Vec<u64> = (0..3).map(|_| mm.allocate_device_on(N * 4, &t).unwrap()).collect();
    assert!(again.contains(&e), "the block is the pool's again once the graph is gone");
    for p in again {
        mm.free_device_on(p, &t).unwrap();
    }
    t.synchronize().unwrap();
    mm.free_device(out).unwrap();
}
