//! Fault injection: makes chosen driver calls (and their stand-ins in the
//! host fallback) fail, at random or at a chosen call, so that tests can
//! check that every failure gives a typed error and leaves the pools whole.
//!
//! Each injection point sits in cumem's own wrapper of the call, before
//! the call is made: an injected failure returns the error the driver
//! would (out of memory for the calls that obtain memory, `CUDA_ERROR_UNKNOWN`
//! for event records and stream queries) and the call is not made. While
//! nothing is armed a point costs one relaxed atomic load.
//!
//! | point | GPU | host fallback |
//! | --- | --- | --- |
//! | [`Point::Create`] | `cuMemCreate`, `cuMemAlloc` | committing host pages (`mprotect`) |
//! | [`Point::Map`] | `cuMemMap` | committing or moving host pages (`mprotect`, `mremap`) |
//! | [`Point::SetAccess`] | `cuMemSetAccess` | after committing host pages (undone) |
//! | [`Point::Reserve`] | `cuMemAddressReserve` | `mmap(PROT_NONE)` |
//! | [`Point::HostAlloc`] | `cuMemHostAlloc` | the host allocation of a chunk |
//! | [`Point::EventRecord`] | `cuEventRecord` (a stream waits for another) | — |
//! | [`Point::StreamQuery`] | `cuStreamQuery` | — |
//!
//! Arm it with [`arm`], or for a whole program with the environment
//! variable `CUMEM_FAULTS`, read when a manager is made:
//! `CUMEM_FAULTS=<points>[@p=<probability>][@nth=<n>][@seed=<seed>]`, where
//! `<points>` is a comma-separated list of point names (`create`, `map`,
//! `set_access`, `reserve`, `host_alloc`, `event_record`, `stream_query`)
//! or `all`; for example `CUMEM_FAULTS=create,map@p=0.01@seed=7`.
//!
//! # Examples
//! ```
//! use cumem::fault::{self, Point, Scope, Trigger};
//! fault::arm(&[Point::HostAlloc], Trigger::Nth(1), Scope::ThisThread);
//! let mm = cumem::MemoryManager::new(cumem::Config::new().backend(cumem::BackendChoice::Host))?;
//! assert!(mm.allocate_pinned(4096).is_err(), "the first host allocation fails");
//! assert!(mm.allocate_pinned(4096).is_ok(), "only the first");
//! assert_eq!(fault::injected(), 1);
//! fault::disarm();
//! # Ok::<(), cumem::Error>(())
//! ```

use std::cell::Cell;

use crate::error::{Error, Result};
use crate::sync::{Ordering, StaticAtomicU64};

/// Where a failure can be injected (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Point {
    /// Physical memory is made.
    Create,
    /// Memory is mapped into address space.
    Map,
    /// Access is given to mapped memory.
    SetAccess,
    /// Address space is reserved.
    Reserve,
    /// Pinned (host) memory is allocated.
    HostAlloc,
    /// An event is recorded on a stream so that another stream waits.
    EventRecord,
    /// A stream is asked whether its work is done.
    StreamQuery,
}

impl Point {
    /// Every point.
    pub const ALL: [Point; 7] = [
        Point::Create,
        Point::Map,
        Point::SetAccess,
        Point::Reserve,
        Point::HostAlloc,
        Point::EventRecord,
        Point::StreamQuery,
    ];

    /// The point's name in `CUMEM_FAULTS`.
    pub fn name(self) -> &'static str {
        match self {
            Point::Create => "create",
            Point::Map => "map",
            Point::SetAccess => "set_access",
            Point::Reserve => "reserve",
            Point::HostAlloc => "host_alloc",
            Point::EventRecord => "event_record",
            Point::StreamQuery => "stream_query",
        }
    }

    /// The driver call an injected failure names.
    fn call(self) -> &'static str {
        match self {
            Point::Create => "cuMemCreate",
            Point::Map => "cuMemMap",
            Point::SetAccess => "cuMemSetAccess",
            Point::Reserve => "cuMemAddressReserve",
            Point::HostAlloc => "cuMemHostAlloc",
            Point::EventRecord => "cuEventRecord",
            Point::StreamQuery => "cuStreamQuery",
        }
    }

    fn bit(self) -> u64 {
        1 << self as u32
    }
}

/// When an armed point fails.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Trigger {
    /// Each call fails with this probability, drawn from a generator
    /// seeded with `seed` (the same calls in the same order fail the same
    /// way).
    Random {
        /// The chance of each call failing, from 0 to 1.
        probability: f64,
        /// The generator's seed.
        seed: u64,
    },
    /// The n-th call (from 1, over all armed points) fails once, then disarms.
    Nth(u64),
}

/// Which threads' calls fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every thread's (a process-wide soak or GPU run).
    Process,
    /// Only the calls of the thread that armed it (tests sharing a process).
    ThisThread,
}

/// The armed points (bits of [`Point`]); 0: off.
static ARMED: StaticAtomicU64 = StaticAtomicU64::new(0);
/// Whether only the arming thread's calls fail.
static THIS_THREAD_ONLY: StaticAtomicU64 = StaticAtomicU64::new(0);
/// The random trigger's threshold (a call fails when its draw is below
/// it) and the generator's state; 0 threshold: the n-th call trigger.
static THRESHOLD: StaticAtomicU64 = StaticAtomicU64::new(0);
static STATE: StaticAtomicU64 = StaticAtomicU64::new(0);
/// Calls left before the n-th call trigger fires.
static COUNTDOWN: StaticAtomicU64 = StaticAtomicU64::new(0);
/// Failures injected since the process began.
static INJECTED: StaticAtomicU64 = StaticAtomicU64::new(0);

