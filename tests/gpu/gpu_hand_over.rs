//! GPU test of one address space per device (`pool/handover.rs`): a
//! thread fills blocks of its arena with a kernel, frees most of them on
//! its stream and ends; the main thread's arena then needs memory and
//! takes the idle arena's mapped range with no map call. A kernel writes
//! the new block, and the giver's block that stayed live keeps its
//! contents: both are read back and compared with what the host computes.
//! The control (`arenas_hand_over=false`) maps new memory instead. Skips
//! without a GPU; fails instead under `CUMEM_REQUIRE_GPU=1`.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::{Config, MemoryManager, Stream};

const KERNEL: &str = r#"
extern "C" __global__ void pattern(unsigned int* p, unsigned int seed, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = (unsigned int)(i * 2654435761ULL) ^ seed;
}
"#;

const MIB: usize = 1 << 20;

struct Kernel {
    f: CudaFunction,
    _module: Arc<CudaModule>,
}

fn kernel(ctx: &Arc<CudaContext>) -> Kernel {
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL).expect("NVRTC compiles the test kernel");
    let module = ctx.load_module(ptx).expect("the module loads");
    Kernel { f: module.load_function("pattern").unwrap(), _module: module }
}

/// Writes the pattern of `seed` over `bytes` at `p` on `s`.
fn pattern(k: &Kernel, s: &Stream, p: u64, bytes: usize, seed: u32) {
    let n = (bytes / 4) as u64;
    let mut l = s.cudarc().unwrap().launch_builder(&k.f);
    l.arg(&p).arg(&seed).arg(&n);
    // SAFETY: the arguments match the kernel; `p` holds `bytes` bytes and
    // stays live until the stream is synchronised.
    unsafe { l.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
}

/// Whether `bytes` at `p` hold the pattern of `seed` (its writer was
/// synchronised).
fn holds(p: u64, bytes: usize, seed: u32) -> bool {
    let mut v = vec![0u32; bytes / 4];
    // SAFETY: `v` holds `bytes` bytes; `p` is a live device block of that
    // size whose writers were synchronised.
    unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), p, bytes) }.result().unwrap();
    v.iter().enumerate().all(|(i, &x)| x == ((i as u64).wrapping_mul(2654435761) as u32) ^ seed)
}

/// Returns the ranges handed over and the map calls the main thread's
/// allocation made.
fn run(ctx: &Arc<CudaContext>, hand_over: bool) -> (u64, u64) {
    let k = kernel(ctx);
    let mm = MemoryManager::new(Config::new().arenas(2).arenas_hand_over(hand_over)).unwrap();
    let set = mm.default_device().unwrap().pool();
    let main_stream = Stream::new().unwrap();
    let first = mm.allocate_device_on(MIB, &main_stream).unwrap();
    let kept = std::thread::scope(|s| {
        s.spawn(|| {
            ctx.bind_to_thread().unwrap();
            let stream = Stream::new().unwrap();
            let blocks: Vec<u64> = (0..8).map(|_| mm.allocate_device_on(8 * MIB, &stream).unwrap()).collect();
            for (i, &b) in blocks.iter().enumerate() {
                pattern(&k, &stream, b, 8 * MIB, 100 + i as u32);
            }
            for &b in &blocks[1..] {
                mm.free_device_on(b, &stream).unwrap();
            }
            stream.synchronize().unwrap();
            cumem::pool::release_thread_shards();
            blocks[0]
        })
        .join()
        .unwrap()
    });
    let maps = mm.device_stats(0).unwrap().pool.map_calls;
    let big = mm.allocate_device_on(48 * MIB, &main_stream).unwrap();
    let maps = mm.device_stats(0).unwrap().pool.map_calls - maps;
    pattern(&k, &main_stream, big, 48 * MIB, 7);
    main_stream.synchronize().unwrap();
    assert!(holds(big, 48 * MIB, 7), "the new block holds what its kernel wrote");
    assert!(holds(kept, 8 * MIB, 100), "the giver's live block kept its contents");
    set.check_invariants().unwrap();
    let handed = set.ranges_handed_over().0;
    for p in [big, kept, first] {
        mm.free_device_on(p, &main_stream).unwrap();
    }
    main_stream.synchronize().unwrap();
    (handed, maps)
}

/// An idle arena's mapped range serves another arena's request with no
/// map call, and the memory works on the device; with hand-over off the
/// same request maps memory.
#[test]
fn an_idle_arenas_mapped_range_serves_another_arena_on_the_device() {
    let Some(ctx) = gpu_for_test("gpu_hand_over::an_idle_arenas_mapped_range_serves_another_arena_on_the_device")
    else {
        return;
    };
    ctx.bind_to_thread().unwrap();
    let (handed, maps) = run(&ctx, true);
    assert_eq!((handed, maps), (1, 0), "one range handed over, no map call");
    let (handed, maps) = run(&ctx, false);
    assert_eq!(handed, 0, "no range handed over with hand-over off");
    assert!(maps > 0, "without hand-over the request maps memory");
}

