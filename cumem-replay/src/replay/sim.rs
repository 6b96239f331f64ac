//! A simulated device upstream for replays: address ranges only, no memory.
//!
//! The pool never reads or writes the memory it manages, so a replay can run
//! it over addresses that are never mapped. [`AddressRange`] hands out
//! chunks from one ascending range with the device's 2 MiB granularity and
//! grows the topmost chunk in place, as CUDA virtual memory (expandable
//! segments) would. It shows the fragmentation an expandable device pool
//! reaches on a trace, on any machine.

use std::time::Instant;

use super::{run_ops, Measurement};
use crate::trace::Trace;
use cumem::cuda::vmm::{record_call, CallKind, DriverCalls};
use cumem::pool::{Pool, StreamTag, BLOCK_ALIGN};
use cumem::upstream::{Chunk, Queued, Upstream};
use cumem::Config;
use cumem::Result;
use std::sync::{Mutex, MutexGuard};

/// The simulation's settings, read once: `CUMEM_SIM_CALL_US`, the
/// microseconds each simulated driver call takes (0, the default: none),
/// so that the background mapper's work and the allocating thread's
/// overlap as they would on a device; and `CUMEM_SIM_QUIET_OPS`, how many
/// replayed operations without a move the simulated mapper waits before
/// it unmaps old mappings of lent memory (default 10,000, about the
/// mapper's 2 ms at the 150–250 ns per operation of a warm replay on a
/// device); and `CUMEM_SIM_CAPACITY_MIB`, the device's memory (0, the
/// default: unbounded): making memory past it fails as out of memory, as
/// `cuMemCreate` would.
fn settings() -> (std::time::Duration, u64, usize) {
    static SETTINGS: std::sync::OnceLock<(std::time::Duration, u64, usize)> = std::sync::OnceLock::new();
    *SETTINGS.get_or_init(|| {
        let env = |name, default: u64| std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default);
        let capacity = match env("CUMEM_SIM_CAPACITY_MIB", 0) as usize {
            0 => usize::MAX,
            mib => mib << 20,
        };
        (std::time::Duration::from_micros(env("CUMEM_SIM_CALL_US", 0)), env("CUMEM_SIM_QUIET_OPS", 10_000), capacity)
    })
}

/// The error of making memory past the simulated capacity.
fn out_of_memory(size: usize) -> cumem::Error {
    cumem::Error::OutOfMemory {
        pool: cumem::PoolKind::Device,
        requested: size,
        state: Box::new(cumem::OomState {
            upstream: Some("the simulated device is full".into()),
            ..Default::default()
        }),
    }
}

/// The largest piece of new memory a map makes with `mapped` bytes mapped
/// and `free` bytes free, as on a device.
fn piece_cap(mapped: usize, free: usize) -> usize {
    cumem::upstream::remap_piece(mapped, free).next_multiple_of(GRANULARITY)
}

/// The granularity of device memory (large pages).
const GRANULARITY: usize = 2 << 20;

/// Where the simulated range starts (nonzero and aligned).
const BASE: usize = 1 << 40;

/// A simulated address range: chunks are carved from the top; the topmost
/// chunk can grow and shrink in place. Separate chunks are one granule
/// apart, so they never touch.
///
/// It also models page remapping as CUDA VMM does it: memory is mapped in
/// pieces (one `cuMemCreate` handle each), a piece is unmapped whole, and
/// unmapped pieces are mapped again elsewhere before new ones are made.
/// [`calls`](Self::calls) counts the driver calls a device would make.
///
/// Memory a move *lends* keeps its old mapping until cumem's mapper thread
/// unmaps it, as on a device: the mapper waits until the pool has made no
/// move for a while (2 ms there), modelled as 10,000 operations of the
/// replay (`CUMEM_SIM_QUIET_OPS`; [`tick`](Self::tick)), then unmaps one
/// old mapping per operation; a map over addresses whose old mapping is
/// still there unmaps it first, on the allocating thread.
#[derive(Debug)]
pub struct AddressRange {
    top: Mutex<usize>,
    vm: Mutex<Mapped>,
    /// Operations replayed so far, and whether old mappings wait.
    ops: std::sync::atomic::AtomicU64,
    stale: std::sync::atomic::AtomicBool,
}

