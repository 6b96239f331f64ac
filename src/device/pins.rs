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
//! hands it out, page remapping unmaps only pages that lie wholly in
//! free space.
//!
//! A pinned block freed during a capture follows the rule of every block
//! freed during a capture (`captures.rs`): the capture's private pool
//! holds it until the graph is gone, never an eager free when the export
//! is released. The book marks it as the graph's (`by_graph`), so the last
//! release frees nothing; when the graph's pool retires first, the book
//! takes the free over and the last release makes it (the graph's work is
//! done by then). Both hand-overs happen under the book's lock, so exactly
//! one side frees the block.

use crate::cuda::Stream;
use crate::error::{Error, PoolKind, Result};
use crate::sync::{lock, AtomicUsize, Mutex, Ordering};

#[derive(Debug)]
struct Pinned {
    size: usize,
    /// Exports not yet released.
    open: u32,
    /// The free made while pinned, with its stream (`Some(None)`: none).
    freed: Option<Option<Stream>>,
    /// Freed during a capture: a graph's private pool holds the block and
    /// frees it when it retires (unless the export outlives that).
    by_graph: bool,
}

impl Pinned {
    fn freed(&self) -> bool {
        self.freed.is_some() || self.by_graph
    }
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
        let p = book.entry(addr).or_insert(Pinned { size, open: 0, freed: None, by_graph: false });
        if p.freed() {
            // Freed while pinned: the owner gave it up; it can't be shared.
            return Err(Error::DoubleFree { pool: PoolKind::Device, addr });
        }
        p.open += 1;
        self.pinned.store(book.len(), Ordering::Release);
        Ok(())
    }

    /// Drops one pin of `addr`; returns the free to make now, if the block
    /// was freed meanwhile (not during a capture: the graph frees those)
    /// and this was its last pin.
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
            Some(p) if p.freed() => Err(Error::DoubleFree { pool: PoolKind::Device, addr }),
            Some(p) => {
                p.freed = Some(stream.cloned());
                Ok(Some(p.size))
            }
            None => Ok(None),
        }
    }

    /// Whether `addr` is pinned (one atomic load while nothing is).
    #[inline]
    pub(super) fn is_pinned(&self, addr: usize) -> bool {
        self.pinned.load(Ordering::Acquire) > 0 && lock(&self.book).contains_key(&addr)
    }

    /// Marks pinned `addr` as freed during a capture, its free left to the
    /// graph; returns its size (`None`: not pinned any more).
    pub(super) fn give_to_graph(&self, addr: usize) -> Result<Option<usize>> {
        let mut book = lock(&self.book);
        match book.get_mut(&addr) {
            Some(p) if p.freed() => Err(Error::DoubleFree { pool: PoolKind::Device, addr }),
            Some(p) => {
                p.by_graph = true;
                Ok(Some(p.size))
            }
            None => Ok(None),
        }
    }

    /// Undoes [`give_to_graph`](Self::give_to_graph) (the graph refused it).
    pub(super) fn take_back_from_graph(&self, addr: usize) {
        if let Some(p) = lock(&self.book).get_mut(&addr) {
            p.by_graph = false;
        }
    }

    /// The graph holding `addr` retires: if the block is still pinned, the
    /// book takes its free over (made at the last release, with no
    /// stream: the graph's work is done), runs `keep` under its lock (so
    /// that the release sees what `keep` restores), and `true` says the
    /// graph must not free it.
    pub(super) fn graph_lets_go(&self, addr: usize, keep: impl FnOnce()) -> bool {
        if self.pinned.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut book = lock(&self.book);
        match book.get_mut(&addr) {
            Some(p) if p.by_graph => {
                p.by_graph = false;
                p.freed = Some(None);
                keep();
                true
            }
            _ => false,
        }
    }

    /// How many blocks are pinned.
    pub(crate) fn count(&self) -> usize {
        self.pinned.load(Ordering::Acquire)
    }
}
