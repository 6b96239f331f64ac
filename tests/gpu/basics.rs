//! GPU tests: real device memory, kernels from NVRTC, streams, the three
//! modes, the native pool's attributes, out of memory. Each skips with a
//! printed reason without a GPU, and fails instead under
//! `CUMEM_REQUIRE_GPU=1`.

use crate::common;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::{Config, DeviceAllocatorMode, DeviceBuffer, Error, MemoryManager, PinnedAlloc, PinnedVec, Stream};

const KERNELS: &str = r#"
extern "C" __global__ void fill(unsigned int* p, unsigned int v, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
extern "C" __global__ void fill_then_spin(unsigned int* p, unsigned int v, unsigned long long n, long long cycles) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void saxpy(float* y, const float* x, float a, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

/// A configuration on the default device (`CUMEM_CONF`'s `device`), the
/// device `gpu_for_test` hands out: the suite runs on device 1 with
/// `CUMEM_CONF=device=1`, and kernels only touch their own device's memory.
fn config() -> Config {
    Config::new().device(Config::from_env().map_or(0, |c| c.device))
}

fn module(ctx: &Arc<CudaContext>) -> Arc<CudaModule> {
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernels");
    ctx.load_module(ptx).expect("the module loads")
}

fn func(m: &Arc<CudaModule>, name: &str) -> CudaFunction {
    m.load_function(name).expect("kernel exists")
}

/// GPU tests run one at a time: one of them fills the device.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

#[test]
fn device_buffer_is_a_kernel_argument() {
    let Some(ctx) = gpu_for_test("device_buffer_is_a_kernel_argument") else { return };
    let _serial = serial();
    let m = module(&ctx);
    let saxpy = func(&m, "saxpy");
    let n = 1 << 20;
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let ys: Vec<f32> = (0..n).map(|i| 1.0 + i as f32).collect();
    let stream = Stream::new().unwrap();
    let x = DeviceBuffer::from_host(&xs).unwrap();
    let y = DeviceBuffer::from_host(&ys).unwrap();
    let (yp, xp, a, nn) = (y.device_ptr(), x.device_ptr(), 2.0f32, n as u64);
    let s = stream.cudarc().unwrap();
    let mut launch = s.launch_builder(&saxpy);
    launch.arg(&yp).arg(&xp).arg(&a).arg(&nn);
    // SAFETY: the kernel's signature matches the arguments; both buffers
    // hold `n` floats and live until after the stream is synchronised.
    unsafe { launch.launch(cfg(n)) }.unwrap();
    stream.synchronize().unwrap();
    let out = y.to_vec().unwrap();
    for i in (0..n).step_by(4099) {
        assert_eq!(out[i], 2.0 * i as f32 + 1.0 + i as f32, "element {i}");
    }
}

#[test]
fn reuse_on_another_stream_waits_for_the_first() {
    let Some(ctx) = gpu_for_test("reuse_on_another_stream_waits_for_the_first") else { return };
    let _serial = serial();
    // A manager of its own, so the free block B gets is predictable.
    let mm = MemoryManager::new(config()).unwrap();
    let m = module(&ctx);
    let fill = func(&m, "fill");
    let spin = func(&m, "fill_then_spin");
    let n = 1usize << 16;
    let bytes = n * 4;
    let a = Stream::new().unwrap();
    let b = Stream::new().unwrap();
    let a_result = mm.allocate_device(bytes).unwrap();
    let b_result = mm.allocate_device(bytes).unwrap();

    // Stream A writes 0xA into the buffer, works for a while, then copies the
    // buffer out: if B's write landed meanwhile, A's copy would see it.
    let buf = mm.allocate_device_on(bytes, &a).unwrap();
    let (va, nn, cycles) = (0xAu32, n as u64, 400_000_000i64);
    let sa = a.cudarc().unwrap();
    let mut launch = sa.launch_builder(&spin);
    launch.arg(&buf).arg(&va).arg(&nn).arg(&cycles);
    // SAFETY: arguments match the kernel; the buffer holds `n` values.
    unsafe { launch.launch(cfg(n)) }.unwrap();
    // SAFETY: both ranges are `bytes`-long device allocations.
    unsafe { cudarc::driver::sys::cuMemcpyDtoDAsync_v2(a_result, buf, bytes, a.cu_stream()) }.result().unwrap();
    mm.free_device_on(buf, &a).unwrap(); // in stream order on A

    // B gets the same block at once and writes 0xB.
    let reused = mm.allocate_device_on(bytes, &b).unwrap();
    assert_eq!(reused, buf, "best fit hands the freed block to B");
    let vb = 0xBu32;
    let sb = b.cudarc().unwrap();
    let mut launch = sb.launch_builder(&fill);
    launch.arg(&reused).arg(&vb).arg(&nn);
    // SAFETY: as above.
    unsafe { launch.launch(cfg(n)) }.unwrap();
    // SAFETY: as above.
    unsafe { cudarc::driver::sys::cuMemcpyDtoDAsync_v2(b_result, reused, bytes, b.cu_stream()) }.result().unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    let read = |p: u64| {
        let mut v = vec![0u32; n];
        // SAFETY: `v` holds `n` values; the streams are idle.
        unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), p, bytes) }.result().unwrap();
        v
    };
    assert!(read(a_result).iter().all(|&v| v == 0xA), "A's data was overwritten by B");
    assert!(read(b_result).iter().all(|&v| v == 0xB), "B's data is wrong");

    // Control: the same race without the allocator's ordering (B writes the
    // address straight away) does corrupt A's copy, so the check above can
    // fail.
    let mut launch = sa.launch_builder(&spin);
    launch.arg(&reused).arg(&va).arg(&nn).arg(&cycles);
    // SAFETY: as above.
    unsafe { launch.launch(cfg(n)) }.unwrap();
    // SAFETY: as above.
    unsafe { cudarc::driver::sys::cuMemcpyDtoDAsync_v2(a_result, reused, bytes, a.cu_stream()) }.result().unwrap();
    let mut launch = sb.launch_builder(&fill);
    launch.arg(&reused).arg(&vb).arg(&nn);
    // SAFETY: as above.
    unsafe { launch.launch(cfg(n)) }.unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert!(read(a_result).contains(&0xB), "control: an unordered write should have raced");
    for p in [reused, a_result, b_result] {
        mm.free_device(p).unwrap();
    }
}