#[derive(Debug)]
struct Mapped {
    /// Mapped pieces, address → size.
    pieces: std::collections::BTreeMap<usize, usize>,
    /// Unmapped pieces kept for the next map: size, and the address of
    /// the old mapping of lent memory while it is still there.
    spare: Vec<(usize, Option<usize>)>,
    /// Old mappings of lent memory, address → size, not yet unmapped.
    stale: std::collections::BTreeMap<usize, usize>,
    /// The operation of the last move.
    last_move: u64,
    /// The driver calls a device would have made (none takes time).
    calls: DriverCalls,
    /// The device's memory: making memory past it fails.
    capacity: usize,
}

impl Mapped {
    /// The memory held: mapped pieces and kept ones (old mappings of lent
    /// memory share theirs).
    fn held(&self) -> usize {
        self.pieces.values().sum::<usize>() + self.spare_bytes()
    }

    /// The memory the device has free (`usize::MAX`: no capacity).
    fn free(&self) -> usize {
        if self.capacity == usize::MAX {
            return usize::MAX;
        }
        self.capacity.saturating_sub(self.held())
    }

    /// Whether `bytes` of new memory can be made.
    fn room_for(&self, bytes: usize) -> bool {
        self.held().saturating_add(bytes) <= self.capacity
    }

    fn spare_bytes(&self) -> usize {
        self.spare.iter().map(|s| s.0).sum()
    }

    fn release_spare(&mut self) {
        for spare in std::mem::take(&mut self.spare) {
            self.release(spare);
        }
    }

    /// Releases a kept piece. Lent memory is freed only with its old
    /// mapping, which goes now, on this thread, as on a device where no
    /// queued work may use it (none here).
    fn release(&mut self, (_, old): (usize, Option<usize>)) {
        if let Some(addr) = old {
            if self.stale.remove(&addr).is_some() {
                self.note(CallKind::Unmap);
            }
        }
        self.note(CallKind::Release);
    }

    /// The old mapping at `addr` is gone: its memory's kept piece, if kept,
    /// has none.
    fn forget_old(&mut self, addr: usize) {
        for s in self.spare.iter_mut().filter(|s| s.1 == Some(addr)) {
            s.1 = None;
        }
    }

    /// Counts one call here and in the library's driver-call counters (on
    /// the thread that makes it, as a device's would be).
    fn note(&mut self, kind: CallKind) {
        let c = &mut self.calls;
        *match kind {
            CallKind::Create => &mut c.create,
            CallKind::Map => &mut c.map,
            CallKind::Unmap => &mut c.unmap,
            CallKind::SetAccess => &mut c.set_access,
            CallKind::Release => &mut c.release,
            CallKind::Query => &mut c.query,
        } += 1;
        record_call(kind);
        let cost = settings().0;
        if !cost.is_zero() {
            // The device's time for the call (the region's lock is held
            // across it, as the real upstream holds its region's).
            let start = Instant::now();
            while start.elapsed() < cost {
                std::hint::spin_loop();
            }
        }
    }

    /// Takes the whole pieces inside `spans` a move would unmap (until
    /// `want` bytes, `choose_pieces`) off the mapped list; returns them.
    fn take_within(&mut self, spans: &[Chunk], want: usize) -> Vec<(usize, usize)> {
        let pieces: Vec<(usize, usize)> = self.pieces.iter().map(|(&a, &s)| (a, s)).collect();
        let spans: Vec<(usize, usize)> = spans.iter().map(|c| (c.addr, c.size)).collect();
        cumem::upstream::choose_pieces(&pieces, &spans, want)
            .into_iter()
            .map(|i| {
                self.pieces.remove(&pieces[i].0);
                pieces[i]
            })
            .collect()
    }

    /// Unmaps the old mappings that overlap `[addr, addr + size)`, on the
    /// calling (allocating) thread.
    fn unmap_stale_in(&mut self, addr: usize, size: usize) {
        let first = self.stale.range(..addr).next_back().filter(|(&a, &l)| a + l > addr).map(|(&a, _)| a);
        let inside: Vec<usize> =
            first.into_iter().chain(self.stale.range(addr..addr + size).map(|(&a, _)| a)).collect();
        for a in inside {
            self.stale.remove(&a);
            self.forget_old(a);
            self.note(CallKind::Unmap);
        }
    }

    fn unmap_inside(&mut self, addr: usize, size: usize) {
        self.unmap_stale_in(addr, size);
        let inside: Vec<usize> = self.pieces.range(addr..addr + size).map(|(&a, _)| a).collect();
        for a in inside {
            self.pieces.remove(&a);
            self.note(CallKind::Unmap);
            self.note(CallKind::Release);
        }
    }
}

impl Default for AddressRange {
    fn default() -> Self {
        AddressRange::new()
    }
}

