//! Two workloads the way an outside check runs them, each in a process of
//! its own (`CUMEM_BENCH_CHECK=peers` or `=pool`; nothing else runs), and
//! pinned growth alone (`=pin`: a pinned pool grown to 4 GiB by one
//! thread, then by 16 at once; the time and the upstream calls).
//!
//! - `peers`: the peers' random workload (`ANCHORS.md`) exactly as their
//!   harness runs it. One process, one manager: `MemoryManager::global()`
//!   with the default configuration (`CUMEM_CONF` unset). Both pools are
//!   warmed first, each by a round of 16 threads with seeds of their own
//!   (the device on the shared stream). Then for each thread count 1, 2,
//!   4, 8, 16 the rows run interleaved: the device on one shared stream
//!   (made once, for the whole run), the device with a new stream per
//!   thread, and the pinned pool; each row on NEW threads with their own
//!   seeds, timed from a barrier to the last join (the threads' final
//!   frees and stream synchronisation included; `CUMEM_CHECK_NOSYNC=1`
//!   leaves the synchronisation out). Beside each figure: the
//!   upstream calls (device: chunks), the page maps and the cross-stream
//!   waits during that row; for the device rows also the page unmaps and
//!   the time the row's threads spent moving pages (summed over the
//!   threads). `CUMEM_CHECK_ROWS=one,each,pinned` (any
//!   of them) runs only those rows, after the same warm-up.
//! - `pool`: a resizing thread pool. Rounds of fresh OS threads, from 1 to
//!   32 a round (a seeded draw, the first rounds 1 and 32), each thread a
//!   mix of device work (one shared stream) and pinned work (a fair coin
//!   per allocation), sizes uniform in 1 B..4 MiB, at most 200 live blocks
//!   per thread; at its end each thread leaves half of what it holds to the
//!   next round, whose threads free it first (frees cross rounds). The
//!   bytes held (as asked) are counted per pool on every step; at the end
//!   the pools' reserved bytes (device: mapped) over the most bytes held
//!   at once, per pool. Through `MemoryManager::new` with the default
//!   configuration (or `CUMEM_CONF`). `CUMEM_CHECK_SEED` draws other round
//!   sizes and sequences (default 0x9001). Printed per pool: physical
//!   memory held at the end (device: mapped and kept; pinned: reserved)
//!   over the most bytes held at once (the *end* ratio); the most
//!   physical memory the pool held at once, sampled every 200 µs by a
//!   thread of the bench (a lower bound of the true peak), and the pool's
//!   own peak, each over the most bytes held; and the driver work:
//!   upstream calls, page maps and unmaps.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use cumem::cuda::Stream;
use cumem::{Config, MemoryManager};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::peers::{ops_per_thread, sequence_counted};
use super::Target;

const THREADS: [usize; 5] = [1, 2, 4, 8, 16];

/// The device sync pool of the global manager: `shared` is the one stream
/// of the one-stream rows; `None` makes a new stream per thread.
struct GlobalDevice {
    mm: &'static MemoryManager,
    shared: Option<Stream>,
}

impl Target for GlobalDevice {
    type Local = Stream;
    fn local(&self) -> Stream {
        match &self.shared {
            Some(s) => s.clone(),
            None => Stream::new().expect("cuStreamCreate"),
        }
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
struct GlobalPinned(&'static MemoryManager);

impl Target for GlobalPinned {
    type Local = ();
    fn local(&self) {}
    fn allocate(&self, _: &(), size: usize) -> u64 {
        self.0.allocate_pinned(size).expect("pinned allocation").as_ptr() as u64
    }
    fn free(&self, _: &(), ptr: u64) {
        self.0.free_pinned(ptr as *mut u8).expect("pinned free");
    }
}

/// `threads` new threads run `ops` steps each (seeds from `seed`), timed
/// from a barrier to the last join.
fn pass<T: Target>(t: &T, threads: usize, ops: u64, seed: u64) -> Duration {
    let go = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|id| {
                let go = &go;
                s.spawn(move || {
                    let l = t.local();
                    let mut live = Vec::with_capacity(1000);
                    go.wait();
                    sequence_counted(t, &l, seed + id as u64, ops, &mut live, None);
                    for p in live.drain(..) {
                        t.free(&l, p);
                    }
                    t.finish(&l);
                })
            })
            .collect();
        go.wait();
        let t0 = Instant::now();
        for h in handles {
            h.join().expect("bench thread");
        }
        t0.elapsed()
    })
}

