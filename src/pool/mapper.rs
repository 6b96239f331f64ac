//! The background mapper: unmaps moved memory's old mappings off-thread.
//!
//! # Implementation details
//!
//! A remapping pool (`remap.rs`) moves memory by lending it: the memory
//! is mapped at its new place while its old place stays mapped, and its
//! old place is unmapped here, off the allocating thread (which then pays
//! a map and an access call per piece of a move, not an unmap too).
//!
//! - **One unmap at a time, between moves.** The driver runs one
//!   thread's VMM calls at a time, so an unmap beside a move delays the
//!   move: a step waits until the pool has made no move for [`QUIET`],
//!   takes the remap lock only if it is free, and unmaps one mapping per
//!   step (a move that starts meanwhile waits for one unmap at most). A
//!   pool queues its job after each move that left some.
//! - **Fences.** A mapping lent behind a fence (memory freed on the
//!   requesting stream, `remap.rs`) is passed over until its fence has
//!   passed (asked, never waited for): a step that finds only such
//!   mappings tries again every [`RETRY`], [`RETRIES`] times.
//! - **Released memory** is not left here: the old mapping of lent memory
//!   the pool released goes on the allocating thread, at the release or
//!   the next map (`Region::plan_released_unmap`), since the memory stays
//!   on the device until it does.
//! - **One thread for the process**, started on demand: pools queue a
//!   [`Job`] (their shared remapping state, held weakly by the queue);
//!   the thread runs queued jobs one step at a time and exits after
//!   [`IDLE`] with nothing queued. Its driver calls count as the
//!   background's ([`crate::cuda::vmm::driver_calls`]).
//! - **Shutdown**: a pool closes its job under the remap lock (no step
//!   then starts anything) and waits until the thread let go of it (a
//!   step unmapping old mappings ends first), unmaps the old mappings
//!   left, and gives its memory back.

use super::page_map::budget;
use super::{Inner, SpinLock};
use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering};
use crate::upstream::Upstream;

/// How long the thread waits for work before it exits.
#[cfg(not(loom))]
const IDLE: std::time::Duration = std::time::Duration::from_millis(500);

/// How long a job waiting for a fence waits before it tries again,
/// and how many times it tries before it waits for the pool's next wake.
#[cfg(not(loom))]
const RETRY: std::time::Duration = std::time::Duration::from_millis(1);
#[cfg(not(loom))]
const RETRIES: u32 = 100;

/// How long after a move the old mappings of lent memory wait before the
/// mapper unmaps them: moves come in bursts (the peak of an iteration),
/// and an unmap beside a move delays it (the driver runs one thread's
/// VMM calls at a time).
#[cfg(not(loom))]
const QUIET: std::time::Duration = std::time::Duration::from_millis(2);

/// A pool's remapping state, shared with the mapper thread.
pub(super) struct Job<U: Upstream> {
    pub(super) inner: Arc<SpinLock<Inner>>,
    pub(super) upstream: Arc<U>,
    pub(super) remap_lock: Arc<Mutex<()>>,
    slack_ppm: u32,
    /// When the pool's last move ended (`moved`), ns since the job was made.
    #[cfg(not(loom))]
    last_move: std::sync::atomic::AtomicU64,
    #[cfg(not(loom))]
    born: std::time::Instant,
    /// Set while the job is in the mapper's queue.
    queued: AtomicBool,
    /// Set when the pool shuts down or drops: no step runs any more.
    closed: AtomicBool,
    /// What a move asks for a fence on the requesting stream
    /// ([`Pool::set_fence_maker`](super::Pool::set_fence_maker)).
    pub(super) fences: once_cell::sync::OnceCell<crate::tag::FenceMaker>,
}

/// What a step of the mapper's work came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    /// Nothing (more) to do until the pool wakes the job again.
    Idle,
    /// A batch done; more is wanted.
    More,
    /// Old mappings are left whose fences have not passed, or a move is
    /// under way: try again shortly.
    Waiting,
}

/// What the mapper thread runs (loom models, with no such thread, call steps).
#[cfg_attr(loom, allow(dead_code))]
pub(crate) trait Step: Send + Sync {
    /// One step of work.
    fn step(&self) -> Progress;
    /// Marks the job as out of the queue (before its step runs).
    fn dequeued(&self);
    /// Marks the job as queued; `false` when it already was.
    fn enqueue(&self) -> bool;
}

impl<U: Upstream> Job<U> {
    pub(super) fn new(
        inner: Arc<SpinLock<Inner>>,
        upstream: Arc<U>,
        remap_lock: Arc<Mutex<()>>,
        slack_ppm: u32,
    ) -> Self {
        Job {
            inner,
            upstream,
            remap_lock,
            slack_ppm,
            #[cfg(not(loom))]
            last_move: std::sync::atomic::AtomicU64::new(0),
            #[cfg(not(loom))]
            born: std::time::Instant::now(),
            queued: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            fences: once_cell::sync::OnceCell::new(),
        }
    }

