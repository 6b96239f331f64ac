//! The peers' random workload (`ANCHORS.md`), exactly: per thread, repeat
//! N times (N = 200,000 for one thread, 100,000 per thread otherwise): if
//! fewer than 1,000 blocks are live and (none is live, or a fair coin says
//! so), allocate a size drawn uniformly from 1 B to 4 MiB, else free a live
//! block chosen uniformly. Each thread first runs its sequence untimed
//! and frees everything, in rounds until a round grows no pool (at most
//! 4), so the pools have grown to their working size; then the same
//! sequence is timed. The `grew` column counts upstream calls during the
//! timed passes of the row (0: the pools had grown).
//!
//! Rows, each through a `MemoryManager` of its own: the device sync pool
//! with one stream shared by all threads, with a stream per thread
//! (`allocate_device_on` / `free_device_on`), and the pinned pool. Beside
//! them raw `cuMemAllocAsync` / `cuMemFreeAsync` on one shared stream and
//! on a stream per thread. The raw rows run a tenth of N (they are 50-100x slower; a rate needs no more) and
//! skip the untimed pass (the driver's pool needs none).
//!
//! Then the same workload the way the peers' harness runs it (`fresh`):
//! one manager with the default configuration per row, warmed first by a
//! separate round of 16 threads with their own seeds; then every column
//! runs on **new threads** spawned for it, with seeds of their own, timed
//! from a barrier to the last join; and a churn column: 64 short-lived
//! threads in waves of 8, 10,000 operations each, timed from the first
//! wave's start to the last join. `calls` counts the upstream calls
//! (chunks, growth, mappings) made during the timed passes; after the run,
//! each pool's reserved (device: mapped) bytes over its peak in use.
//!
//! After the table: growing the pinned pool to 10 GiB in these sizes from
//! one thread, with the number of upstream calls and their total time.
//!
//! `CUMEM_PEERS_SCALE` multiplies N (e.g. 0.1 for a quick look).
//! `CUMEM_PEERS_CONF` (in `CUMEM_CONF` syntax) replaces the default
//! configuration of the fresh-thread rows' managers.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crossbeam::utils::CachePadded;
use cudarc::driver::{result, CudaContext, CudaStream};
use cumem::cuda::{driver_status, DriverStatus, Stream};
use cumem::{BackendChoice, Config, MemoryManager};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::Target;

const LIVE: usize = 1000;
const MAX: usize = 4 << 20;
const THREADS: [usize; 5] = [1, 2, 4, 8, 16];

fn scale() -> f64 {
    std::env::var("CUMEM_PEERS_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1.0)
}

pub(crate) fn ops_per_thread(threads: usize, tenth: bool) -> u64 {
    let n = if threads == 1 { 200_000.0 } else { 100_000.0 };
    let n = n * scale() / if tenth { 10.0 } else { 1.0 };
    (n as u64).max(100)
}

/// The device sync pool through the manager; `per_thread`: a stream per
/// thread, else one shared stream.
struct Device {
    mm: MemoryManager,
    shared: Stream,
    per_thread: bool,
    /// On the host fallback (host queues, no CUDA streams).
    host: bool,
}

impl Target for Device {
    type Local = Stream;
    fn local(&self) -> Stream {
        if self.host {
            Stream::host()
        } else if self.per_thread {
            Stream::new().expect("cuStreamCreate")
        } else {
            self.shared.clone()
        }
    }
    fn allocate(&self, s: &Stream, size: usize) -> u64 {
        self.mm.allocate_device_on(size, s).expect("device allocation")
    }
    fn free(&self, s: &Stream, ptr: u64) {
        self.mm.free_device_on(ptr, s).expect("device free");
    }
    fn finish(&self, s: &Stream) {
        s.synchronize().expect("cuStreamSynchronize");
    }
    fn growth(&self) -> u64 {
        self.mm.device_stats(0).map_or(0, |s| s.pool.upstream_allocs)
    }
}

/// The pinned pool through the manager.
struct Pinned(MemoryManager);

impl Target for Pinned {
    type Local = ();
    fn local(&self) {}
    fn allocate(&self, _: &(), size: usize) -> u64 {
        self.0.allocate_pinned(size).expect("pinned allocation").as_ptr() as u64
    }
    fn free(&self, _: &(), ptr: u64) {
        self.0.free_pinned(ptr as *mut u8).expect("pinned free");
    }
    fn growth(&self) -> u64 {
        self.0.pinned_stats().upstream_allocs
    }
}

/// Raw `cuMemAllocAsync` from the device's default pool; `shared`: every
/// thread on this one stream, else a stream per thread.
pub(crate) struct Raw {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) shared: Option<Arc<CudaStream>>,
}

