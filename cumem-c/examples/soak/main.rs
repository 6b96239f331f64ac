//! The soak: a bounded run of everything a long-lived program does to
//! cumem at once, through the Rust API and the C ABI, with every value
//! checked. `scripts/gpu-suite.sh run soak` runs it.
//!
//! Worker threads come and go (each lives a few seconds and runs random
//! tasks); each task makes its own streams (cumem's, `cumem_stream_create`'s
//! and raw `cuStreamCreate` ones) and destroys them; device blocks are
//! handed across streams and freed in stream order; graphs are captured in
//! every capture mode (cumem's guard, and cudarc's global, thread-local and
//! relaxed captures routed into a graph pool), replayed and destroyed;
//! growable buffers grow and shrink; pinned vectors grow; one thread shares
//! blocks with a second process (this binary again, `--ipc-child`) through
//! both IPC interfaces. Every kernel writes a pattern whose every value is
//! read back and compared.
//!
//! Every `--report-secs` (60) it prints device, pinned and host memory and
//! cumem's table sizes; at the end it joins everything, releases cached
//! memory and checks that reserved memory is back at its starting value.
//! It exits non-zero on any error or wrong value.
//!
//! Options: `--secs N` (600 by default), `--report-secs N`, `--threads N`
//! (live workers, 6), `--light` (small and few: for compute-sanitizer).

mod crash;
mod graphs;
mod ipc;
mod report;
mod tasks;
mod work;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cumem::MemoryManager;

const KERNELS: &str = r#"
__device__ unsigned int pattern(unsigned int seed, unsigned long long i) {
    unsigned int x = (unsigned int)i * 2654435761u ^ seed;
    return x ^ (x >> 15);
}
extern "C" __global__ void fill(unsigned int* p, unsigned int seed, unsigned long long n, unsigned int reps) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    for (unsigned int r = 0; r < reps; ++r) {
        p[i] = pattern(seed + (reps - 1 - r), i);
    }
}
extern "C" __global__ void add_copy(unsigned int* dst, const unsigned int* src, unsigned int k, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] + k;
}
"#;

/// The value `fill` leaves at index `i` for `seed`.
pub(crate) fn pattern(seed: u32, i: usize) -> u32 {
    let x = (i as u32).wrapping_mul(2_654_435_761) ^ seed;
    x ^ (x >> 15)
}

/// What every thread shares.
pub(crate) struct Soak {
    pub(crate) mm: &'static MemoryManager,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) fill: CudaFunction,
    pub(crate) add_copy: CudaFunction,
    _module: Arc<CudaModule>,
    /// Tasks that must run alone (a global-mode capture forbids other
    /// threads' unsafe calls) take it for writing, the others for reading.
    pub(crate) exclusive: RwLock<()>,
    /// Captures take it for reading; growable buffers and stream-less
    /// buffers for writing: they synchronise the device or the legacy
    /// stream, which breaks a capture under way on another thread.
    pub(crate) capture_gate: RwLock<()>,
    pub(crate) stop: AtomicBool,
    /// Light (`--light`): small blocks, one rewrite, slower IPC rounds.
    pub(crate) light: bool,
    /// The largest block a task takes, in u32 values.
    pub(crate) max_values: usize,
    /// How many times `fill` rewrites each value (slow kernels leave work
    /// queued when blocks change streams).
    pub(crate) reps: u32,
    pub(crate) ops: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) wrong: AtomicU64,
    pub(crate) graphs: AtomicU64,
    pub(crate) ipc_rounds: AtomicU64,
}

impl Soak {
    /// Counts a failure and prints the first ones.
    pub(crate) fn error(&self, what: &str) {
        if self.errors.fetch_add(1, Ordering::Relaxed) < 30 {
            eprintln!("soak: ERROR {what}");
        }
    }

    /// Counts `n` wrong values found by `what`.
    pub(crate) fn wrong_values(&self, what: &str, n: usize) {
        if n > 0 && self.wrong.fetch_add(n as u64, Ordering::Relaxed) < 30 {
            eprintln!("soak: WRONG {n} values in {what}");
        }
    }
}

