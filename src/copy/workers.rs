//! Helper threads for the staged copies: started on first need and kept,
//! so a copy wakes threads (a channel send) instead of spawning them (tens
//! of microseconds each, a real share of an 8 MiB copy). After a task a
//! helper polls for the next one for a short while before it sleeps, so
//! back-to-back copies don't pay a wake-up each.
//!
//! [`run_with_helpers`] lends the helpers a reference to work on the
//! caller's stack and waits for every helper's answer before it returns
//! or unwinds, which is what makes erasing the reference's lifetime sound.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use crossbeam::channel::{bounded, unbounded, Receiver, Sender, TryRecvError};
use once_cell::sync::Lazy;

use crate::error::{Error, Result};
use crate::sync::{Ordering, StaticAtomicU64};

/// A helper's work, shared by reference.
type Work<'a> = dyn Fn() + Sync + 'a;

/// What a helper answers: `Ok` or its panic.
type Answer = std::thread::Result<()>;

/// How long an idle helper polls for the next task before it sleeps:
/// longer than the DMA tail of a copy to the device, through which the
/// helpers have nothing to copy (8 to 32 MiB back to back on an H200 host:
/// 2 to 3 GB/s more than with 100 us, helpers no longer waking from sleep).
const LINGER: Duration = Duration::from_micros(500);

struct Task {
    /// The work, its lifetime erased (see the module docs).
    work: *const Work<'static>,
    done: Sender<Answer>,
}

// SAFETY: the work is `Sync`, so calling it from another thread through a
// shared pointer is allowed; `run_with_helpers` keeps it alive until the
// task's answer (or the task itself) is gone.
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

/// The next task: polled for [`LINGER`], then waited for (`None`: closed).
fn next_task(queue: &Receiver<Task>) -> Option<Task> {
    let since = Instant::now();
    let mut rounds = 0u32;
    loop {
        match queue.try_recv() {
            Ok(task) => return Some(task),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) if since.elapsed() < LINGER => {
                rounds += 1;
                if rounds % 64 == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            Err(TryRecvError::Empty) => return queue.recv().ok(),
        }
    }
}

fn helper(queue: Receiver<Task>) {
    while let Some(task) = next_task(&queue) {
        // SAFETY: `run_with_helpers` keeps the work alive until our answer.
        let answer = catch_unwind(AssertUnwindSafe(|| unsafe { (*task.work)() }));
        let _ = task.done.send(answer);
    }
}

/// Starts helpers until `n` exist (as threads can be had); how many do.
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

/// Runs `work()` on up to `helpers` helper threads while `main(started)`
/// runs on this thread (`started`: how many helpers were handed the work;
/// `main` must finish the job without them if need be, since a helper
/// busy with another copy may come late). Waits for every helper before
/// returning, and re-raises a helper's panic only after that. Returns
/// `main`'s result.
pub(super) fn run_with_helpers(helpers: usize, work: &Work<'_>, main: impl FnOnce(usize) -> Result<()>) -> Result<()> {
    let have = if helpers == 0 { 0 } else { ensure_helpers(helpers).min(helpers) };
    let (done, answers) = bounded::<Answer>(have.max(1));
    // SAFETY: only the lifetime changes (same pointer, same vtable); the
    // work stays alive until every task that holds the pointer has answered
    // or was dropped, which the wait below ensures on every path.
    let erased: *const Work<'static> = unsafe { std::mem::transmute::<*const Work<'_>, *const Work<'static>>(work) };
    let mut sent = 0;
    for _ in 0..have {
        if HELPERS.tasks.send(Task { work: erased, done: done.clone() }).is_ok() {
            sent += 1;
        }
    }
    drop(done);
    let mine = catch_unwind(AssertUnwindSafe(|| main(sent)));
    let mut lost = false;
    let mut panic = None;
    for _ in 0..sent {
        match answers.recv() {
            Ok(Ok(())) => {}
            Ok(Err(p)) => panic = Some(p),
            // Every remaining task was dropped unrun: nothing uses the work.
            Err(_) => {
                lost = true;
                break;
            }
        }
    }
    let result = match mine {
        Ok(r) => r,
        Err(p) => {
            panic = panic.or(Some(p));
            Ok(())
        }
    };
    if let Some(p) = panic {
        resume_unwind(p);
    }
    if lost {
        return result.and(Err(Error::InvalidState("a staging helper was lost".into())));
    }
    result
}

#[cfg(test)]
mod tests;