std::thread_local! {
    static ARMED_HERE: Cell<bool> = const { Cell::new(false) };
}

/// Arms `points` with `trigger` for `scope`, replacing what was armed.
pub fn arm(points: &[Point], trigger: Trigger, scope: Scope) {
    ARMED.store(0, Ordering::SeqCst);
    match trigger {
        Trigger::Random { probability, seed } => {
            let p = probability.clamp(0.0, 1.0);
            // At least 1 so the trigger stays random (0 means "n-th").
            let threshold = if p >= 1.0 { u64::MAX } else { ((p * u64::MAX as f64) as u64).max(1) };
            THRESHOLD.store(threshold, Ordering::SeqCst);
            STATE.store(seed, Ordering::SeqCst);
        }
        Trigger::Nth(n) => {
            THRESHOLD.store(0, Ordering::SeqCst);
            COUNTDOWN.store(n.max(1), Ordering::SeqCst);
        }
    }
    THIS_THREAD_ONLY.store(u64::from(scope == Scope::ThisThread), Ordering::SeqCst);
    let _ = ARMED_HERE.try_with(|h| h.set(true));
    ARMED.store(points.iter().fold(0, |m, p| m | p.bit()), Ordering::SeqCst);
}

/// Disarms every point.
pub fn disarm() {
    ARMED.store(0, Ordering::SeqCst);
    let _ = ARMED_HERE.try_with(|h| h.set(false));
}

/// Failures injected so far (in the whole process).
pub fn injected() -> u64 {
    INJECTED.load(Ordering::Relaxed)
}

/// Arms what `CUMEM_FAULTS` asks for (see the module docs), process-wide;
/// `Ok(false)` when it is unset or empty.
///
/// # Errors
/// [`Error::Config`] for a value that can't be read.
pub fn arm_from_env() -> Result<bool> {
    match std::env::var("CUMEM_FAULTS") {
        Ok(v) if !v.trim().is_empty() => {
            let (points, trigger) = parse(&v)?;
            arm(&points, trigger, Scope::Process);
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Reads a `CUMEM_FAULTS` value.
fn parse(v: &str) -> Result<(Vec<Point>, Trigger)> {
    let bad = |why: String| Error::Config(format!("CUMEM_FAULTS={v:?}: {why}"));
    let mut parts = v.trim().split('@');
    let mut points = Vec::new();
    for name in parts.next().unwrap_or("").split(',').map(str::trim) {
        match name {
            "all" => points.extend(Point::ALL),
            _ => points.push(
                Point::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| bad(format!("no point {name:?}")))?,
            ),
        }
    }
    let (mut probability, mut nth, mut seed) = (None, None, 0);
    for part in parts {
        let (key, value) = part.split_once('=').ok_or_else(|| bad(format!("{part:?} is not key=value")))?;
        let number = || value.trim().parse::<u64>().map_err(|_| bad(format!("{value:?} is not a number")));
        match key.trim() {
            "p" => {
                let p = value.trim().parse::<f64>().ok().filter(|p| (0.0..=1.0).contains(p));
                probability = Some(p.ok_or_else(|| bad(format!("p={value} is not a probability")))?);
            }
            "nth" => nth = Some(number()?),
            "seed" => seed = number()?,
            k => return Err(bad(format!("no setting {k:?} (p, nth, seed)"))),
        }
    }
    let trigger = match (probability, nth) {
        (Some(_), Some(_)) => return Err(bad("p and nth exclude each other".into())),
        (_, Some(n)) => Trigger::Nth(n),
        (p, None) => Trigger::Random { probability: p.unwrap_or(0.01), seed },
    };
    Ok((points, trigger))
}

/// Fails the call at `point` when the injection says so, with the error
/// the driver would give. One relaxed load while nothing is armed.
#[inline]
pub(crate) fn check(point: Point) -> Result<()> {
    // The message names the error code without asking the driver for its
    // text: the host fallback has no driver to ask.
    check_driver(point).map_err(|e| Error::Driver {
        call: point.call(),
        message: format!("{:?} (injected at fault point {})", e.0, point.name()),
        device: None,
    })
}

/// [`check`] as the driver's own error, for wrappers that map driver
/// errors themselves (out of memory becomes [`Error::OutOfMemory`]).
#[inline]
pub(crate) fn check_driver(point: Point) -> std::result::Result<(), cudarc::driver::DriverError> {
    if ARMED.load(Ordering::Relaxed) & point.bit() == 0 || !fires() {
        return Ok(());
    }
    INJECTED.fetch_add(1, Ordering::Relaxed);
    use cudarc::driver::sys::cudaError_enum as E;
    Err(cudarc::driver::DriverError(match point {
        Point::EventRecord | Point::StreamQuery => E::CUDA_ERROR_UNKNOWN,
        _ => E::CUDA_ERROR_OUT_OF_MEMORY,
    }))
}

/// Whether this call at an armed point fails.
#[cold]
fn fires() -> bool {
    if THIS_THREAD_ONLY.load(Ordering::Relaxed) != 0 && !ARMED_HERE.try_with(Cell::get).unwrap_or(false) {
        return false;
    }
    let threshold = THRESHOLD.load(Ordering::Relaxed);
    if threshold != 0 {
        return draw() < threshold;
    }
    // The n-th call: the one that takes the countdown from 1 to 0.
    let fired = COUNTDOWN.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)) == Ok(1);
    if fired {
        ARMED.store(0, Ordering::SeqCst);
    }
    fired
}

/// The next number of the generator (splitmix64 over a shared counter).
fn draw() -> u64 {
    let mut z = STATE.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(all(test, not(loom)))]
mod tests;