#[test]
fn every_mode_allocates_real_device_memory() {
    let Some(ctx) = gpu_for_test("every_mode_allocates_real_device_memory") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config()).unwrap();
    assert!(mm.supports_async_device_allocator(), "H100/H200 support memory pools");
    let stream = Stream::from_cudarc(ctx.new_stream().unwrap());
    let mut live = Vec::new();
    for mode in DeviceAllocatorMode::ALL {
        assert_eq!(mm.set_device_allocator_mode(mode).unwrap(), mode);
        let n = 1 << 18;
        let data: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2654435761) ^ mode as u32).collect();
        let d = mm.allocate_device_on(n * 4, &stream).unwrap();
        let d2 = mm.allocate_device(n * 4).unwrap();
        // SAFETY: `data` lives until the synchronisation below; `d` holds n u32.
        unsafe { mm.copy_to_device_async(d, data.as_ptr().cast(), n * 4, &stream) }.unwrap();
        let mut back = vec![0u32; n];
        // SAFETY: `back` lives until the synchronisation below.
        unsafe { mm.copy_to_host_async(back.as_mut_ptr().cast(), d, n * 4, &stream) }.unwrap();
        stream.synchronize().unwrap();
        assert_eq!(back, data, "round trip in mode {mode}");
        mm.free_device_on(d, &stream).unwrap();
        live.push((mode, d2));
    }
    // Switch modes with allocations live: each is freed by the mode that made it.
    mm.set_device_allocator_mode(DeviceAllocatorMode::SyncPool).unwrap();
    for (mode, d) in live {
        mm.free_device(d).unwrap_or_else(|e| panic!("freeing a {mode} allocation: {e}"));
    }
    let st = mm.device_stats(mm.config().device).unwrap();
    assert_eq!(st.stream_ordered.live, 0);
    assert_eq!(st.pool.live_blocks, 0);
    assert!(st.native_pool.is_some() && st.default_pool.is_some());
    let e = mm.free_device(12345).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer { .. }), "{e}");
    println!("{}", mm.memory_summary());
}

