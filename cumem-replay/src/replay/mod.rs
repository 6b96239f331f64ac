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

pub use sim::AddressRange;

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
/// use cumem_replay::replay::{replay, Target};
/// let csv = "Thread,Time,Action,Pointer,Size,Stream\n0,1,allocate,0x1000,5000,0x0\n0,2,free,0x1000,5000,0x0\n";
/// let trace = cumem_replay::trace::parse_str(csv)?;
/// let report = replay(&trace, Target::Simulated, &cumem::Config::new(), 1)?;
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
    /// `cuMemAllocAsync` / `cuMemFreeAsync` on one stream, from the
    /// device's default pool.
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
    /// Peak live bytes as the target counted them.
    pub peak_live: usize,
    /// Peak live bytes computed from the trace itself.
    pub trace_peak_live: usize,
    /// Peak reserved bytes (`None`: the target can't tell).
    pub peak_reserved: Option<usize>,
    /// `peak_reserved / trace_peak_live`.
    pub ratio: Option<f64>,
    /// Allocations that failed in the last replay.
    pub failures: usize,
    /// Map calls in the last replay's timed pass.
    pub map_calls: Option<u64>,
    /// Unmap calls in the last replay's timed pass.
    pub unmap_calls: Option<u64>,
    /// Driver calls that moved physical memory in the last replay's timed
    /// pass, on the allocating thread and on the background mapper.
    pub driver_calls: Option<Calls>,
    /// The CUDA streams (or stream tags) the replay used: the trace's
    /// streams, or 1 with `--one-stream`.
    pub streams: usize,
    /// Cross-stream reuses that waited in the last replay.
    pub stream_waits: u64,
    /// The nanoseconds issuing those waits took in the last replay.
    pub stream_wait_ns: u64,
    /// Cross-stream reuses in the last replay that needed no wait.
    pub stream_waits_elided: u64,
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
    /// All of them.
    pub total: u64,
    /// Nanoseconds spent in them, by kind in the order above (none on
    /// `sim_device`, whose calls take no time).
    pub ns: [u64; 5],
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
            total: c.total(),
            ns: c.ns,
            total_ns: c.total_ns(),
        }
    }
}

/// The driver calls of a timed pass, on the allocating thread and on
/// cumem's background mapper.
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

/// Replays `trace` once through `target`. `base` configures the cumem
/// targets (pool sizes, `min_chunk`, `expandable`, device); its mode and
/// backend are replaced by the target's.
///
/// # Errors
/// [`Error::NeedsGpu`] for a GPU target without a GPU; errors creating the
/// manager, stream or pool.
pub fn replay_once(trace: &Trace, target: Target, base: &Config) -> Result<Measurement> {
    replay_once_with(trace, target, base, false)
}

/// As [`replay_once`]; with `warm`, the fresh resources first replay the
/// trace once untimed (and free what it left), so the timed pass measures
/// an allocator that already holds its memory (steady state) rather than
/// one that grows from nothing.
///
/// # Errors
/// As [`replay_once`].
pub fn replay_once_with(trace: &Trace, target: Target, base: &Config, warm: bool) -> Result<Measurement> {
    replay_once_on(trace, target, base, warm, false)
}

/// As [`replay_once_with`]. Each stream of the trace's `Stream` column
/// replays on a CUDA stream of its own (on `sim_device`, a stream tag of
/// its own), so frees and reuses cross streams as they did in the program;
/// with `one_stream` every operation runs on one stream. The raw driver
/// targets always use one stream (a free on another stream than the
/// allocation's would need events the trace does not record), and so does
/// the host fallback, whose streams carry no tags.
///
/// # Errors
/// As [`replay_once`].
pub fn replay_once_on(
    trace: &Trace,
    target: Target,
    base: &Config,
    warm: bool,
    one_stream: bool,
) -> Result<Measurement> {
    if target.needs_gpu() && cumem::cuda::driver_status().devices() == 0 {
        return Err(Error::NeedsGpu("this replay target"));
    }
    match target {
        Target::Host => replay_cumem(trace, base.clone().backend(BackendChoice::Host), warm, one_stream),
        Target::Mode(m) => replay_cumem(trace, base.clone().backend(BackendChoice::Auto).mode(m), warm, one_stream),
        Target::RawCuMemAlloc => raw::replay_cumemalloc(trace, base.device),
        Target::RawCuMemAllocAsync => raw::replay_cumemallocasync(trace, base.device, warm),
        Target::Simulated => sim::replay_simulated(trace, base, warm, one_stream),
    }
}

