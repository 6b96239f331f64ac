//! Replaying allocation traces: time per operation and fragmentation.
//!
//! A [`Trace`] is replayed through a [`Target`]: one of cumem's device modes
//! on a fresh [`MemoryManager`] (a new pool for every replay), the host
//! fallback, or the raw driver calls (`cuMemAlloc`/`cuMemFree`,
//! `cuMemAllocAsync`/`cuMemFreeAsync`). Only the allocation and free calls
//! are timed, with one clock around the whole loop; the trace is parsed and
//! resolved to slots before (see [`crate::trace`]).
//!
//! Fragmentation is peak reserved bytes over peak live bytes, where peak
//! live is the largest sum of the *requested* sizes of live allocations
//! (the pool's `peak_requested`; the stream-ordered modes' `peak_in_use`).
//! The trace's own peak live ([`Trace::peak_live`]) is reported beside it:
//! the two agree when every allocation succeeded.

mod floor;
pub mod plot;
mod raw;
mod sim;

pub use floor::{page_floor, PageFloor};

pub use sim::{smallest_fit, AddressRange};

use std::time::Instant;

use serde::Serialize;

use crate::trace::{Op, Trace};
use cumem::cuda::driver_err;
use cumem::device::{DeviceAllocator, DeviceAllocatorMode, NativePool};
use cumem::Stream;
use cumem::{BackendChoice, Config, MemoryManager};
use cumem::{Error, Result};

/// What a trace is replayed through.
///
/// # Examples
/// ```
/// use cumem_replay::replay::{replay, Pass, Target};
/// let csv = "Thread,Time,Action,Pointer,Size,Stream\n0,1,allocate,0x1000,5000,0x0\n0,2,free,0x1000,5000,0x0\n";
/// let trace = cumem_replay::trace::parse_str(csv)?;
/// let report = replay(&trace, Target::Simulated, &cumem::Config::new(), 1, Pass::default())?;
/// assert_eq!(report.trace_peak_live, 5000);
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// A cumem device mode on the GPU, a fresh manager per replay.
    Mode(DeviceAllocatorMode),
    /// cumem's sync pool on the host fallback (no GPU needed).
    Host,
    /// `cuMemAlloc` / `cuMemFree`, one call per operation.
    RawCuMemAlloc,
    /// `cuMemAllocAsync` / `cuMemFreeAsync` on one stream, the default pool.
    RawCuMemAllocAsync,
    /// cumem's pool over a simulated device address range
    /// ([`AddressRange`]: 2 MiB granularity, the top chunk grows in place
    /// when `expandable`): the fragmentation a device pool would reach,
    /// on any machine. Not part of `all`.
    Simulated,
}

impl Target {
    /// Every target, in report order.
    pub const ALL: [Target; 6] = [
        Target::Mode(DeviceAllocatorMode::SyncPool),
        Target::Mode(DeviceAllocatorMode::AsyncStreamOrdered),
        Target::Mode(DeviceAllocatorMode::CudaAsyncPool),
        Target::Host,
        Target::RawCuMemAlloc,
        Target::RawCuMemAllocAsync,
    ];

    /// Every target `from_str` knows: [`Target::ALL`] and the simulation.
    pub const KNOWN: [Target; 7] = {
        let a = Target::ALL;
        [a[0], a[1], a[2], a[3], a[4], a[5], Target::Simulated]
    };

    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Target::Mode(m) => m.name(),
            Target::Host => "host",
            Target::RawCuMemAlloc => "raw_cumemalloc",
            Target::RawCuMemAllocAsync => "raw_cumemallocasync",
            Target::Simulated => "sim_device",
        }
    }

    /// Whether the target needs a CUDA device.
    pub fn needs_gpu(self) -> bool {
        !matches!(self, Target::Host | Target::Simulated)
    }

    /// Parses `all` or a comma-separated list of target names.
    ///
    /// # Errors
    /// [`Error::Config`] naming an unknown target.
    pub fn parse_list(s: &str) -> Result<Vec<Target>> {
        let mut out = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let targets = if name.eq_ignore_ascii_case("all") { Target::ALL.to_vec() } else { vec![name.parse()?] };
            for t in targets {
                if !out.contains(&t) {
                    out.push(t);
                }
            }
        }
        if out.is_empty() {
            return Err(Error::Config("no replay target named".into()));
        }
        Ok(out)
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Target {
    type Err = Error;
    fn from_str(s: &str) -> Result<Target> {
        Target::KNOWN.into_iter().find(|t| t.name().eq_ignore_ascii_case(s)).ok_or_else(|| {
            let names: Vec<&str> = Target::KNOWN.iter().map(|t| t.name()).collect();
            Error::Config(format!("unknown replay target '{s}' (known: all, {})", names.join(", ")))
        })
    }
}

