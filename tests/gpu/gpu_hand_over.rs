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
