//! Scaling across threads: random sizes from 1 B to 4 MiB (log-uniform),
//! random frees, at most 1,000 live blocks per thread, 1 to 16 threads;
//! reported as total operations (allocations + frees) per second. Also the
//! hot pair (allocate + free of one size) with and without thread caches.
//!
//! Targets: the pinned pool on the host fallback (always), and where a CUDA
//! driver is available the device sync pool, the pinned pool, and raw
//! `cuMemAllocAsync`/`cuMemFreeAsync` (one stream per thread). Each pool
//! runs with its thread cache on and off.
//!
//! `cargo bench --bench threads` (filter with criterion's usual argument,
//! e.g. `-- scaling/host`); a plain table of Mops/s follows criterion's
//! output. `CUMEM_BENCH_SIZES=uniform` draws sizes uniformly instead;
//! `CUMEM_BENCH_CACHE_MIB` sets the per-thread cache budget.
//!
//! First comes the peers' own workload (`peers.rs`, the anchors' exact
//! definition) through the manager, beside raw `cuMemAllocAsync` of the
//! same run; `CUMEM_BENCH_PEERS_ONLY=1` stops after it.
//! `CUMEM_BENCH_CHECK=peers` or `=pool` runs only the workload of that
//! name the way an outside check runs it (`threads/check.rs`).

use std::collections::BTreeMap;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use cudarc::driver::CudaContext;
use cumem::cuda::{driver_status, DriverStatus};
use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::{CudaDeviceMemory, CudaPinnedMemory};
use cumem::upstream::{Host, Upstream};
use cumem::PoolKind;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[path = "threads/check.rs"]
mod check;
#[path = "threads/peers.rs"]
mod peers;

const MAX_LIVE: usize = 1000;
const MAX_SIZE: f64 = (4 << 20) as f64;
const THREADS: [usize; 5] = [1, 2, 4, 8, 16];

/// Something to allocate from, with per-thread state.
trait Target: Sync {
    type Local;
    fn local(&self) -> Self::Local;
    fn allocate(&self, l: &Self::Local, size: usize) -> u64;
    fn free(&self, l: &Self::Local, ptr: u64);
    fn finish(&self, _l: &Self::Local) {}
    /// Upstream calls made so far (growth), where the target counts them.
    fn growth(&self) -> u64 {
        0
    }
}

impl<U: Upstream> Target for Pool<U> {
    type Local = ();
    fn local(&self) {}
    fn allocate(&self, _: &(), size: usize) -> u64 {
        Pool::allocate(self, size, 256).expect("pool allocation").addr as u64
    }
    fn free(&self, _: &(), ptr: u64) {
        self.deallocate(ptr as usize, StreamTag::NONE).expect("pool free");
    }
}

/// A request size: log-uniform from 1 B to 4 MiB (as many 1-2 KiB
/// requests as 1-2 MiB ones), or uniform with `CUMEM_BENCH_SIZES=uniform`.
fn size(rng: &mut SmallRng) -> usize {
    if *UNIFORM {
        rng.gen_range(1..=MAX_SIZE as usize)
    } else {
        (rng.gen_range(0.0..MAX_SIZE.ln()).exp() as usize).max(1)
    }
}

static UNIFORM: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var("CUMEM_BENCH_SIZES").is_ok_and(|v| v == "uniform"));

/// One thread's random operations: allocate or free with equal odds,
/// within `MAX_LIVE` live blocks.
fn step<T: Target>(t: &T, l: &T::Local, rng: &mut SmallRng, live: &mut Vec<u64>) {
    if live.is_empty() || (live.len() < MAX_LIVE && rng.gen_bool(0.5)) {
        live.push(t.allocate(l, size(rng)));
    } else {
        let i = rng.gen_range(0..live.len());
        t.free(l, live.swap_remove(i));
    }
}

/// Runs `ops` operations on each of `threads` threads; returns the wall
/// time of the timed part (after every thread has 500 live blocks).
fn run<T: Target>(t: &T, threads: usize, ops: u64) -> Duration {
    let start = Barrier::new(threads + 1);
    let end = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        for id in 0..threads {
            let (start, end) = (&start, &end);
            s.spawn(move || {
                let l = t.local();
                let mut rng = SmallRng::seed_from_u64(id as u64 * 7919 + ops);
                let mut live: Vec<u64> = (0..MAX_LIVE / 2).map(|_| t.allocate(&l, size(&mut rng))).collect();
                start.wait();
                for _ in 0..ops {
                    step(t, &l, &mut rng, &mut live);
                }
                end.wait();
                for p in live {
                    t.free(&l, p);
                }
                t.finish(&l);
            });
        }
        start.wait();
        let t0 = Instant::now();
        end.wait();
        t0.elapsed()
    })
}

type Table = Mutex<BTreeMap<String, BTreeMap<usize, (u64, Duration)>>>;

/// Share of allocations served by thread caches, per pool target.
type Hits = Mutex<BTreeMap<String, f64>>;

/// Allocations served in all, and by the shared pool.
fn counts<U: Upstream>(pool: &Pool<U>) -> (u64, u64) {
    (pool.stats().allocations, pool.with_fit(|f| f.stats().allocations))
}

