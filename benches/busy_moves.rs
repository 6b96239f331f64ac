//! What a page move costs the allocating thread while the GPU is busy.
//!
//! A program's allocating thread usually runs ahead of its stream: blocks
//! it frees on the stream may still be used by queued work. When a
//! remapping pool moves such memory to where a request lands, it must not
//! let that work reach the new owner's memory. This bench times such
//! moves through a manager built from `CUMEM_CONF` (no slack, so the
//! memory moves): 16 blocks of 32 MiB on stream A, work of `d` ms queued
//! on A (a host function that sleeps: the stream is busy that long), every
//! other block freed on A, then one request of 8 blocks' size, which fits
//! in no free block:
//! - on A, the stream the memory was freed on (its work runs before the
//!   new owner's);
//! - on B, another stream that has freed memory before (B is made to
//!   wait for A's work on the device);
//! - on no stream (`allocate_device`: nothing to order after A's work, so
//!   the move waits for the device).
//!
//! Each row is the median of seven rounds, each a fresh manager, in µs of
//! the allocation call alone. A move that waits for the device takes at
//! least `d`.
//!
//! A second table asks whether the driver holds a thread's page calls
//! back while the device is busy or another thread waits for it: with
//! 20 ms of work queued on a stream (a host function that sleeps, or a
//! kernel that spins), one thread maps, grants and unmaps one 32 MiB
//! piece no work uses (µs per call, median of seven rounds), with or
//! without another thread in `cuCtxSynchronize` meanwhile.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cumem::{Config, MemoryManager, Stream};

const PIECE: usize = 32 << 20;
const ROUNDS: usize = 7;

/// Sleeps the milliseconds its argument points to (a host function
/// queued on a stream: the stream is busy meanwhile).
unsafe extern "C" fn sleep_ms(arg: *mut c_void) {
    // SAFETY: the argument is a `u64` that outlives the stream's work
    // (`hold` synchronises the stream before it returns the value).
    let ms = unsafe { *(arg as *const u64) };
    std::thread::sleep(Duration::from_millis(ms));
}

/// Where the request of a round is made.
#[derive(Clone, Copy)]
enum Request {
    /// On the stream the memory was freed on.
    Same,
    /// On another stream (that has freed memory before).
    Other,
    /// On no stream.
    NoStream,
}

/// One round: the allocation's time (µs), and whether the stream it was
/// freed on was still busy when the allocation returned.
fn round(config: &Config, busy_ms: u64, request: Request) -> cumem::Result<(f64, bool)> {
    let mm = MemoryManager::new(config.clone())?;
    let ctx = cumem::cuda::device_context(config.device)?.expect("a device");
    let a = Stream::from_cudarc(ctx.new_stream().expect("a stream"));
    let b = Stream::from_cudarc(ctx.new_stream().expect("a stream"));
    let first = mm.allocate_device_on(4096, &b)?;
    mm.free_device_on(first, &b)?;
    b.synchronize()?;
    let blocks: Vec<u64> = (0..16).map(|_| mm.allocate_device_on(PIECE, &a)).collect::<cumem::Result<_>>()?;
    a.synchronize()?;
    let ms = Box::new(busy_ms);
    let cu = a.cudarc().expect("a CUDA stream").cu_stream();
    let arg = (&*ms as *const u64).cast_mut().cast::<c_void>();
    // SAFETY: the stream is alive; `sleep_ms` only reads `*arg`, which
    // lives until the stream is synchronised below.
    unsafe { cudarc::driver::sys::cuLaunchHostFunc(cu, Some(sleep_ms), arg) }.result().expect("a host function");
    for &p in blocks.iter().skip(1).step_by(2) {
        mm.free_device_on(p, &a)?;
    }
    let t = Instant::now();
    let big = match request {
        Request::Same => mm.allocate_device_on(8 * PIECE, &a)?,
        Request::Other => mm.allocate_device_on(8 * PIECE, &b)?,
        Request::NoStream => mm.allocate_device(8 * PIECE)?,
    };
    let took = t.elapsed().as_secs_f64() * 1e6;
    // SAFETY: as above; the call only asks.
    let busy = unsafe { cudarc::driver::sys::cuStreamQuery(cu) } == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY;
    a.synchronize()?;
    b.synchronize()?;
    drop(ms);
    mm.free_device_on(big, &b)?;
    for &p in blocks.iter().step_by(2) {
        mm.free_device_on(p, &a)?;
    }
    a.synchronize()?;
    b.synchronize()?;
    Ok((took, busy))
}

/// A kernel that spins for the nanoseconds it is given.
const SPIN: &str = r#"
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"#;

