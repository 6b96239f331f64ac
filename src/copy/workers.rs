//! Helper threads for the staged copies' lanes: started on first need and
//! kept, so a copy wakes threads (a channel send) instead of spawning them
//! (tens of microseconds each, a real share of an 8 MiB copy).
//!
//! [`run_lanes`] lends the helpers a reference to work on the caller's
//! stack and waits for every lane's answer before it returns or unwinds,
//! which is what makes erasing the reference's lifetime sound.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use crossbeam::channel::{bounded, unbounded, Receiver, Sender};
use once_cell::sync::Lazy;

use crate::error::{Error, Result};
use crate::sync::{Ordering, StaticAtomicU64};

/// One lane's work, shared by reference.
type Work<'a> = dyn Fn(usize) -> Result<()> + Sync + 'a;

/// What a helper answers: the lane's result, or its panic.
type Answer = std::thread::Result<Result<()>>;

struct Task {
    /// The work, its lifetime erased (see the module docs).
    work: *const Work<'static>,
    lane: usize,
    done: Sender<Answer>,
}

// SAFETY: the work is `Sync`, so calling it from another thread through a
// shared pointer is allowed; `run_lanes` keeps it alive until the task's
// answer (or the task itself) is gone.
unsafe impl Send for Task {}

struct Helpers {
    tasks: Sender<Task>,
    queue: Receiver<Task>,
    started: StaticAtomicU64,
}

static HELPERS: Lazy<Helpers> = Lazy::new(|| {
    let (tasks, queue) = unbounded();
    Helpers { tasks, queue, started: StaticAtomicU64::new(0) }
});

fn helper(queue: Receiver<Task>) {
    for task in queue.iter() {
        // SAFETY: `run_lanes` keeps the work alive until this task's answer
        // is received (see `Task`).
        let answer = catch_unwind(AssertUnwindSafe(|| unsafe { (*task.work)(task.lane) }));
        let _ = task.done.send(answer);
    }
}

/// Starts helpers until `n` exist, as far as threads can be had; returns
/// how many exist.
fn ensure_helpers(n: usize) -> usize {
    let h = &*HELPERS;
    loop {
        let have = h.started.load(Ordering::Acquire) as usize;
        if have >= n {
            return have;
        }
        if h.started.compare_exchange(have as u64, have as u64 + 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
            continue;
        }
        let queue = h.queue.clone();
        if std::thread::Builder::new().name("cumem-staging".into()).spawn(move || helper(queue)).is_err() {
            h.started.fetch_sub(1, Ordering::AcqRel);
            return have;
        }
    }
}

/// Runs `work(lane)` for every lane in `0..lanes`: lane 0 on this thread,
/// the others on helper threads (or here, when no helper can be had).
/// Returns the first error; waits for every lane before returning, and
/// re-raises a lane's panic only after that.
pub(super) fn run_lanes(lanes: usize, work: &Work<'_>) -> Result<()> {
    let wanted = lanes.saturating_sub(1);
    let helpers = if wanted == 0 { 0 } else { ensure_helpers(wanted).min(wanted) };
    let (done, answers) = bounded::<Answer>(lanes.max(1));
    // SAFETY: only the lifetime changes (same pointer, same vtable); the
    // work stays alive until every task that holds the pointer has answered
    // or was dropped, which the wait below ensures on every path.
    let erased: *const Work<'static> = unsafe { std::mem::transmute::<*const Work<'_>, *const Work<'static>>(work) };
    let mut sent = 0;
    let mut inline = Vec::new();
    for lane in 1..lanes {
        let task = Task { work: erased, lane, done: done.clone() };
        if lane <= helpers && HELPERS.tasks.send(task).is_ok() {
            sent += 1;
        } else {
            inline.push(lane);
        }
    }
    drop(done);
    let mine = catch_unwind(AssertUnwindSafe(|| {
        let mut r = work(0);
        for lane in inline {
            r = r.and(work(lane));
        }
        r
    }));
    let mut result = Ok(());
    let mut panic = None;
    for _ in 0..sent {
        match answers.recv() {
            Ok(Ok(r)) => result = result.and(r),
            Ok(Err(p)) => panic = Some(p),
            // Every remaining task was dropped unrun: nothing uses the work.
            Err(_) => {
                result = result.and(Err(Error::InvalidState("a staging lane was lost".into())));
                break;
            }
        }
    }
    match mine {
        Ok(r) => result = r.and(result),
        Err(p) => panic = panic.or(Some(p)),
    }
    if let Some(p) = panic {
        resume_unwind(p);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::run_lanes;
    use crate::error::Error;
    use crate::sync::{AtomicUsize, Ordering};

    #[test]
    fn every_lane_runs_once_and_errors_come_back() {
        for lanes in [1usize, 2, 5, 8] {
            let hits: Vec<AtomicUsize> = (0..lanes).map(|_| AtomicUsize::new(0)).collect();
            run_lanes(lanes, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
            .unwrap();
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        let r = run_lanes(4, &|i| if i == 3 { Err(Error::InvalidState("lane 3".into())) } else { Ok(()) });
        assert!(matches!(r, Err(Error::InvalidState(m)) if m == "lane 3"));
    }

    #[test]
    fn a_panicking_lane_is_waited_for_and_re_raised() {
        let done = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(|| {
            run_lanes(3, &|i| {
                if i == 1 {
                    panic!("lane 1");
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
                done.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
        });
        assert!(r.is_err());
        assert_eq!(done.load(Ordering::Relaxed), 2, "the other lanes finished first");
    }
}