impl AddressRange {
    /// An empty range on a device of `CUMEM_SIM_CAPACITY_MIB` (unbounded
    /// by default).
    pub fn new() -> Self {
        AddressRange::with_capacity(settings().2)
    }

    /// An empty range on a device of `capacity` bytes: making memory past
    /// it fails as out of memory, as `cuMemCreate` would, and new pieces
    /// are sized for the memory left, as the device's free memory sizes
    /// them ([`remap_piece`](cumem::upstream::remap_piece)).
    pub fn with_capacity(capacity: usize) -> Self {
        let vm = Mapped {
            pieces: Default::default(),
            spare: Vec::new(),
            stale: Default::default(),
            last_move: 0,
            calls: DriverCalls::default(),
            capacity,
        };
        AddressRange {
            top: Mutex::new(BASE),
            vm: Mutex::new(vm),
            ops: std::sync::atomic::AtomicU64::new(0),
            stale: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// One replayed operation: the simulated mapper unmaps one old mapping
    /// of lent memory once the pool has made no move for 10,000 operations
    /// (`CUMEM_SIM_QUIET_OPS`).
    pub fn tick(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let op = self.ops.fetch_add(1, Relaxed) + 1;
        if !self.stale.load(Relaxed) {
            return;
        }
        let mut vm = lock(&self.vm);
        if op.saturating_sub(vm.last_move) < settings().1 {
            return;
        }
        if let Some((&a, _)) = vm.stale.iter().next() {
            vm.stale.remove(&a);
            vm.forget_old(a);
            vm.calls.unmap += 1;
            cumem::cuda::vmm::record_background_call(CallKind::Unmap);
        }
        self.stale.store(!vm.stale.is_empty(), Relaxed);
    }

    /// The driver calls made so far.
    pub fn calls(&self) -> DriverCalls {
        lock(&self.vm).calls
    }

    fn carve(&self, size: usize) -> Chunk {
        let mut top = lock(&self.top);
        let addr = *top + GRANULARITY;
        *top = addr + size;
        Chunk { addr, size }
    }

    fn extend_top(&self, chunk: Chunk, extra: usize) -> bool {
        let mut top = lock(&self.top);
        if chunk.end() != *top {
            return false;
        }
        *top += extra;
        true
    }

    /// Records one piece mapped with new memory (the plain growth path).
    fn map_new(&self, addr: usize, size: usize) -> Result<()> {
        let mut vm = lock(&self.vm);
        if !vm.room_for(size) {
            return Err(out_of_memory(size));
        }
        vm.pieces.insert(addr, size);
        vm.note(CallKind::Create);
        vm.note(CallKind::Map);
        vm.note(CallKind::SetAccess);
        Ok(())
    }
}

impl Upstream for AddressRange {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        let chunk = self.carve(size);
        if let Err(e) = self.map_new(chunk.addr, chunk.size) {
            let mut top = lock(&self.top);
            *top = chunk.addr - GRANULARITY;
            return Err(e);
        }
        Ok(chunk)
    }

    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        lock(&self.vm).unmap_inside(chunk.addr, chunk.size);
        let mut top = lock(&self.top);
        if chunk.end() == *top {
            *top = chunk.addr - GRANULARITY;
        }
        Ok(())
    }

    fn can_extend(&self) -> bool {
        true
    }

    fn try_extend(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        let extended = self.extend_top(chunk, extra);
        if extended {
            if let Err(e) = self.map_new(chunk.end(), extra) {
                *lock(&self.top) -= extra;
                return Err(e);
            }
        }
        Ok(extended)
    }

    fn try_shrink(&self, chunk: Chunk, amount: usize) -> Result<bool> {
        let mut top = lock(&self.top);
        if chunk.end() != *top || amount > chunk.size {
            return Ok(false);
        }
        *top -= amount;
        lock(&self.vm).unmap_inside(chunk.end() - amount, amount);
        Ok(true)
    }

    fn can_remap(&self) -> bool {
        true
    }

    fn reserve_chunk(&self, size: usize) -> Result<Chunk> {
        Ok(self.carve(size))
    }

    fn try_extend_reserved(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        Ok(self.extend_top(chunk, extra))
    }