#[test]
fn native_pool_attributes_trim_and_high_water() {
    let Some(ctx) = gpu_for_test("native_pool_attributes_trim_and_high_water") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config().mode(DeviceAllocatorMode::CudaAsyncPool).release_threshold(u64::MAX)).unwrap();
    let stream = Stream::from_cudarc(ctx.new_stream().unwrap());
    let ptrs: Vec<u64> = (0..8).map(|_| mm.allocate_device_on(32 << 20, &stream).unwrap()).collect();
    let dev = mm.device(mm.config().device).unwrap();
    let attrs = dev.native_pool().unwrap().attributes().unwrap();
    assert!(attrs.used_current >= 256 << 20, "{attrs:?}");
    assert!(attrs.reserved_current >= attrs.used_current, "{attrs:?}");
    assert_eq!(attrs.release_threshold, u64::MAX);
    for p in ptrs {
        mm.free_device_on(p, &stream).unwrap();
    }
    stream.synchronize().unwrap();
    let after = dev.native_pool().unwrap().attributes().unwrap();
    assert_eq!(after.used_current, 0, "{after:?}");
    assert!(after.reserved_current >= 256 << 20, "the release threshold keeps memory cached: {after:?}");
    assert!(after.used_high >= 256 << 20);
    dev.native_pool().unwrap().trim_to(0).unwrap();
    let trimmed = dev.native_pool().unwrap().attributes().unwrap();
    assert_eq!(trimmed.reserved_current, 0, "trim_to(0) releases everything free: {trimmed:?}");
    dev.native_pool().unwrap().reset_high_watermarks().unwrap();
    let reset = dev.native_pool().unwrap().attributes().unwrap();
    assert_eq!(reset.used_high, 0, "{reset:?}");
}

#[test]
fn pinned_pool_is_page_locked_memory() {
    let Some(ctx) = gpu_for_test("pinned_pool_is_page_locked_memory") else { return };
    let _serial = serial();
    let mm = MemoryManager::global().unwrap();
    // The fallible form: a refusal fails the test with its reason instead
    // of aborting the whole binary in `handle_alloc_error`.
    let mut v: PinnedVec<u8> = PinnedVec::new_in(PinnedAlloc);
    v.try_reserve_exact(1 << 20).unwrap_or_else(|e| panic!("{e:?}: {:?}", PinnedAlloc::last_error()));
    v.resize(1 << 20, 3);
    let mut flags = 0u32;
    ctx.bind_to_thread().unwrap();
    // SAFETY: `v` is live host memory; the call only reads the pointer.
    let r = unsafe { cudarc::driver::sys::cuMemHostGetFlags(&mut flags, v.as_mut_ptr().cast()) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS, "the driver knows the PinnedVec's memory as pinned");
    assert!(mm.pinned_stats().reserved >= 1 << 20);
}

#[test]
fn out_of_memory_is_recoverable_and_nothing_leaks() {
    let Some(ctx) = gpu_for_test("out_of_memory_is_recoverable_and_nothing_leaks") else { return };
    let _serial = serial();
    let (free_before, _) = ctx.mem_get_info().unwrap();
    let mm = MemoryManager::new(config().expandable(false)).unwrap();
    let chunk = 1usize << 30;
    let mut held = Vec::new();
    let err = loop {
        match mm.allocate_device(chunk) {
            Ok(p) => held.push(p),
            Err(e) => break e,
        }
        assert!(held.len() < 4096, "the device never ran out");
    };
    match &err {
        Error::OutOfMemory { requested, state, .. } => {
            assert_eq!(*requested, chunk);
            assert!(state.in_use >= held.len() * chunk);
            assert!(state.device_free.is_some(), "{err}");
        }
        other => panic!("expected OutOfMemory, got {other}"),
    }
    println!("filled {} GiB, then: {err}", held.len());
    for p in held.drain(..) {
        mm.free_device(p).unwrap();
    }
    // Allocating again works (cached memory is reused).
    let p = mm.allocate_device(chunk).unwrap();
    mm.free_device(p).unwrap();
    mm.release_cached().unwrap();
    let (free_after, _) = ctx.mem_get_info().unwrap();
    assert!(
        free_after + (64 << 20) >= free_before,
        "device free memory returns to where it started: {free_before} before, {free_after} after"
    );
}

