//! GPU variant of `tests/host/training_threads.rs`: a threaded training
//! loop on the device pool with the library's default configuration. The
//! forward pass runs on the main thread, the backward pass on a thread of
//! its own (autograd's), both on one stream; the backward thread frees
//! the forward's activations, the main thread frees the backward's
//! gradients (zero_grad), each thread keeps a workspace for good
//! (cuBLAS's), shapes change from step to step (batch x length), and now
//! and then the cached memory is released (empty_cache). A kernel writes
//! a pattern unique to each block into every byte after it is allocated,
//! and another checks every byte before it is freed, counting mismatches
//! on the device: a live block whose pages were unmapped faults (the
//! stream's sync fails), and two live blocks that overlap count
//! mismatches. Skips without a GPU; fails instead under
//! `CUMEM_REQUIRE_GPU=1`.

use std::sync::mpsc;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::{Config, MemoryManager, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const KERNELS: &str = r#"
__device__ unsigned char byte_of(unsigned long long id, unsigned long long i) {
    unsigned long long x = (id * 0x9E3779B97F4A7C15ULL) ^ (i >> 2);
    x ^= x >> 29;
    return (unsigned char)((x >> (8 * (i & 3))) | 1);
}
extern "C" __global__ void fill(unsigned char* p, unsigned long long id, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        p[i] = byte_of(id, i);
    }
}
extern "C" __global__ void check(const unsigned char* p, unsigned long long id, unsigned long long n,
                                 unsigned long long* errors) {
    unsigned long long bad = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        if (p[i] != byte_of(id, i)) bad++;
    }
    if (bad) atomicAdd(errors, bad);
}
"#;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// The fill and check kernels (`gpu_unmapped_pages.rs` uses them too).
pub(super) struct Kernels {
    pub(super) fill: CudaFunction,
    pub(super) check: CudaFunction,
    _module: Arc<CudaModule>,
}

pub(super) fn kernels(ctx: &Arc<CudaContext>) -> Kernels {
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernels");
    let module = ctx.load_module(ptx).expect("the module loads");
    Kernels {
        fill: module.load_function("fill").unwrap(),
        check: module.load_function("check").unwrap(),
        _module: module,
    }
}

pub(super) fn grid(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// A live block and the id its pattern is made of.
struct Live {
    ptr: u64,
    size: usize,
    id: u64,
}

/// What every thread of the loop shares.
struct Ctx<'a> {
    mm: &'a MemoryManager,
    stream: Stream,
    k: &'a Kernels,
    /// A device counter of mismatched bytes.
    errors: u64,
    next_id: std::sync::atomic::AtomicU64,
}

impl Ctx<'_> {
    fn alloc(&self, size: usize) -> Live {
        let ptr = self.mm.allocate_device_on(size, &self.stream).unwrap();
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let n = size as u64;
        let mut l = self.stream.cudarc().unwrap().launch_builder(&self.k.fill);
        l.arg(&ptr).arg(&id).arg(&n);
        // SAFETY: the arguments match the kernel; `ptr` holds `size` bytes
        // and stays live until a later launch on the same stream checks
        // it, before it is freed on that stream.
        unsafe { l.launch(grid(n)) }.unwrap();
        Live { ptr, size, id }
    }

    fn check(&self, b: &Live) {
        let n = b.size as u64;
        let mut l = self.stream.cudarc().unwrap().launch_builder(&self.k.check);
        l.arg(&b.ptr).arg(&b.id).arg(&n).arg(&self.errors);
        // SAFETY: as in `alloc`; `errors` is a live 8-byte device counter.
        unsafe { l.launch(grid(n)) }.unwrap();
    }

    fn free(&self, b: Live) {
        self.check(&b);
        self.mm.free_device_on(b.ptr, &self.stream).unwrap();
    }
}

struct Step {
    activations: Vec<Live>,
    scale: usize,
}

