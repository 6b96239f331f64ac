//! NCCL over cumem's buffers: every GPU of the machine in one NCCL
//! communicator, one thread per GPU (`Comm::from_rank` with one shared
//! `Id`), through cudarc's NCCL API (`cudarc::nccl`).
//!
//! 1. All-reduce (sum; out of place and in place) and all-gather of cumem
//!    `DeviceBuffer<f32>`s handed straight to `Comm` (a `DeviceBuffer`
//!    implements cudarc's `DevicePtr` / `DevicePtrMut`), then both in one
//!    NCCL group (`Comm::group`, over `cuda_view`s). The values are
//!    integers, so every sum is exact: each result is copied back and
//!    compared bit for bit.
//! 2. The all-reduce captured into a CUDA graph (`CudaStream::begin_capture`
//!    / `end_capture`; NCCL 2.9 or newer) and replayed with new inputs,
//!    every replay checked.
//! 3. Bandwidth: a 256 MiB f32 all-reduce in cumem buffers and in cudarc's
//!    own `CudaSlice`s (`alloc_zeros`), alternated in this one process:
//!    algbw and busbw (algbw × 2(n−1)/n, as nccl-tests) for both, and the
//!    ratio.
//!
//! Build with `cargo build --release --example nccl --features nccl`: the
//! feature only turns on cudarc's NCCL bindings; NCCL itself is loaded at
//! run time. cudarc 0.19 `dlopen`s it by the names `libnccl.so`,
//! `libnccl.so.13`, `.12`, ... but not `libnccl.so.2`, NCCL's own soname,
//! which is often the only name installed (pip's `nvidia-nccl-*`, the
//! runtime package without `-dev`). A directory with a `libnccl.so` link
//! on `LD_LIBRARY_PATH` does it; when NCCL is missing, the example says
//! where a `libnccl.so.2` is and what to run (docs/multi-gpu.md).
//!
//! Without a GPU or without NCCL it prints why and exits 0.
//! `CUMEM_REQUIRE_GPU=1` makes a missing GPU an error, `CUMEM_GPUS=n`
//! fewer than `n` GPUs, `CUMEM_REQUIRE_NCCL=1` a missing NCCL.
//! `CUMEM_NCCL_TIMEOUT_S` (default 240) bounds the whole run: a rank that
//! fails leaves the others waiting inside NCCL, so the example reports
//! the ranks that did not finish and ends the process.

use std::ffi::CStr;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::ExitCode;
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, ReduceOp};
use cumem::{DeviceBuffer, MemoryManager, Stream};

mod loading;

use loading::{load_nccl, version_text, Missing};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

/// Values per rank in the checked collectives (not a round number, so no
/// size happens to suit an algorithm).
const CHECK_LEN: usize = (1 << 20) + 17;
/// Replays of the captured all-reduce, each with new inputs.
const GRAPH_REPLAYS: usize = 5;
/// NCCL can be captured into CUDA graphs from 2.9 on (version code
/// major × 10000 + minor × 100 + patch).
const NCCL_GRAPHS_FROM: i32 = 20900;
/// The bandwidth test: bytes per all-reduce, warm-up and timed iterations
/// per measurement, and rounds (each times both kinds, alternating which
/// goes first).
const BW_BYTES: usize = 256 << 20;
const BW_WARMUP: usize = 3;
const BW_ITERS: usize = 20;
const BW_ROUNDS: usize = 3;

fn main() -> ExitCode {
    // cudarc panics where a library or symbol is missing; those panics are
    // caught and reported as errors, so one line each is enough.
    std::panic::set_hook(Box::new(|info| eprintln!("panic: {info}")));
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nccl example FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn env_flag(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| v == "1")
}

/// A number from the environment, `default` when unset.
fn env_number(name: &str, default: u64) -> Res<u64> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map_err(|_| format!("{name}={v:?} is not a whole number").into()),
        Err(_) => Ok(default),
    }
}

