//! A threaded training loop on the device pool with the library's default
//! configuration (per-thread shards while `arenas=0` is the default), on
//! the host fallback, where device memory is host memory committed with
//! `mprotect`: touching a page the pool unmapped faults, and two live
//! blocks that overlap overwrite each other's patterns.
//!
//! The pattern is PyTorch's: the forward pass runs on the main thread and
//! the backward pass on autograd's own thread, both on one stream; the
//! backward thread frees the activations the forward thread made, the
//! main thread frees the gradients the backward thread made (zero_grad),
//! each thread keeps a workspace for good (cuBLAS's), the shapes change
//! from step to step (batch x length), and now and then the cached memory
//! is released (empty_cache). Every live block carries a pattern unique
//! to it, checked before it is freed; no two live blocks may overlap, and
//! every live block must lie on mapped memory.
//!
//! `TT_STEPS` and `TT_SEED` set the steps (40) and the seed (1) of the
//! default-configuration runs.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::Mutex;

use cumem::{BackendChoice, Config, MemoryManager, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PAGE: usize = 4096;

/// A live block and the pattern it holds.
struct Live {
    ptr: u64,
    size: usize,
    id: u64,
}

/// The 8 bytes at `offset` of block `id`.
fn word(id: u64, offset: usize) -> u64 {
    (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ offset as u64).rotate_left(17) | 1
}

/// The offsets written: the first and last 64 bytes of every page the
/// block touches (8-byte words, inside the block).
fn offsets(ptr: u64, size: usize) -> impl Iterator<Item = usize> {
    let start = ptr as usize;
    let end = start + size;
    let first_page = start / PAGE;
    let last_page = (end - 1) / PAGE;
    (first_page..=last_page).flat_map(move |p| {
        let lo = (p * PAGE).max(start);
        let hi = ((p + 1) * PAGE).min(end);
        let head = (lo..(lo + 64).min(hi)).step_by(8);
        let tail_start = hi.saturating_sub(64).max(lo + 64).min(hi);
        let tail = (tail_start..hi).step_by(8);
        head.chain(tail).filter(move |&a| a + 8 <= end).map(move |a| a - start)
    })
}

impl Live {
    fn fill(&self) {
        for off in offsets(self.ptr, self.size) {
            // SAFETY: on the host fallback a live device block of `size`
            // bytes is host memory that this test alone uses until it
            // frees the block; blocks are 512-byte aligned, so every
            // 8-byte offset from the start is aligned for a u64.
            unsafe { ((self.ptr as usize + off) as *mut u64).write_volatile(word(self.id, off)) };
        }
    }

    /// The first offset whose word is not the block's pattern.
    fn first_mismatch(&self) -> Option<(usize, u64)> {
        offsets(self.ptr, self.size).find_map(|off| {
            // SAFETY: as in `fill`.
            let got = unsafe { ((self.ptr as usize + off) as *const u64).read_volatile() };
            (got != word(self.id, off)).then_some((off, got))
        })
    }
}

/// The test's own record of the live blocks: no two may overlap.
struct Book {
    live: Mutex<BTreeMap<u64, (u64, u64)>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl Book {
    fn new() -> Self {
        Book { live: Mutex::new(BTreeMap::new()), next_id: std::sync::atomic::AtomicU64::new(1) }
    }
}

/// One shared stream (a host queue: its work is always done).
struct Ctx<'a> {
    mm: &'a MemoryManager,
    stream: Stream,
    book: Book,
}

impl Ctx<'_> {
    fn alloc(&self, size: usize, what: &str) -> Live {
        let ptr = self.mm.allocate_device_on(size, &self.stream).unwrap_or_else(|e| panic!("{what}: {e}"));
        let id = self.book.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        {
            let mut live = self.book.live.lock().unwrap();
            let end = ptr + size as u64;
            if let Some((&s, &(e, other))) = live.range(..end).next_back() {
                assert!(
                    e <= ptr,
                    "{what}: block {ptr:#x}+{size} (id {id}) overlaps live block {s:#x}..{e:#x} (id {other})"
                );
            }
            live.insert(ptr, (end, id));
        }
        let missing = super::unmapped_pages::unmapped_bytes(ptr as usize, size);
        assert_eq!(missing, 0, "{what}: block {ptr:#x}+{size} (id {id}) handed out on unmapped memory");
        let b = Live { ptr, size, id };
        b.fill();
        b
    }

    fn free(&self, b: Live, what: &str) {
        if let Some((off, got)) = b.first_mismatch() {
            panic!(
                "{what}: block {:#x}+{} (id {}) overwritten at offset {off}: {got:#x}, want {:#x}",
                b.ptr,
                b.size,
                b.id,
                word(b.id, off)
            );
        }
        self.book.live.lock().unwrap().remove(&b.ptr);
        self.mm.free_device_on(b.ptr, &self.stream).unwrap_or_else(|e| panic!("{what}: {e}"));
    }

    /// Checks every block of `blocks` is intact (the long-lived ones).
    fn check(&self, blocks: &[Live], what: &str) {
        for b in blocks {
            if let Some((off, got)) = b.first_mismatch() {
                panic!(
                    "{what}: long-lived block {:#x}+{} (id {}) overwritten at offset {off}: {got:#x}",
                    b.ptr, b.size, b.id
                );
            }
        }
    }
}

