//! Counts of the VMM driver calls that move physical memory (and of the
//! reads of the device's free memory that size it), and the time spent
//! in them, kept apart for the program's threads and for cumem's
//! background mapper ([`driver_calls`]).

/// A kind of driver call that moves physical memory ([`driver_calls`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// `cuMemCreate`: new physical memory.
    Create,
    /// `cuMemMap`: one piece of memory mapped.
    Map,
    /// `cuMemUnmap`: one piece unmapped.
    Unmap,
    /// `cuMemSetAccess`: access given to a mapped run.
    SetAccess,
    /// `cuMemRelease`: physical memory given back.
    Release,
    /// `cuMemGetInfo`: free memory read (it sizes pieces near a full device).
    Query,
}

/// How many kinds of call there are.
const KINDS: usize = 6;

/// Counts of the driver calls that move physical memory, one per kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCalls {
    /// `cuMemCreate` calls.
    pub create: u64,
    /// `cuMemMap` calls.
    pub map: u64,
    /// `cuMemUnmap` calls.
    pub unmap: u64,
    /// `cuMemSetAccess` calls.
    pub set_access: u64,
    /// `cuMemRelease` calls.
    pub release: u64,
    /// `cuMemGetInfo` calls.
    pub query: u64,
    /// Nanoseconds spent in these calls, by kind in [`CallKind`] order
    /// (the calling threads' wall time, summed; simulated calls add none).
    pub ns: [u64; KINDS],
}

impl DriverCalls {
    /// All calls together.
    pub fn total(&self) -> u64 {
        self.create + self.map + self.unmap + self.set_access + self.release + self.query
    }

    /// The nanoseconds spent in all of them.
    pub fn total_ns(&self) -> u64 {
        self.ns.iter().sum()
    }

    /// The calls made since `before` (counts only grow).
    pub fn since(&self, before: &DriverCalls) -> DriverCalls {
        DriverCalls {
            create: self.create - before.create,
            map: self.map - before.map,
            unmap: self.unmap - before.unmap,
            set_access: self.set_access - before.set_access,
            release: self.release - before.release,
            query: self.query - before.query,
            ns: std::array::from_fn(|k| self.ns[k] - before.ns[k]),
        }
    }
}

/// The process's driver calls that move physical memory, split by the
/// thread that made them: threads that allocate and free, and cumem's
/// background mapper (`pool/mapper.rs`), which moves pages off their way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCallCounts {
    /// Calls made on the threads of the program (allocating, freeing).
    pub allocating: DriverCalls,
    /// Calls made by the background mapper.
    pub background: DriverCalls,
}

impl DriverCallCounts {
    /// The calls made since `before`.
    pub fn since(&self, before: &DriverCallCounts) -> DriverCallCounts {
        DriverCallCounts {
            allocating: self.allocating.since(&before.allocating),
            background: self.background.since(&before.background),
        }
    }
}

/// One counter per kind (in [`CallKind`] order) for the program's threads,
/// then one per kind for the background mapper; then the nanoseconds spent
/// in calls, in the same order.
static CALLS: [crate::sync::StaticAtomicU64; 4 * KINDS] = [const { crate::sync::StaticAtomicU64::new(0) }; 4 * KINDS];

std::thread_local! {
    /// Set on the background mapper's thread.
    static BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as cumem's background mapper (its driver calls
/// count under [`DriverCallCounts::background`]) until the guard drops
/// (there is no mapper thread under loom).
#[cfg(not(loom))]
pub(crate) struct BackgroundThread(());

#[cfg(not(loom))]
impl BackgroundThread {
    pub(crate) fn enter() -> Self {
        BACKGROUND.with(|b| b.set(true));
        BackgroundThread(())
    }
}

#[cfg(not(loom))]
impl Drop for BackgroundThread {
    fn drop(&mut self) {
        BACKGROUND.with(|b| b.set(false));
    }
}

/// Whether the calling thread is cumem's background mapper.
pub fn on_background_mapper() -> bool {
    BACKGROUND.with(|b| b.get())
}

/// Counts one driver call of `kind` made by the calling thread. cumem's
/// VMM wrappers count their own calls; an upstream that simulates a device
/// (the replay tool's) counts the calls the device would have made.
pub fn record_call(kind: CallKind) {
    CALLS[counter(kind)].fetch_add(1, crate::sync::Ordering::Relaxed);
}

/// The index of the calling thread's counter of `kind` in `CALLS`.
fn counter(kind: CallKind) -> usize {
    kind as usize + if on_background_mapper() { KINDS } else { 0 }
}

/// Makes driver call `call` of `kind`, counted as [`record_call`] counts
/// it, and adds the time it took to the calling thread's kind.
pub(super) fn timed<T>(kind: CallKind, call: impl FnOnce() -> T) -> T {
    let i = counter(kind);
    CALLS[i].fetch_add(1, crate::sync::Ordering::Relaxed);
    let start = std::time::Instant::now();
    let r = call();
    CALLS[2 * KINDS + i].fetch_add(start.elapsed().as_nanos() as u64, crate::sync::Ordering::Relaxed);
    r
}

/// Counts one driver call of `kind` as cumem's background mapper's,
/// whatever thread calls: for an upstream that simulates a device and
/// models the mapper's work on the calling thread (the replay tool's).
pub fn record_background_call(kind: CallKind) {
    CALLS[kind as usize + KINDS].fetch_add(1, crate::sync::Ordering::Relaxed);
}

/// The driver calls that moved physical memory so far in this process
/// (`cuMemCreate`, `cuMemMap`, `cuMemUnmap`, `cuMemSetAccess`,
/// `cuMemRelease`, and `cuMemGetInfo`), on the program's threads and on
/// the background mapper.
/// Take the difference of two readings ([`DriverCallCounts::since`]) for
/// the calls of a stretch of work.
pub fn driver_calls() -> DriverCallCounts {
    let read = |base: usize| {
        let c = |k: usize| CALLS[base + k].load(crate::sync::Ordering::Relaxed);
        let ns = std::array::from_fn(|k| c(2 * KINDS + k));
        DriverCalls { create: c(0), map: c(1), unmap: c(2), set_access: c(3), release: c(4), query: c(5), ns }
    };
    DriverCallCounts { allocating: read(0), background: read(KINDS) }
}
