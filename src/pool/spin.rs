//! A small lock for data one thread uses nearly always alone.
//!
//! # Implementation details
//!
//! One `AtomicBool`: locking is a compare-exchange (Acquire), unlocking a
//! plain store (Release), about half the cost of `std::sync::Mutex`, whose
//! unlock must also check for sleeping waiters. A waiter spins, then
//! yields (`crate::sync::backoff`); it never sleeps, so use this only where
//! critical sections are short and never block: a thread cache is locked
//! by its own thread on every operation and by others only for a
//! cross-thread free or a drain; a pool's state is locked for one best-fit
//! step (no upstream call is made under it). On the H100 host the pool's
//! switch from `Mutex` to this lock also helped contended threads (16
//! threads without caches: 1.34 against 0.69 Mops/s); with more threads
//! than cores, yielding waiters do worse than sleeping ones (2 cores, 16
//! threads: 3.4 against 5.3 Mops/s).

#[cfg(not(loom))]
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

// Under loom the value sits in loom's cell: models check holders never overlap.
#[cfg(loom)]
use loom::cell::UnsafeCell;

use crate::sync::{backoff, AtomicBool, Ordering};

/// A spin lock around a `T`.
pub(super) struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out access to the value to one thread at a time
// (the Acquire/Release pair orders each holder's accesses after the
// previous holder's), so sharing it needs only that `T` may move between
// threads.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: moving the lock moves the value; `T: Send` makes that sound.
unsafe impl<T: Send> Send for SpinLock<T> {}

impl<T> SpinLock<T> {
    /// An unlocked lock around `value`.
    pub(super) fn new(value: T) -> Self {
        SpinLock { locked: AtomicBool::new(false), value: UnsafeCell::new(value) }
    }

    /// Waits until the lock is free and takes it.
    #[inline]
    pub(super) fn lock(&self) -> SpinGuard<'_, T> {
        self.lock_noting_wait().0
    }

    /// [`lock`](Self::lock), and whether the lock was held by another
    /// thread at the first try (the pool's sign of contention).
    #[inline]
    pub(super) fn lock_noting_wait(&self) -> (SpinGuard<'_, T>, bool) {
        let mut attempt = 0;
        let mut waited = false;
        while self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            waited = true;
            // Wait on plain loads so the cache line is not bounced around.
            while self.locked.load(Ordering::Relaxed) {
                backoff(attempt);
                attempt = attempt.saturating_add(1);
            }
        }
        let guard = SpinGuard {
            lock: self,
            #[cfg(loom)]
            access: Some(self.value.get_mut()),
        };
        (guard, waited)
    }
}

/// Access to a [`SpinLock`]'s value; unlocks when dropped.
pub(super) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
    /// Loom's record of this holder's access (ends before the unlock).
    #[cfg(loom)]
    access: Option<loom::cell::MutPtr<T>>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        #[cfg(not(loom))]
        // SAFETY: the guard exists only while this thread holds the lock,
        // so no other reference to the value is live.
        return unsafe { &*self.lock.value.get() };
        #[cfg(loom)]
        // SAFETY: as above; loom checks it.
        return unsafe { loom::cell::MutPtr::deref(self.access.as_ref().expect("held")) };
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        #[cfg(not(loom))]
        // SAFETY: as in `deref`; `&mut self` makes this the guard's only use.
        return unsafe { &mut *self.lock.value.get() };
        #[cfg(loom)]
        // SAFETY: as above; loom checks it.
        return unsafe { loom::cell::MutPtr::deref(self.access.as_ref().expect("held")) };
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        #[cfg(loom)]
        drop(self.access.take());
        self.lock.locked.store(false, Ordering::Release);
    }
}
