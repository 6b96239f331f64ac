//! Initialise-once storage for the manager singleton, built on the `sync`
//! shim so that loom can model the race for the first initialisation.

use std::cell::UnsafeCell;

use crate::sync::{lock, AtomicBool, Mutex, Ordering};

/// A value written at most once, then shared for the life of the cell.
///
/// Writers serialise on a mutex; readers take a lock-free fast path once
/// `ready` is set (Release on write, Acquire on read, so a reader that sees
/// `ready` sees the whole value).
#[doc(hidden)]
pub struct InitCell<T> {
    ready: AtomicBool,
    lock: Mutex<()>,
    value: UnsafeCell<Option<T>>,
}

// SAFETY: the value is written once, under `lock`, before `ready` is
// released; afterwards it is only read. Sharing needs `T: Sync` (readers on
// many threads) and `T: Send` (it may be written on one thread and read or
// dropped on another).
unsafe impl<T: Send + Sync> Sync for InitCell<T> {}
// SAFETY: moving the cell moves the value; `T: Send` makes that sound.
unsafe impl<T: Send> Send for InitCell<T> {}

impl<T> Default for InitCell<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> InitCell<T> {
    /// An empty cell.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        InitCell { ready: AtomicBool::new(false), lock: Mutex::new(()), value: UnsafeCell::new(None) }
    }

    /// An empty cell.
    #[cfg(loom)]
    pub fn new() -> Self {
        InitCell { ready: AtomicBool::new(false), lock: Mutex::new(()), value: UnsafeCell::new(None) }
    }

    /// The value, if set.
    pub fn get(&self) -> Option<&T> {
        if self.ready.load(Ordering::Acquire) {
            // SAFETY: `ready` is set only after the value was written, never
            // written again; the Acquire load makes the write visible here.
            unsafe { (*self.value.get()).as_ref() }
        } else {
            None
        }
    }

    /// Sets the value to `make()` if the cell is empty; `Err(InitError::AlreadySet)` if
    /// another call set it first (then `make` is not called).
    ///
    /// # Errors
    /// [`InitError::AlreadySet`]; or `make`'s error, leaving the cell empty.
    pub fn init<E>(&self, make: impl FnOnce() -> Result<T, E>) -> Result<&T, InitError<E>> {
        let _guard = lock(&self.lock);
        if self.ready.load(Ordering::Acquire) {
            return Err(InitError::AlreadySet);
        }
        let value = make().map_err(InitError::Failed)?;
        // SAFETY: we hold the lock and `ready` is false, so no reader has a
        // reference into the cell and no other writer is running.
        unsafe { *self.value.get() = Some(value) };
        self.ready.store(true, Ordering::Release);
        Ok(self.get().expect("just set"))
    }

    /// The value, setting it to `make()` first if the cell is empty.
    ///
    /// # Errors
    /// `make`'s error, leaving the cell empty.
    pub fn get_or_init<E>(&self, make: impl FnOnce() -> Result<T, E>) -> Result<&T, E> {
        if let Some(v) = self.get() {
            return Ok(v);
        }
        match self.init(make) {
            Ok(v) => Ok(v),
            Err(InitError::AlreadySet) => Ok(self.get().expect("set by another thread")),
            Err(InitError::Failed(e)) => Err(e),
        }
    }
}

/// Why [`InitCell::init`] did not set the value.
#[doc(hidden)]
#[derive(Debug, PartialEq, Eq)]
pub enum InitError<E> {
    /// A value was there already.
    AlreadySet,
    /// The constructor failed.
    Failed(E),
}