/// An NCCL error with NCCL's own words for it (`ncclGetErrorString`).
fn nccl(call: &'static str) -> impl Fn(NcclError) -> BoxError {
    move |e| {
        // SAFETY: NCCL is loaded (every caller got `e` from it), and
        // `ncclGetErrorString` takes any result code and returns a static
        // string or NULL.
        let text = unsafe { cudarc::nccl::sys::ncclGetErrorString(e.0) };
        let text = if text.is_null() {
            String::new()
        } else {
            // SAFETY: not NULL: NCCL's static, NUL-terminated message.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        format!("{call} failed: {:?} ({text}); NCCL_DEBUG=WARN prints NCCL's reason", e.0).into()
    }
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".to_string(),
    }
}

fn run() -> Res<()> {
    let require_gpu = env_flag("CUMEM_REQUIRE_GPU");
    let require_nccl = env_flag("CUMEM_REQUIRE_NCCL");
    let promised = env_number("CUMEM_GPUS", 0)? as usize;
    let timeout = Duration::from_secs(env_number("CUMEM_NCCL_TIMEOUT_S", 240)?);

    let mm = MemoryManager::global()?;
    println!("cumem runs on: {}", mm.backend());
    if mm.backend().is_host() {
        if require_gpu || promised > 0 {
            return Err(format!(
                "no GPU (CUMEM_REQUIRE_GPU={}, CUMEM_GPUS={promised}): {}",
                u8::from(require_gpu),
                mm.backend()
            )
            .into());
        }
        println!("skipped: no GPU, so nothing for NCCL to communicate between.");
        match load_nccl() {
            Ok(v) => println!("(NCCL {} would be used)", version_text(v)),
            Err(Missing(why)) => println!("(and NCCL: {why})"),
        }
        return Ok(());
    }
    let n = mm.device_count();
    if n < promised {
        return Err(format!("CUMEM_GPUS={promised} but {n} GPU(s) present").into());
    }

    let version = match load_nccl() {
        Ok(v) => v,
        Err(Missing(why)) if !require_nccl => {
            println!("skipped: {why}");
            return Ok(());
        }
        Err(Missing(why)) => return Err(format!("CUMEM_REQUIRE_NCCL=1 but {why}").into()),
    };
    println!(
        "NCCL {} ({}), {n} GPU(s), one thread and communicator rank each",
        version_text(version),
        match std::env::var("NCCL_DEBUG") {
            Ok(v) => format!("NCCL_DEBUG={v}"),
            Err(_) => "set NCCL_DEBUG=WARN or INFO to hear from NCCL".into(),
        }
    );

    // NCCL may read a peer's buffers directly (registered buffers, graph
    // captures); cumem memory is reachable from another GPU only once
    // granted (VMM mappings need `cuMemSetAccess` per peer). NCCL works
    // without it otherwise, so a refusal is only reported.
    let mut granted = 0;
    for a in 0..n {
        for b in (0..n).filter(|&b| b != a) {
            match cumem::cuda::can_access_peer(a, b)
                .and_then(|can| can.then(|| mm.enable_peer_access(a, b)).transpose())
            {
                Ok(Some(())) => granted += 1,
                Ok(None) => println!("note: GPU {a} has no peer path to GPU {b}"),
                Err(e) => println!("note: peer access of GPU {a} to GPU {b}'s cumem memory not granted: {e}"),
            }
        }
    }
    if n > 1 {
        println!("peer access granted for {granted} of {} ordered GPU pairs", n * (n - 1));
    }

    let id = catch_unwind(Id::new)
        .map_err(|p| format!("ncclGetUniqueId panicked: {}", panic_text(&*p)))?
        .map_err(nccl("ncclGetUniqueId"))?;
    let shared = Arc::new(Shared { n, id, version, barrier: Barrier::new(n) });
    let (tx, rx) = mpsc::channel();
    for rank in 0..n {
        let (tx, shared) = (tx.clone(), shared.clone());
        std::thread::Builder::new().name(format!("nccl-rank-{rank}")).spawn(move || {
            let out = catch_unwind(AssertUnwindSafe(|| rank_main(rank, &shared)))
                .unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(&*p)).into()));
            let _ = tx.send((rank, out.map_err(|e| e.to_string())));
        })?;
    }
    drop(tx);
    let reports = collect(&rx, n, timeout)?;
    print_reports(&reports, version);
    println!("{}", mm.memory_summary());
    Ok(())
}