use common::CHECK;

fn check_kernel(ctx: &Arc<CudaContext>) -> CudaFunction {
    let ptx = cudarc::nvrtc::compile_ptx(CHECK).expect("NVRTC compiles the check kernel");
    let m = ctx.load_module(ptx).expect("module loads");
    m.load_function("fill_spin_check").expect("kernel exists")
}

/// 400 random allocations across four streams (some stream-less, some
/// stream-less frees after a sync), each checked by [`CHECK`]; returns the
/// elements overwritten early (0 when every reuse was ordered) and the
/// bytes the pool's thread caches held once the last blocks were freed.
fn random_rounds(ctx: &Arc<CudaContext>, mm: &MemoryManager, streams: &[Stream]) -> (u64, usize) {
    use rand::{Rng, SeedableRng};
    let f = check_kernel(ctx);
    let errors = mm.allocate_device(8).unwrap();
    // SAFETY: `errors` is an 8-byte device allocation.
    unsafe { cudarc::driver::sys::cuMemsetD8_v2(errors, 0, 8) }.result().unwrap();
    ctx.synchronize().unwrap(); // the memset ran on the legacy stream
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut live: Vec<(u64, usize)> = Vec::new();
    for round in 0..400u32 {
        if live.len() > 6 || (!live.is_empty() && rng.gen_bool(0.5)) {
            let (p, s) = live.swap_remove(rng.gen_range(0..live.len()));
            if rng.gen_bool(0.15) {
                // A stream-less free is allowed once the stream is idle.
                streams[s].synchronize().unwrap();
                mm.free_device(p).unwrap();
            } else {
                mm.free_device_on(p, &streams[s]).unwrap();
            }
        }
        let s = rng.gen_range(0..streams.len());
        let n = [1usize << 12, 1 << 14, 1 << 16][rng.gen_range(0..3)];
        let p = if rng.gen_bool(0.1) {
            mm.allocate_device(n * 4).unwrap()
        } else {
            mm.allocate_device_on(n * 4, &streams[s]).unwrap()
        };
        let (v, nn, cycles) = (round + 1, n as u64, rng.gen_range(100_000i64..2_000_000));
        let cs = streams[s].cudarc().unwrap();
        let mut launch = cs.launch_builder(&f);
        launch.arg(&p).arg(&v).arg(&nn).arg(&cycles).arg(&errors);
        // SAFETY: the arguments match the kernel; `p` holds `n` u32 and is
        // freed only in stream order after this launch.
        unsafe { launch.launch(cfg(n)) }.unwrap();
        live.push((p, s));
    }
    for (p, s) in live {
        mm.free_device_on(p, &streams[s]).unwrap();
    }
    let cached = mm.default_device().unwrap().pool().stats().cached;
    for s in streams {
        s.synchronize().unwrap();
    }
    let mut count = 0u64;
    // SAFETY: `count` is 8 writable bytes; every stream is idle.
    unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2((&mut count as *mut u64).cast(), errors, 8) }.result().unwrap();
    mm.free_device(errors).unwrap();
    (count, cached)
}

#[test]
fn random_cross_stream_reuse_with_thread_caches_never_races() {
    let name = "random_cross_stream_reuse_with_thread_caches_never_races";
    let Some(ctx) = gpu_for_test(name) else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config().device_thread_cache(true)).unwrap();
    let streams: Vec<Stream> = (0..4).map(|_| Stream::new().unwrap()).collect();
    let (count, cached) = random_rounds(&ctx, &mm, &streams);
    assert_eq!(count, 0, "{count} elements were overwritten by a premature reuse");
    assert!(cached > 0, "blocks freed on streams were cached");
}

