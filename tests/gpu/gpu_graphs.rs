//! CUDA graphs on a GPU: captured kernels replayed many times must never
//! overwrite memory that anyone outside the graph holds, in every mode.
//! Each test skips with a printed reason without a GPU and fails instead
//! under `CUMEM_REQUIRE_GPU=1`.

use std::sync::{Arc, Barrier, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::{Config, DeviceAllocatorMode, Error, MemoryManager, Stream};

mod capture_edges;
mod outside;

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