/// What the forward pass hands the backward thread for one step.
struct Step {
    activations: Vec<Live>,
    /// Per layer: the parameter sizes (the backward thread makes their
    /// gradients, which the main thread frees at the next zero_grad).
    param_sizes: Vec<usize>,
    scale: usize,
}

/// The layer sizes of a BERT-like encoder at `scale` tokens (batch x
/// length): per layer, the activations it saves for backward.
fn activation_sizes(layers: usize, scale: usize, rng: &mut SmallRng) -> Vec<usize> {
    let hidden = 256; // bytes per token of one hidden vector (fp16, 128 wide)
    let mut out = Vec::new();
    for _ in 0..layers {
        // q, k, v, attention scores, context, two norms, the MLP's wide
        // output and its activation, a dropout mask, some small stats.
        out.push(scale * hidden); // q
        out.push(scale * hidden); // k
        out.push(scale * hidden); // v
        out.push(scale * 64 + rng.gen_range(0..4) * KIB); // scores (per head)
        out.push(scale * hidden); // context
        out.push(scale * 4 * hidden); // mlp up
        out.push(scale * 4 * hidden); // gelu
        out.push(scale * hidden / 2); // dropout mask
        out.push(256 + scale / 8); // norm statistics
        out.push(scale * 4); // per-token mean
    }
    out
}

/// The training loop (see the module docs); `steps` forward and backward
/// passes.
fn train(mm: &MemoryManager, steps: usize, seed: u64) {
    let ctx = Ctx { mm, stream: Stream::host(), book: Book::new() };
    let ctx = &ctx;
    let mut rng = SmallRng::seed_from_u64(seed);
    let layers = 4;
    // Parameters: allocated once on the main thread, kept.
    let param_sizes: Vec<usize> =
        (0..layers * 6).map(|i| [256, 1024, 64 * KIB, 256 * KIB, MIB, 2 * MIB][i % 6]).collect();
    let params: Vec<Live> = param_sizes.iter().map(|&s| ctx.alloc(s, "parameter")).collect();
    let (to_bwd, bwd_rx) = mpsc::channel::<Step>();
    let (grads_tx, grads_rx) = mpsc::channel::<Vec<Live>>();
    std::thread::scope(|s| {
        let mut backward: Option<std::thread::ScopedJoinHandle<'_, ()>> = None;
        let mut bwd_rx = Some(bwd_rx);
        let mut grads_tx = Some(grads_tx);
        let mut workspace: Option<Live> = None;
        let mut grads: Vec<Live> = Vec::new();
        for step in 0..steps {
            // Shapes change from step to step.
            let batch = [8, 16, 24, 32, 48, 64][rng.gen_range(0..6)];
            let len = [64, 96, 128, 192, 256][rng.gen_range(0..5)];
            let scale = batch * len;
            // Forward: the workspace on first use (kept), activations.
            if workspace.is_none() {
                workspace = Some(ctx.alloc(4 * MIB, "forward workspace"));
            }
            let sizes = activation_sizes(layers, scale, &mut rng);
            let mut activations = Vec::with_capacity(sizes.len());
            let mut temps = Vec::new();
            for (i, &sz) in sizes.iter().enumerate() {
                activations.push(ctx.alloc(sz, "activation"));
                // A temporary per layer, freed at once (cuBLAS output
                // before a copy, a softmax buffer).
                if i % 10 == 3 {
                    temps.push(ctx.alloc(sz, "forward temporary"));
                }
                if temps.len() > 1 {
                    ctx.free(temps.remove(0), "forward temporary");
                }
            }
            temps.into_iter().for_each(|t| ctx.free(t, "forward temporary"));
            // Backward runs on autograd's own thread, made at the first
            // backward (after the forward thread built its shard).
            if backward.is_none() {
                let rx = bwd_rx.take().unwrap();
                let tx = grads_tx.take().unwrap();
                backward = Some(s.spawn(move || backward_thread(ctx, rx, tx, seed)));
            }
            to_bwd.send(Step { activations, param_sizes: param_sizes.clone(), scale }).unwrap();
            // loss.backward() returns once autograd is done: the new
            // gradients come back. zero_grad(set_to_none) frees the
            // last step's first (the optimizer reads the new ones).
            let new_grads = grads_rx.recv().expect("the backward thread died");
            // Optimizer: a temporary per parameter.
            for g in &new_grads {
                let t = ctx.alloc(g.size, "optimizer temporary");
                ctx.free(t, "optimizer temporary");
            }
            for g in grads.drain(..) {
                ctx.free(g, "gradient (freed by zero_grad on the main thread)");
            }
            grads = new_grads;
            ctx.check(&params, "parameters");
            if let Some(w) = &workspace {
                ctx.check(std::slice::from_ref(w), "forward workspace");
            }
            // Now and then: empty_cache.
            if step % 7 == 6 {
                mm.release_cached().unwrap();
            }
            // Now and then a short-lived helper thread allocates, hands a
            // block to the main thread and exits (its shard goes idle).
            if step % 5 == 2 {
                let b = s
                    .spawn(move || {
                        let a = ctx.alloc(scale * 64 + 512, "helper block");
                        let kept = ctx.alloc(scale * 128, "helper block kept");
                        ctx.free(a, "helper block");
                        kept
                    })
                    .join()
                    .unwrap();
                ctx.free(b, "helper block freed by the main thread");
            }
        }
        drop(to_bwd);
        backward.take().unwrap().join().unwrap();
        grads.into_iter().for_each(|g| ctx.free(g, "gradient"));
        if let Some(w) = workspace.take() {
            ctx.free(w, "forward workspace");
        }
    });
    params.into_iter().for_each(|p| ctx.free(p, "parameter"));
}

