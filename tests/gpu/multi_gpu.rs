//! Several devices. The host tests check the dispatch (allocation on the
//! device asked for, frees that find their owner, per-device statistics,
//! shutdown over every device, peer copies, configuration) on the host
//! fallback's stand-in devices; they run everywhere. The GPU tests need two
//! GPUs: they skip with a reason on fewer, and fail instead under
//! `CUMEM_REQUIRE_GPU=1` with `CUMEM_GPUS=2`.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use cumem::arena::ArenaPlan;
use cumem::device::gpus_for_test;
use cumem::{
    BackendChoice, Config, DeviceAllocatorMode, DeviceBuffer, Error, GrowableBuffer, MemoryManager, PeerAccess,
    PinnedAlloc, PinnedVec, Stream, VmBackend,
};

fn host_manager(devices: usize) -> MemoryManager {
    MemoryManager::new(Config::new().backend(BackendChoice::Host).host_devices(devices)).unwrap()
}

#[test]
fn host_allocations_land_on_the_device_asked_for_and_frees_find_their_owner() {
    let mm = host_manager(3);
    assert_eq!(mm.device_count(), 3);
    let on1 = mm.allocate_device_for(1, 4096).unwrap();
    let on2 = mm.allocate_device_for(2, 8192).unwrap();
    let on0 = mm.allocate_device(1024).unwrap();
    assert_eq!((mm.owner_of(on0), mm.owner_of(on1), mm.owner_of(on2)), (Some(0), Some(1), Some(2)));
    assert_eq!(mm.device_stats(1).unwrap().pool.live_blocks, 1);
    assert_eq!(mm.device_stats(2).unwrap().pool.in_use, 8192);
    let summary = mm.memory_summary();
    for d in 0..3 {
        assert!(summary.contains(&format!("device {d} pool")), "{summary}");
    }
    // Frees name no device: the default device is asked first, then the
    // others; the owner takes it.
    mm.free_device(on1).unwrap();
    mm.free_device_on(on2, &Stream::host()).unwrap();
    assert_eq!(mm.device_stats(1).unwrap().pool.live_blocks, 0);
    assert_eq!(mm.device_stats(2).unwrap().pool.live_blocks, 0);
    // A second free is the owner's double free, not an unknown pointer.
    assert!(matches!(mm.free_device(on1), Err(Error::DoubleFree { .. })));
    assert!(matches!(mm.free_device(0xdead_0000), Err(Error::UnknownPointer { .. })));
    let e = mm.allocate_device_for(3, 4096).unwrap_err();
    assert!(matches!(e, Error::NoSuchDevice { ordinal: 3, count: 3 }), "{e}");
    assert_eq!(mm.all_device_stats().iter().map(|(d, _)| *d).collect::<Vec<_>>(), vec![0, 1, 2]);

    // Shutdown covers every device and says where live memory is.
    let live = mm.allocate_device_for(2, 256).unwrap();
    let report = mm.shutdown().unwrap();
    assert_eq!(report.live_count, 2, "{report}");
    let mut devices: Vec<_> = report.live.iter().map(|a| a.device).collect();
    devices.sort();
    assert_eq!(devices, vec![Some(0), Some(2)]);
    assert!(matches!(mm.allocate_device_for(1, 256), Err(Error::ShutDown(_))));
    mm.free_device(live).unwrap();
    mm.free_device(on0).unwrap();
}

#[test]
fn host_peer_copies_and_peer_access_checks() {
    let mm = host_manager(2);
    let s = Stream::host();
    let (a, b) = (mm.allocate_device_for(0, 4096).unwrap(), mm.allocate_device_for(1, 4096).unwrap());
    let data: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
    let mut back = vec![0u8; 4096];
    // SAFETY: `a` and `b` are 4096-byte allocations; on the host fallback
    // the copies happen at once, while `data` and `back` are alive.
    unsafe {
        mm.copy_to_device_async(a, data.as_ptr(), 4096, &s).unwrap();
        mm.copy_peer_async(b, 1, a, 0, 4096, &s).unwrap();
        mm.copy_to_host_async(back.as_mut_ptr(), b, 4096, &s).unwrap();
    }
    assert_eq!(back, data);
    mm.enable_peer_access(0, 1).unwrap();
    mm.enable_peer_access(1, 1).unwrap();
    assert!(matches!(mm.enable_peer_access(0, 2), Err(Error::NoSuchDevice { ordinal: 2, count: 2 })));
    // SAFETY: refused before any memory is touched.
    let e = unsafe { mm.copy_peer_async(b, 7, a, 0, 16, &s) }.unwrap_err();
    assert!(matches!(e, Error::NoSuchDevice { ordinal: 7, .. }), "{e}");
    mm.free_device(a).unwrap();
    mm.free_device(b).unwrap();
}