    fn map_runs(&self, runs: &[Chunk]) -> Result<u64> {
        let mut vm = lock(&self.vm);
        // The pieces first: kept ones of at most the run's remaining size
        // (largest first), new ones for the rest, sized for the memory
        // free now (a device reads it once per call). A device that runs
        // out midway unmaps what the call mapped and releases the kept
        // memory: the new memory is checked before anything is mapped.
        let (free, held) = (vm.free(), vm.held());
        let mut mapped: usize = vm.pieces.values().sum();
        let (mut plan, mut new) = (Vec::new(), 0);
        for (r, run) in runs.iter().enumerate() {
            let mut at = run.addr;
            while at < run.end() {
                let rem = run.end() - at;
                let pick = (0..vm.spare.len()).filter(|&i| vm.spare[i].0 <= rem).max_by_key(|&i| vm.spare[i].0);
                let len = match pick {
                    Some(i) => vm.spare.swap_remove(i).0,
                    None => rem.min(piece_cap(mapped, free)),
                };
                new += if pick.is_none() { len } else { 0 };
                plan.push((r, at, len, pick.is_none()));
                mapped += len;
                at += len;
            }
        }
        if new > 0 && vm.capacity != usize::MAX {
            // A bounded device reads its free memory for new pieces.
            vm.note(CallKind::Query);
        }
        if held.saturating_add(new) > vm.capacity {
            for _ in plan.iter().filter(|p| !p.3) {
                vm.note(CallKind::Release);
            }
            vm.release_spare();
            self.stale.store(!vm.stale.is_empty(), std::sync::atomic::Ordering::Relaxed);
            return Err(out_of_memory(new));
        }
        let maps = plan.len() as u64;
        let mut pieces = plan.into_iter().peekable();
        for (r, run) in runs.iter().enumerate() {
            // Old mappings still there go first, on this thread.
            vm.unmap_stale_in(run.addr, run.size);
            self.stale.store(!vm.stale.is_empty(), std::sync::atomic::Ordering::Relaxed);
            while let Some((_, at, len, fresh)) = pieces.next_if(|p| p.0 == r) {
                if fresh {
                    vm.note(CallKind::Create);
                }
                vm.pieces.insert(at, len);
                vm.note(CallKind::Map);
            }
            vm.note(CallKind::SetAccess);
        }
        // Unused spares stay for the next map (`kept`).
        Ok(maps)
    }

    fn unmap_within(&self, spans: &[Chunk], want: usize, _pending: bool, keep: bool) -> Result<Vec<Chunk>> {
        let mut vm = lock(&self.vm);
        let taken = vm.take_within(spans, want);
        for &(_, size) in &taken {
            vm.note(CallKind::Unmap);
            if keep {
                vm.spare.push((size, None));
            } else {
                vm.note(CallKind::Release);
            }
        }
        Ok(taken.into_iter().map(|(addr, size)| Chunk { addr, size }).collect())
    }