/// What every rank's thread shares.
struct Shared {
    n: usize,
    id: Id,
    version: i32,
    /// Lines the ranks up before each timed loop.
    barrier: Barrier,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Cumem,
    Cudarc,
}

/// One rank's findings.
#[derive(Debug, Default)]
struct RankReport {
    /// What was checked, one line each.
    checked: Vec<String>,
    /// Seconds per all-reduce, per measurement in the order made.
    times: Vec<(Kind, f64)>,
}

/// Waits for every rank's report, at most `timeout` in all (and 10 s past
/// the first failure: the other ranks may be stuck in NCCL waiting for
/// it). Ends the process if a rank is stuck.
fn collect(
    rx: &mpsc::Receiver<(usize, Result<RankReport, String>)>,
    n: usize,
    timeout: Duration,
) -> Res<Vec<RankReport>> {
    let mut deadline = Instant::now() + timeout;
    let mut reports: Vec<Option<RankReport>> = (0..n).map(|_| None).collect();
    let mut failures = Vec::new();
    let mut heard = 0;
    while heard < n {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((rank, result)) => {
                heard += 1;
                match result {
                    Ok(r) => reports[rank] = Some(r),
                    Err(e) => {
                        failures.push(format!("rank {rank}: {e}"));
                        reports[rank] = Some(RankReport::default());
                        deadline = deadline.min(Instant::now() + Duration::from_secs(10));
                    }
                }
            }
            Err(_) => {
                let stuck: Vec<usize> = (0..n).filter(|&r| reports[r].is_none()).collect();
                failures.push(format!(
                    "rank(s) {stuck:?} did not finish in time (CUMEM_NCCL_TIMEOUT_S={}); the process ends here",
                    timeout.as_secs()
                ));
                eprintln!("nccl example FAILED: {}", failures.join("\n  "));
                let _ = std::io::stdout().flush();
                let _ = std::io::stderr().flush();
                // SAFETY: ends the process at once. Stuck threads are inside
                // NCCL and CUDA calls; `exit`'s handlers (CUDA's and NCCL's
                // teardown) could wait for them forever. Output is flushed.
                unsafe { libc::_exit(1) };
            }
        }
    }
    if !failures.is_empty() {
        return Err(failures.join("\n  ").into());
    }
    Ok(reports.into_iter().flatten().collect())
}

/// One rank: its communicator, the checked collectives, the graph, the
/// bandwidth.
fn rank_main(rank: usize, shared: &Shared) -> Res<RankReport> {
    let n = shared.n;
    let stream = Stream::new_on(rank)?;
    let cs = stream.cudarc().ok_or("a host queue on a GPU backend")?.clone();
    // NCCL takes the device from the calling thread's current context.
    cs.context().bind_to_thread()?;
    let comm = Comm::from_rank(cs.clone(), rank, n, shared.id).map_err(nccl("ncclCommInitRank"))?;
    let mut report = RankReport::default();
    eager(&comm, &cs, &stream, rank, n, &mut report)?;
    if shared.version >= NCCL_GRAPHS_FROM {
        captured(&comm, &cs, &stream, rank, n, &mut report)?;
    } else {
        report.checked.push(format!(
            "graph capture skipped: NCCL {} is older than 2.9, which added it",
            version_text(shared.version)
        ));
    }
    report.times = bandwidth(&comm, &cs, &stream, &shared.barrier)?;
    cs.synchronize()?;
    // Every buffer is gone (freed in `cs`'s order, after the collectives);
    // the communicator goes last (`ncclCommAbort`, in cudarc's `Drop`).
    drop(comm);
    Ok(report)
}