/// Runs the scaling benchmark on a pool and records its cache hit rate.
fn scaling_pool<U: Upstream>(c: &mut Criterion, table: &Table, hits: &Hits, name: &str, pool: &Pool<U>) {
    let (all0, shared0) = counts(pool);
    scaling(c, table, name, pool);
    let (all, shared) = counts(pool);
    let (all, shared) = (all - all0, shared - shared0);
    hits.lock().unwrap().insert(name.to_string(), (all - shared) as f64 / all.max(1) as f64);
}

fn scaling<T: Target>(c: &mut Criterion, table: &Table, name: &str, t: &T) {
    let mut g = c.benchmark_group(format!("scaling/{name}"));
    for threads in THREADS {
        g.throughput(Throughput::Elements(threads as u64));
        g.bench_with_input(BenchmarkId::from_parameter(threads), &threads, |b, &threads| {
            b.iter_custom(|iters| {
                let d = run(t, threads, iters);
                let mut table = table.lock().unwrap();
                let e = table.entry(name.to_string()).or_default().entry(threads).or_default();
                e.0 += iters * threads as u64;
                e.1 += d;
                d
            })
        });
    }
    g.finish();
}

fn pair<U: Upstream>(c: &mut Criterion, name: &str, pool: &Pool<U>) {
    let mut g = c.benchmark_group(format!("pair/{name}"));
    for (label, size) in [("256B", 256), ("64KiB", 64 << 10), ("2MiB", 2 << 20)] {
        g.bench_function(label, |b| {
            b.iter(|| {
                let a = pool.allocate(std::hint::black_box(size), 256).unwrap();
                pool.deallocate(a.addr, StreamTag::NONE).unwrap();
            })
        });
    }
    g.finish();
}

fn config(kind: PoolKind, cache: bool) -> PoolConfig {
    let mut c = PoolConfig::new(kind);
    c.thread_cache = cache;
    // Per-thread cache budget in MiB, for experiments.
    if let Some(mib) = std::env::var("CUMEM_BENCH_CACHE_MIB").ok().and_then(|v| v.parse::<usize>().ok()) {
        c.thread_cache_bytes = mib << 20;
    }
    c
}

fn main() {
    if check::main() {
        return;
    }
    peers::main();
    if std::env::var("CUMEM_BENCH_PEERS_ONLY").is_ok_and(|v| v == "1") {
        return;
    }
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    let table = Table::default();
    let hits = Hits::default();
    for cache in [true, false] {
        let tag = if cache { "cache_on" } else { "cache_off" };
        let host = Pool::new(Host::new(), config(PoolKind::Pinned, cache));
        pair(&mut c, &format!("host_pinned_pool/{tag}"), &host);
        scaling_pool(&mut c, &table, &hits, &format!("host_pinned_pool/{tag}"), &host);
    }
    match driver_status() {
        DriverStatus::Available { .. } => {
            let ctx = CudaContext::new(0).expect("device 0");
            for cache in [true, false] {
                let tag = if cache { "cache_on" } else { "cache_off" };
                let dev = Pool::new(CudaDeviceMemory::new(ctx.clone()), config(PoolKind::Device, cache));
                pair(&mut c, &format!("device_sync_pool/{tag}"), &dev);
                scaling_pool(&mut c, &table, &hits, &format!("device_sync_pool/{tag}"), &dev);
                drop(dev);
                // Pinned memory is reserved up front, as a program sets
                // `pinned_pool_size` at start: growing it inside the timed
                // loop would time `cuMemHostAlloc` (about 1 ms per call,
                // serialised in the driver), not the pool.
                let mut pc = config(PoolKind::Pinned, cache);
                pc.initial_size = 10 << 30;
                let pinned = Pool::new(CudaPinnedMemory::new(ctx.clone()), pc);
                // Make the reservation now, outside the measurements.
                if let Ok(a) = pinned.allocate(256, 256) {
                    let _ = pinned.deallocate(a.addr, StreamTag::NONE);
                }
                scaling_pool(&mut c, &table, &hits, &format!("cuda_pinned_pool/{tag}"), &pinned);
            }
            if ctx.has_async_alloc() {
                scaling(&mut c, &table, "raw_cuMemAllocAsync", &peers::Raw { ctx: ctx.clone(), shared: None });
            }
        }
        DriverStatus::Unavailable(why) => println!("no CUDA driver ({why}): host fallback only"),
    }
    c.final_summary();

    let dist = if *UNIFORM { "uniform" } else { "log-uniform" };
    println!("\nTotal Mops/s (allocations + frees), {dist} 1 B..4 MiB, <= {MAX_LIVE} live per thread");
    print!("{:<34}", "target");
    for t in THREADS {
        print!("{:>9}", format!("{t} thr"));
    }
    println!("{:>10}{:>10}", "16 vs 1", "hits");
    for (name, row) in table.lock().unwrap().iter() {
        print!("{name:<34}");
        let rate = |t: &usize| row.get(t).map(|(ops, d)| *ops as f64 / d.as_secs_f64() / 1e6);
        for t in THREADS {
            match rate(&t) {
                Some(r) => print!("{r:>9.2}"),
                None => print!("{:>9}", "-"),
            }
        }
        match (rate(&1), rate(&16)) {
            (Some(a), Some(b)) => print!("{:>9.1}x", b / a),
            _ => print!("{:>10}", "-"),
        }
        match hits.lock().unwrap().get(name) {
            Some(h) => println!("{:>9.0}%", h * 100.0),
            None => println!("{:>10}", "-"),
        }
    }
}
