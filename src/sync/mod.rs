//! The one place cumem takes its synchronisation primitives from.
//!
//! Under `cfg(loom)` every lock and atomic is loom's, so the models in
//! `loom-tests/` check the real code; otherwise they are `std`'s. Nothing in
//! the crate names `std::sync` directly.

#![allow(unused_imports)]

mod init;
mod slot;

pub use init::{InitCell, InitError};
pub(crate) use slot::thread_slot;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

/// An atomic for `static` counters that hand out ids. Loom objects can't
/// live in statics, so this one is always `std`'s; use it only where the
/// value is an identity, never to order other memory.
pub(crate) use std::sync::atomic::AtomicU64 as StaticAtomicU64;

/// Locks `mutex`, recovering the data if a panicking thread poisoned it.
///
/// Pool state is updated so that a panic can't leave it half-changed (every
/// operation validates before it mutates), so a poisoned lock still guards
/// consistent data.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    #[cfg(loom)]
    {
        mutex.lock().unwrap_or_else(|e| e.into_inner())
    }
    #[cfg(not(loom))]
    {
        mutex.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Waits a moment in a spin loop: spins at first, then yields (under loom
/// always yields, so models of spin loops terminate).
pub(crate) fn backoff(attempt: u32) {
    #[cfg(loom)]
    {
        let _ = attempt;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        if attempt < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}