impl Target for Raw {
    type Local = Arc<CudaStream>;
    fn local(&self) -> Arc<CudaStream> {
        self.ctx.bind_to_thread().expect("cuCtxSetCurrent");
        match &self.shared {
            Some(s) => s.clone(),
            None => self.ctx.new_stream().expect("cuStreamCreate"),
        }
    }
    fn allocate(&self, s: &Arc<CudaStream>, size: usize) -> u64 {
        // SAFETY: the stream belongs to the context bound to this thread.
        unsafe { result::malloc_async(s.cu_stream(), size) }.expect("cuMemAllocAsync")
    }
    fn free(&self, s: &Arc<CudaStream>, ptr: u64) {
        // SAFETY: `ptr` came from `cuMemAllocAsync` on this context and no
        // work uses it.
        unsafe { result::free_async(ptr, s.cu_stream()) }.expect("cuMemFreeAsync");
    }
    fn finish(&self, s: &Arc<CudaStream>) {
        s.synchronize().expect("cuStreamSynchronize");
    }
}

/// One thread's sequence of `ops` steps (the anchors' rule).
fn sequence<T: Target>(t: &T, l: &T::Local, seed: u64, ops: u64, live: &mut Vec<u64>) {
    sequence_counted(t, l, seed, ops, live, None);
}

/// [`sequence`], storing the bytes the thread holds (as asked) in `held`
/// after every step: a cache line of the thread's own, read by the
/// sampler of [`fresh_pass`].
pub(crate) fn sequence_counted<T: Target>(
    t: &T,
    l: &T::Local,
    seed: u64,
    ops: u64,
    live: &mut Vec<u64>,
    held: Option<&AtomicUsize>,
) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut sizes: Vec<usize> = Vec::with_capacity(LIVE);
    let mut bytes = 0;
    for _ in 0..ops {
        if live.len() < LIVE && (live.is_empty() || rng.gen_bool(0.5)) {
            let size = rng.gen_range(1..=MAX);
            live.push(t.allocate(l, size));
            sizes.push(size);
            bytes += size;
        } else {
            let i = rng.gen_range(0..live.len());
            t.free(l, live.swap_remove(i));
            bytes -= sizes.swap_remove(i);
        }
        if let Some(h) = held {
            h.store(bytes, Ordering::Relaxed);
        }
    }
}

/// The most untimed rounds before the timed pass.
const WARM_ROUNDS: usize = 4;