    /// Notes a move (the old mappings wait [`QUIET`] after it).
    pub(super) fn moved(&self) {
        #[cfg(not(loom))]
        self.last_move.store(self.born.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the pool moved memory less than [`QUIET`] ago.
    fn moving(&self) -> bool {
        #[cfg(not(loom))]
        {
            let last = self.last_move.load(std::sync::atomic::Ordering::Relaxed);
            (self.born.elapsed().as_nanos() as u64).saturating_sub(last) < QUIET.as_nanos() as u64
        }
        #[cfg(loom)]
        false
    }

    /// Stops the job: then no step runs, and none will do anything.
    pub(super) fn close(&self) {
        let _remap = lock(&self.remap_lock);
        self.closed.store(true, Ordering::Release);
    }

    /// Above the budget (new memory was made where kept pieces did not
    /// fit), releases the excess of kept memory. The caller holds the
    /// remap lock, not the pool lock.
    pub(super) fn trim_excess(&self) {
        let keep = {
            let inner = self.inner.lock();
            let pages = &inner.pages;
            let budget = budget(&inner.fit, &inner.pages, self.slack_ppm);
            if pages.physical() <= budget || pages.kept == 0 {
                return;
            }
            pages.kept.saturating_sub(pages.physical() - budget) << pages.shift()
        };
        self.upstream.trim_kept(keep);
        let kept = self.upstream.kept();
        self.inner.lock().pages.set_kept(kept);
    }

    /// One step (see the module docs): one old mapping of moved memory
    /// unmapped, while no move is under way or just done (`benches/vmm.rs`:
    /// beside a second thread's unmaps a map and grant took more than twice
    /// as long).
    pub(super) fn run_step(&self) -> Progress {
        if self.closed.load(Ordering::Acquire) || !self.upstream.has_stale() {
            return Progress::Idle;
        }
        if self.moving() {
            return Progress::Waiting;
        }
        let Ok(_remap) = self.remap_lock.try_lock() else { return Progress::Waiting };
        if self.closed.load(Ordering::Acquire) {
            return Progress::Idle;
        }
        // One whose fence has passed: the others' work may still run, so
        // they are tried again shortly.
        if self.upstream.unmap_stale(1, false) == 0 {
            return Progress::Waiting;
        }
        if self.upstream.has_stale() {
            Progress::More
        } else {
            Progress::Idle
        }
    }
}

impl<U: Upstream> Step for Job<U> {
    fn step(&self) -> Progress {
        self.run_step()
    }
    fn dequeued(&self) {
        self.queued.store(false, Ordering::Release);
    }
    fn enqueue(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && !self.queued.swap(true, Ordering::AcqRel)
    }
}

/// Queues `job` for the mapper thread, unless it is queued already.
pub(super) fn wake<U: Upstream>(job: &Arc<Job<U>>) {
    if !job.enqueue() {
        return;
    }
    #[cfg(not(loom))]
    {
        let weak: std::sync::Weak<dyn Step> = {
            let strong: Arc<dyn Step> = job.clone();
            Arc::downgrade(&strong)
        };
        thread::submit(weak);
    }
}

/// Waits until no one but `job`'s owner holds it (the mapper thread lets go
/// after its step, which a closed job ends at once).
pub(super) fn wait_released<U: Upstream>(job: &Arc<Job<U>>) {
    let mut attempt = 0;
    while Arc::strong_count(job) > 1 {
        crate::sync::backoff(attempt);
        attempt = attempt.saturating_add(1);
    }
}

#[cfg(not(loom))]
mod thread {
    //! The process's mapper thread and its queue.

    use std::collections::VecDeque;
    use std::sync::{Condvar, Weak};

    use super::{Progress, Step, IDLE, RETRIES, RETRY};
    use crate::sync::{lock, Mutex};

    struct Queue {
        jobs: VecDeque<Weak<dyn Step>>,
        /// Jobs waiting for stream work to complete, with their tries.
        waiting: Vec<(Weak<dyn Step>, u32)>,
        running: bool,
    }

    static QUEUE: Mutex<Queue> = Mutex::new(Queue { jobs: VecDeque::new(), waiting: Vec::new(), running: false });
    static READY: Condvar = Condvar::new();

    /// Queues `job`, starting the thread if it is not running.
    pub(super) fn submit(job: Weak<dyn Step>) {
        let mut q = lock(&QUEUE);
        q.jobs.push_back(job);
        if q.running {
            drop(q);
            READY.notify_one();
            return;
        }
        q.running = true;
        drop(q);
        let started = std::thread::Builder::new().name("cumem-mapper".into()).spawn(run);
        if started.is_err() {
            // The mapper only saves the allocating thread work: without a
            // thread, the allocating thread moves pages itself.
            let mut q = lock(&QUEUE);
            q.running = false;
            let q = &mut *q;
            let waiting = q.waiting.drain(..).map(|(job, _)| job);
            for job in q.jobs.drain(..).chain(waiting).collect::<Vec<_>>() {
                if let Some(j) = job.upgrade() {
                    j.dequeued();
                }
            }
        }
    }

    fn run() {
        let _background = crate::cuda::vmm::BackgroundThread::enter();
        loop {
            let (job, tries) = {
                let mut q = lock(&QUEUE);
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        break (job, 0);
                    }
                    if let Some(entry) = q.waiting.pop() {
                        // Jobs waiting for stream work: try again shortly.
                        drop(q);
                        std::thread::sleep(RETRY);
                        break entry;
                    }
                    let (g, timeout) = READY.wait_timeout(q, IDLE).unwrap_or_else(|e| e.into_inner());
                    q = g;
                    if timeout.timed_out() && q.jobs.is_empty() && q.waiting.is_empty() {
                        q.running = false;
                        return;
                    }
                }
            };
            let Some(job) = job.upgrade() else { continue };
            // Dequeued before the step: a wake during it queues it again.
            job.dequeued();
            let progress = job.step();
            let again = match progress {
                Progress::More => true,
                Progress::Waiting => tries < RETRIES,
                Progress::Idle => false,
            };
            if again && job.enqueue() {
                let weak = std::sync::Arc::downgrade(&job);
                drop(job);
                let mut q = lock(&QUEUE);
                if progress == Progress::More {
                    // Back in the queue behind the others.
                    q.jobs.push_back(weak);
                } else {
                    q.waiting.push((weak, tries + 1));
                }
            }
        }
    }
}
