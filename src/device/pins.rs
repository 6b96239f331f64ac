//! The book of device blocks exported to other processes: each stays
//! pinned (allocated, where it is) until its exports are released
//! (`exports.rs` makes and releases the exports).
//!
//! # Implementation details
//! A book (address → record) under its own lock, and a count of records
//! that lets every free skip the lock while nothing is exported. A free of
//! a pinned block is recorded (with its stream) instead of made, and made
//! when the last export of the block is released. The block stays live in
//! its pool meanwhile, so nothing the pools do touches it: best fit never
//! hands it out, shards lend and move only free memory, page remapping
//! unmaps only pages that lie wholly in free space.

use crate::cuda::Stream;
use crate::error::{Error, PoolKind, Result};
use crate::sync::{lock, AtomicUsize, Mutex, Ordering};

#[derive(Debug)]
struct Pinned {
    size: usize,
    /// Exports not yet released.
    open: u32,
    /// The free made while pinned, with its stream (`Some(None)`: a free
    /// with no stream).
    freed: Option<Option<Stream>>,
}

/// The exported (pinned) blocks of one device.
#[derive(Debug, Default)]
pub(crate) struct Pins {
    book: Mutex<hashbrown::HashMap<usize, Pinned>>,
    /// `book.len()`, read without the lock.
    pinned: AtomicUsize,
}

impl Pins {
    /// Pins `addr` (`size` bytes) once more.
    pub(super) fn pin(&self, addr: usize, size: usize) -> Result<()> {
        let mut book = lock(&self.book);
        let p = book.entry(addr).or_insert(Pinned { size, open: 0, freed: None });
        if p.freed.is_some() {
            // Freed while pinned: the owner gave it up; it can't be shared.
            return Err(Error::DoubleFree { pool: PoolKind::Device, addr });
        }
        p.open += 1;
        self.pinned.store(book.len(), Ordering::Release);
        Ok(())
    }

    /// Drops one pin of `addr`; returns the free to make now, if the block
    /// was freed meanwhile and this was its last pin.
    pub(super) fn unpin(&self, addr: usize) -> Result<Option<Option<Stream>>> {
        let mut book = lock(&self.book);
        let Some(p) = book.get_mut(&addr) else {
            return Err(Error::Ipc(format!("device block {addr:#x} is not exported")));
        };
        p.open -= 1;
        if p.open > 0 {
            return Ok(None);
        }
        let p = book.remove(&addr).expect("found above");
        self.pinned.store(book.len(), Ordering::Release);
        Ok(p.freed)
    }

    /// Records a free of `addr` if it is pinned; returns its size then.
    pub(super) fn defer_free(&self, addr: usize, stream: Option<&Stream>) -> Result<Option<usize>> {
        if self.pinned.load(Ordering::Acquire) == 0 {
            return Ok(None);
        }
        let mut book = lock(&self.book);
        match book.get_mut(&addr) {
            Some(p) if p.freed.is_some() => Err(Error::DoubleFree { pool: PoolKind::Device, addr }),
            Some(p) => {
                p.freed = Some(stream.cloned());
                Ok(Some(p.size))
            }
            None => Ok(None),
        }
    }

    /// How many blocks are pinned.
    pub(crate) fn count(&self) -> usize {
        self.pinned.load(Ordering::Acquire)
    }
}