/// Runs the workload on `threads` threads; returns total Mops/s of the
/// timed pass (from the first thread's start to the last one's end) and
/// the upstream calls (growth) made during it. With `warm`, every thread
/// first runs its sequence untimed and frees everything, in rounds, until
/// a round grows no pool (at most `WARM_ROUNDS`), so the timed pass finds
/// the pools grown.
fn run<T: Target>(t: &T, threads: usize, ops: u64, warm: bool) -> (f64, u64) {
    let round_done = Barrier::new(threads + 1);
    let decided = Barrier::new(threads + 1);
    let go = Barrier::new(threads + 1);
    let again = AtomicBool::new(warm);
    let (spans, grew) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|id| {
                let (round_done, decided, go, again) = (&round_done, &decided, &go, &again);
                s.spawn(move || {
                    let l = t.local();
                    let seed = 0x5eed_0000 + id as u64;
                    let mut live = Vec::with_capacity(LIVE);
                    while again.load(Ordering::Acquire) {
                        sequence(t, &l, seed, ops, &mut live);
                        for p in live.drain(..) {
                            t.free(&l, p);
                        }
                        t.finish(&l);
                        round_done.wait();
                        decided.wait();
                    }
                    go.wait();
                    let start = Instant::now();
                    sequence(t, &l, seed, ops, &mut live);
                    let end = Instant::now();
                    for p in live.drain(..) {
                        t.free(&l, p);
                    }
                    t.finish(&l);
                    (start, end)
                })
            })
            .collect();
        let mut grown = t.growth();
        let mut rounds = 0;
        while again.load(Ordering::Acquire) {
            round_done.wait();
            rounds += 1;
            let now = t.growth();
            if (rounds > 1 && now == grown) || rounds >= WARM_ROUNDS {
                again.store(false, Ordering::Release);
            }
            grown = now;
            decided.wait();
        }
        let before = t.growth();
        go.wait();
        let spans: Vec<(Instant, Instant)> = handles.into_iter().map(|h| h.join().expect("bench thread")).collect();
        (spans, t.growth() - before)
    });
    let start = spans.iter().map(|s| s.0).min().expect("one thread at least");
    let end = spans.iter().map(|s| s.1).max().expect("one thread at least");
    let elapsed: Duration = end - start;
    ((ops * threads as u64) as f64 / elapsed.as_secs_f64() / 1e6, grew)
}

fn print_row(name: &str, row: &[(f64, u64)], raw: Option<&[(f64, u64)]>) {
    print!("{name:<44}");
    for (r, _) in row {
        print!("{r:>9.2}");
    }
    let (one, eight, sixteen) = (row[0].0, row[3].0, row[4].0);
    print!("{:>9.1}x{:>9.2}", eight / one, sixteen / eight);
    match raw {
        Some(raw) => print!("{:>9.1}x", eight / raw[3].0),
        None => print!("{:>10}", "-"),
    }
    println!("{:>7}", row.iter().map(|r| r.1).sum::<u64>());
}

/// Runs `ops` steps on each of `threads` new threads with seeds from
/// `seed`, timed from a barrier to the last join (final frees included).
/// Also returns the most bytes the threads held at once (as asked), from
/// a sampler thread that sums the threads' own counters every 100 µs.
fn fresh_pass<T: Target>(t: &T, threads: usize, ops: u64, seed: u64) -> (Duration, usize) {
    let go = Barrier::new(threads + 1);
    let held: Vec<CachePadded<AtomicUsize>> = (0..threads).map(|_| CachePadded::new(AtomicUsize::new(0))).collect();
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|id| {
                let (go, held) = (&go, &held[id]);
                s.spawn(move || {
                    let l = t.local();
                    let mut live = Vec::with_capacity(LIVE);
                    go.wait();
                    sequence_counted(t, &l, seed + id as u64, ops, &mut live, Some(held));
                    for p in live.drain(..) {
                        t.free(&l, p);
                    }
                    held.store(0, Ordering::Relaxed);
                    t.finish(&l);
                })
            })
            .collect();
        let (held, done) = (&held, &done);
        let sampler = s.spawn(move || {
            let mut peak = 0;
            while !done.load(Ordering::Relaxed) {
                peak = peak.max(held.iter().map(|h| h.load(Ordering::Relaxed)).sum::<usize>());
                std::thread::sleep(Duration::from_micros(100));
            }
            peak
        });
        go.wait();
        let t0 = Instant::now();
        for h in handles {
            h.join().expect("bench thread");
        }
        let took = t0.elapsed();
        done.store(true, Ordering::Relaxed);
        (took, sampler.join().expect("sampler"))
    })
}

/// One row of the fresh-thread table: Mops/s per thread count, the churn
/// rate and upstream calls during the timed passes.
struct FreshRow {
    rates: Vec<f64>,
    churn: f64,
    calls: u64,
    /// The most bytes held at once by the threads of any pass (sampled).
    held: usize,
}