/// What changed in the manager during a row.
#[derive(Clone, Copy, Default)]
struct Counts {
    dev_calls: u64,
    dev_maps: u64,
    waits: u64,
    pinned_calls: u64,
    /// Page unmaps, and the time the allocating threads spent moving pages.
    dev_unmaps: u64,
    move_ns: u64,
    /// Pinned bytes reserved.
    pinned_reserved: usize,
}

fn counts(mm: &MemoryManager) -> Counts {
    let ds = mm.device_stats(0).expect("device stats");
    let ps = mm.pinned_stats();
    Counts {
        dev_calls: ds.pool.upstream_allocs,
        dev_maps: ds.pool.map_calls,
        waits: ds.stream_waits,
        pinned_calls: ps.upstream_allocs,
        dev_unmaps: ds.pool.unmap_calls,
        move_ns: ds.pool.page_move_ns,
        pinned_reserved: ps.reserved,
    }
}

/// The peers' workload through the global manager, rows interleaved.
fn peers() {
    let mm = MemoryManager::global().expect("the global manager");
    let shared = Stream::new().expect("cuStreamCreate");
    let one = GlobalDevice { mm, shared: Some(shared) };
    let each = GlobalDevice { mm, shared: None };
    let pinned = GlobalPinned(mm);
    pass(&one, 16, ops_per_thread(16, false), 0x0a11_0000);
    pass(&pinned, 16, ops_per_thread(16, false), 0x0a12_0000);
    println!("\nThe peers' workload as the check runs it (global manager, rows interleaved, new threads), Mops/s");
    println!("{:<34}{:>8}{:>10}{:>9}{:>8}{:>8}{:>8}", "row", "threads", "Mops/s", "ms", "dcalls", "maps", "waits");
    let mut table: Vec<(&str, Vec<f64>)> =
        ["device, one shared stream", "device, a stream per thread", "pinned"].map(|n| (n, Vec::new())).into();
    // `CUMEM_CHECK_ROWS=one,each,pinned` (any of them) runs only those
    // rows (a profile of one row), after the same warm-up.
    let rows = std::env::var("CUMEM_CHECK_ROWS").unwrap_or_else(|_| "one,each,pinned".into());
    let wanted = |r: usize| rows.split(',').any(|w| w.trim() == ["one", "each", "pinned"][r]);
    for n in THREADS {
        let ops = ops_per_thread(n, false);
        for (r, (name, rates)) in table.iter_mut().enumerate().filter(|(r, _)| wanted(*r)) {
            let seed = 0x5eed_0000 + (n as u64) * 1000 + (r as u64) * 100;
            let before = counts(mm);
            let took = match r {
                0 => pass(&one, n, ops, seed),
                1 => pass(&each, n, ops, seed),
                _ => pass(&pinned, n, ops, seed),
            };
            let after = counts(mm);
            let rate = (ops * n as u64) as f64 / took.as_secs_f64() / 1e6;
            rates.push(rate);
            println!(
                "{:<34}{:>8}{:>10.2}{:>9.1}{:>8}{:>8}{:>8}{}",
                name,
                n,
                rate,
                took.as_secs_f64() * 1e3,
                after.dev_calls - before.dev_calls,
                after.dev_maps - before.dev_maps,
                after.waits - before.waits,
                if r == 2 {
                    format!(
                        "  pinned calls {}, reserved {} -> {} MiB",
                        after.pinned_calls - before.pinned_calls,
                        before.pinned_reserved >> 20,
                        after.pinned_reserved >> 20,
                    )
                } else {
                    // Page moves on the allocating threads: unmaps, and
                    // the time in maps and unmaps summed over the threads.
                    let unmaps = after.dev_unmaps - before.dev_unmaps;
                    let moves = (after.move_ns - before.move_ns) as f64 / 1e6;
                    // The device's memory against the most pages its
                    // blocks touched at once, after the row.
                    let pool = mm.device_stats(0).expect("device stats").pool;
                    let floor = pool.peak_touched.max(1);
                    format!(
                        "  unmaps {unmaps}, moving pages {moves:.1} ms; mapped / page floor {:.3}",
                        pool.mapped as f64 / floor as f64
                    )
                }
            );
        }
    }
    println!("\nsummary (Mops/s)");
    print!("{:<34}", "row");
    for n in THREADS {
        print!("{:>9}", format!("{n} thr"));
    }
    println!("{:>9}", "16/8");
    for (name, rates) in table.iter().filter(|(_, rates)| rates.len() == THREADS.len()) {
        print!("{name:<34}");
        for r in rates {
            print!("{r:>9.2}");
        }
        println!("{:>9.2}", rates[4] / rates[3]);
    }
    let ds = mm.device_stats(0).expect("device stats").pool;
    let ps = mm.pinned_stats();
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
    fn sub(&self, n: usize) {
        self.now.fetch_sub(n, Ordering::Relaxed);
    }
}

