//! A small lock for data one thread uses nearly always alone.
//!
//! # Implementation details
//!
//! One `AtomicBool`: locking is a compare-exchange (Acquire), unlocking a
//! plain store (Release), about half the cost of `std::sync::Mutex`, whose
//! unlock must also check for sleeping waiters. A waiter spins, then
//! yields (`crate::sync::backoff`); it never sleeps, so use this only where
//! contention is rare and critical sections are short: a thread cache is
//! locked by its own thread on every operation and by others only for a
//! cross-thread free or a drain.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

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
        let mut attempt = 0;
        while self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            // Wait on plain loads so the cache line is not bounced around.
            while self.locked.load(Ordering::Relaxed) {
                backoff(attempt);
                attempt = attempt.saturating_add(1);
            }
        }
        SpinGuard { lock: self }
    }
}

/// Access to a [`SpinLock`]'s value; unlocks when dropped.
pub(super) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while this thread holds the lock,
        // so no other reference to the value is live.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only access
        // through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}