    fn has_stale(&self) -> bool {
        self.stale.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn lend_within(&self, spans: &[Chunk], want: usize, _queued: Queued) -> Result<Vec<Chunk>> {
        // The memory is kept as `unmap_within` keeps it; its old place
        // stays mapped until the simulated mapper unmaps it (`tick`) or a
        // map needs those addresses.
        let mut vm = lock(&self.vm);
        let taken = vm.take_within(spans, want);
        for &(addr, size) in &taken {
            vm.stale.insert(addr, size);
            vm.spare.push((size, Some(addr)));
        }
        if !taken.is_empty() {
            vm.last_move = self.ops.load(std::sync::atomic::Ordering::Relaxed);
            self.stale.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(taken.into_iter().map(|(addr, size)| Chunk { addr, size }).collect())
    }

    fn release_kept(&self) {
        let mut vm = lock(&self.vm);
        vm.release_spare();
        self.stale.store(!vm.stale.is_empty(), std::sync::atomic::Ordering::Relaxed);
    }

    fn kept(&self) -> usize {
        lock(&self.vm).spare_bytes()
    }

    fn trim_kept(&self, keep: usize) {
        let mut vm = lock(&self.vm);
        vm.spare.sort_unstable_by_key(|s| s.0);
        let mut total = vm.spare_bytes();
        while total > keep {
            let Some(spare) = vm.spare.pop() else { break };
            total -= spare.0;
            vm.release(spare);
        }
        self.stale.store(!vm.stale.is_empty(), std::sync::atomic::Ordering::Relaxed);
    }

    fn granularity(&self) -> usize {
        GRANULARITY
    }

    fn name(&self) -> &'static str {
        "simulated address range"
    }

    fn host_accessible(&self) -> bool {
        false
    }
}

/// Replays `trace` through a fresh [`Pool`] over an [`AddressRange`], with
/// the device pool settings of `config` (`min_chunk`, `expandable`,
/// `device_pool_size`, `max_device_pool_size`).
///
/// Unless `one_stream`, each of the trace's streams frees with a tag of its
/// own (stream index + 1, with a sequence number per free), and an
/// allocation handed a block last freed on another stream counts as a
/// stream wait (what the device pool would order with an event).
pub(super) fn replay_simulated(trace: &Trace, config: &Config, warm: bool, one_stream: bool) -> Result<Measurement> {
    replay_on(AddressRange::new(), trace, config, warm, one_stream)
}

/// What fits: the smallest simulated device (in steps of its 2 MiB
/// granularity) on which a cold replay of `trace` through the device
/// pool of `config` has no failed allocation, found by bisection between
/// the trace's peak of live bytes and the memory an unbounded replay
/// held. Returns that capacity and the unbounded replay's peak.
///
/// # Errors
/// A replay's error.
pub fn smallest_fit(trace: &Trace, config: &Config, one_stream: bool) -> Result<(usize, usize)> {
    let fits = |capacity| -> Result<bool> {
        Ok(replay_on(AddressRange::with_capacity(capacity), trace, config, false, one_stream)?.failures == 0)
    };
    let unbounded = replay_on(AddressRange::with_capacity(usize::MAX), trace, config, false, one_stream)?;
    let Some(peak) = unbounded.peak_reserved else { return Ok((0, 0)) };
    // No capacity below the peak of live bytes fits; the unbounded peak
    // does (a pool held no more there).
    let (mut lo, mut hi) = (unbounded.peak_live / GRANULARITY, peak.div_ceil(GRANULARITY));
    if !fits(hi * GRANULARITY)? {
        return Ok((peak, peak));
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid * GRANULARITY)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok((hi * GRANULARITY, peak))
}

/// [`replay_simulated`] over `range`.
fn replay_on(range: AddressRange, trace: &Trace, config: &Config, warm: bool, one_stream: bool) -> Result<Measurement> {
    let pool = Pool::new(range, config.device_pool_config());
    // No work is ever queued on a simulated device: every free's work is
    // complete, as a replay's on a real device (no kernels run) soon is.
    pool.set_tag_oracle(std::sync::Arc::new(|_| true));
    let mut addrs = vec![0u64; trace.slots];
    let seq = std::cell::Cell::new(0u64);
    let stream_of = |i: usize| if one_stream { 1 } else { u64::from(trace.op_streams[i]) + 1 };
    let pass = |addrs: &mut Vec<u64>| {
        let waits = std::cell::Cell::new(0u64);
        let allocate = |i, size| {
            pool.upstream().tick();
            let a = pool.allocate_for(size, BLOCK_ALIGN, stream_of(i)).ok()?;
            waits.set(waits.get() + u64::from(a.tag != StreamTag::NONE && a.tag.stream != stream_of(i)));
            Some(a.addr as u64)
        };
        let free = |i, a: u64| {
            pool.upstream().tick();
            seq.set(seq.get() + 1);
            pool.deallocate(a as usize, StreamTag { stream: stream_of(i), seq: seq.get() }).is_ok()
        };
        (run_ops(trace, addrs, allocate, free), waits.get())
    };
    if warm {
        // Once untimed, then free what is left: the timed pass finds the
        // pool holding its memory.
        pass(&mut addrs);
        for a in addrs.iter_mut().filter(|a| **a != 0) {
            pool.deallocate(std::mem::take(a) as usize, StreamTag::NONE)?;
        }
    }
    let before = pool.upstream().calls();
    let calls_before = cumem::cuda::vmm::driver_calls();
    let start = Instant::now();
    let (failures, stream_waits) = pass(&mut addrs);
    let elapsed_ns = start.elapsed().as_nanos() as u64;
    let calls_after = cumem::cuda::vmm::driver_calls();
    let after = pool.upstream().calls();
    let stats = pool.stats();
    Ok(Measurement {
        elapsed_ns,
        peak_live: stats.peak_requested,
        peak_reserved: Some(stats.peak_mapped),
        failures,
        map_calls: Some(after.map - before.map),
        unmap_calls: Some(after.unmap - before.unmap),
        driver_calls: Some(super::Calls::between(&calls_before, &calls_after)),
        stream_waits,
        stream_wait_ns: 0,
        stream_waits_elided: 0,
    })
}

/// Locks `m`; a panicking replay leaves nothing half-changed that a later
/// reader could trip on, so a poisoned lock's data is used as it is.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests;