/// What one replay measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Measurement {
    /// Time spent in the allocation and free calls, in nanoseconds.
    pub elapsed_ns: u64,
    /// Peak live bytes as the target counted them (requested sizes).
    pub peak_live: usize,
    /// Peak reserved bytes, where the target can tell.
    pub peak_reserved: Option<usize>,
    /// Allocations that failed (their frees are skipped).
    pub failures: usize,
    /// Map calls during the timed replay, where the target can tell
    /// (page remapping and growth: one per piece of memory mapped).
    pub map_calls: Option<u64>,
    /// Unmap calls during the timed replay, where the target can tell.
    pub unmap_calls: Option<u64>,
    /// Driver calls that moved physical memory during the timed replay
    /// (cumem's remapping targets), by the allocating thread and by the
    /// background mapper.
    pub driver_calls: Option<Calls>,
    /// Reuses of a block freed on another of the trace's streams that had
    /// to wait for that stream's work (in the timed pass).
    pub stream_waits: u64,
    /// The nanoseconds issuing those waits took (within `elapsed_ns`; 0
    /// where nothing is issued, as in `sim_device`).
    pub stream_wait_ns: u64,
    /// Cross-stream reuses that needed no wait: the using stream had
    /// already waited for a later point of the freeing stream.
    pub stream_waits_elided: u64,
}

/// A trace replayed several times through one target.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The trace's name.
    pub trace: String,
    /// The target's name.
    pub target: String,
    /// Allocations and frees per replay.
    pub operations: usize,
    /// Replays measured.
    pub repeats: usize,
    /// Median nanoseconds per operation over the replays.
    pub ns_per_op: f64,
    /// The fastest replay's nanoseconds per operation.
    pub ns_per_op_min: f64,
    /// Peak live bytes computed from the trace itself.
    pub trace_peak_live: usize,
    /// `peak_reserved / trace_peak_live` of the last replay.
    pub ratio: Option<f64>,
    /// The streams (or stream tags) used: the trace's, or 1 (`--one-stream`).
    pub streams: usize,
    /// The last replay's figures (peaks, failures, calls, waits).
    #[serde(flatten)]
    pub last: Measurement,
}

impl ReplayReport {
    /// The report of `measured` (1 or more replays of `trace` on `target`).
    pub fn new(trace: &Trace, target: Target, pass: Pass, measured: &[Measurement]) -> ReplayReport {
        let ops = trace.operations().max(1) as f64;
        let mut per_op: Vec<f64> = measured.iter().map(|m| m.elapsed_ns as f64 / ops).collect();
        let last = measured.last().cloned().unwrap_or_default();
        ReplayReport {
            trace: trace.name.clone(),
            target: target.name().to_string(),
            operations: trace.operations(),
            repeats: measured.len(),
            ns_per_op_min: per_op.iter().copied().fold(f64::INFINITY, f64::min),
            ns_per_op: median(&mut per_op),
            trace_peak_live: trace.peak_live,
            // Against the trace's own peak: the pool's peak counts blocks
            // parked in thread caches as live, so it is only an upper bound.
            ratio: last.peak_reserved.filter(|_| trace.peak_live > 0).map(|r| r as f64 / trace.peak_live as f64),
            streams: match target {
                Target::Mode(_) | Target::Simulated if !pass.one_stream => trace.streams(),
                _ => 1,
            },
            last,
        }
    }
}

/// Driver calls by kind (`cuMemCreate`, `cuMemMap`, `cuMemUnmap`,
/// `cuMemSetAccess`, `cuMemRelease`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CallKinds {
    /// `cuMemCreate`.
    pub create: u64,
    /// `cuMemMap`.
    pub map: u64,
    /// `cuMemUnmap`.
    pub unmap: u64,
    /// `cuMemSetAccess`.
    pub set_access: u64,
    /// `cuMemRelease`.
    pub release: u64,
    /// `cuMemGetInfo` (the free memory that sizes new pieces).
    pub query: u64,
    /// All of them.
    pub total: u64,
    /// Nanoseconds in them, by kind in the order above (none on `sim_device`).
    pub ns: [u64; 6],
    /// Nanoseconds spent in all of them.
    pub total_ns: u64,
}

