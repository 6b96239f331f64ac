//! Which thread uses which shard of a set: shards are claimed by threads
//! and handed back when the threads exit, so shards (and the memory they
//! cache) outlive the threads that grew them.
//!
//! # Implementation details
//!
//! - **Claim.** A thread's first allocation from a set claims a shard
//!   (cold path, under the registry's lock): the lowest-numbered shard that
//!   is made and has no thread (its memory is reused), else the lowest one
//!   not made yet, else the one with the fewest threads (more threads than
//!   shards share). In a set with worker shards (shard 0 remaps pages), it
//!   goes to the set's first thread, and later threads take it only when
//!   every other shard is taken: a new thread's layout differs from the
//!   last one's, and in shard 0 that costs page moves (driver calls),
//!   where the worker shards trade whole chunks with none. The claim is
//!   remembered in a thread-local list keyed by the set's id (ids are
//!   never reused, so a dropped set's entry can't be mistaken for a new
//!   one); the hot path reads one cached `(id, shard)` pair.
//! - **Hand-back.** The thread-local list's destructor (or
//!   [`release_thread_shards`]) lowers each claimed shard's thread count;
//!   the next thread to claim finds it free. Nothing else changes hands:
//!   the shard's pool, its blocks and its chunks stay where they are, and a
//!   free from any thread still finds the shard through the chunk
//!   directory, so a free racing with the hand-back needs no care (the
//!   loom model `shard_handed_back_while_another_thread_frees_into_it`
//!   checks it).
//! - **Idle trim.** When a hand-back leaves a shard with no thread, the
//!   set's hook (if it has one) runs on the exiting thread ([`Registry::on_idle`]): a set
//!   of remapping shards gives back what its idle shards hold above the
//!   set's page floor (`reclaim.rs`, `trim_idle`), after flushing the
//!   thread's caches so that their blocks count as free.
//! - **Bound.** A set holds at most its count of shards (by default the
//!   processors), however many threads were ever made.

use std::cell::{Cell, RefCell};

use crate::sync::{lock, try_lock, Arc, AtomicUsize, Mutex, Ordering, StaticAtomicU64};

/// Set ids (identities only).
static NEXT_ID: StaticAtomicU64 = StaticAtomicU64::new(1);

/// The threads on each shard of one set.
pub(super) struct Registry {
    id: u64,
    users: Box<[AtomicUsize]>,
    /// Whether shard 0 is kept for the set's first thread (it remaps
    /// pages): later threads take it only when every other shard is
    /// taken.
    primary_first_only: bool,
    /// Whether any thread claimed yet; held while a thread claims.
    claimed: Mutex<bool>,
    /// Shards handed back so far (a shard may have gone idle since a
    /// count was read: `handover.rs` looks again then).
    handed_back: AtomicUsize,
    /// Run by a hand-back that leaves a shard with no thread; removed by
    /// the set's drop. Only tried: a hand-back while it runs passes over.
    idle_hook: Mutex<Option<IdleHook>>,
}

/// What a set runs when one of its shards is left with no thread.
pub(super) type IdleHook = Box<dyn Fn() + Send + Sync>;

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("id", &self.id).field("users", &self.users).finish_non_exhaustive()
    }
}

impl Registry {
    pub(super) fn new(count: usize, primary_first_only: bool) -> Arc<Self> {
        Arc::new(Registry {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            users: (0..count).map(|_| AtomicUsize::new(0)).collect(),
            primary_first_only,
            claimed: Mutex::new(false),
            handed_back: AtomicUsize::new(0),
            idle_hook: Mutex::new(None),
        })
    }

    /// Threads on shard `i` now.
    pub(super) fn users(&self, i: usize) -> usize {
        self.users[i].load(Ordering::Acquire)
    }

    /// The calling thread's shard, claimed on first use; `made(i)` says
    /// whether shard `i` exists yet; `claimed(i)` runs after this thread
    /// claimed shard `i` (outside the registry's lock).
    #[inline]
    pub(super) fn home(this: &Arc<Self>, made: impl Fn(usize) -> bool, claimed: impl Fn(usize)) -> usize {
        let hit = HOMES.try_with(|h| (h.last_id.get() == this.id).then(|| h.last_shard.get()));
        match hit {
            Ok(Some(i)) => i,
            Ok(None) => Self::home_slow(this, made, claimed),
            // Thread-locals torn down: share shard 0 without a claim.
            Err(_) => 0,
        }
    }