#[test]
fn a_device_with_no_device_behind_it_is_an_error_not_a_panic() {
    let mm = MemoryManager::global().unwrap_or_else(|e| panic!("the global manager: {e}"));
    let count = mm.device_count();
    let b = DeviceBuffer::<u32>::new_on_device(0, 64).unwrap();
    assert_eq!(b.device(), 0);
    let e = DeviceBuffer::<u32>::new_on_device(count + 4, 64).unwrap_err();
    assert!(matches!(e, Error::NoSuchDevice { .. }), "{e}");
    assert!(matches!(mm.allocate_device_for(count, 64), Err(Error::NoSuchDevice { .. })));
    assert!(matches!(ArenaPlan::new_on_device(count, 0, 4096), Err(Error::NoSuchDevice { .. })));
    assert!(matches!(mm.enable_peer_access(count, 0), Err(Error::NoSuchDevice { .. })));
    assert_eq!(Stream::host().device(), None);
}

#[test]
fn peer_access_configuration_parses() {
    let c: Config = "peer_access=all,host_devices=2".parse().unwrap();
    assert_eq!((c.peer_access, c.host_devices), (PeerAccess::All, 2));
    let c: Config = "peer_access=1:0;0:1;1:0".parse().unwrap();
    assert_eq!(c.peer_access, PeerAccess::Pairs(vec![(1, 0), (0, 1)]));
    assert_eq!("peer_access=none".parse::<Config>().unwrap().peer_access, PeerAccess::None);
    for bad in ["peer_access=1", "peer_access=a:b", "peer_access=1:0:2", "host_devices=0"] {
        let e = bad.parse::<Config>().unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{bad}: {e}");
    }
    // On the host fallback a peer configuration is accepted and does nothing.
    let mm =
        MemoryManager::new(Config::new().backend(BackendChoice::Host).host_devices(2).peer_access(PeerAccess::All))
            .unwrap();
    let p = mm.allocate_device_for(1, 256).unwrap();
    mm.free_device(p).unwrap();
}

#[test]
fn driver_and_out_of_memory_errors_name_the_device() {
    let e = Error::Driver { call: "cuMemAlloc", message: "CUDA_ERROR_OUT_OF_MEMORY".into(), device: Some(1) };
    assert!(e.to_string().contains("cuMemAlloc failed on device 1"), "{e}");
    let mm = MemoryManager::new(
        Config::new().backend(BackendChoice::Host).host_devices(2).max_device_pool_size(4 << 20).min_chunk(1 << 20),
    )
    .unwrap();
    let e = mm.allocate_device_for(1, 64 << 20).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }) && e.to_string().contains("device 1"), "{e}");
}

// ---- two GPUs ----

const KERNELS: &str = r#"
extern "C" __global__ void affine(unsigned int* p, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = p[i] * 2u + 1u;
}
"#;

fn affine(ctx: &Arc<CudaContext>) -> CudaFunction {
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernel");
    ctx.load_module(ptx).expect("module loads").load_function("affine").expect("kernel exists")
}

/// The device `ptr` belongs to (`cuPointerGetAttribute(DEVICE_ORDINAL)`).
fn device_of(ptr: u64) -> i32 {
    let mut ordinal = -1i32;
    let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL;
    // SAFETY: `ordinal` is a valid out-pointer for this int attribute.
    unsafe { sys::cuPointerGetAttribute((&mut ordinal as *mut i32).cast(), attr, ptr) }.result().unwrap();
    ordinal
}