#[test]
fn random_cross_stream_reuse_never_races() {
    let Some(ctx) = gpu_for_test("random_cross_stream_reuse_never_races") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config()).unwrap();
    let streams: Vec<Stream> = (0..4).map(|_| Stream::new().unwrap()).collect();
    let (mut count, _) = random_rounds(&ctx, &mm, &streams);
    assert_eq!(count, 0, "{count} elements were overwritten by a premature reuse");
    let f = check_kernel(&ctx);
    let errors = mm.allocate_device(8).unwrap();

    // Control: break the contract (a stream-less free while the kernel
    // still runs) and the check must see the race. A fresh manager, so no
    // stream tag from the rounds above orders the two kernels by chance.
    // SAFETY: as above.
    unsafe { cudarc::driver::sys::cuMemsetD8_v2(errors, 0, 8) }.result().unwrap();
    ctx.synchronize().unwrap();
    let fresh = MemoryManager::new(config()).unwrap();
    let n = 1usize << 16;
    let (nn, cycles) = (n as u64, 20_000_000i64);
    let a = fresh.allocate_device_on(n * 4, &streams[0]).unwrap();
    let sa = streams[0].cudarc().unwrap();
    let mut launch = sa.launch_builder(&f);
    let va = 0xAAu32;
    launch.arg(&a).arg(&va).arg(&nn).arg(&cycles).arg(&errors);
    // SAFETY: as above; the early free below is the point of the control.
    unsafe { launch.launch(cfg(n)) }.unwrap();
    fresh.free_device(a).unwrap();
    let b = fresh.allocate_device_on(n * 4, &streams[1]).unwrap();
    assert_eq!(a, b, "best fit hands the same block to the second stream");
    let sb = streams[1].cudarc().unwrap();
    let mut launch = sb.launch_builder(&f);
    let vb = 0xBBu32;
    launch.arg(&b).arg(&vb).arg(&nn).arg(&cycles).arg(&errors);
    // SAFETY: as above.
    unsafe { launch.launch(cfg(n)) }.unwrap();
    for s in &streams {
        s.synchronize().unwrap();
    }
    // SAFETY: as above.
    unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2((&mut count as *mut u64).cast(), errors, 8) }.result().unwrap();
    assert!(count > 0, "control: a premature reuse should have been detected");
    fresh.free_device(b).unwrap();
    mm.free_device(errors).unwrap();
}

#[path = "../support/faults.rs"]
mod faults;

/// Device bytes reached with the driver's memset and copy, on the block's
/// stream.
struct GpuBytes;

impl faults::DeviceBytes for GpuBytes {
    fn fill(&self, addr: u64, len: usize, value: u8, stream: &Stream) {
        // SAFETY: the workload passes bytes of a live block it owns; the
        // stream is alive.
        unsafe { cudarc::driver::result::memset_d8_async(addr, value, len, stream.cu_stream()) }.unwrap();
    }
    fn read(&self, addr: u64, len: usize, stream: &Stream) -> Vec<u8> {
        let mut out = vec![0u8; len];
        // SAFETY: as above; `out` outlives the copy (the stream is
        // synchronised before it is read).
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut out, addr, stream.cu_stream()) }.unwrap();
        stream.synchronize().unwrap();
        out
    }
}

/// The driver calls fail at random (cuMemCreate, cuMemMap, cuMemSetAccess,
/// cuMemAddressReserve, cuMemHostAlloc, cuEventRecord, cuStreamQuery), at
/// least 1,000 times (`CUMEM_FAULTS_TARGET` sets another count) over
/// fixed seeds, on three streams with frees across them: every failure is
/// a typed error, the pools' invariants hold after each step, no live
/// block is handed out twice or loses its contents, and reserved memory
/// returns to its start once everything is freed and released.
#[test]
fn a_thousand_injected_driver_failures_break_nothing_on_the_gpu() {
    let Some(ctx) = gpu_for_test("a_thousand_injected_driver_failures_break_nothing_on_the_gpu") else { return };
    let _serial = serial();
    ctx.bind_to_thread().unwrap();
    let target: u64 = std::env::var("CUMEM_FAULTS_TARGET").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let mut total = faults::Outcome::default();
    for seed in 0..200 {
        let mm = MemoryManager::new(config()).unwrap();
        let device = mm.config().device;
        let streams: Vec<Stream> = (0..3).map(|_| Stream::new_on(device).unwrap()).collect();
        let o = faults::run(&mm, device, &streams, &GpuBytes, seed, 2_000, 0.1);
        total.ops += o.ops;
        total.injected += o.injected;
        total.errors += o.errors;
        if total.injected >= target {
            break;
        }
    }
    println!("GPU fault injection: {total:?}");
    assert!(total.injected >= target, "only {} failures injected", total.injected);
    assert!(total.errors > 0, "no failure reached the caller");
}