impl From<cumem::cuda::vmm::DriverCalls> for CallKinds {
    fn from(c: cumem::cuda::vmm::DriverCalls) -> Self {
        CallKinds {
            create: c.create,
            map: c.map,
            unmap: c.unmap,
            set_access: c.set_access,
            release: c.release,
            query: c.query,
            total: c.total(),
            ns: c.ns,
            total_ns: c.total_ns(),
        }
    }
}

/// A timed pass's driver calls, on the allocating thread and the mapper.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Calls {
    /// Made by the thread that replays the trace.
    pub allocating: CallKinds,
    /// Made by the background mapper while the pass ran.
    pub background: CallKinds,
}

impl Calls {
    /// The calls made between two readings of
    /// [`driver_calls`](cumem::cuda::vmm::driver_calls).
    pub fn between(before: &cumem::cuda::vmm::DriverCallCounts, after: &cumem::cuda::vmm::DriverCallCounts) -> Self {
        let d = after.since(before);
        Calls { allocating: d.allocating.into(), background: d.background.into() }
    }
}

/// The median of `values` (0 when empty).
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// How a trace is replayed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pass {
    /// The fresh resources first replay the trace once untimed (and free
    /// what it left), so the timed pass measures an allocator that already
    /// holds its memory (steady state) rather than one that grows from
    /// nothing (cold, the default).
    pub warm: bool,
    /// Every operation on one stream. By default each stream of the
    /// trace's `Stream` column replays on a CUDA stream of its own (on
    /// `sim_device`, a stream tag of its own), so frees and reuses cross
    /// streams as they did in the program. The raw driver targets always
    /// use one stream (a free on another stream than the allocation's
    /// would need events the trace does not record), and so does the host
    /// fallback, whose streams carry no tags.
    pub one_stream: bool,
}

/// Replays `trace` once through `target`. `base` configures the cumem
/// targets (pool sizes, `min_chunk`, `expandable`, device); its mode and
/// backend are replaced by the target's.
///
/// # Errors
/// [`Error::NeedsGpu`] for a GPU target without a GPU; errors creating the
/// manager, stream or pool.
pub fn replay_once(trace: &Trace, target: Target, base: &Config, pass: Pass) -> Result<Measurement> {
    if target.needs_gpu() && cumem::cuda::driver_status().devices() == 0 {
        return Err(Error::NeedsGpu("this replay target"));
    }
    let Pass { warm, one_stream } = pass;
    match target {
        Target::Host => replay_cumem(trace, base.clone().backend(BackendChoice::Host), pass),
        Target::Mode(m) => replay_cumem(trace, base.clone().backend(BackendChoice::Auto).mode(m), pass),
        Target::RawCuMemAlloc => raw::replay_cumemalloc(trace, base.device),
        Target::RawCuMemAllocAsync => raw::replay_cumemallocasync(trace, base.device, warm),
        Target::Simulated => sim::replay_simulated(trace, base, warm, one_stream),
    }
}

/// Replays `trace` `repeat` times (at least once) through `target` and
/// reports the median time per operation and the peaks of the last replay.
///
/// # Errors
/// The first replay's error.
pub fn replay(trace: &Trace, target: Target, base: &Config, repeat: usize, pass: Pass) -> Result<ReplayReport> {
    let measured = (0..repeat.max(1)).map(|_| replay_once(trace, target, base, pass)).collect::<Result<Vec<_>>>()?;
    Ok(ReplayReport::new(trace, target, pass, &measured))
}

/// Runs `trace`'s operations in order, keeping each allocation's pointer
/// in its slot of `ptrs`: `allocate(i, size)` makes operation `i`'s
/// allocation (`None`: it failed, and its free is skipped), `free(i, ptr)`
/// frees (false: it failed). Returns the failures.
pub(crate) fn run_ops(
    trace: &Trace,
    ptrs: &mut [u64],
    mut allocate: impl FnMut(usize, usize) -> Option<u64>,
    mut free: impl FnMut(usize, u64) -> bool,
) -> usize {
    let mut failures = 0;
    for (i, op) in trace.ops.iter().enumerate() {
        match *op {
            Op::Allocate { slot, size } => match allocate(i, size) {
                Some(p) => ptrs[slot as usize] = p,
                None => failures += 1,
            },
            Op::Free { slot } => {
                let p = std::mem::take(&mut ptrs[slot as usize]);
                failures += usize::from(p != 0 && !free(i, p));
            }
        }
    }
    failures
}