/// GPU tests one at a time (one of them grants peer access process-wide).
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The configurations every device-memory path is checked under.
fn configs() -> Vec<(&'static str, Config)> {
    vec![
        ("sync_pool, expandable", Config::new()),
        ("sync_pool, cuMemAlloc", Config::new().expandable(false)),
        ("async_stream_ordered", Config::new().mode(DeviceAllocatorMode::AsyncStreamOrdered)),
        ("cuda_async_pool", Config::new().mode(DeviceAllocatorMode::CudaAsyncPool)),
    ]
}

#[test]
fn gpu_allocations_land_on_the_streams_device_and_frees_reach_the_owner() {
    let Some(ctxs) = gpus_for_test(2, "gpu_allocations_land_on_the_streams_device_and_frees_reach_the_owner") else {
        return;
    };
    let _serial = serial();
    let streams = [Stream::new_on(0).unwrap(), Stream::new_on(1).unwrap()];
    assert_eq!((streams[0].device(), streams[1].device()), (Some(0), Some(1)));
    for (name, config) in configs() {
        let mm = MemoryManager::new(config).unwrap();
        for (d, s) in streams.iter().enumerate() {
            let p = mm.allocate_device_on(1 << 20, s).unwrap();
            s.synchronize().unwrap(); // a stream-ordered allocation exists once its stream gets there
            assert_eq!(device_of(p), d as i32, "{name}: allocate_device_on a device-{d} stream");
            let q = mm.allocate_device_for(d, 1 << 20).unwrap();
            assert_eq!(device_of(q), d as i32, "{name}: allocate_device_for({d})");
            // Freed on the other device's stream: it still reaches device d.
            let other = &streams[1 - d];
            mm.free_device_on(p, other).unwrap_or_else(|e| panic!("{name}: free from the other device: {e}"));
            other.synchronize().unwrap();
            mm.free_device(q).unwrap();
            let st = mm.device_stats(d).unwrap();
            assert_eq!((st.pool.live_blocks, st.stream_ordered.live), (0, 0), "{name}: device {d}");
        }
        let summary = mm.memory_summary();
        assert!(summary.contains("device 0 pool") && summary.contains("device 1 pool"), "{summary}");
    }
    // The safe surface: buffers, growable buffers and the arena follow the
    // stream or the ordinal too.
    for (d, s) in streams.iter().enumerate() {
        let b = DeviceBuffer::<u32>::new_on(1 << 16, s).unwrap();
        assert_eq!((b.device(), device_of(b.device_ptr())), (d, d as i32));
        let b = DeviceBuffer::<u32>::new_on_device(d, 1 << 16).unwrap();
        assert_eq!(device_of(b.device_ptr()), d as i32);
        let g = GrowableBuffer::<u32>::with_capacity_for(s, 1 << 20).unwrap();
        assert_eq!((g.backend(), device_of(g.device_ptr())), (VmBackend::Cuda(d), d as i32));
        let mut plan = ArenaPlan::new_on_device(d, 0, 1 << 20).unwrap();
        let h = plan.want_device::<u32>(1024).unwrap();
        plan.commit().unwrap();
        assert_eq!(device_of(plan.device_ptr(&h).unwrap()), d as i32);
    }
    drop(ctxs);
}

/// Runs `affine` on device 1 over `n` values at `ptr` (device-0 memory
/// holding `i` at index `i`) and checks the result through a copy.
fn check_from_device_1(what: &str, f: &CudaFunction, ctx0: &CudaContext, s1: &Stream, ptr: u64, n: usize) {
    let seed: Vec<u32> = (0..n as u32).collect();
    ctx0.bind_to_thread().unwrap();
    // SAFETY: `ptr` holds `n` u32 of device memory; the copy is synchronous.
    unsafe { sys::cuMemcpyHtoD_v2(ptr, seed.as_ptr().cast(), n * 4) }.result().unwrap();
    // From pageable memory the copy may return before its DMA lands; the
    // device-1 kernel runs on a non-blocking stream of another device.
    ctx0.synchronize().unwrap();
    let nn = n as u64;
    let cs = s1.cudarc().unwrap();
    let mut launch = cs.launch_builder(f);
    launch.arg(&ptr).arg(&nn);
    // SAFETY: the kernel takes (u32*, u64); `ptr` holds `n` values.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    s1.synchronize().unwrap_or_else(|e| panic!("{what}: the device-1 kernel failed: {e}"));
    let mut back = vec![0u32; n];
    ctx0.bind_to_thread().unwrap();
    // SAFETY: `back` takes `n` values; the stream is idle.
    unsafe { sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), ptr, n * 4) }.result().unwrap();
    for i in (0..n).step_by(997).chain([n - 1]) {
        assert_eq!(back[i], 2 * i as u32 + 1, "{what}: element {i}");
    }
}

