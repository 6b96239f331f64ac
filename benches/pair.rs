//! Allocate + free of one block, same size, repeated (hot): cumem against
//! the raw driver calls, measured in one run.
//!
//! - host: the best-fit pool over the host upstream, and the manager's
//!   device path on the host fallback (always);
//! - device (GPU only): each device mode of cumem, with capture detection
//!   and without (`*_no_detection`), against `cuMemAlloc` / `cuMemFree`
//!   and `cuMemAllocAsync` / `cuMemFreeAsync` on one stream;
//! - pinned (GPU only): the pinned pool against `cuMemHostAlloc` /
//!   `cuMemFreeHost`.
//!
//! The managers start from `CUMEM_CONF`: one binary compares configurations.
//!
//! Criterion runs each case with few samples; every timed batch is also
//! recorded here, and a plain summary (median ns per pair, ratio against
//! the raw driver calls) is printed at the end.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use cudarc::driver::{result, sys};
use cumem::cuda::{driver_status, DriverStatus};
use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::Host;
use cumem::{BackendChoice, Config, DeviceAllocatorMode, MemoryManager, PoolKind, Stream};

const DEVICE_SIZES: [usize; 4] = [256, 64 << 10, 2 << 20, 64 << 20];
const PINNED_SIZES: [usize; 3] = [4 << 10, 1 << 20, 64 << 20];

/// A benchmark case: (group, size, target).
type Case = (&'static str, usize, String);

/// ns per pair of every timed batch, by case.
static SAMPLES: Mutex<BTreeMap<Case, Vec<f64>>> = Mutex::new(BTreeMap::new());

/// Runs `pair` as a criterion benchmark and records each batch's ns/pair.
fn bench_pair(c: &mut Criterion, group: &'static str, target: &str, size: usize, mut pair: impl FnMut()) {
    let mut g = c.benchmark_group(group);
    g.bench_function(BenchmarkId::new(target, size_name(size)), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                pair();
            }
            let elapsed = start.elapsed();
            let per = elapsed.as_nanos() as f64 / iters.max(1) as f64;
            SAMPLES.lock().unwrap().entry((group, size, target.to_string())).or_default().push(per);
            elapsed
        })
    });
    g.finish();
}

/// Every manager's configuration here: `CUMEM_CONF`, or the defaults.
fn base() -> Config {
    Config::from_env().expect("CUMEM_CONF")
}

fn size_name(size: usize) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// Allocate + free of `size` device bytes through `mm`, on `stream` (or none).
fn manager_pair(
    c: &mut Criterion,
    group: &'static str,
    target: &str,
    mm: &MemoryManager,
    on: Option<&Stream>,
    size: usize,
) {
    bench_pair(c, group, target, size, || match on {
        Some(s) => {
            let p = mm.allocate_device_on(size, s).expect("allocate");
            mm.free_device_on(std::hint::black_box(p), s).expect("free");
        }
        None => {
            let p = mm.allocate_device(size).expect("allocate");
            mm.free_device(std::hint::black_box(p)).expect("free");
        }
    });
}

fn host_benches(c: &mut Criterion) {
    let pool = Pool::new(Host::new(), PoolConfig::new(PoolKind::Standalone));
    let mm = MemoryManager::new(base().backend(BackendChoice::Host)).expect("host manager");
    let cached =
        MemoryManager::new(base().backend(BackendChoice::Host).device_thread_cache(true)).expect("host manager");
    for size in DEVICE_SIZES {
        bench_pair(c, "host", "host_pool", size, || {
            let a = pool.allocate(size, 256).expect("allocate");
            pool.deallocate(std::hint::black_box(a.addr), StreamTag::NONE).expect("free");
        });
        manager_pair(c, "host", "host_manager_device", &mm, None, size);
        manager_pair(c, "host", "host_manager_device_thread_cache", &cached, None, size);
    }
}