    #[cold]
    fn home_slow(this: &Arc<Self>, made: impl Fn(usize) -> bool, claimed: impl Fn(usize)) -> usize {
        let (i, fresh) = HOMES
            .try_with(|h| {
                let known = h.list.borrow().iter().find(|(r, _)| r.id == this.id).map(|(_, i)| *i);
                let (i, fresh) = match known {
                    Some(i) => (i, false),
                    None => {
                        let i = this.claim(made);
                        h.list.borrow_mut().push((this.clone(), i));
                        (i, true)
                    }
                };
                h.last_id.set(this.id);
                h.last_shard.set(i);
                (i, fresh)
            })
            .unwrap_or((0, false));
        if fresh {
            claimed(i);
        }
        i
    }

    /// Claims a shard for a new thread (see the module docs).
    fn claim(&self, made: impl Fn(usize) -> bool) -> usize {
        let mut claimed = lock(&self.claimed);
        let first = !std::mem::replace(&mut *claimed, true);
        let free = |i: &usize| self.users[*i].load(Ordering::Acquire) == 0;
        let n = self.users.len();
        // Shard 0 kept for the first thread: the others look past it.
        let skip = usize::from(self.primary_first_only && !first);
        let i = (skip..n)
            .filter(|i| made(*i))
            .find(free)
            .or_else(|| (skip..n).find(|i| !made(*i) && free(i)))
            .or_else(|| (0..skip).find(free))
            .unwrap_or_else(|| (0..n).min_by_key(|i| self.users[*i].load(Ordering::Acquire)).unwrap_or(0));
        self.users[i].fetch_add(1, Ordering::AcqRel);
        i
    }

    /// Sets what a hand-back runs when it leaves a shard with no thread
    /// (see the module docs).
    pub(super) fn on_idle(&self, hook: IdleHook) {
        *lock(&self.idle_hook) = Some(hook);
    }

    /// Removes the idle hook, waiting for a run in progress to end (the
    /// set's drop: the hook borrows the set).
    pub(super) fn clear_idle(&self) {
        drop(lock(&self.idle_hook).take());
    }

    fn hand_back(&self, i: usize) {
        let before = self.users[i].fetch_sub(1, Ordering::AcqRel);
        self.handed_back.fetch_add(1, Ordering::Release);
        if before == 1 {
            if let Some(hook) = try_lock(&self.idle_hook) {
                if let Some(run) = hook.as_ref() {
                    run();
                }
            }
        }
    }

    /// Shards handed back by exiting threads so far.
    pub(super) fn handed_back(&self) -> usize {
        self.handed_back.load(Ordering::Acquire)
    }
}

/// The shards the calling thread claimed, one per set.
struct Homes {
    last_id: Cell<u64>,
    last_shard: Cell<usize>,
    list: RefCell<Vec<(Arc<Registry>, usize)>>,
}

impl Homes {
    fn release(&self) {
        self.last_id.set(0);
        let list = self.list.try_borrow_mut().map(|mut l| std::mem::take(&mut *l)).unwrap_or_default();
        for (r, i) in list {
            r.hand_back(i);
        }
    }
}

impl Drop for Homes {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(not(loom))]
std::thread_local! {
    static HOMES: Homes = const { Homes { last_id: Cell::new(0), last_shard: Cell::new(0), list: RefCell::new(Vec::new()) } };
}

#[cfg(loom)]
loom::thread_local! {
    static HOMES: Homes = Homes { last_id: Cell::new(0), last_shard: Cell::new(0), list: RefCell::new(Vec::new()) };
}

/// Hands the calling thread's shards (of every set) back, as the thread's
/// exit does; a later allocation on this thread claims anew.
///
/// Threads that stay alive but stop allocating may call it so that new
/// threads reuse their shards. (Under loom, where thread-local destructors
/// can't use loom objects, models call it before a thread ends.)
pub fn release_thread_shards() {
    let _ = HOMES.try_with(Homes::release);
}