/// A small xorshift generator (the soak needs no statistics).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in `lo..hi`.
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo) as u64) as usize
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--ipc-child") {
        std::process::exit(ipc::child());
    }
    let (mut secs, mut report_secs, mut threads, mut light) = (600u64, 60u64, 6u64, false);
    let mut it = argv.iter().skip(1);
    while let Some(arg) = it.next() {
        let mut num =
            || it.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or_else(|| panic!("{arg} takes a number"));
        match arg.as_str() {
            "--secs" => secs = num(),
            "--report-secs" => report_secs = num().max(1),
            "--threads" => threads = num().max(1),
            "--light" => light = true,
            other => panic!("unknown argument {other} (--secs N, --report-secs N, --threads N, --light)"),
        }
    }
    crash::install();
    let mm = MemoryManager::global().expect("cumem's manager starts");
    let Some(ctx) = cumem::device::device_context(mm.config().device).expect("the device opens") else {
        eprintln!("soak: no GPU ({}): nothing to soak", mm.backend());
        std::process::exit(if std::env::var_os("CUMEM_REQUIRE_GPU").is_some() { 1 } else { 0 });
    };
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the soak's kernels");
    let module = ctx.load_module(ptx).expect("the module loads");
    let soak = Arc::new(Soak {
        mm,
        fill: module.load_function("fill").unwrap(),
        add_copy: module.load_function("add_copy").unwrap(),
        _module: module,
        ctx,
        exclusive: RwLock::new(()),
        capture_gate: RwLock::new(()),
        stop: AtomicBool::new(false),
        light,
        max_values: if light { 64 << 10 } else { 4 << 20 },
        reps: if light { 1 } else { 64 },
        ops: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        wrong: AtomicU64::new(0),
        graphs: AtomicU64::new(0),
        ipc_rounds: AtomicU64::new(0),
    });
    let light = if light { ", light" } else { "" };
    println!("soak: {secs} s on {} ({threads} workers at a time{light}), reports every {report_secs} s", mm.backend());
    let t0 = Instant::now();
    let mut samples = vec![report::Figures::now(&soak)];
    println!("{}", samples[0].row(0.0, &soak));
    let ipc_thread = {
        let s = soak.clone();
        std::thread::spawn(move || ipc::parent(&s))
    };
    let mut workers: Vec<std::thread::JoinHandle<()>> = Vec::new();
    let mut rng = Rng::new(0x5eed_0000 ^ std::process::id() as u64);
    let mut next_report = t0 + Duration::from_secs(report_secs);
    while t0.elapsed() < Duration::from_secs(secs) {
        // Threads come and go: finished workers are joined, new ones seeded.
        workers.retain(|w| !w.is_finished());
        while workers.len() < threads as usize {
            let (s, seed, life) = (soak.clone(), rng.next(), Duration::from_millis(rng.range(300, 3000) as u64));
            workers.push(std::thread::spawn(move || tasks::worker(&s, seed, life)));
        }
        std::thread::sleep(Duration::from_millis(20));
        if Instant::now() >= next_report {
            let f = {
                let _g = soak.exclusive.read().unwrap_or_else(|e| e.into_inner());
                report::Figures::now(&soak)
            };
            println!("{}", f.row(t0.elapsed().as_secs_f64(), &soak));
            samples.push(f);
            next_report += Duration::from_secs(report_secs);
        }
    }
    soak.stop.store(true, Ordering::Relaxed);
    let panicked = workers.into_iter().chain([ipc_thread]).map(|w| w.join()).filter(Result::is_err).count();
    if panicked > 0 {
        soak.error(&format!("{panicked} threads panicked"));
    }
    samples.push(report::Figures::now(&soak));
    println!("{}", samples[samples.len() - 1].row(t0.elapsed().as_secs_f64(), &soak));
    if let Err(e) = mm.release_cached() {
        soak.error(&format!("release_cached: {e}"));
    }
    let after = report::Figures::now(&soak);
    println!("{}", after.row(t0.elapsed().as_secs_f64(), &soak));
    std::process::exit(report::verdict(&soak, &samples, &after));
}