fn device_benches(c: &mut Criterion, ctx: &std::sync::Arc<cudarc::driver::CudaContext>) {
    let stream = Stream::new().expect("stream");
    // The context's legacy (null) stream, as PyTorch's default stream
    // reaches cumem: its question needs the context current on the thread.
    let legacy = Stream::from_cudarc(ctx.default_stream());
    for mode in DeviceAllocatorMode::ALL.map(Some).into_iter().chain([None]) {
        // `None`: the sync pool with per-thread caches from the start (a block
        // freed on a stream is reused by that stream without the pool lock).
        let (config, name) = match mode {
            Some(m) => (base().mode(m), m.name().to_string()),
            None => (base().device_thread_cache(true), "sync_pool_thread_cache".to_string()),
        };
        let mm = MemoryManager::new(config.clone()).expect("manager");
        let effective = mm.effective_device_allocator_mode();
        if mode.is_some_and(|m| m != effective) {
            println!("pair: {name} runs as {effective} on this device; skipped");
            continue;
        }
        // The same without capture detection: the program promises to
        // register its captures, so no call asks the driver whether the
        // stream captures (the default asks on every call on a stream).
        let promised = MemoryManager::new(config.promise_registered_captures(true)).expect("manager");
        let mut cases =
            vec![(name.clone(), &mm, Some(&stream)), (format!("{name}_no_detection"), &promised, Some(&stream))];
        if mode == Some(DeviceAllocatorMode::SyncPool) {
            cases.push(("sync_pool_no_stream".into(), &mm, None));
            cases.push(("sync_pool_legacy".into(), &mm, Some(&legacy)));
            cases.push(("sync_pool_legacy_no_detection".into(), &promised, Some(&legacy)));
        }
        for size in DEVICE_SIZES {
            for (target, mm, on) in &cases {
                manager_pair(c, "device", target, mm, *on, size);
            }
        }
        stream.synchronize().expect("sync");
    }
    ctx.bind_to_thread().expect("bind");
    let cu = stream.cu_stream();
    for size in DEVICE_SIZES {
        bench_pair(c, "device", "raw_cumemalloc", size, || {
            // SAFETY: the context is current; the memory is freed, untouched.
            let p = unsafe { result::malloc_sync(size) }.expect("cuMemAlloc");
            // SAFETY: `p` came from cuMemAlloc just now and is freed once.
            unsafe { result::free_sync(std::hint::black_box(p)) }.expect("cuMemFree");
        });
        bench_pair(c, "device", "raw_cumemallocasync", size, || {
            // SAFETY: `cu` is a live stream of the current context; the
            // memory is freed on it at once and never used.
            let p = unsafe { result::malloc_async(cu, size) }.expect("cuMemAllocAsync");
            // SAFETY: `p` came from cuMemAllocAsync on `cu`, freed once.
            unsafe { result::free_async(std::hint::black_box(p), cu) }.expect("cuMemFreeAsync");
        });
    }
    stream.synchronize().expect("sync");
}

fn pinned_benches(c: &mut Criterion, ctx: &std::sync::Arc<cudarc::driver::CudaContext>) {
    let mm = MemoryManager::new(base()).expect("manager");
    for size in PINNED_SIZES {
        bench_pair(c, "pinned", "pinned_pool", size, || {
            let p = mm.allocate_pinned(size).expect("allocate");
            mm.free_pinned(std::hint::black_box(p.as_ptr())).expect("free");
        });
    }
    ctx.bind_to_thread().expect("bind");
    for size in PINNED_SIZES {
        bench_pair(c, "pinned", "raw_cumemhostalloc", size, || {
            // SAFETY: the context is current; the memory is freed, untouched.
            let p = unsafe { result::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) }.expect("cuMemHostAlloc");
            // SAFETY: `p` came from cuMemHostAlloc just now, freed once.
            unsafe { result::free_host(std::hint::black_box(p)) }.expect("cuMemFreeHost");
        });
    }
}

fn print_summary() {
    let samples = SAMPLES.lock().unwrap();
    let mut medians: BTreeMap<(&str, usize), Vec<(String, f64)>> = BTreeMap::new();
    for ((group, size, target), v) in samples.iter() {
        let mut v = v.clone();
        v.sort_by(f64::total_cmp);
        medians.entry((*group, *size)).or_default().push((target.clone(), v[v.len() / 2]));
    }
    println!();
    println!("pair summary (median ns per allocate+free pair; ratio = ours / raw driver, lower is better)");
    println!(
        "{:<8} {:>8}  {:<32} {:>14} {:>12} {:>14}",
        "group", "size", "target", "ns/pair", "vs cuMemAlloc", "vs raw async/host"
    );
    for ((group, size), rows) in &medians {
        let raw = |name: &str| rows.iter().find(|(t, _)| t == name).map(|r| r.1);
        let (sync_raw, other_raw) = match *group {
            "device" => (raw("raw_cumemalloc"), raw("raw_cumemallocasync")),
            "pinned" => (None, raw("raw_cumemhostalloc")),
            _ => (None, None),
        };
        for (target, ns) in rows {
            let ratio = |r: Option<f64>| r.map_or_else(|| "-".to_string(), |r| format!("{:.4}x", ns / r));
            println!(
                "{:<8} {:>8}  {:<32} {:>14.1} {:>12} {:>14}",
                group,
                size_name(*size),
                target,
                ns,
                ratio(sync_raw),
                ratio(other_raw)
            );
        }
    }
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(150))
        .measurement_time(Duration::from_millis(400))
        .without_plots()
        .configure_from_args();
    host_benches(&mut c);
    match driver_status() {
        DriverStatus::Available { .. } => {
            let ctx = cumem::cuda::device_context(0).expect("context").expect("a device");
            device_benches(&mut c, &ctx);
            pinned_benches(&mut c, &ctx);
        }
        DriverStatus::Unavailable(why) => {
            println!("pair: no GPU ({why}); device and pinned benches skipped")
        }
    }
    c.final_summary();
    print_summary();
}