#[test]
fn gpu_peer_access_reaches_every_kind_of_device_0_memory() {
    let Some(ctxs) = gpus_for_test(2, "gpu_peer_access_reaches_every_kind_of_device_0_memory") else { return };
    let _serial = serial();
    assert!(cumem::device::can_access_peer(1, 0).unwrap(), "the two-GPU machine has NVLink");
    let f = affine(&ctxs[1]);
    let (s0, s1) = (Stream::new_on(0).unwrap(), Stream::new_on(1).unwrap());
    let n = 3 << 18; // 3 MiB: more than one 2 MiB mapping
                     // Memory made before the grant (existing mappings, pools, buffers)...
    let managers: Vec<(&str, &'static MemoryManager)> =
        configs().into_iter().map(|(name, c)| (name, &*Box::leak(Box::new(MemoryManager::new(c).unwrap())))).collect();
    let before: Vec<u64> = managers.iter().map(|(_, mm)| mm.allocate_device_on(n * 4, &s0).unwrap()).collect();
    let mut grown = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Cuda(0), n).unwrap();
    grown.resize(n, 0).unwrap();
    let mut plan = ArenaPlan::with_manager_on_device(managers[0].1, 0, 0, n * 4).unwrap();
    let arena = plan.want_device::<u32>(n).unwrap();
    plan.commit().unwrap();
    s0.synchronize().unwrap();

    managers[0].1.enable_peer_access(1, 0).unwrap();
    managers[0].1.enable_peer_access(1, 0).unwrap(); // twice is harmless
    assert!(cumem::device::peers_of(0).contains(&1));
    assert!(managers[0].1.memory_summary().contains("devices with peer access: 1"));

    // ... and memory made after it (new mappings, new pools, growth).
    let after: Vec<u64> = managers.iter().map(|(_, mm)| mm.allocate_device_on(n * 4, &s0).unwrap()).collect();
    let fresh = MemoryManager::new(Config::new().mode(DeviceAllocatorMode::CudaAsyncPool)).unwrap();
    let fresh_ptr = fresh.allocate_device_on(n * 4, &s0).unwrap();
    s0.synchronize().unwrap();
    for (i, (name, _)) in managers.iter().enumerate() {
        check_from_device_1(&format!("{name}, allocated before the grant"), &f, &ctxs[0], &s1, before[i], n);
        check_from_device_1(&format!("{name}, allocated after the grant"), &f, &ctxs[0], &s1, after[i], n);
    }
    check_from_device_1("a new dedicated pool", &f, &ctxs[0], &s1, fresh_ptr, n);
    check_from_device_1("a growable buffer mapped before the grant", &f, &ctxs[0], &s1, grown.device_ptr(), n);
    grown.resize(4 * n, 0).unwrap(); // new pieces, mapped after the grant
    let tail = grown.device_ptr() + (3 * n * 4) as u64;
    check_from_device_1("a growable buffer's growth after the grant", &f, &ctxs[0], &s1, tail, n);
    let mut late = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Cuda(0), n).unwrap();
    late.resize(n, 0).unwrap();
    check_from_device_1("a growable buffer made after the grant", &f, &ctxs[0], &s1, late.device_ptr(), n);
    check_from_device_1("the arena's block", &f, &ctxs[0], &s1, plan.device_ptr(&arena).unwrap(), n);

    for (i, (_, mm)) in managers.iter().enumerate() {
        mm.free_device_on(before[i], &s1).unwrap();
        mm.free_device_on(after[i], &s0).unwrap();
    }
    fresh.free_device_on(fresh_ptr, &s0).unwrap();
    s0.synchronize().unwrap();
    s1.synchronize().unwrap();
}