/// Warm-up by 16 threads, then every column on new threads (see the
/// module docs). `calls` reads the pool's upstream calls.
fn fresh_row<T: Target>(t: &T, calls: &dyn Fn() -> u64) -> FreshRow {
    let (_, mut held) = fresh_pass(t, 16, ops_per_thread(16, false), 0x0a11_0000);
    let calls0 = calls();
    let rates = THREADS
        .iter()
        .map(|&n| {
            let ops = ops_per_thread(n, false);
            let (d, h) = fresh_pass(t, n, ops, 0x5eed_0000 + (n as u64) * 1000);
            held = held.max(h);
            (ops * n as u64) as f64 / d.as_secs_f64() / 1e6
        })
        .collect();
    let churn_ops = ((10_000.0 * scale()) as u64).max(100);
    let t0 = Instant::now();
    for wave in 0..8u64 {
        held = held.max(fresh_pass(t, 8, churn_ops, 0xc4a0_0000 + wave * 100).1);
    }
    let churn = (64 * churn_ops) as f64 / t0.elapsed().as_secs_f64() / 1e6;
    FreshRow { rates, churn, calls: calls() - calls0, held }
}

fn print_fresh(name: &str, r: &FreshRow, after: &str) {
    print!("{name:<44}");
    for x in &r.rates {
        print!("{x:>9.2}");
    }
    println!("{:>9.2}{:>9.2}{:>7}  {after}", r.churn, r.churn / r.rates[3], r.calls);
}

/// Reserved (device: mapped) after the run over the most bytes the
/// threads held at once (sampled; as asked, so rounding counts against
/// the pool), with the pool's own peak in use.
fn ratio(reserved: usize, held: usize, pool_peak: usize) -> String {
    format!(
        "{} / {} MiB = {:.3} (the pool's peak in use {} MiB)",
        reserved >> 20,
        held >> 20,
        reserved as f64 / held.max(1) as f64,
        pool_peak >> 20
    )
}

/// The fresh-thread table (the peers' harness).
/// The fresh-thread rows' configuration: the default, or `CUMEM_PEERS_CONF`.
fn fresh_config() -> Config {
    match std::env::var("CUMEM_PEERS_CONF") {
        Ok(text) => text.parse().unwrap_or_else(|e| panic!("CUMEM_PEERS_CONF: {e}")),
        Err(_) => Config::new(),
    }
}

fn fresh_table(backend: BackendChoice, gpu: bool) {
    println!("\nFresh threads per column after a 16-thread warm-up (peers' harness), total Mops/s");
    if let Ok(conf) = std::env::var("CUMEM_PEERS_CONF") {
        println!("configuration: {conf}");
    }
    print!("{:<44}", "target");
    for t in THREADS {
        print!("{:>9}", format!("{t} thr"));
    }
    println!("{:>9}{:>9}{:>7}  after: reserved / most held at once", "churn", "ch/8", "calls");
    let stream = || if gpu { Stream::new().expect("cuStreamCreate") } else { Stream::host() };
    for per_thread in [false, true] {
        let mm = MemoryManager::new(fresh_config().backend(backend)).expect("a manager");
        let d = Device { mm, shared: stream(), per_thread, host: !gpu };
        let calls = || {
            let s = d.mm.default_device().expect("device").pool().stats();
            s.upstream_allocs + s.map_calls
        };
        let row = fresh_row(&d, &calls);
        let ds = d.mm.device_stats(0).expect("device stats");
        let s = ds.pool;
        let name = if per_thread { "device, a stream per thread" } else { "device, one shared stream" };
        let after = format!(
            "{}; stream waits {} ({:.1} ms), elided {}; maps {}",
            ratio(s.mapped, row.held, s.peak_in_use),
            ds.stream_waits,
            ds.stream_wait_ns as f64 / 1e6,
            ds.stream_waits_elided,
            s.map_calls,
        );
        print_fresh(name, &row, &after);
    }
    let p = Pinned(MemoryManager::new(fresh_config().backend(backend)).expect("a manager"));
    let calls = || p.0.pinned_stats().upstream_allocs;
    let row = fresh_row(&p, &calls);
    let s = p.0.pinned_stats();
    let after = ratio(s.reserved, row.held, s.peak_in_use);
    print_fresh("pinned", &row, &after);
}