/// A block one pool thread holds: (device?, address, size).
type Block = (bool, u64, usize);

/// The resizing thread pool (see the module docs).
fn pool() {
    const ROUNDS: usize = 24;
    const LIVE: usize = 200;
    const OPS: usize = 4_000;
    let scale: f64 = std::env::var("CUMEM_PEERS_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1.0);
    let ops = ((OPS as f64 * scale) as usize).max(100);
    let conf = Config::from_env().expect("CUMEM_CONF");
    let mm = MemoryManager::new(conf).expect("a manager");
    let stream = Stream::new().expect("cuStreamCreate");
    let (dev, pin) = (Held::default(), Held::default());
    let carried: Mutex<Vec<Block>> = Mutex::new(Vec::new());
    let seed: u64 = std::env::var("CUMEM_CHECK_SEED")
        .ok()
        .and_then(|v| v.strip_prefix("0x").map_or_else(|| v.parse().ok(), |h| u64::from_str_radix(h, 16).ok()))
        .unwrap_or(0x9001);
    let mut rng = SmallRng::seed_from_u64(seed);
    let t0 = Instant::now();
    let mut sizes = Vec::new();
    // The pools' physical memory, sampled while the rounds run, and the
    // device figure's floor: the pages live blocks touch (the pool can
    // hold no less and keep its blocks).
    let physical = |mm: &MemoryManager| {
        let d = mm.device_stats(0).expect("device stats").pool;
        (d.mapped, mm.pinned_stats().reserved, d.touched)
    };
    let (sampled, done) = (Mutex::new((0usize, 0usize, 0usize)), std::sync::atomic::AtomicBool::new(false));
    std::thread::scope(|watch| {
        watch.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                let (d, p, t) = physical(&mm);
                let mut s = sampled.lock().unwrap();
                *s = (s.0.max(d), s.1.max(p), s.2.max(t));
                drop(s);
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        for round in 0..ROUNDS {
            let n = match round {
                0 => 1,
                1 => 32,
                _ => rng.gen_range(1..=32),
            };
            sizes.push(n);
            // The blocks the round before left, shared out among this round.
            let inherited: Vec<Block> = std::mem::take(&mut *carried.lock().unwrap());
            let per = inherited.len().div_ceil(n).max(1);
            let parts: Vec<Vec<Block>> = inherited.chunks(per).map(<[Block]>::to_vec).collect();
            std::thread::scope(|s| {
                for id in 0..n {
                    let mine = parts.get(id).cloned().unwrap_or_default();
                    let (mm, stream, dev, pin, carried) = (&mm, &stream, &dev, &pin, &carried);
                    s.spawn(move || {
                        let free = |b: Block| {
                            if b.0 {
                                mm.free_device_on(b.1, stream).expect("device free");
                                dev.sub(b.2);
                            } else {
                                mm.free_pinned(b.1 as *mut u8).expect("pinned free");
                                pin.sub(b.2);
                            }
                        };
                        for b in mine {
                            free(b);
                        }
                        let mut r = SmallRng::seed_from_u64(seed ^ (((round as u64) << 32) | id as u64));
                        let mut live: Vec<Block> = Vec::with_capacity(LIVE);
                        for _ in 0..ops {
                            if live.len() < LIVE && (live.is_empty() || r.gen_bool(0.5)) {
                                let size = r.gen_range(1..=4usize << 20);
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
                        for b in live {
                            free(b);
                        }
                        carried.lock().unwrap().extend(keep);
                    });
                }
            });
            let (d, p, t) = physical(&mm);
            let mut s = sampled.lock().unwrap();
            *s = (s.0.max(d), s.1.max(p), s.2.max(t));
        }
        done.store(true, Ordering::Relaxed);
    });
    let took = t0.elapsed();
    stream.synchronize().expect("cuStreamSynchronize");
    let ds = mm.device_stats(0).expect("device stats").pool;
    let ps = mm.pinned_stats();
    let (dp, pp) = (dev.peak.load(Ordering::Relaxed).max(1) as f64, pin.peak.load(Ordering::Relaxed).max(1) as f64);
    let (sd, sp, st) = *sampled.lock().unwrap();
    let mib = |b: usize| b >> 20;
    println!(
        "\nA resizing thread pool (seed {seed:#x}): {ROUNDS} rounds of {sizes:?} fresh threads, {ops} steps each, half carried over"
    );
    println!(
        "device: end mapped {} MiB / most held at once {} MiB = {:.3}; peak mapped {} MiB (sampled) = {:.3}, \
         the pool's peak {} MiB = {:.3}; pages touched by live blocks (the floor, sampled) {} MiB = {:.3}; \
         upstream calls {}, map calls {}, unmap calls {}",
        mib(ds.mapped),
        mib(dp as usize),
        ds.mapped as f64 / dp,
        mib(sd),
        sd as f64 / dp,
        mib(ds.peak_mapped),
        ds.peak_mapped as f64 / dp,
        mib(st),
        st as f64 / dp,
        ds.upstream_allocs,
        ds.map_calls,
        ds.unmap_calls,
    );
    println!(
        "pinned: end reserved {} MiB / most held at once {} MiB = {:.3}; peak reserved {} MiB (sampled) = {:.3}, \
         the pool's peak {} MiB = {:.3}; upstream calls {}",
        mib(ps.reserved),
        mib(pp as usize),
        ps.reserved as f64 / pp,
        mib(sp),
        sp as f64 / pp,
        mib(ps.peak_reserved),
        ps.peak_reserved as f64 / pp,
        ps.upstream_allocs,
    );
    println!("took {:.2} s", took.as_secs_f64());
    for b in std::mem::take(&mut *carried.lock().unwrap()) {
        if b.0 {
            mm.free_device_on(b.1, &stream).expect("device free");
        } else {
            mm.free_pinned(b.1 as *mut u8).expect("pinned free");
        }
    }
}

/// Pinned growth: a fresh manager's pinned pool grown to 4 GiB by one
/// thread, then another's by 16 threads at once (each to a sixteenth),
/// in the peers' sizes (1 B..4 MiB, nothing freed); the time and the
/// upstream calls.
fn pin() {
    const TARGET: usize = 4 << 30;
    for threads in [1usize, 16] {
        let mm = MemoryManager::new(Config::from_env().expect("CUMEM_CONF")).expect("a manager");
        let go = Barrier::new(threads);
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for id in 0..threads {
                let (mm, go) = (&mm, &go);
                s.spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(0x9140 + id as u64);
                    let (mut held, mut live) = (0, Vec::new());
                    go.wait();
                    while held < TARGET / threads {
                        let size = rng.gen_range(1..=4 << 20);
                        live.push(mm.allocate_pinned(size).expect("pinned allocation").as_ptr() as usize);
                        held += size;
                    }
                    // Kept live until the manager drops: nothing is freed.
                    drop(live);
                });
            }
        });
        let s = mm.pinned_stats();
        println!(
            "pinned growth to {} MiB by {threads} thread(s): {:.1} ms, {} upstream calls",
            s.reserved >> 20,
            t0.elapsed().as_secs_f64() * 1e3,
            s.upstream_allocs
        );
    }
}

/// Runs the workload `CUMEM_BENCH_CHECK` names; returns whether it ran one.
pub fn main() -> bool {
    match std::env::var("CUMEM_BENCH_CHECK").as_deref() {
        Ok("peers") => peers(),
        Ok("pool") => pool(),
        Ok("pin") => pin(),
        _ => return false,
    }
    true
}