/// Rank `r`'s all-reduce input at `i`; the sum over `n` ranks is
/// [`reduce_sum`].
fn reduce_input(r: usize, i: usize) -> f32 {
    ((r + 1) * (i % 1024) + r) as f32
}
fn reduce_sum(n: usize, i: usize) -> f32 {
    ((i % 1024) * n * (n + 1) / 2 + n * (n - 1) / 2) as f32
}
/// The in-place all-reduce's input, and its sum.
fn inplace_input(r: usize, i: usize) -> f32 {
    (3 * r + i % 509) as f32
}
fn inplace_sum(n: usize, i: usize) -> f32 {
    (3 * n * (n - 1) / 2 + n * (i % 509)) as f32
}
/// Rank `r`'s all-gather contribution at `i` (below 2^24 for up to 100
/// ranks, so exact in f32).
fn gather_input(r: usize, i: usize) -> f32 {
    (r * 100_000 + i % 65_536) as f32
}
/// The graph's input at replay `k`, and its sum.
fn graph_input(r: usize, i: usize, k: usize) -> f32 {
    ((r + 1) * ((i + 7 * k) % 1024) + r + k) as f32
}
fn graph_sum(n: usize, i: usize, k: usize) -> f32 {
    (((i + 7 * k) % 1024) * n * (n + 1) / 2 + n * (n - 1) / 2 + n * k) as f32
}

fn host_values(len: usize, f: impl Fn(usize) -> f32) -> Vec<f32> {
    (0..len).map(f).collect()
}

/// Compares `got` with `want(i)` bit for bit.
fn check(what: &str, got: &[f32], len: usize, want: impl Fn(usize) -> f32) -> Res<String> {
    if got.len() != len {
        return Err(format!("{what}: {} values came back, {len} expected", got.len()).into());
    }
    if let Some((i, g)) = got.iter().enumerate().find(|&(i, g)| g.to_bits() != want(i).to_bits()) {
        return Err(format!("{what}: element {i} is {g}, expected {}", want(i)).into());
    }
    Ok(format!("{what}: {len} values exact"))
}

/// The collectives on cumem buffers passed straight to cudarc's `Comm`.
fn eager(comm: &Comm, cs: &Arc<CudaStream>, stream: &Stream, r: usize, n: usize, report: &mut RankReport) -> Res<()> {
    let len = CHECK_LEN;
    // Out of place. cudarc's own copies fill and read the buffers too.
    let mut send = DeviceBuffer::<f32>::new_on(len, stream)?;
    cs.memcpy_htod(&host_values(len, |i| reduce_input(r, i)), &mut send)?;
    let mut recv = DeviceBuffer::<f32>::new_on(len, stream)?;
    comm.all_reduce(&send, &mut recv, &ReduceOp::Sum).map_err(nccl("ncclAllReduce"))?;
    report.checked.push(check("all-reduce (sum)", &cs.clone_dtoh(&recv)?, len, |i| reduce_sum(n, i))?);

    // In place.
    let mut both = DeviceBuffer::<f32>::new_on(len, stream)?;
    cs.memcpy_htod(&host_values(len, |i| inplace_input(r, i)), &mut both)?;
    comm.all_reduce_in_place(&mut both, &ReduceOp::Sum).map_err(nccl("ncclAllReduce (in place)"))?;
    report.checked.push(check("all-reduce in place", &cs.clone_dtoh(&both)?, len, |i| inplace_sum(n, i))?);

    // All-gather: rank q's values land at q * len.
    let mut part = DeviceBuffer::<f32>::new_on(len, stream)?;
    cs.memcpy_htod(&host_values(len, |i| gather_input(r, i)), &mut part)?;
    let mut all = DeviceBuffer::<f32>::new_on(n * len, stream)?;
    comm.all_gather(&part, &mut all).map_err(nccl("ncclAllGather"))?;
    let gathered = |j: usize| gather_input(j / len, j % len);
    report.checked.push(check("all-gather", &cs.clone_dtoh(&all)?, n * len, gathered)?);

    // Both in one NCCL group (`ncclGroupStart` .. `ncclGroupEnd`). cudarc's
    // `Group` takes views, made before the group, and records their uses
    // after `ncclGroupEnd` has queued the work.
    let mut recv2 = DeviceBuffer::<f32>::new_on(len, stream)?;
    let mut all2 = DeviceBuffer::<f32>::new_on(n * len, stream)?;
    {
        let (s, d) = (send.cuda_view(..)?, recv2.cuda_view_mut(..)?);
        let (p, a) = (part.cuda_view(..)?, all2.cuda_view_mut(..)?);
        let mut group = comm.group();
        group.all_reduce(s, d, &ReduceOp::Sum).map_err(nccl("ncclAllReduce (grouped)"))?;
        group.all_gather(p, a).map_err(nccl("ncclAllGather (grouped)"))?;
    }
    let sums = check("grouped all-reduce", &cs.clone_dtoh(&recv2)?, len, |i| reduce_sum(n, i))?;
    let gathers = check("grouped all-gather", &cs.clone_dtoh(&all2)?, n * len, gathered)?;
    report.checked.push(format!("{sums}; {gathers}"));
    Ok(())
}

