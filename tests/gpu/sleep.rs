//! Memory tags on the GPU: a CUDA graph captured (with cudarc's own API)
//! before a sleep replays after the wake with the same output, the device
//! reports the tags' memory given back, and what can't sleep is refused.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::{Config, DeviceAllocatorMode, Error, MemoryManager, Stream, TagState};

const KERNELS: &str = r#"
extern "C" __global__ void pattern(unsigned int* p, unsigned int seed, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = (unsigned int)(i * 2654435761ULL) ^ seed;
}
extern "C" __global__ void mix(unsigned int* out, const unsigned int* a, const unsigned int* b, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * 3u + b[n - 1 - i];
}
"#;

const N: usize = 8 << 20; // 32 MiB of u32 per block

struct Kernels {
    pattern: CudaFunction,
    mix: CudaFunction,
    _module: Arc<CudaModule>,
}

fn kernels(ctx: &Arc<CudaContext>) -> Kernels {
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernels");
    let module = ctx.load_module(ptx).expect("the module loads");
    Kernels {
        pattern: module.load_function("pattern").unwrap(),
        mix: module.load_function("mix").unwrap(),
        _module: module,
    }
}

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn pattern(k: &Kernels, s: &Stream, p: u64, seed: u32) {
    let nn = N as u64;
    let mut l = s.cudarc().unwrap().launch_builder(&k.pattern);
    l.arg(&p).arg(&seed).arg(&nn);
    // SAFETY: the arguments match the kernel; `p` holds `N` u32.
    unsafe { l.launch(LaunchConfig::for_num_elems(N as u32)) }.unwrap();
}

fn mix(k: &Kernels, s: &Stream, out: u64, a: u64, b: u64) {
    let nn = N as u64;
    let mut l = s.cudarc().unwrap().launch_builder(&k.mix);
    l.arg(&out).arg(&a).arg(&b).arg(&nn);
    // SAFETY: the arguments match the kernel; all three hold `N` u32.
    unsafe { l.launch(LaunchConfig::for_num_elems(N as u32)) }.unwrap();
}

fn read(p: u64) -> Vec<u32> {
    let mut v = vec![0u32; N];
    // SAFETY: `v` holds `N` u32; `p` is a device allocation of that size
    // whose writers were synchronised.
    unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), p, N * 4) }.result().unwrap();
    v
}

/// What `mix` computes from two `pattern` blocks, on the host.
fn expected(seed_a: u32, seed_b: u32) -> Vec<u32> {
    let pat = |i: usize, seed: u32| ((i as u64).wrapping_mul(2654435761) as u32) ^ seed;
    (0..N).map(|i| pat(i, seed_a).wrapping_mul(3).wrapping_add(pat(N - 1 - i, seed_b))).collect()
}

fn free_device_memory() -> usize {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: two valid out-pointers; the calling thread has a current
    // context (the test's stream bound it).
    unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }.result().unwrap();
    free
}

fn run_graph_across_sleep(ctx: &Arc<CudaContext>, mode: DeviceAllocatorMode) {
    ctx.bind_to_thread().unwrap();
    let k = kernels(ctx);
    let mm = MemoryManager::new(Config::from_env().expect("CUMEM_CONF parses").mode(mode)).unwrap();
    let cs = ctx.new_stream().unwrap();
    let s = Stream::from_cudarc(cs.clone());
    let (a, b) = {
        let _tag = mm.tag("weights").unwrap();
        (mm.allocate_device_on(N * 4, &s).unwrap(), mm.allocate_device_on(N * 4, &s).unwrap())
    };
    let kv = {
        let _tag = mm.tag("kv").unwrap();
        mm.allocate_device_on(16 * N * 4, &s).unwrap()
    };
    let out = mm.allocate_device_on(N * 4, &s).unwrap();
    pattern(&k, &s, a, 0xA5A5_0001);
    pattern(&k, &s, b, 0x0F0F_7777);
    s.synchronize().unwrap();
    // The graph reads the tagged blocks at their addresses.
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    mix(&k, &s, out, a, b);
    let graph = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
    graph.launch().unwrap();
    s.synchronize().unwrap();
    let want = expected(0xA5A5_0001, 0x0F0F_7777);
    assert!(read(out) == want, "the graph computes the mix before sleep");

    let held: usize = mm.tag_usage().iter().map(|u| u.pool.mapped).sum();
    let before = free_device_memory();
    let slept = mm.sleep(&["weights"], &["kv"]).unwrap();
    let after = free_device_memory();
    assert!(mm.tag_usage().iter().all(|u| u.state == TagState::Asleep && u.pool.mapped == 0));
    assert_eq!(slept.released, held);
    assert!(
        (after - before) as f64 >= 0.99 * held as f64,
        "the device got back {} B of the {held} B the tags held",
        after - before
    );
    // While asleep the tags refuse allocations; untagged memory works.
    {
        let _tag = mm.tag("weights").unwrap();
        assert!(matches!(mm.allocate_device_on(4096, &s), Err(Error::Tag { .. })));
    }
    let scratch = mm.allocate_device_on(N * 4, &s).unwrap();
    mm.free_device_on(scratch, &s).unwrap();

    mm.wake(&[]).unwrap();
    // The output is cleared, so only a replay that reads the restored
    // contents at the old addresses gives the mix again.
    // SAFETY: `out` holds `N * 4` bytes; nothing else uses it now.
    unsafe { sys::cuMemsetD32_v2(out, 0, N) }.result().unwrap();
    graph.launch().unwrap();
    s.synchronize().unwrap();
    assert!(read(out) == want, "the graph captured before sleep replays after wake with the same output");
    // The discarded tag's block is usable again (contents undefined).
    pattern(&k, &s, kv, 3);
    s.synchronize().unwrap();
    drop(graph);
    for p in [a, b, kv, out] {
        mm.free_device(p).unwrap();
    }
}