/// Autograd's thread: per step, frees the forward's activations in
/// reverse (checked), making gradients as it goes.
fn backward_thread(ctx: &Ctx<'_>, rx: mpsc::Receiver<Step>, tx: mpsc::Sender<Vec<Live>>, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0xbac4);
    let mut workspace: Option<Live> = None;
    while let Ok(Step { mut activations, param_sizes, scale }) = rx.recv() {
        if workspace.is_none() {
            workspace = Some(ctx.alloc(4 * MIB + 32 * KIB, "backward workspace"));
        }
        let mut grad_out = ctx.alloc(scale * 256, "output gradient");
        let mut param_grads = Vec::new();
        let mut p = param_sizes.len();
        while let Some(a) = activations.pop() {
            // The gradient of this activation's input, then the
            // activation goes (freed by the thread that did not make it).
            let grad_in = ctx.alloc(a.size.max(256), "input gradient");
            if rng.gen_bool(0.2) {
                let t = ctx.alloc(a.size / 2 + 256, "backward temporary");
                ctx.free(t, "backward temporary");
            }
            ctx.free(a, "activation (freed by the backward thread)");
            ctx.free(std::mem::replace(&mut grad_out, grad_in), "gradient");
            if activations.len() % 2 == 0 && p > 0 {
                p -= 1;
                param_grads.push(ctx.alloc(param_sizes[p], "parameter gradient"));
            }
        }
        while p > 0 {
            p -= 1;
            param_grads.push(ctx.alloc(param_sizes[p], "parameter gradient"));
        }
        ctx.free(grad_out, "gradient");
        if let Some(w) = &workspace {
            ctx.check(std::slice::from_ref(w), "backward workspace");
        }
        if tx.send(param_grads).is_err() {
            break;
        }
    }
    if let Some(w) = workspace.take() {
        ctx.free(w, "backward workspace");
    }
}

fn host(config: Config) -> MemoryManager {
    MemoryManager::new(config.backend(BackendChoice::Host)).unwrap()
}

/// The training loop with the library's defaults: every live block keeps
/// its memory and its pattern, and no two overlap.
#[test]
fn a_threaded_training_loop_keeps_every_live_block() {
    run_loop(host(Config::new()));
}

/// Runs the loop (`TT_STEPS` steps, 40 by default, from seed `TT_SEED`)
/// and prints the pool's figures.
fn run_loop(mm: MemoryManager) {
    let steps = std::env::var("TT_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
    let seed = std::env::var("TT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    train(&mm, steps, seed);
    eprintln!("stats {:?}", mm.device_stats(0).unwrap().pool);
    mm.default_device().unwrap().pool().check_invariants().unwrap();
}