/// The all-reduce captured into a CUDA graph and replayed with new inputs.
///
/// Inside a capture a stream may wait only for events recorded in the same
/// capture, and cudarc's tracking makes every use of a buffer wait for the
/// events of its last uses, recorded before the capture. So the captured
/// buffers are made while the context does not track events (their cudarc
/// shadows have none), and are used on `cs` alone and by cumem's
/// synchronous copies after `cs` is synchronised.
fn captured(
    comm: &Comm,
    cs: &Arc<CudaStream>,
    stream: &Stream,
    r: usize,
    n: usize,
    report: &mut RankReport,
) -> Res<()> {
    let len = CHECK_LEN;
    let ctx = cs.context().clone();
    let was_tracking = ctx.is_event_tracking();
    // SAFETY: only this thread uses this device's context. The buffers made
    // while tracking is off are used on `cs` only (the capture, its
    // replays, cudarc's views) and by cumem's synchronous copies made after
    // `cs` is synchronised; nothing else has to be ordered after them.
    unsafe { ctx.disable_event_tracking() };
    let made = (|| -> Res<(DeviceBuffer<f32>, DeviceBuffer<f32>)> {
        let send = DeviceBuffer::<f32>::new_on(len, stream)?;
        let recv = DeviceBuffer::<f32>::new_on(len, stream)?;
        // A view makes each buffer's cudarc shadow now, without events.
        send.cuda_view(..)?;
        recv.cuda_view(..)?;
        Ok((send, recv))
    })();
    if was_tracking {
        // SAFETY: back to cudarc's default for everything made later;
        // the two buffers above keep no events.
        unsafe { ctx.enable_event_tracking() };
    }
    let (mut send, mut recv) = made?;
    send.copy_from_host(&host_values(len, |i| graph_input(r, i, 0)))?;
    cs.synchronize()?;

    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let queued = comm.all_reduce(&send, &mut recv, &ReduceOp::Sum);
    // The capture ends whatever happened, so the stream is usable again.
    let graph = cs.end_capture(sys::CUgraphInstantiate_flags(0));
    queued.map_err(nccl("ncclAllReduce (captured)"))?;
    let graph = graph.map_err(|e| format!("capturing ncclAllReduce: {e}"))?.ok_or("the capture recorded nothing")?;

    for k in 0..GRAPH_REPLAYS {
        if k > 0 {
            send.copy_from_host(&host_values(len, |i| graph_input(r, i, k)))?;
        }
        graph.launch()?;
        cs.synchronize()?;
        check(&format!("graph replay {k}"), &recv.to_vec()?, len, |i| graph_sum(n, i, k))?;
    }
    report.checked.push(format!(
        "all-reduce captured in a CUDA graph: {GRAPH_REPLAYS} replays with new inputs, each {len} values exact"
    ));
    // The graph goes before the buffers and the communicator it uses.
    drop(graph);
    cs.synchronize()?;
    Ok(())
}

/// The timed all-reduces: cumem buffers and cudarc's `CudaSlice`s,
/// alternating which goes first.
fn bandwidth(comm: &Comm, cs: &Arc<CudaStream>, stream: &Stream, barrier: &Barrier) -> Res<Vec<(Kind, f64)>> {
    let len = BW_BYTES / size_of::<f32>();
    let mut cumem_send = DeviceBuffer::<f32>::new_on(len, stream)?;
    let mut cumem_recv = DeviceBuffer::<f32>::new_on(len, stream)?;
    cumem_send.zero()?;
    cumem_recv.zero()?;
    let cudarc_send = cs.alloc_zeros::<f32>(len)?;
    let mut cudarc_recv = cs.alloc_zeros::<f32>(len)?;
    let mut times = Vec::new();
    for round in 0..BW_ROUNDS {
        let order = if round % 2 == 0 { [Kind::Cumem, Kind::Cudarc] } else { [Kind::Cudarc, Kind::Cumem] };
        for kind in order {
            let t = match kind {
                Kind::Cumem => time_all_reduce(comm, cs, barrier, &cumem_send, &mut cumem_recv)?,
                Kind::Cudarc => time_all_reduce(comm, cs, barrier, &cudarc_send, &mut cudarc_recv)?,
            };
            times.push((kind, t));
        }
    }
    Ok(times)
}