/// Per layer, the activations a BERT-like encoder saves at `scale`
/// tokens (hidden vectors of 2 KiB: 1024 wide in fp16).
fn activation_sizes(layers: usize, scale: usize, rng: &mut SmallRng) -> Vec<usize> {
    let hidden = 2 * KIB;
    let mut out = Vec::new();
    for _ in 0..layers {
        out.extend([scale * hidden, scale * hidden, scale * hidden]);
        out.push(scale * 512 + rng.gen_range(0..4) * KIB);
        out.extend([scale * hidden, scale * 4 * hidden, scale * 4 * hidden, scale * hidden / 2]);
        out.extend([256 + scale / 8, scale * 4]);
    }
    out
}

fn backward_thread(ctx: &Ctx<'_>, cu: &Arc<CudaContext>, rx: mpsc::Receiver<Step>, tx: mpsc::Sender<Vec<Live>>) {
    cu.bind_to_thread().unwrap();
    let mut rng = SmallRng::seed_from_u64(0xbac4);
    let workspace = ctx.alloc(32 * MIB + 32 * KIB);
    while let Ok(Step { mut activations, scale }) = rx.recv() {
        let mut grad_out = ctx.alloc(scale * 2 * KIB);
        let mut grads = Vec::new();
        while let Some(a) = activations.pop() {
            let grad_in = ctx.alloc(a.size.max(256));
            if rng.gen_bool(0.2) {
                let t = ctx.alloc(a.size / 2 + 256);
                ctx.free(t);
            }
            ctx.free(a);
            ctx.free(std::mem::replace(&mut grad_out, grad_in));
            if activations.len() % 4 == 0 {
                grads.push(ctx.alloc([256, 64 * KIB, 4 * MIB, 16 * MIB][activations.len() % 16 / 4]));
            }
        }
        ctx.free(grad_out);
        ctx.check(&workspace);
        if tx.send(grads).is_err() {
            break;
        }
    }
    ctx.free(workspace);
    ctx.stream.synchronize().unwrap();
}

/// Runs `steps` training steps on `mm`; returns the mismatched bytes the
/// device counted (a fault fails the test at a sync).
fn train(cu: &Arc<CudaContext>, mm: &MemoryManager, steps: usize) -> u64 {
    let k = kernels(cu);
    let mut errors = 0u64;
    // SAFETY: `errors` receives a new device pointer to 8 bytes.
    unsafe { sys::cuMemAlloc_v2(&mut errors, 8) }.result().unwrap();
    // SAFETY: `errors` points at 8 device bytes.
    unsafe { sys::cuMemsetD8_v2(errors, 0, 8) }.result().unwrap();
    let ctx = Ctx { mm, stream: Stream::new().unwrap(), k: &k, errors, next_id: std::sync::atomic::AtomicU64::new(1) };
    let ctx = &ctx;
    let mut rng = SmallRng::seed_from_u64(1);
    let params: Vec<Live> =
        (0..24).map(|i| ctx.alloc([256, 4 * KIB, 256 * KIB, 2 * MIB, 8 * MIB, 16 * MIB][i % 6])).collect();
    let (to_bwd, bwd_rx) = mpsc::channel::<Step>();
    let (grads_tx, grads_rx) = mpsc::channel::<Vec<Live>>();
    std::thread::scope(|s| {
        let mut bwd_rx = Some(bwd_rx);
        let mut grads_tx = Some(grads_tx);
        let mut backward = None;
        let workspace = ctx.alloc(32 * MIB);
        let mut grads: Vec<Live> = Vec::new();
        for step in 0..steps {
            let scale = [8, 16, 24, 32, 48, 64][rng.gen_range(0..6)] * [64, 96, 128, 192, 256][rng.gen_range(0..5)];
            let activations: Vec<Live> =
                activation_sizes(4, scale, &mut rng).into_iter().map(|sz| ctx.alloc(sz)).collect();
            if backward.is_none() {
                let (rx, tx) = (bwd_rx.take().unwrap(), grads_tx.take().unwrap());
                backward = Some(s.spawn(move || backward_thread(ctx, cu, rx, tx)));
            }
            to_bwd.send(Step { activations, scale }).unwrap();
            let new_grads = grads_rx.recv().expect("the backward thread died");
            for g in &new_grads {
                let t = ctx.alloc(g.size);
                ctx.free(t);
            }
            grads.drain(..).for_each(|g| ctx.free(g));
            grads = new_grads;
            params.iter().chain([&workspace]).for_each(|p| ctx.check(p));
            if step % 7 == 6 {
                ctx.stream.synchronize().unwrap();
                mm.release_cached().unwrap();
            }
            if step % 5 == 2 {
                let kept = s
                    .spawn(move || {
                        cu.bind_to_thread().unwrap();
                        let a = ctx.alloc(scale * 512 + 512);
                        let kept = ctx.alloc(scale * KIB);
                        ctx.free(a);
                        kept
                    })
                    .join()
                    .unwrap();
                ctx.free(kept);
            }
        }
        drop(to_bwd);
        backward.take().unwrap().join().unwrap();
        grads.into_iter().for_each(|g| ctx.free(g));
        ctx.free(workspace);
    });
    params.into_iter().for_each(|p| ctx.free(p));
    ctx.stream.synchronize().expect("no kernel faulted on a block the pool unmapped");
    let mut bad = 0u64;
    // SAFETY: `bad` is 8 host bytes; `errors` 8 device bytes, whose
    // writers were synchronised above.
    unsafe { sys::cuMemcpyDtoH_v2((&mut bad as *mut u64).cast(), errors, 8) }.result().unwrap();
    // SAFETY: `errors` came from cuMemAlloc and is no longer used.
    unsafe { sys::cuMemFree_v2(errors) }.result().unwrap();
    bad
}