#[test]
fn a_graph_captured_before_sleep_replays_after_wake() {
    let Some(ctx) = gpu_for_test("a_graph_captured_before_sleep_replays_after_wake") else { return };
    let _serial = serial();
    run_graph_across_sleep(&ctx, DeviceAllocatorMode::SyncPool);
}

#[test]
fn tagged_memory_sleeps_in_the_stream_ordered_modes_too() {
    let Some(ctx) = gpu_for_test("tagged_memory_sleeps_in_the_stream_ordered_modes_too") else { return };
    let _serial = serial();
    run_graph_across_sleep(&ctx, DeviceAllocatorMode::AsyncStreamOrdered);
    run_graph_across_sleep(&ctx, DeviceAllocatorMode::CudaAsyncPool);
}

#[test]
fn exports_and_captures_are_refused() {
    let Some(ctx) = gpu_for_test("exports_and_captures_are_refused") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(Config::from_env().expect("CUMEM_CONF parses")).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let p = {
        let _tag = mm.tag("shared").unwrap();
        mm.allocate_device_on(1 << 20, &s).unwrap()
    };
    let Err(e) = mm.export_device(p) else { panic!("a tagged block was exported") };
    assert!(matches!(e, Error::Tag { .. }), "{e}");
    // A capture under way: sleep refuses and the tag stays awake.
    let pool = mm.graph_pool().unwrap();
    let capture = mm.begin_capture(&s, &pool).unwrap();
    {
        // Allocations in a capture belong to its graph, tag or not.
        let _tag = mm.tag("shared").unwrap();
        let in_graph = mm.allocate_device_on(4096, &s).unwrap();
        assert_eq!(mm.tag_usage()[0].pool.live_blocks, 1, "the captured allocation is the graph's");
        mm.free_device_on(in_graph, &s).unwrap();
    }
    assert!(matches!(mm.sleep(&["shared"], &[]), Err(Error::Capture(_))));
    let graph = capture.end().unwrap();
    drop(graph);
    assert_eq!(mm.tag_usage()[0].state, TagState::Awake);
    mm.sleep(&["shared"], &[]).unwrap();
    mm.wake(&["shared"]).unwrap();
    mm.free_device(p).unwrap();
}

#[test]
fn gpu_two_devices_sleep_together_and_a_peer_reads_woken_memory() {
    let name = "gpu_two_devices_sleep_together_and_a_peer_reads_woken_memory";
    let Some(ctxs) = cumem::device::gpus_for_test(2, name) else { return };
    let _serial = serial();
    let k: Vec<Kernels> = ctxs.iter().map(kernels).collect();
    let mm = MemoryManager::new(Config::from_env().expect("CUMEM_CONF parses")).unwrap();
    // Device 1's kernels read device 0's memory: the pages wake maps must
    // be given to the peer too.
    mm.enable_peer_access(1, 0).unwrap();
    let s: Vec<Stream> = (0..2).map(|d| Stream::new_on(d).unwrap()).collect();
    let blocks: Vec<u64> = {
        let _tag = mm.tag("weights").unwrap();
        s.iter().map(|s| mm.allocate_device_on(N * 4, s).unwrap()).collect()
    };
    let out = mm.allocate_device_on(N * 4, &s[1]).unwrap();
    for (d, &p) in blocks.iter().enumerate() {
        pattern(&k[d], &s[d], p, 0x5EED_0000 + d as u32);
        s[d].synchronize().unwrap();
    }
    let usage = mm.tag_usage();
    assert_eq!(usage.iter().map(|u| u.device).collect::<Vec<_>>(), vec![0, 1], "one pool per device");

    let slept = mm.sleep(&["weights"], &[]).unwrap();
    assert_eq!(slept.offloaded, 2 * N * 4);
    assert!(mm.tag_usage().iter().all(|u| u.state == TagState::Asleep && u.pool.mapped == 0));
    mm.wake(&["weights"]).unwrap();

    for (d, &p) in blocks.iter().enumerate() {
        ctxs[d].bind_to_thread().unwrap();
        let seed = 0x5EED_0000 + d as u32;
        let want: Vec<u32> = (0..N).map(|i| ((i as u64).wrapping_mul(2654435761) as u32) ^ seed).collect();
        assert!(read(p) == want, "device {d}'s block came back whole at its address");
    }
    // A kernel on device 1 reads device 0's woken block (and device 1's).
    mix(&k[1], &s[1], out, blocks[0], blocks[1]);
    s[1].synchronize().unwrap();
    ctxs[1].bind_to_thread().unwrap();
    assert!(read(out) == expected(0x5EED_0000, 0x5EED_0001), "the peer reads the woken memory");
    for p in blocks.into_iter().chain([out]) {
        mm.free_device(p).unwrap();
    }
}