/// Grows a fresh pinned pool to 10 GiB in these sizes from one thread.
fn pinned_growth(mm: MemoryManager) {
    let mut rng = SmallRng::seed_from_u64(7);
    let mut live = Vec::new();
    let t0 = Instant::now();
    while mm.pinned_stats().reserved < 10 << 30 {
        match mm.allocate_pinned(rng.gen_range(1..=MAX)) {
            Ok(p) => live.push(p),
            Err(e) => {
                println!("pinned growth stopped at {} MiB: {e}", mm.pinned_stats().reserved >> 20);
                break;
            }
        }
    }
    let took = t0.elapsed();
    let s = mm.pinned_stats();
    println!(
        "pinned growth to {} MiB ({} blocks live, {} MiB in use): {} upstream calls, {:.1} ms in all (allocation \
         loop included)",
        s.reserved >> 20,
        live.len(),
        s.in_use >> 20,
        s.upstream_allocs,
        took.as_secs_f64() * 1e3
    );
    for p in live {
        mm.free_pinned(p.as_ptr()).expect("pinned free");
    }
}

/// The peers' table. Without a GPU it is skipped, unless
/// `CUMEM_PEERS_HOST=1` runs the cumem rows on the host fallback (a smoke
/// test of the bench itself; its figures mean nothing for the GPU).
pub fn main() {
    let ctx = match driver_status() {
        DriverStatus::Available { .. } => Some(CudaContext::new(0).expect("device 0")),
        DriverStatus::Unavailable(why) if std::env::var("CUMEM_PEERS_HOST").is_ok_and(|v| v == "1") => {
            println!("peers' workload on the host fallback ({why}): the cumem rows only");
            None
        }
        DriverStatus::Unavailable(why) => {
            println!("peers' workload: no CUDA driver ({why}), skipped");
            return;
        }
    };
    let backend = if ctx.is_some() { BackendChoice::Auto } else { BackendChoice::Host };
    fresh_table(backend, ctx.is_some());
    if std::env::var("CUMEM_PEERS_FRESH_ONLY").is_ok_and(|v| v == "1") {
        return;
    }
    let manager = || MemoryManager::new(Config::new().backend(backend)).expect("a manager");
    let stream = || if ctx.is_some() { Stream::new().expect("cuStreamCreate") } else { Stream::host() };
    println!("\nThe peers' workload (uniform 1 B..4 MiB, <= {LIVE} live per thread, fair coin), total Mops/s");
    print!("{:<44}", "target");
    for t in THREADS {
        print!("{:>9}", format!("{t} thr"));
    }
    println!("{:>10}{:>9}{:>10}{:>7}", "8 vs 1", "16/8", "8 vs raw", "grew");
    let rows = |f: &dyn Fn(usize) -> (f64, u64)| THREADS.iter().map(|&t| f(t)).collect::<Vec<_>>();
    let (mut raw_shared, mut raw_each) = (None, None);
    if let Some(ctx) = &ctx {
        let shared = rows(&|t| {
            let raw = Raw { ctx: ctx.clone(), shared: Some(ctx.new_stream().expect("cuStreamCreate")) };
            run(&raw, t, ops_per_thread(t, true), false)
        });
        print_row("raw cuMemAllocAsync, one shared stream", &shared, None);
        let each = rows(&|t| run(&Raw { ctx: ctx.clone(), shared: None }, t, ops_per_thread(t, true), false));
        print_row("raw cuMemAllocAsync, a stream per thread", &each, None);
        (raw_shared, raw_each) = (Some(shared), Some(each));
    }
    let device = |per_thread: bool| {
        rows(&|t| {
            let d = Device { mm: manager(), shared: stream(), per_thread, host: ctx.is_none() };
            // One pool with a stream per thread is the slow case.
            run(&d, t, ops_per_thread(t, per_thread), true)
        })
    };
    let (s, e) = (raw_shared.as_deref(), raw_each.as_deref());
    print_row("cumem device, one shared stream", &device(false), s);
    print_row("cumem device, a stream per thread", &device(true), e);
    let pinned = rows(&|t| run(&Pinned(manager()), t, ops_per_thread(t, false), true));
    print_row("cumem pinned", &pinned, s);
    pinned_growth(manager());
}
