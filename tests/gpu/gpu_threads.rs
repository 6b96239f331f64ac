//! GPU tests of threads sharing a device's one sync pool: threads with a
//! stream each allocate device memory, run a kernel on every block, and
//! pass some blocks to another thread, which uses them on its own stream
//! (after waiting for the sender's) and frees them there (as autograd's
//! backward thread frees the forward pass's tensors). The block goes back
//! to the pool tagged with the receiver's stream, so the next reuse on
//! another stream must wait for the receiver's kernel. Every kernel
//! writes its own value, spins, and counts elements that changed under it:
//! a reuse that was not ordered shows up as a mismatch. Skips without a
//! GPU; fails instead under `CUMEM_REQUIRE_GPU=1`.

use crate::common;

use std::sync::{Arc, Barrier};

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::{Config, MemoryManager, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use common::CHECK;

const THREADS: usize = 4;
const ROUNDS: u32 = 200;

/// A block handed to another thread: its address, its length in `u32`s,
/// and the stream its last kernel ran on.
type Handoff = (u64, usize, Stream);

struct Check {
    f: CudaFunction,
    errors: u64,
}

impl Check {
    /// Launches the check kernel on `s` over `n` u32 at `p`, writing `v`.
    fn launch(&self, s: &Stream, p: u64, n: usize, v: u32, cycles: i64) {
        let cs = s.cudarc().expect("a CUDA stream");
        let nn = n as u64;
        let mut launch = cs.launch_builder(&self.f);
        launch.arg(&p).arg(&v).arg(&nn).arg(&cycles).arg(&self.errors);
        // SAFETY: the arguments match the kernel; `p` holds `n` u32 and is
        // freed only in stream order after this launch.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.expect("launch");
    }
}

fn worker(
    ctx: &Arc<CudaContext>,
    mm: &MemoryManager,
    check: &Check,
    id: usize,
    inbox: crossbeam::channel::Receiver<Handoff>,
    next: &crossbeam::channel::Sender<Handoff>,
    done: &Barrier,
) {
    ctx.bind_to_thread().expect("cuCtxSetCurrent");
    let stream = Stream::new().expect("cuStreamCreate");
    let mut rng = SmallRng::seed_from_u64(11 + id as u64);
    let mut live: Vec<(u64, usize)> = Vec::new();
    let value = |round: u32, k: u32| (id as u32) << 24 | round << 4 | k;
    let receive = |(p, n, from): Handoff, round: u32| {
        // Use it here after the sender's work, then free it on this stream.
        stream.wait_for(&from).expect("cuStreamWaitEvent");
        check.launch(&stream, p, n, value(round, 1), rng_cycles(round));
        mm.free_device_on(p, &stream).expect("free");
    };
    for round in 1..=ROUNDS {
        while let Ok(h) = inbox.try_recv() {
            receive(h, round);
        }
        if live.len() > 6 || (!live.is_empty() && rng.gen_bool(0.5)) {
            let (p, n) = live.swap_remove(rng.gen_range(0..live.len()));
            if rng.gen_bool(0.3) {
                next.send((p, n, stream.clone())).expect("peer alive");
            } else {
                mm.free_device_on(p, &stream).expect("free");
            }
        }
        let n = [1usize << 12, 1 << 14, 1 << 16][rng.gen_range(0..3)];
        let p = mm.allocate_device_on(n * 4, &stream).expect("allocation");
        check.launch(&stream, p, n, value(round, 0), rng.gen_range(100_000i64..1_000_000));
        live.push((p, n));
    }
    for (p, _) in live {
        mm.free_device_on(p, &stream).expect("free");
    }
    done.wait();
    while let Ok(h) = inbox.try_recv() {
        receive(h, ROUNDS + 1);
    }
    stream.synchronize().expect("cuStreamSynchronize");
}

fn rng_cycles(round: u32) -> i64 {
    200_000 + (round as i64 * 7919) % 800_000
}

#[test]
fn threads_with_a_stream_each_reuse_one_pool_in_order() {
    reuse_across_threads_in_order("threads_with_a_stream_each_reuse_one_pool_in_order", false);
}

/// The same with the device pool's thread caches on: a block another
/// thread frees goes back to the cache of the thread that allocated it, or
/// to the pool, with its stream's tag either way.
#[test]
fn threads_with_a_stream_each_reuse_through_thread_caches_in_order() {
    reuse_across_threads_in_order("threads_with_a_stream_each_reuse_through_thread_caches_in_order", true);
}

fn reuse_across_threads_in_order(name: &str, thread_cache: bool) {
    let Some(ctx) = gpu_for_test(name) else { return };
    let device = Config::from_env().map_or(0, |c| c.device);
    let config = Config::new().device(device).device_thread_cache(thread_cache);
    let mm = MemoryManager::new(config).unwrap();
    let ptx = cudarc::nvrtc::compile_ptx(CHECK).expect("NVRTC compiles the check kernel");
    let f = ctx.load_module(ptx).expect("module loads").load_function("fill_spin_check").expect("kernel");
    let errors = mm.allocate_device(8).unwrap();
    // SAFETY: `errors` is an 8-byte device allocation.
    unsafe { cudarc::driver::sys::cuMemsetD8_v2(errors, 0, 8) }.result().unwrap();
    ctx.synchronize().unwrap();
    let check = Check { f, errors };
    let (tx, rx): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| crossbeam::channel::unbounded::<Handoff>()).unzip();
    let done = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for (id, inbox) in rx.into_iter().enumerate() {
            let (ctx, mm, check, tx, done) = (&ctx, &mm, &check, &tx, &done);
            s.spawn(move || worker(ctx, mm, check, id, inbox, &tx[(id + 1) % THREADS], done));
        }
    });
    ctx.synchronize().unwrap();
    let mut count = 0u64;
    // SAFETY: `count` is 8 writable bytes; the device is idle.
    unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2((&mut count as *mut u64).cast(), errors, 8) }.result().unwrap();
    mm.free_device(errors).unwrap();
    let pool = mm.default_device().unwrap().pool();
    pool.check_invariants().unwrap();
    mm.release_cached().unwrap();
    assert_eq!(pool.stats().in_use, 0);
    assert_eq!(count, 0, "{count} elements were overwritten by a premature reuse");
}