/// Set in the child process of the test below.
const CUDA_WAY_ENV: &str = "CUMEM_MULTI_GPU_CUDA_WAY_CHILD";

/// Peer access enabled the CUDA way: a program that calls
/// `cuCtxEnablePeerAccess` (what `cudaDeviceEnablePeerAccess` and PyTorch
/// do), never cumem's `enable_peer_access`, reads and writes device 0's
/// pool memory from a kernel on device 1: the default pool's mappings
/// (expandable segments, made before and after the call), `cuMemAlloc`
/// chunks, a growable buffer and its growth, and a graph's private pool.
/// It runs in a process of its own, where nothing ever calls cumem's
/// grant. Control: against main's build (mappings named only the owner)
/// the child faulted with CUDA_ERROR_ILLEGAL_ADDRESS on the first VMM
/// case, as `gpu_without_peer_access_...` below shows for no grant at all.
#[test]
fn gpu_peer_access_enabled_the_cuda_way_reaches_pool_memory() {
    let name = "gpu_peer_access_enabled_the_cuda_way_reaches_pool_memory";
    if std::env::var_os(CUDA_WAY_ENV).is_some() {
        let ctxs = gpus_for_test(2, name).expect("the parent saw two GPUs");
        let f = affine(&ctxs[1]);
        let (s0, s1) = (Stream::new_on(0).unwrap(), Stream::new_on(1).unwrap());
        let n = 3 << 18; // 3 MiB: more than one 2 MiB mapping
        let mm = MemoryManager::new(Config::new().device(0)).unwrap();
        let plain = MemoryManager::new(Config::new().device(0).expandable(false)).unwrap();
        let before = mm.allocate_device_on(n * 4, &s0).unwrap();
        s0.synchronize().unwrap();
        // The CUDA way: device 1's context may access device 0's.
        ctxs[1].bind_to_thread().unwrap();
        // SAFETY: both are live primary contexts; flags must be 0.
        let rc = unsafe { sys::cuCtxEnablePeerAccess(ctxs[0].cu_ctx(), 0) };
        assert!(
            matches!(rc, sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED),
            "cuCtxEnablePeerAccess: {rc:?}"
        );
        assert!(cumem::device::peers_of(0).is_empty(), "nothing told cumem");
        check_from_device_1("the default pool, mapped before cuCtxEnablePeerAccess", &f, &ctxs[0], &s1, before, n);
        let after = mm.allocate_device_on(n * 4, &s0).unwrap();
        let big = mm.allocate_device_on(64 << 20, &s0).unwrap(); // new mappings
        s0.synchronize().unwrap();
        check_from_device_1("the default pool, mapped after it", &f, &ctxs[0], &s1, after, n);
        check_from_device_1("a new 64 MiB mapping", &f, &ctxs[0], &s1, big, n);
        let chunk = plain.allocate_device_on(n * 4, &s0).unwrap();
        s0.synchronize().unwrap();
        check_from_device_1("a cuMemAlloc chunk", &f, &ctxs[0], &s1, chunk, n);
        let mut grown = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Cuda(0), n).unwrap();
        grown.resize(n, 0).unwrap();
        check_from_device_1("a growable buffer", &f, &ctxs[0], &s1, grown.device_ptr(), n);
        grown.resize(8 * n, 0).unwrap();
        let tail = grown.device_ptr() + (7 * n * 4) as u64;
        check_from_device_1("a growable buffer's growth", &f, &ctxs[0], &s1, tail, n);
        // A graph's private pool: its output block, made in the capture.
        let pool = mm.graph_pool().unwrap();
        let capture = mm.begin_capture(&s0, &pool).unwrap();
        let output = mm.allocate_device_on(n * 4, &s0).unwrap();
        let graph = capture.end().unwrap();
        graph.launch(&s0).unwrap();
        s0.synchronize().unwrap();
        check_from_device_1("a graph's private pool", &f, &ctxs[0], &s1, output, n);
        for p in [before, after, big] {
            mm.free_device_on(p, &s0).unwrap();
        }
        plain.free_device_on(chunk, &s0).unwrap();
        mm.free_device_on(output, &s0).unwrap();
        drop((graph, pool));
        s0.synchronize().unwrap();
        println!("cumem-cuda-way: every kind reached");
        std::process::exit(0);
    }
    let Some(_ctxs) = gpus_for_test(2, name) else { return };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([crate::common::test_name(module_path!(), name).as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CUDA_WAY_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("child: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("cumem-cuda-way: every kind reached"),
        "a device-1 kernel could not reach device-0 pool memory after cuCtxEnablePeerAccess"
    );
}

/// Set in the child process of the control below.
const CONTROL_ENV: &str = "CUMEM_MULTI_GPU_CONTROL_CHILD";

#[test]
fn gpu_without_peer_access_a_device_1_kernel_faults_on_device_0_memory() {
    let name = "gpu_without_peer_access_a_device_1_kernel_faults_on_device_0_memory";
    if std::env::var_os(CONTROL_ENV).is_some() {
        // The child: no grant in this process. The fault kills device 1's
        // context, so the child reports and exits at once.
        let ctxs = gpus_for_test(2, name).expect("the parent saw two GPUs");
        let f = affine(&ctxs[1]);
        // `cuMemAlloc` memory: context peer access is what reaches it (VMM
        // mappings name every reachable device whose context is active, as
        // device 1's is here).
        let mm = MemoryManager::new(Config::new().expandable(false)).unwrap();
        let (s0, s1) = (Stream::new_on(0).unwrap(), Stream::new_on(1).unwrap());
        let p = mm.allocate_device_on(1 << 22, &s0).unwrap();
        s0.synchronize().unwrap();
        let (pp, nn) = (p, 1u64 << 20);
        let cs = s1.cudarc().unwrap();
        let mut launch = cs.launch_builder(&f);
        launch.arg(&pp).arg(&nn);
        // SAFETY: the arguments match; the access is illegal on purpose, in
        // a process of its own.
        let r = unsafe { launch.launch(LaunchConfig::for_num_elems(1 << 20)) }
            .map_err(|e| e.to_string())
            .and_then(|_| s1.synchronize().map_err(|e| e.to_string()));
        println!("cumem-control: faulted={} ({r:?})", r.is_err());
        std::process::exit(0);
    }
    let Some(_ctxs) = gpus_for_test(2, name) else { return };
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([crate::common::test_name(module_path!(), name).as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CONTROL_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("child: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("cumem-control: faulted=true"),
        "control: without peer access the device-1 kernel should fault on device-0 memory"
    );
}

#[test]
fn gpu_peer_copies_and_pinned_memory_from_device_1() {
    let Some(ctxs) = gpus_for_test(2, "gpu_peer_copies_and_pinned_memory_from_device_1") else { return };
    let _serial = serial();
    let n = 1 << 20;
    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let (s0, s1) = (Stream::new_on(0).unwrap(), Stream::new_on(1).unwrap());
    let mut a = DeviceBuffer::<f32>::new_on(n, &s0).unwrap();
    let mut b = DeviceBuffer::<f32>::new_on(n, &s1).unwrap();
    a.copy_from_host(&data).unwrap();
    // SAFETY: both buffers live past the synchronisation below.
    unsafe { b.copy_from_buffer_async(&a, &s1) }.unwrap();
    s1.synchronize().unwrap();
    assert_eq!(b.to_vec().unwrap(), data, "peer copy 0 -> 1 on a device-1 stream");
    let mut c = DeviceBuffer::<f32>::new_on_device(0, n).unwrap();
    c.copy_from_buffer(&b).unwrap();
    assert_eq!(c.to_vec().unwrap(), data, "synchronous peer copy 1 -> 0");
    assert!(b.copy_from_buffer(&DeviceBuffer::<f32>::new_on_device(0, 7).unwrap()).is_err());

    // Pinned memory (portable) is pinned for device 1's context too, and
    // async copies from and to it on a device-1 stream round-trip.
    let mm = MemoryManager::global().unwrap();
    let mut pinned: PinnedVec<f32> = PinnedVec::new_in(PinnedAlloc);
    pinned.try_reserve(n).expect("pinned memory");
    pinned.extend(data.iter().copied());
    let mut flags = 0u32;
    ctxs[1].bind_to_thread().unwrap();
    // SAFETY: `pinned` is live host memory; the call only reads the pointer.
    unsafe { sys::cuMemHostGetFlags(&mut flags, pinned.as_mut_ptr().cast()) }.result().unwrap();
    assert_ne!(flags & sys::CU_MEMHOSTALLOC_PORTABLE, 0, "portable pinned memory: flags {flags:#x}");
    let d1 = mm.allocate_device_on(n * 4, &s1).unwrap();
    let mut back: PinnedVec<f32> = PinnedVec::new_in(PinnedAlloc);
    back.try_reserve(n).unwrap();
    back.resize(n, 0.0);
    // SAFETY: both pinned vectors and `d1` live past the synchronisation.
    unsafe {
        mm.copy_to_device_async(d1, pinned.as_ptr().cast(), n * 4, &s1).unwrap();
        mm.copy_to_host_async(back.as_mut_ptr().cast(), d1, n * 4, &s1).unwrap();
    }
    s1.synchronize().unwrap();
    assert_eq!(&back[..], &data[..]);
    mm.free_device_on(d1, &s1).unwrap();
}

#[test]
fn a_mode_set_before_a_device_is_first_used_holds_for_it() {
    let mm = host_manager(2);
    mm.set_device_allocator_mode(DeviceAllocatorMode::AsyncStreamOrdered).unwrap();
    // Device 1 is created now; it takes the mode asked for, falling back to
    // the sync pool on the host as device 0 does.
    let d1 = mm.device(1).unwrap();
    assert_eq!(d1.requested_mode(), DeviceAllocatorMode::AsyncStreamOrdered);
    assert_eq!(d1.effective_mode(), mm.effective_device_allocator_mode());
}

/// Set in the child processes of the tests below: `one` (only device 0's
/// context is ever made), `follow` (device 1's is made later).
const FOLLOW_ENV: &str = "CUMEM_MULTI_GPU_FOLLOW_CHILD";

/// Whether `device`'s primary context is active in this process.
fn primary_active(device: i32) -> bool {
    let dev = cudarc::driver::result::device::get(device).unwrap();
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: both are valid out-pointers; the handle is from cuDeviceGet.
    unsafe { sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) }.result().unwrap();
    active != 0
}

/// The child of the tests below: device-0 memory (the default pool and a
/// growable buffer) mapped while only device 0's context exists names no
/// peer; with `follow`, device 1's context is then made and peer access
/// enabled the CUDA way, one cumem allocation is made on device 1, and a
/// device-1 kernel reads and writes the old memory.
fn follow_child(mode: &str) {
    let ctx0 = cumem::device::device_context(0).unwrap().expect("a GPU");
    assert!(!primary_active(1), "device 1's context exists before the test made it");
    let s0 = Stream::new_on(0).unwrap();
    let n = 3 << 18; // 3 MiB: more than one 2 MiB mapping
    let mm = MemoryManager::new(Config::new().device(0)).unwrap();
    let old = mm.allocate_device_on(n * 4, &s0).unwrap();
    let big = mm.allocate_device_on(64 << 20, &s0).unwrap();
    let mut grown = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Cuda(0), n).unwrap();
    grown.resize(n, 0).unwrap();
    s0.synchronize().unwrap();
    assert!(!primary_active(1), "cumem made device 1's context");
    assert_eq!(cumem::device::mapped_peers(0), Vec::<usize>::new(), "device 0's mappings name a peer");
    assert_eq!(grown.peers(), Vec::<usize>::new(), "the growable buffer names a peer");
    println!("cumem-follow: one GPU in use, no peer named");
    if mode == "follow" {
        // Device 1 comes into use; peer access the CUDA way.
        let ctx1 = cumem::device::device_context(1).unwrap().expect("a second GPU");
        ctx1.bind_to_thread().unwrap();
        // SAFETY: both are live primary contexts; flags must be 0.
        let rc = unsafe { sys::cuCtxEnablePeerAccess(ctx0.cu_ctx(), 0) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuCtxEnablePeerAccess");
        let f = affine(&ctx1);
        let s1 = Stream::new_on(1).unwrap();
        // One cumem allocation, on the other device: its first mapping.
        let other = mm.allocate_device_on(1 << 20, &s1).unwrap();
        if std::env::var("CUMEM_MAP_PEERS").as_deref() != Ok("off") {
            assert_eq!(cumem::device::mapped_peers(0), vec![1]);
            assert_eq!(grown.peers(), vec![1]);
        }
        check_from_device_1("the default pool, mapped before device 1's context existed", &f, &ctx0, &s1, old, n);
        check_from_device_1("a 64 MiB mapping made before it", &f, &ctx0, &s1, big, n);
        check_from_device_1("a growable buffer mapped before it", &f, &ctx0, &s1, grown.device_ptr(), n);
        grown.resize(4 * n, 0).unwrap();
        let tail = grown.device_ptr() + (3 * n * 4) as u64;
        check_from_device_1("the growable buffer's growth", &f, &ctx0, &s1, tail, n);
        mm.free_device_on(other, &s1).unwrap();
        s1.synchronize().unwrap();
        println!("cumem-follow: old memory reached from device 1");
    }
    mm.free_device_on(old, &s0).unwrap();
    mm.free_device_on(big, &s0).unwrap();
    s0.synchronize().unwrap();
    std::process::exit(0);
}

/// Runs test `name` in a child process with `FOLLOW_ENV=mode` and the
/// extra environment `env`; returns its stdout and stderr.
fn run_follow_child(name: &str, mode: &str, env: &[(&str, &str)]) -> (String, String) {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([crate::common::test_name(module_path!(), name).as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(FOLLOW_ENV, mode);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("child ({mode} {env:?}): {stdout}\n{stderr}");
    (stdout.into_owned(), stderr.into_owned())
}

/// A process that uses one GPU (only device 0's context exists, as in a
/// DDP rank) maps for no peer: no `cuMemSetAccess` names device 1, so it
/// pays nothing for it, and cumem never makes device 1's context.
#[test]
fn gpu_a_process_using_one_gpu_maps_for_no_peer() {
    let name = "gpu_a_process_using_one_gpu_maps_for_no_peer";
    if let Ok(mode) = std::env::var(FOLLOW_ENV) {
        follow_child(&mode);
    }
    let Some(_ctxs) = gpus_for_test(2, name) else { return };
    let (stdout, _) = run_follow_child(name, "one", &[("CUMEM_MAP_PEERS", "active")]);
    assert!(stdout.contains("cumem-follow: one GPU in use, no peer named"), "a one-GPU process named a peer");
}

/// Memory mapped on device 0 before device 1's context exists; then the
/// program makes device 1's context, enables peer access the CUDA way and
/// makes one cumem allocation (on device 1): a device-1 kernel reads the
/// old memory, as cumem followed the newly active peer.
#[test]
fn gpu_memory_mapped_before_a_peer_context_existed_is_reached_after_the_next_mapping() {
    let name = "gpu_memory_mapped_before_a_peer_context_existed_is_reached_after_the_next_mapping";
    if let Ok(mode) = std::env::var(FOLLOW_ENV) {
        follow_child(&mode);
    }
    let Some(_ctxs) = gpus_for_test(2, name) else { return };
    let (stdout, _) = run_follow_child(name, "follow", &[]);
    assert!(
        stdout.contains("cumem-follow: old memory reached from device 1"),
        "device 1 could not reach device-0 memory mapped before its context existed"
    );
}

/// Control of the test above: with the follow off (`CUMEM_MAP_PEERS=off`)
/// the same child's device-1 kernel faults (`CUDA_ERROR_ILLEGAL_ADDRESS`)
/// on the old memory.
#[test]
fn control_gpu_without_the_follow_old_memory_is_not_reached() {
    let name = "control_gpu_without_the_follow_old_memory_is_not_reached";
    if let Ok(mode) = std::env::var(FOLLOW_ENV) {
        follow_child(&mode);
    }
    let Some(_ctxs) = gpus_for_test(2, name) else { return };
    let (stdout, stderr) = run_follow_child(name, "follow", &[("CUMEM_MAP_PEERS", "off")]);
    assert!(stdout.contains("cumem-follow: one GPU in use, no peer named"), "the child did not get going");
    assert!(!stdout.contains("cumem-follow: old memory reached"), "control: reached with the follow off");
    assert!(stderr.contains("ILLEGAL_ADDRESS"), "control: the child failed for another reason");
}