/// The training loop with the library's defaults: no kernel faults and
/// every byte of every block holds its own pattern until it is freed.
#[test]
fn a_threaded_training_loop_keeps_every_live_block_on_the_device() {
    let Some(cu) = gpu_for_test("gpu_training_threads::a_threaded_training_loop_keeps_every_live_block_on_the_device")
    else {
        return;
    };
    cu.bind_to_thread().unwrap();
    let mm = MemoryManager::new(Config::new()).unwrap();
    let bad = train(&cu, &mm, 60);
    eprintln!("stats {:?}", mm.device_stats(0).unwrap().pool);
    assert_eq!(bad, 0, "bytes of live blocks overwritten on the device");
}

/// The control of the check: a byte overwritten behind the pool's back
/// (by `cuMemsetD8`) is counted.
#[test]
fn the_check_counts_an_overwritten_byte() {
    let Some(cu) = gpu_for_test("gpu_training_threads::the_check_counts_an_overwritten_byte") else {
        return;
    };
    cu.bind_to_thread().unwrap();
    let mm = MemoryManager::new(Config::new()).unwrap();
    let k = kernels(&cu);
    let mut errors = 0u64;
    // SAFETY: `errors` receives a new device pointer to 8 bytes.
    unsafe { sys::cuMemAlloc_v2(&mut errors, 8) }.result().unwrap();
    // SAFETY: `errors` points at 8 device bytes.
    unsafe { sys::cuMemsetD8_v2(errors, 0, 8) }.result().unwrap();
    let ctx =
        Ctx { mm: &mm, stream: Stream::new().unwrap(), k: &k, errors, next_id: std::sync::atomic::AtomicU64::new(1) };
    let b = ctx.alloc(1 << 20);
    ctx.stream.synchronize().unwrap();
    // SAFETY: byte 1000 of the live 1 MiB block, whose fill has finished.
    unsafe { sys::cuMemsetD8_v2(b.ptr + 1000, 0, 1) }.result().unwrap();
    // The memset may still run on the legacy stream, which the pool's
    // stream does not wait for: the check must come after it.
    // SAFETY: no arguments; waits for the context's work.
    unsafe { sys::cuCtxSynchronize() }.result().unwrap();
    ctx.free(b);
    ctx.stream.synchronize().unwrap();
    let mut bad = 0u64;
    // SAFETY: `bad` is 8 host bytes; the check that wrote `errors` is done.
    unsafe { sys::cuMemcpyDtoH_v2((&mut bad as *mut u64).cast(), errors, 8) }.result().unwrap();
    // SAFETY: `errors` came from cuMemAlloc and is no longer used.
    unsafe { sys::cuMemFree_v2(errors) }.result().unwrap();
    assert_eq!(bad, 1, "the check missed a byte overwritten behind the pool's back");
}