/// Threads that come and go, each with a stream of its own (a thread per
/// request, a resized thread pool): a new thread reuses free blocks that
/// carry the stream of a thread that has exited (and synced). Its frees
/// merge with those blocks; the merged blocks must keep the live stream's
/// tag, not become "freed on several streams", or every reuse of them
/// waits for every other thread's stream.
#[test]
fn threads_that_come_and_go_with_streams_of_their_own_never_wait_for_each_other() {
    let name = "threads_that_come_and_go_with_streams_of_their_own_never_wait_for_each_other";
    let Some(ctx) = gpu_for_test(name) else { return };
    let device = Config::from_env().map_or(0, |c| c.device);
    let mm = MemoryManager::new(Config::new().device(device)).unwrap();
    let wave = |seed: u64| {
        std::thread::scope(|s| {
            for id in 0..4u64 {
                let (ctx, mm) = (&ctx, &mm);
                s.spawn(move || {
                    ctx.bind_to_thread().expect("cuCtxSetCurrent");
                    let stream = Stream::new().expect("cuStreamCreate");
                    let mut rng = SmallRng::seed_from_u64(seed * 100 + id);
                    let mut live = Vec::new();
                    for _ in 0..3000 {
                        if live.len() < 200 && (live.is_empty() || rng.gen_bool(0.5)) {
                            live.push(mm.allocate_device_on(rng.gen_range(1..=4 << 20), &stream).unwrap());
                        } else {
                            let p = live.swap_remove(rng.gen_range(0..live.len()));
                            mm.free_device_on(p, &stream).unwrap();
                        }
                    }
                    for p in live {
                        mm.free_device_on(p, &stream).unwrap();
                    }
                    stream.synchronize().unwrap();
                });
            }
        });
    };
    wave(0);
    wave(1);
    let before = mm.device_stats(device).unwrap().stream_waits;
    for seed in 2..8 {
        wave(seed);
    }
    let waits = mm.device_stats(device).unwrap().stream_waits - before;
    assert_eq!(waits, 0, "reuses waited for other threads' streams {waits} times");
    let pool = mm.default_device().unwrap().pool();
    pool.check_invariants().unwrap();
    assert_eq!(pool.stats().in_use, 0);
}
