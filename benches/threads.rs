//! Threads: the peers' random workload the way an outside check runs it,
//! and a resizing thread pool. `cargo bench --bench threads` runs both;
//! `CUMEM_BENCH_CHECK=peers` or `=pool` runs one. `CUMEM_PEERS_SCALE`
//! multiplies the operations per thread (0.1 for a quick look).
//!
//! - `peers`: the peers' workload (`ANCHORS.md`): per thread, N steps
//!   (`ops_per_thread`): if fewer than 1,000 blocks are live and (none
//!   is, or a fair coin says so), allocate 1 B..4 MiB, else free a live
//!   block chosen uniformly. Through `MemoryManager::global()`, both pools
//!   warmed first. For 1, 2, 4, 8, 16 threads the rows run interleaved,
//!   each on new threads, timed from the first thread's start to the last
//!   one's end (final frees and stream synchronisation included;
//!   `CUMEM_CHECK_NOSYNC=1` leaves the synchronisation out): the device on
//!   one shared stream, on a stream per thread, the pinned pool, and (on a
//!   GPU) raw `cuMemAllocAsync` on one stream (a tenth of N). Beside each:
//!   the device's upstream calls, page maps and cross-stream waits.
//!   `CUMEM_CHECK_ROWS=one,each,pinned,raw` (any of them) picks rows.
//! - `pool`: rounds of 1 to 32 fresh OS threads (a seeded draw, the first
//!   rounds 1 and 32; `CUMEM_CHECK_SEED`), each mixing device (one shared
//!   stream) and pinned allocations of 1 B..4 MiB, at most 200 live; each
//!   thread leaves half of what it holds to the next round, which frees it
//!   first. Through `MemoryManager::new`. Printed per pool: physical memory
//!   held at the end and the pool's peak (on the device also the floor of
//!   touched pages) over the most bytes held at once; upstream calls, page
//!   maps and unmaps.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{result, CudaContext, CudaStream};
use cumem::cuda::{device_context, Stream};
use cumem::{Config, MemoryManager};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const THREADS: [usize; 5] = [1, 2, 4, 8, 16];
const MAX_SIZE: usize = 4 << 20;