/// Runs the trim's scenario on the device with `idle_arenas_trim` as
/// given; returns the memory the device's arenas held before the other
/// thread's exit and after it, the pages the exit unmapped and the unmaps
/// the driver-call counters saw on the exiting thread.
fn exit_trim(ctx: &Arc<CudaContext>, trim: bool) -> (usize, usize, usize, u64) {
    let k = kernel(ctx);
    // As a program builds it: from `CUMEM_CONF`, two arenas.
    let config = Config::from_env().expect("CUMEM_CONF parses").arenas(2).idle_arenas_trim(trim);
    let mm = MemoryManager::new(config).unwrap();
    let set = mm.default_device().unwrap().pool();
    let main_stream = Stream::new().unwrap();
    let first = mm.allocate_device_on(MIB, &main_stream).unwrap();
    let (go, done) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    let (wide, kept, held, exit_unmaps) = std::thread::scope(|s| {
        let other = s.spawn(|| {
            ctx.bind_to_thread().unwrap();
            let stream = Stream::new().unwrap();
            let blocks: Vec<u64> = (0..8).map(|_| mm.allocate_device_on(8 * MIB, &stream).unwrap()).collect();
            for (i, &b) in blocks.iter().enumerate() {
                pattern(&k, &stream, b, 8 * MIB, 100 + i as u32);
            }
            blocks.iter().step_by(2).for_each(|&b| mm.free_device_on(b, &stream).unwrap());
            go.wait();
            done.wait();
            // All but the second block go; that one stays live through
            // the exit's trim.
            blocks.iter().skip(3).step_by(2).for_each(|&b| mm.free_device_on(b, &stream).unwrap());
            stream.synchronize().unwrap();
            let held = mm.device_stats(0).unwrap().pool.mapped;
            let before = cumem::cuda::vmm::driver_calls();
            cumem::pool::release_thread_shards();
            let after = cumem::cuda::vmm::driver_calls();
            // The main thread waits on the join: the calls are this exit's.
            (blocks[1], held, after.since(&before).allocating.unmap)
        });
        go.wait();
        // No 8 MiB hole holds this: the set maps more than its peak.
        let wide = mm.allocate_device_on(24 * MIB, &main_stream);
        done.wait();
        let (kept, held, unmaps) = other.join().unwrap();
        (wide.unwrap(), kept, held, unmaps)
    });
    let after = mm.device_stats(0).unwrap().pool.mapped;
    pattern(&k, &main_stream, wide, 24 * MIB, 7);
    main_stream.synchronize().unwrap();
    assert!(holds(wide, 24 * MIB, 7), "the main thread's block holds what its kernel wrote");
    assert!(holds(kept, 8 * MIB, 101), "the exiting thread's live block kept its contents");
    set.check_invariants().unwrap();
    // The arenas serve their peak again, and the memory works.
    let again: Vec<u64> = (0..8).map(|_| mm.allocate_device_on(8 * MIB, &main_stream).unwrap()).collect();
    for (i, &b) in again.iter().enumerate() {
        pattern(&k, &main_stream, b, 8 * MIB, 200 + i as u32);
    }
    main_stream.synchronize().unwrap();
    for (i, &b) in again.iter().enumerate() {
        assert!(holds(b, 8 * MIB, 200 + i as u32), "block {i} served after the trim holds what its kernel wrote");
    }
    let trimmed = set.bytes_reclaimed();
    for p in again.into_iter().chain([wide, kept, first]) {
        mm.free_device_on(p, &main_stream).unwrap();
    }
    main_stream.synchronize().unwrap();
    set.check_invariants().unwrap();
    (held, after, trimmed, exit_unmaps)
}

/// With `idle_arenas_trim=true`, a thread's exit that leaves its arena
/// idle unmaps (on the exiting thread) what the device's arenas hold
/// above 102 % of the most pages their blocks touched at once: the
/// memory held falls, stays at or above that peak, the exiting thread's
/// live block and the other thread's keep their contents, and the arenas
/// serve their peak again. By default nothing is unmapped.
#[test]
fn a_threads_exit_trims_a_devices_arenas_on_the_device() {
    let Some(ctx) = gpu_for_test("gpu_hand_over::a_threads_exit_trims_a_devices_arenas_on_the_device") else {
        return;
    };
    ctx.bind_to_thread().unwrap();
    // The peak: the first block's page and the other thread's 64 MiB.
    let floor = 66 * MIB;
    let (held, after, trimmed, unmaps) = exit_trim(&ctx, true);
    eprintln!(
        "trim on: {} MiB held before the exit, {} after, {} MiB given back",
        held / MIB,
        after / MIB,
        trimmed >> 20
    );
    assert!(held >= floor + 16 * MIB, "held {} MiB before the exit", held / MIB);
    assert!(after < held && trimmed > 0, "the exit gave nothing back ({} MiB)", after / MIB);
    assert!(after >= floor, "{} MiB held after the exit: below the peak's pages", after / MIB);
    assert!(unmaps > 0, "the exiting thread made no unmap call");
    let (held, after, trimmed, unmaps) = exit_trim(&ctx, false);
    eprintln!("trim off: {} MiB held before the exit, {} after", held / MIB, after / MIB);
    assert_eq!((after, trimmed, unmaps), (held, 0, 0), "without the trim the exit keeps everything");
}