/// One round of the second table: the µs of `cuMemMap`, `cuMemSetAccess`
/// and `cuMemUnmap` of one piece while 20 ms of work is queued on a
/// stream (`spin`, a kernel, or else a host function), with or without
/// another thread in `cuCtxSynchronize`.
fn calls_beside_a_wait(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    range: &cumem::cuda::vmm::AddressRange,
    piece: &cumem::cuda::vmm::PhysicalChunk,
    spin: Option<&cudarc::driver::CudaFunction>,
    waiter: bool,
) -> cumem::Result<[f64; 3]> {
    let stream = ctx.new_stream().expect("a stream");
    let ms = Box::new(20u64);
    match spin {
        Some(f) => {
            use cudarc::driver::PushKernelArg;
            let ns = *ms * 1_000_000;
            let mut l = stream.launch_builder(f);
            l.arg(&ns);
            let one = cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the argument matches the kernel, which touches no memory.
            unsafe { l.launch(one) }.expect("the kernel launches");
        }
        None => {
            let arg = (&*ms as *const u64).cast_mut().cast::<c_void>();
            // SAFETY: the stream is alive; `sleep_ms` only reads `*arg`,
            // which lives until the stream is synchronised below.
            unsafe { cudarc::driver::sys::cuLaunchHostFunc(stream.cu_stream(), Some(sleep_ms), arg) }
                .result()
                .expect("a host function");
        }
    }
    let other = waiter.then(|| {
        let ctx = ctx.clone();
        std::thread::spawn(move || ctx.synchronize().expect("cuCtxSynchronize"))
    });
    // The other thread is inside its wait by now.
    std::thread::sleep(Duration::from_millis(2));
    let mut t = Instant::now();
    let mut lap = || {
        let us = t.elapsed().as_secs_f64() * 1e6;
        t = Instant::now();
        us
    };
    range.map(0, piece)?;
    let map = lap();
    range.set_access(0, piece.size(), &[])?;
    let access = lap();
    range.unmap(0, piece.size())?;
    let unmap = lap();
    if let Some(h) = other {
        h.join().expect("the waiting thread");
    }
    stream.synchronize().expect("the stream's work");
    drop(ms);
    Ok([map, access, unmap])
}

fn main() -> cumem::Result<()> {
    if cumem::cuda::driver_status().devices() == 0 {
        println!("busy_moves: no GPU; nothing measured");
        return Ok(());
    }
    let config = Config::from_env()?.remap_slack_ppm(0);
    println!("## A page move while the stream is busy (µs for the allocation, median of {ROUNDS} rounds)");
    println!();
    println!("| work queued (ms) | on the freeing stream | busy after | on another stream | busy after | on no stream | busy after |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for busy_ms in [0u64, 2, 20] {
        let mut cells = Vec::new();
        for request in [Request::Same, Request::Other, Request::NoStream] {
            let mut times = Vec::new();
            let mut busy = 0;
            for _ in 0..ROUNDS {
                let (t, b) = round(&config, busy_ms, request)?;
                times.push(t);
                busy += usize::from(b);
            }
            times.sort_by(f64::total_cmp);
            cells.push(format!("{:.1} | {busy}/{ROUNDS}", times[ROUNDS / 2]));
        }
        println!("| {busy_ms} | {} |", cells.join(" | "));
    }
    let ctx = cumem::cuda::device_context(config.device)?.expect("a device");
    ctx.bind_to_thread().expect("the device's context");
    let range = cumem::cuda::vmm::AddressRange::reserve(&ctx, PIECE, 0)?;
    let piece = cumem::cuda::vmm::PhysicalChunk::create(&ctx, PIECE)?;
    println!();
    let ptx = cudarc::nvrtc::compile_ptx(SPIN).expect("NVRTC compiles the kernel");
    let module = ctx.load_module(ptx).expect("the module loads");
    let spin = module.load_function("spin").expect("spin");
    println!("## Page calls beside 20 ms of queued work (µs, median of {ROUNDS} rounds)");
    println!();
    println!("| work | another thread | `cuMemMap` | `cuMemSetAccess` | `cuMemUnmap` |");
    println!("| --- | --- | ---: | ---: | ---: |");
    for (kernel, waiter) in [(false, false), (false, true), (true, false), (true, true)] {
        let mut cols = [Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..ROUNDS {
            let r = calls_beside_a_wait(&ctx, &range, &piece, kernel.then_some(&spin), waiter)?;
            for (c, v) in cols.iter_mut().zip(r) {
                c.push(v);
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[ROUNDS / 2]
        };
        let [a, b, c] = &mut cols;
        let who = if waiter { "in `cuCtxSynchronize`" } else { "none" };
        let work = if kernel { "a kernel" } else { "a host function" };
        println!("| {work} | {who} | {:.1} | {:.1} | {:.1} |", med(a), med(b), med(c));
    }
    Ok(())
}