/// The device's default pool, trimmed to nothing and its high-water marks
/// reset, so a replay's `reserved_high` is its own. Its release threshold
/// is set to keep everything cached (as cumem's stream-ordered mode does).
fn fresh_default_pool(ordinal: usize) -> Result<Option<NativePool>> {
    let Some(ctx) = cumem::cuda::device_context(ordinal)? else {
        return Ok(None);
    };
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
    ctx.synchronize().map_err(driver_err("cuCtxSynchronize"))?;
    let pool = NativePool::device_default(ctx, u64::MAX)?;
    pool.trim_to(0)?;
    pool.reset_high_watermarks()?;
    Ok(Some(pool))
}

/// Makes the driver pool of `mode` on `dev` now (none for the sync
/// pool), emptied and with its high watermarks reset: the device's default
/// pool is shared by the process and may hold memory of earlier replays.
pub(crate) fn fresh_mode_pool(dev: &DeviceAllocator, mode: DeviceAllocatorMode) -> Result<()> {
    let Some(pool) = dev.mode_pool(mode)? else { return Ok(()) };
    if let Some(ctx) = dev.context() {
        ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        ctx.synchronize().map_err(driver_err("cuCtxSynchronize"))?;
    }
    pool.trim_to(0)?;
    pool.reset_high_watermarks()?;
    Ok(())
}

fn replay_cumem(trace: &Trace, config: Config, pass: Pass) -> Result<Measurement> {
    let ordinal = config.device;
    let mm = MemoryManager::new(config)?;
    let dev = mm.default_device()?;
    let mode = dev.effective_mode();
    let count = if pass.one_stream || dev.context().is_none() { 1 } else { trace.streams() };
    let streams: Vec<Stream> = match dev.context() {
        Some(_) => (0..count).map(|_| Stream::new_on(ordinal)).collect::<Result<_>>()?,
        None => Vec::new(),
    };
    // The stream of operation `i` (none on the host fallback); a leftover
    // block is freed on the first (the trace records no work on it).
    let stream_of = |i: Option<usize>| streams.get(i.filter(|_| count > 1).map_or(0, |i| trace.op_streams[i] as usize));
    let allocate = |i, size| match stream_of(Some(i)) {
        Some(s) => mm.allocate_device_on(size, s).ok(),
        None => mm.allocate_device(size).ok(),
    };
    let free = |i: Option<usize>, p| match stream_of(i) {
        Some(s) => mm.free_device_on(p, s),
        None => mm.free_device(p),
    };
    let free_all = |ptrs: &mut Vec<u64>| -> Result<()> {
        ptrs.iter_mut().filter(|p| **p != 0).try_for_each(|p| free(None, std::mem::take(p)))?;
        streams.iter().try_for_each(Stream::synchronize)
    };
    fresh_mode_pool(dev, mode)?;
    let mut ptrs = vec![0u64; trace.slots];
    if pass.warm {
        run_ops(trace, &mut ptrs, allocate, |i, p| free(Some(i), p).is_ok());
        free_all(&mut ptrs)?;
    }
    let before = dev.stats();
    let calls_before = cumem::cuda::vmm::driver_calls();
    let start = Instant::now();
    let failures = run_ops(trace, &mut ptrs, allocate, |i, p| free(Some(i), p).is_ok());
    let elapsed_ns = start.elapsed().as_nanos() as u64;
    let calls_after = cumem::cuda::vmm::driver_calls();
    let stats = dev.stats();
    let sync_pool = mode == DeviceAllocatorMode::SyncPool;
    // Physical memory (the sync pool's mapped pages).
    let held = stats.mode_memory(mode);
    free_all(&mut ptrs)?;
    mm.release_cached()?;
    Ok(Measurement {
        elapsed_ns,
        peak_live: held.peak_live,
        peak_reserved: held.peak_reserved,
        failures,
        map_calls: sync_pool.then(|| stats.pool.map_calls - before.pool.map_calls),
        unmap_calls: sync_pool.then(|| stats.pool.unmap_calls - before.pool.unmap_calls),
        driver_calls: sync_pool.then(|| Calls::between(&calls_before, &calls_after)),
        stream_waits: stats.stream_waits - before.stream_waits,
        stream_wait_ns: stats.stream_wait_ns - before.stream_wait_ns,
        stream_waits_elided: stats.stream_waits_elided - before.stream_waits_elided,
    })
}

#[cfg(test)]
mod tests;