/// The streams a target replays `trace` on.
fn streams_used(trace: &Trace, target: Target, one_stream: bool) -> usize {
    match target {
        Target::Mode(_) | Target::Simulated if !one_stream => trace.streams(),
        _ => 1,
    }
}

/// Replays `trace` `repeat` times (at least once) through `target` and
/// reports the median time per operation and the peaks of the last replay.
///
/// # Errors
/// The first replay's error.
pub fn replay(trace: &Trace, target: Target, base: &Config, repeat: usize) -> Result<ReplayReport> {
    replay_with(trace, target, base, repeat, false)
}

/// As [`replay`], warm or cold (see [`replay_once_with`]).
///
/// # Errors
/// The first replay's error.
pub fn replay_with(trace: &Trace, target: Target, base: &Config, repeat: usize, warm: bool) -> Result<ReplayReport> {
    replay_on(trace, target, base, repeat, warm, false)
}

/// As [`replay_with`], on the trace's streams or (`one_stream`) on one
/// (see [`replay_once_on`]).
///
/// # Errors
/// The first replay's error.
pub fn replay_on(
    trace: &Trace,
    target: Target,
    base: &Config,
    repeat: usize,
    warm: bool,
    one_stream: bool,
) -> Result<ReplayReport> {
    let mut per_op = Vec::with_capacity(repeat.max(1));
    let mut last = Measurement::default();
    for _ in 0..repeat.max(1) {
        last = replay_once_on(trace, target, base, warm, one_stream)?;
        per_op.push(last.elapsed_ns as f64 / trace.operations().max(1) as f64);
    }
    let min = per_op.iter().copied().fold(f64::INFINITY, f64::min);
    Ok(ReplayReport {
        trace: trace.name.clone(),
        target: target.name().to_string(),
        operations: trace.operations(),
        repeats: per_op.len(),
        ns_per_op: median(&mut per_op),
        ns_per_op_min: min,
        peak_live: last.peak_live,
        trace_peak_live: trace.peak_live,
        peak_reserved: last.peak_reserved,
        // Against the trace's own peak: the pool's peak counts blocks parked
        // in thread caches as live, so it is only an upper bound.
        ratio: last.peak_reserved.filter(|_| trace.peak_live > 0).map(|r| r as f64 / trace.peak_live as f64),
        failures: last.failures,
        map_calls: last.map_calls,
        unmap_calls: last.unmap_calls,
        driver_calls: last.driver_calls,
        streams: streams_used(trace, target, one_stream),
        stream_waits: last.stream_waits,
        stream_wait_ns: last.stream_wait_ns,
        stream_waits_elided: last.stream_waits_elided,
    })
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

fn replay_cumem(trace: &Trace, config: Config, warm: bool, one_stream: bool) -> Result<Measurement> {
    let ordinal = config.device;
    let mm = MemoryManager::new(config)?;
    let dev = mm.default_device()?;
    let mode = dev.effective_mode();
    let count = if one_stream || dev.context().is_none() { 1 } else { trace.streams() };
    let streams: Vec<Stream> = match dev.context() {
        Some(_) => (0..count).map(|_| Stream::new_on(ordinal)).collect::<Result<_>>()?,
        None => Vec::new(),
    };
    // The stream of operation `i` (none on the host fallback).
    let stream_of = |i: usize| streams.get(if count == 1 { 0 } else { trace.op_streams[i] as usize });
    // Where a leftover block is freed: any stream orders it (the trace
    // records no work on it).
    let stream = streams.first();
    fresh_mode_pool(dev, mode)?;
    let pass = |ptrs: &mut Vec<u64>| {
        let mut failures = 0;
        for (i, op) in trace.ops.iter().enumerate() {
            let stream = stream_of(i);
            match *op {
                Op::Allocate { slot, size } => {
                    let r = match stream {
                        Some(s) => mm.allocate_device_on(size, s),
                        None => mm.allocate_device(size),
                    };
                    match r {
                        Ok(p) => ptrs[slot as usize] = p,
                        Err(_) => failures += 1,
                    }
                }
                Op::Free { slot } => {
                    let p = std::mem::take(&mut ptrs[slot as usize]);
                    if p != 0 {
                        let r = match stream {
                            Some(s) => mm.free_device_on(p, s),
                            None => mm.free_device(p),
                        };
                        failures += usize::from(r.is_err());
                    }
                }
            }
        }
        failures
    };
    let free_all = |ptrs: &mut Vec<u64>| -> Result<()> {
        for p in ptrs.iter_mut().filter(|p| **p != 0) {
            match stream {
                Some(s) => mm.free_device_on(std::mem::take(p), s)?,
                None => mm.free_device(std::mem::take(p))?,
            }
        }
        Ok(())
    };
    let mut ptrs = vec![0u64; trace.slots];
    if warm {
        pass(&mut ptrs);
        free_all(&mut ptrs)?;
        for s in &streams {
            s.synchronize()?;
        }
    }
    let before = dev.stats();
    let calls_before = cumem::cuda::vmm::driver_calls();
    let start = Instant::now();
    let failures = pass(&mut ptrs);
    let elapsed_ns = start.elapsed().as_nanos() as u64;
    let calls_after = cumem::cuda::vmm::driver_calls();
    let stats = dev.stats();
    let calls = (mode == DeviceAllocatorMode::SyncPool)
        .then(|| (stats.pool.map_calls - before.pool.map_calls, stats.pool.unmap_calls - before.pool.unmap_calls));
    let stream_waits = stats.stream_waits - before.stream_waits;
    let stream_wait_ns = stats.stream_wait_ns - before.stream_wait_ns;
    let stream_waits_elided = stats.stream_waits_elided - before.stream_waits_elided;
    // Physical memory (the sync pool's mapped pages).
    let held = stats.mode_memory(mode);
    let (peak_live, peak_reserved) = (held.peak_live, held.peak_reserved);
    free_all(&mut ptrs)?;
    for s in &streams {
        s.synchronize()?;
    }
    mm.release_cached()?;
    Ok(Measurement {
        elapsed_ns,
        peak_live,
        peak_reserved,
        failures,
        map_calls: calls.map(|c| c.0),
        unmap_calls: calls.map(|c| c.1),
        driver_calls: (mode == DeviceAllocatorMode::SyncPool).then(|| Calls::between(&calls_before, &calls_after)),
        stream_waits,
        stream_wait_ns,
        stream_waits_elided,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_names_round_trip() {
        for t in Target::KNOWN {
            assert_eq!(t.name().parse::<Target>().unwrap(), t);
        }
        assert_eq!(Target::parse_list("all").unwrap().len(), 6);
        assert_eq!(Target::parse_list("all,sim_device").unwrap().len(), 7);
        assert_eq!(Target::parse_list("host, raw_cumemalloc,host").unwrap(), vec![Target::Host, Target::RawCuMemAlloc]);
        let e = Target::parse_list("host,nope").unwrap_err().to_string();
        assert!(e.contains("'nope'"), "{e}");
        assert!(Target::parse_list(" ").is_err());
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }
}