fn scale() -> f64 {
    std::env::var("CUMEM_PEERS_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1.0)
}

/// The peers' N for `threads` threads, divided by `divide`.
fn ops_per_thread(threads: usize, divide: f64) -> u64 {
    let n = if threads == 1 { 200_000.0 } else { 100_000.0 };
    ((n * scale() / divide) as u64).max(100)
}

/// Something to allocate from, with per-thread state.
trait Target: Sync {
    type Local;
    fn local(&self) -> Self::Local;
    fn allocate(&self, l: &Self::Local, size: usize) -> u64;
    fn free(&self, l: &Self::Local, ptr: u64);
    fn finish(&self, _l: &Self::Local) {}
}

/// The device sync pool of the global manager: `shared` is the stream of
/// the one-stream row; `None` makes a new stream per thread.
struct Device {
    mm: &'static MemoryManager,
    shared: Option<Stream>,
}

impl Target for Device {
    type Local = Stream;
    fn local(&self) -> Stream {
        self.shared.clone().unwrap_or_else(|| Stream::new().expect("cuStreamCreate"))
    }
    fn allocate(&self, s: &Stream, size: usize) -> u64 {
        self.mm.allocate_device_on(size, s).expect("device allocation")
    }
    fn free(&self, s: &Stream, ptr: u64) {
        self.mm.free_device_on(ptr, s).expect("device free");
    }
    fn finish(&self, s: &Stream) {
        // `CUMEM_CHECK_NOSYNC=1`: the threads end without synchronising
        // their streams (a harness that queues no kernels may not).
        if std::env::var("CUMEM_CHECK_NOSYNC").is_err() {
            s.synchronize().expect("cuStreamSynchronize");
        }
    }
}

/// The pinned pool of the global manager.
struct Pinned(&'static MemoryManager);

impl Target for Pinned {
    type Local = ();
    fn local(&self) {}
    fn allocate(&self, _: &(), size: usize) -> u64 {
        self.0.allocate_pinned(size).expect("pinned allocation").as_ptr() as u64
    }
    fn free(&self, _: &(), ptr: u64) {
        self.0.free_pinned(ptr as *mut u8).expect("pinned free");
    }
}

/// Raw `cuMemAllocAsync` from the default pool, every thread on one stream.
struct Raw {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl Target for Raw {
    type Local = ();
    fn local(&self) {
        self.ctx.bind_to_thread().expect("cuCtxSetCurrent");
    }
    fn allocate(&self, _: &(), size: usize) -> u64 {
        // SAFETY: the stream belongs to the context bound to this thread.
        unsafe { result::malloc_async(self.stream.cu_stream(), size) }.expect("cuMemAllocAsync")
    }
    fn free(&self, _: &(), ptr: u64) {
        // SAFETY: `ptr` is this context's `cuMemAllocAsync`'s; no work uses it.
        unsafe { result::free_async(ptr, self.stream.cu_stream()) }.expect("cuMemFreeAsync");
    }
    fn finish(&self, _: &()) {
        self.stream.synchronize().expect("cuStreamSynchronize");
    }
}

/// `threads` new threads run `ops` steps each of the peers' workload (seeds
/// from `seed`), timed from the first start after a barrier to the last end.
fn pass<T: Target>(t: &T, threads: usize, ops: u64, seed: u64) -> Duration {
    let go = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|id| {
                let go = &go;
                s.spawn(move || {
                    let l = t.local();
                    let mut live = Vec::with_capacity(1000);
                    go.wait();
                    let start = Instant::now();
                    let mut rng = SmallRng::seed_from_u64(seed + id as u64);
                    for _ in 0..ops {
                        if live.len() < 1000 && (live.is_empty() || rng.gen_bool(0.5)) {
                            live.push(t.allocate(&l, rng.gen_range(1..=MAX_SIZE)));
                        } else {
                            let i = rng.gen_range(0..live.len());
                            t.free(&l, live.swap_remove(i));
                        }
                    }
                    for p in live {
                        t.free(&l, p);
                    }
                    t.finish(&l);
                    (start, Instant::now())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("bench thread")).collect()
    });
    let start = spans.iter().map(|s| s.0).min().expect("a thread");
    spans.iter().map(|s| s.1).max().expect("a thread") - start
}

/// The device's upstream calls, page maps and cross-stream waits so far.
fn device_counts(mm: &MemoryManager) -> [u64; 3] {
    let ds = mm.device_stats(0).expect("device stats");
    [ds.pool.upstream_allocs, ds.pool.map_calls, ds.stream_waits]
}

/// The peers' workload through the global manager, rows interleaved.
fn peers() {
    let mm = MemoryManager::global().expect("the global manager");
    let one = Device { mm, shared: Some(Stream::new().expect("cuStreamCreate")) };
    let each = Device { mm, shared: None };
    let pinned = Pinned(mm);
    let raw = device_context(0).ok().flatten().filter(|c| c.has_async_alloc()).map(|ctx| {
        ctx.bind_to_thread().expect("cuCtxSetCurrent");
        Raw { stream: ctx.new_stream().expect("cuStreamCreate"), ctx }
    });
    pass(&one, 16, ops_per_thread(16, 1.0), 0x0a11_0000);
    pass(&pinned, 16, ops_per_thread(16, 1.0), 0x0a12_0000);
    println!("\nThe peers' workload as the check runs it ({}, rows interleaved, new threads)", mm.backend());
    println!("{:<34}{:>8}{:>10}{:>9}{:>8}{:>8}{:>8}", "row", "threads", "Mops/s", "ms", "dcalls", "maps", "waits");
    let names = ["one", "each", "pinned", "raw"];
    let rows = std::env::var("CUMEM_CHECK_ROWS").unwrap_or_else(|_| names.join(","));
    let wanted: Vec<usize> = (0..4).filter(|&r| rows.split(',').any(|w| w.trim() == names[r])).collect();
    let titles =
        ["device, one shared stream", "device, a stream per thread", "pinned", "raw cuMemAllocAsync, one stream"];
    let mut table = vec![Vec::new(); 4];
    for n in THREADS {
        for &r in &wanted {
            let ops = ops_per_thread(n, if r == 3 { 10.0 } else { 1.0 });
            let seed = 0x5eed_0000 + (n as u64) * 1000 + (r as u64) * 100;
            let before = device_counts(mm);
            let took = match (r, &raw) {
                (0, _) => pass(&one, n, ops, seed),
                (1, _) => pass(&each, n, ops, seed),
                (2, _) => pass(&pinned, n, ops, seed),
                (_, Some(raw)) => pass(raw, n, ops, seed),
                (_, None) => continue,
            };
            let after = device_counts(mm);
            let rate = (ops * n as u64) as f64 / took.as_secs_f64() / 1e6;
            table[r].push(rate);
            let [calls, maps, waits] = [0, 1, 2].map(|i| after[i] - before[i]);
            let ms = took.as_secs_f64() * 1e3;
            println!("{:<34}{n:>8}{rate:>10.2}{ms:>9.1}{calls:>8}{maps:>8}{waits:>8}", titles[r]);
        }
    }
    println!("\nsummary (Mops/s)");
    print!("{:<34}", "row");
    for n in THREADS {
        print!("{:>9}", format!("{n} thr"));
    }
    println!("{:>9}", "16/8");
    for (name, rates) in titles.iter().zip(&table).filter(|(_, rates)| rates.len() == THREADS.len()) {
        print!("{name:<34}");
        for r in rates {
            print!("{r:>9.2}");
        }
        println!("{:>9.2}", rates[4] / rates[3]);
    }
    let (ds, ps) = (mm.device_stats(0).expect("device stats").pool, mm.pinned_stats());
    println!(
        "after: device mapped {} MiB, peak in use {} MiB, map calls {}; pinned reserved {} MiB, peak in use {} MiB",
        ds.mapped >> 20,
        ds.peak_in_use >> 20,
        ds.map_calls,
        ps.reserved >> 20,
        ps.peak_in_use >> 20
    );
}

/// Bytes held (as asked) in one pool now, and the most at once.
#[derive(Default)]
struct Held {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Held {
    fn add(&self, n: usize) {
        let now = self.now.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
    fn peak(&self) -> f64 {
        self.peak.load(Ordering::Relaxed).max(1) as f64
    }
}

/// A block one pool thread holds: (device?, address, size).
type Block = (bool, u64, usize);

/// The resizing thread pool (see the module docs).
fn pool() {
    const ROUNDS: usize = 24;
    const LIVE: usize = 200;
    let ops = ((4_000.0 * scale()) as usize).max(100);
    let mm = MemoryManager::new(Config::from_env().expect("CUMEM_CONF")).expect("a manager");
    let stream = Stream::new().expect("cuStreamCreate");
    let (dev, pin) = (Held::default(), Held::default());
    let carried: Mutex<Vec<Block>> = Mutex::new(Vec::new());
    let seed: u64 = std::env::var("CUMEM_CHECK_SEED")
        .ok()
        .and_then(|v| v.strip_prefix("0x").map_or_else(|| v.parse().ok(), |h| u64::from_str_radix(h, 16).ok()))
        .unwrap_or(0x9001);
    let free = |b: Block| {
        if b.0 {
            mm.free_device_on(b.1, &stream).expect("device free");
            dev.now.fetch_sub(b.2, Ordering::Relaxed);
        } else {
            mm.free_pinned(b.1 as *mut u8).expect("pinned free");
            pin.now.fetch_sub(b.2, Ordering::Relaxed);
        }
    };
    let mut rng = SmallRng::seed_from_u64(seed);
    let t0 = Instant::now();
    let mut sizes = Vec::new();
    for round in 0..ROUNDS {
        let n = match round {
            0 => 1,
            1 => 32,
            _ => rng.gen_range(1..=32),
        };
        sizes.push(n);
        // The blocks the round before left, shared out among this round.
        let inherited = std::mem::take(&mut *carried.lock().unwrap());
        let per = inherited.len().div_ceil(n).max(1);
        let mut parts = inherited.chunks(per).map(<[Block]>::to_vec);
        std::thread::scope(|s| {
            for id in 0..n {
                let mine = parts.next().unwrap_or_default();
                let (mm, stream, dev, pin, carried, free) = (&mm, &stream, &dev, &pin, &carried, &free);
                s.spawn(move || {
                    mine.into_iter().for_each(free);
                    let mut r = SmallRng::seed_from_u64(seed ^ (((round as u64) << 32) | id as u64));
                    let mut live: Vec<Block> = Vec::with_capacity(LIVE);
                    for _ in 0..ops {
                        if live.len() < LIVE && (live.is_empty() || r.gen_bool(0.5)) {
                            let size = r.gen_range(1..=MAX_SIZE);
                            if r.gen_bool(0.5) {
                                let p = mm.allocate_device_on(size, stream).expect("device allocation");
                                dev.add(size);
                                live.push((true, p, size));
                            } else {
                                let p = mm.allocate_pinned(size).expect("pinned allocation").as_ptr() as u64;
                                pin.add(size);
                                live.push((false, p, size));
                            }
                        } else {
                            let i = r.gen_range(0..live.len());
                            free(live.swap_remove(i));
                        }
                    }
                    // Half goes to the next round; the rest is freed here.
                    let keep = live.split_off(live.len() / 2);
                    live.into_iter().for_each(free);
                    carried.lock().unwrap().extend(keep);
                });
            }
        });
    }
    let took = t0.elapsed();
    stream.synchronize().expect("cuStreamSynchronize");
    let (ds, ps) = (mm.device_stats(0).expect("device stats").pool, mm.pinned_stats());
    let (dp, pp) = (dev.peak(), pin.peak());
    let of = |b: usize, held: f64| format!("{} MiB = {:.3}", b >> 20, b as f64 / held);
    println!("\nA resizing thread pool (seed {seed:#x}): {ROUNDS} rounds of {sizes:?} fresh threads, {ops} steps each");
    println!(
        "device: end mapped {} / most held at once {} MiB; peak mapped {}; the most pages live blocks \
         touched (the floor) {}; upstream calls {}, map calls {}, unmap calls {}",
        of(ds.mapped, dp),
        dp as usize >> 20,
        of(ds.peak_mapped, dp),
        of(ds.peak_touched, dp),
        ds.upstream_allocs,
        ds.map_calls,
        ds.unmap_calls,
    );
    println!(
        "pinned: end reserved {} / most held at once {} MiB; peak reserved {}; upstream calls {}",
        of(ps.reserved, pp),
        pp as usize >> 20,
        of(ps.peak_reserved, pp),
        ps.upstream_allocs,
    );
    println!("took {:.2} s", took.as_secs_f64());
    std::mem::take(&mut *carried.lock().unwrap()).into_iter().for_each(free);
}

fn main() {
    match std::env::var("CUMEM_BENCH_CHECK").as_deref() {
        Ok("peers") => peers(),
        Ok("pool") => pool(),
        Ok(other) => eprintln!("CUMEM_BENCH_CHECK={other}: the workloads are `peers` and `pool`"),
        Err(_) => {
            peers();
            pool();
        }
    }
}
