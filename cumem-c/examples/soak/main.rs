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
//! Every `--report-secs` (60) it prints reserved and mapped device memory,
//! the process's resident host memory and cumem's table sizes; at the end
//! it joins everything, releases cached memory and checks that reserved
//! memory is back at its starting value. It exits non-zero on any error or
//! wrong value.
//!
//! Options: `--secs N` (or `CUMEM_SOAK_SECS`; 600 by default),
//! `--report-secs N`, `--threads N` (live workers, 6), `--light` (small
//! blocks, few replays: for compute-sanitizer), `--only rust,c,graphs,
//! growable,pinned,legacy,ipc` (some tasks only), `--keep-foreign` (keep
//! raw streams in a pool for reuse, as PyTorch does, instead of destroying
//! each after its task with `cumem_stream_forget` first),
//! `--beside-captures` (run growable buffers and buffers without a stream
//! while other threads capture graphs: they synchronise the device or the
//! legacy stream, which fails and invalidates the captures, so by default
//! they run apart from captures).

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
    /// Captures take it for reading; with `apart`, growable buffers and
    /// stream-less buffers take it for writing (they synchronise the device
    /// or the legacy stream, which breaks a capture under way elsewhere).
    pub(crate) capture_gate: RwLock<()>,
    /// Growable and stream-less buffers run apart from captures.
    pub(crate) apart: bool,
    pub(crate) stop: AtomicBool,
    pub(crate) light: bool,
    pub(crate) ops: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) wrong: AtomicU64,
    pub(crate) threads_started: AtomicU64,
    pub(crate) streams_made: AtomicU64,
    pub(crate) graphs_made: AtomicU64,
    pub(crate) ipc_rounds: AtomicU64,
    /// The tasks workers choose among, with their weights.
    pub(crate) tasks: Vec<(tasks::Task, usize)>,
    /// Whether the IPC thread runs.
    pub(crate) ipc: bool,
    /// Raw streams are destroyed after each task (else kept for reuse).
    pub(crate) destroy_foreign: bool,
    /// Raw streams kept for reuse.
    pub(crate) foreign: tasks::ForeignStreams,
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

    /// The largest block a task takes, in u32 values.
    pub(crate) fn max_values(&self) -> usize {
        if self.light {
            64 << 10
        } else {
            4 << 20
        }
    }

    /// A task drawn by weight.
    pub(crate) fn pick(&self, rng: &mut Rng) -> tasks::Task {
        let total: usize = self.tasks.iter().map(|t| t.1).sum();
        let mut x = rng.range(0, total);
        for &(t, w) in &self.tasks {
            if x < w {
                return t;
            }
            x -= w;
        }
        self.tasks[0].0
    }

    /// How many times `fill` rewrites each value (slow kernels leave work
    /// queued when blocks change streams).
    pub(crate) fn reps(&self) -> u32 {
        if self.light {
            1
        } else {
            64
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
    pub(crate) fn coin(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

struct Args {
    secs: u64,
    report_secs: u64,
    threads: usize,
    light: bool,
    only: Option<Vec<String>>,
    destroy_foreign: bool,
    beside: bool,
}

fn args() -> Args {
    let mut a = Args {
        secs: std::env::var("CUMEM_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(600),
        report_secs: 60,
        threads: 6,
        light: false,
        only: None,
        destroy_foreign: true,
        beside: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> u64 {
            it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{name} takes a number"))
        };
        match arg.as_str() {
            "--secs" => a.secs = num("--secs"),
            "--report-secs" => a.report_secs = num("--report-secs").max(1),
            "--threads" => a.threads = num("--threads").max(1) as usize,
            "--light" => a.light = true,
            "--keep-foreign" => a.destroy_foreign = false,
            "--beside-captures" => a.beside = true,
            "--only" => a.only = Some(it.next().expect("--only takes a list").split(',').map(String::from).collect()),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--ipc-child") {
        std::process::exit(ipc::child(&argv[2]));
    }
    let a = args();
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
        apart: !a.beside,
        stop: AtomicBool::new(false),
        light: a.light,
        ops: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        wrong: AtomicU64::new(0),
        threads_started: AtomicU64::new(0),
        streams_made: AtomicU64::new(0),
        graphs_made: AtomicU64::new(0),
        ipc_rounds: AtomicU64::new(0),
        tasks: tasks::TASKS
            .iter()
            .filter(|t| a.only.as_ref().is_none_or(|o| o.iter().any(|n| n == t.1)))
            .map(|t| (t.0, t.2))
            .collect(),
        ipc: a.only.as_ref().is_none_or(|o| o.iter().any(|n| n == "ipc")),
        destroy_foreign: a.destroy_foreign,
        foreign: tasks::ForeignStreams::default(),
    });
    let start_figures = report::Figures::now(&soak);
    println!(
        "soak: {} s on {} ({} workers at a time{}), reports every {} s",
        a.secs,
        mm.backend(),
        a.threads,
        if a.light { ", light" } else { "" },
        a.report_secs
    );
    println!("{}", report::Figures::header());
    println!("{}", start_figures.row(0.0, &soak));

    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(a.secs);
    let ipc_thread = soak.ipc.then(|| {
        let s = soak.clone();
        std::thread::spawn(move || ipc::parent(&s))
    });
    let mut workers: Vec<std::thread::JoinHandle<()>> = Vec::new();
    let mut rng = Rng::new(0x5eed_0000 ^ std::process::id() as u64);
    let mut next_report = t0 + Duration::from_secs(a.report_secs);
    let mut samples = vec![start_figures.clone()];
    while Instant::now() < end {
        // Threads come and go: finished workers are joined, new ones take
        // their place with seeds of their own.
        workers.retain(|w| !w.is_finished());
        while workers.len() < a.threads && !soak.tasks.is_empty() {
            let s = soak.clone();
            let seed = rng.next();
            let life = Duration::from_millis(rng.range(300, 3000) as u64);
            soak.threads_started.fetch_add(1, Ordering::Relaxed);
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
            next_report += Duration::from_secs(a.report_secs);
        }
    }
    soak.stop.store(true, Ordering::Relaxed);
    for w in workers {
        if w.join().is_err() {
            soak.error("a worker panicked");
        }
    }
    if ipc_thread.is_some_and(|t| t.join().is_err()) {
        soak.error("the IPC thread panicked");
    }
    let last = report::Figures::now(&soak);
    println!("{}", last.row(t0.elapsed().as_secs_f64(), &soak));
    samples.push(last);
    let released = mm.release_cached();
    if let Err(e) = &released {
        soak.error(&format!("release_cached: {e}"));
    }
    let after = report::Figures::now(&soak);
    println!("{}", after.row(t0.elapsed().as_secs_f64(), &soak));
    println!("soak: after release: {}", after.describe());
    // The kept raw streams go last: until then cumem may wait for them.
    if let Err(e) = soak.foreign.destroy_all() {
        soak.error(&e);
    }
    let code = report::verdict(&soak, &start_figures, &samples, &after);
    std::process::exit(code);
}