/// Seconds per all-reduce of `send` into `recv`, over `BW_ITERS` after
/// `BW_WARMUP`, with every rank starting together.
fn time_all_reduce<S: DevicePtr<f32>, R: DevicePtrMut<f32>>(
    comm: &Comm,
    cs: &Arc<CudaStream>,
    barrier: &Barrier,
    send: &S,
    recv: &mut R,
) -> Res<f64> {
    for _ in 0..BW_WARMUP {
        comm.all_reduce(send, recv, &ReduceOp::Sum).map_err(nccl("ncclAllReduce"))?;
    }
    cs.synchronize()?;
    barrier.wait();
    let start = Instant::now();
    for _ in 0..BW_ITERS {
        comm.all_reduce(send, recv, &ReduceOp::Sum).map_err(nccl("ncclAllReduce"))?;
    }
    cs.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / BW_ITERS as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        l if l % 2 == 1 => v[l / 2],
        l => (v[l / 2 - 1] + v[l / 2]) / 2.0,
    }
}

fn print_reports(reports: &[RankReport], version: i32) {
    let n = reports.len();
    println!("checked on each of the {n} rank(s):");
    for line in &reports[0].checked {
        println!("  {line}");
    }
    for (r, rep) in reports.iter().enumerate().skip(1) {
        if rep.checked.len() != reports[0].checked.len() {
            println!("  rank {r} checked {} things, rank 0 {}", rep.checked.len(), reports[0].checked.len());
        }
    }

    // A collective takes as long as its slowest rank.
    let slowest = |m: usize| reports.iter().map(|rep| rep.times[m].1).fold(0.0f64, f64::max);
    let kinds: Vec<Kind> = reports[0].times.iter().map(|t| t.0).collect();
    let bus_factor = 2.0 * (n as f64 - 1.0) / n as f64;
    let per_kind = |kind: Kind| -> Vec<f64> { (0..kinds.len()).filter(|&m| kinds[m] == kind).map(slowest).collect() };
    let gbs = |secs: f64| BW_BYTES as f64 / secs / 1e9;
    println!(
        "all-reduce (sum) of {} MiB of f32, {BW_ITERS} iterations after {BW_WARMUP} warm-up, {BW_ROUNDS} alternated rounds, NCCL {}:",
        BW_BYTES >> 20,
        version_text(version)
    );
    for (kind, name) in [(Kind::Cumem, "cumem DeviceBuffer"), (Kind::Cudarc, "cudarc CudaSlice (alloc_zeros)")] {
        let rounds: Vec<String> = per_kind(kind).iter().map(|&t| format!("{:.3} ms", t * 1e3)).collect();
        println!("  {name:32} per round: {}", rounds.join(", "));
    }
    let (tc, tr) = (median(per_kind(Kind::Cumem)), median(per_kind(Kind::Cudarc)));
    for (name, t) in [("cumem DeviceBuffer", tc), ("cudarc CudaSlice", tr)] {
        println!(
            "  {name:32} median {:.3} ms: algbw {:.1} GB/s, busbw {:.1} GB/s",
            t * 1e3,
            gbs(t),
            gbs(t) * bus_factor
        );
    }
    println!("  cumem / cudarc algbw ratio: {:.3}", tr / tc);
    if n == 1 {
        println!(
            "  one GPU: bus bandwidth measures nothing here (busbw = algbw × 2(n−1)/n = 0; an all-reduce over one \
             rank is a device-local copy), so the algbw figures are a copy's, not the interconnect's."
        );
    }
}
