//! Blocks exported to other processes ([`crate::ipc`]): the exporter keeps
//! each one pinned (allocated, where it is) until its exports are released.
//!
//! # Implementation details
//! A book (address → record) under its own lock, and a count of records
//! that lets every free skip the lock while nothing is exported. A free of
//! a pinned block is recorded (with its stream) instead of made, and made
//! when the last export of the block is released. The block stays live in
//! its pool meanwhile, so nothing the pools do touches it: best fit never
//! hands it out, arenas lend and move only free memory, page remapping
//! unmaps only pages that lie wholly in free space. Driver calls (the
//! export itself, the deferred free) happen outside the lock.
//!
//! A pinned block freed during a capture follows the rule of every block
//! freed during a capture (`graph.rs`): the capture's private pool holds
//! it until the graph is gone, never an eager free when the export is
//! released. The book marks it as the graph's (`by_graph`), so the last
//! release frees nothing; when the graph's pool retires first, the book
//! takes the free over and the last release makes it (the graph's work is
//! done by then). Both hand-overs happen under the book's lock, so exactly
//! one side frees the block.

use std::os::fd::OwnedFd;

use super::allocator::DeviceAllocator;
use super::graph::Held;
use super::DeviceAllocatorMode;
use crate::cuda::{ipc, vmm, Stream};
use crate::error::{Error, PoolKind, Result};
use crate::ipc::{HandleKind, IpcHandle};
use crate::sync::{lock, AtomicUsize, Mutex, Ordering, StaticAtomicU64};

#[derive(Debug)]
struct Pinned {
    size: usize,
    /// Exports not yet released.
    open: u32,
    /// The free made while pinned, with its stream (`Some(None)`: a free
    /// with no stream).
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

/// The exported blocks of one device.
#[derive(Debug, Default)]
pub(crate) struct Exports {
    book: Mutex<hashbrown::HashMap<usize, Pinned>>,
    /// `book.len()`, read without the lock.
    pinned: AtomicUsize,
}

/// Export ids, unique in the process.
static NEXT_ID: StaticAtomicU64 = StaticAtomicU64::new(1);

impl Exports {
    /// Pins `addr` (`size` bytes) once more.
    fn pin(&self, addr: usize, size: usize) -> Result<()> {
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
    fn unpin(&self, addr: usize) -> Result<Option<Option<Stream>>> {
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
    fn defer_free(&self, addr: usize, stream: Option<&Stream>) -> Result<Option<usize>> {
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
    fn is_pinned(&self, addr: usize) -> bool {
        self.pinned.load(Ordering::Acquire) > 0 && lock(&self.book).contains_key(&addr)
    }

    /// Marks pinned `addr` as freed during a capture, its free left to the
    /// graph; returns its size (`None`: not pinned any more).
    fn give_to_graph(&self, addr: usize) -> Result<Option<usize>> {
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

    /// Undoes [`give_to_graph`](Self::give_to_graph) (the graph refused
    /// the block).
    fn take_back_from_graph(&self, addr: usize) {
        if let Some(p) = lock(&self.book).get_mut(&addr) {
            p.by_graph = false;
        }
    }

    /// The graph holding `addr` retires: if the block is still pinned, the
    /// book takes its free over (made at the last release, with no
    /// stream: the graph's work is done), runs `keep` under its lock (so
    /// that the release sees what `keep` restores), and `true` says the
    /// graph must not free it.
    fn graph_lets_go(&self, addr: usize, keep: impl FnOnce()) -> bool {
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

impl DeviceAllocator {
    /// Exports the live block at `ptr` to other processes and pins it (see
    /// [`crate::ipc`]); each export is released once with
    /// [`release_export`](Self::release_export).
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback; [`Error::UnknownPointer`],
    /// [`Error::InteriorPointer`], [`Error::DoubleFree`] for a pointer that
    /// is not a live block's start; [`Error::Ipc`] for memory that can't be
    /// exported (the default pool of `async_stream_ordered`, graph memory,
    /// memory made without an exportable handle type); driver errors.
    pub fn export(&self, ptr: u64) -> Result<IpcHandle> {
        let ctx = self.context().ok_or(Error::NeedsGpu("exporting device memory"))?.clone();
        let addr = ptr as usize;
        let (size, native) = match self.stream_ordered_block(addr) {
            Some((size, DeviceAllocatorMode::CudaAsyncPool, 0)) => (size, true),
            Some((_, mode, capture)) => {
                let why = if capture != 0 {
                    "it belongs to a CUDA graph".to_string()
                } else {
                    format!("it comes from the device's default pool ({mode} mode), which can't be exported; use the cuda_async_pool mode")
                };
                return Err(Error::Ipc(format!("device block {ptr:#x} can't be exported: {why}")));
            }
            None => (self.pool.check_live(addr)?, false),
        };
        self.exports.pin(addr, size)?;
        // The handle reports what was asked for: an importer reading
        // `size()` bytes must not read past the exporter's data. The block
        // (and the pieces mapped over it) may be larger.
        let asked = if native { size } else { self.pool.requested_size(addr).filter(|r| *r <= size).unwrap_or(size) };
        let made = (|| {
            let (kind, offset, fds) = if native {
                let (fd, data) = self.native_pool()?.export(ptr)?;
                (HandleKind::NativePool { data }, 0, vec![fd])
            } else if let Some(pieces) = self.pool.mapped_pieces(addr, size) {
                let fds = pieces
                    .iter()
                    .map(|p| vmm::export_mapping(&ctx, p.addr as u64))
                    .collect::<Result<Vec<OwnedFd>>>()?;
                let sizes = pieces.iter().map(|p| p.size as u64).collect();
                (HandleKind::Mapped { pieces: sizes }, (addr - pieces[0].addr) as u64, fds)
            } else {
                let (base, _) = ipc::allocation_range(&ctx, ptr)?;
                (HandleKind::Allocation { handle: ipc::ipc_handle(&ctx, base)? }, ptr - base, Vec::new())
            };
            Ok(IpcHandle {
                kind,
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                pid: std::process::id(),
                uuid: ipc::device_uuid(&ctx)?,
                size: asked as u64,
                offset,
                fds,
            })
        })();
        if made.is_err() {
            self.release_export(ptr)?;
        }
        made
    }

    /// Releases one export of `ptr`: once all of its exports are released,
    /// a free made meanwhile takes effect.
    ///
    /// # Errors
    /// [`Error::Ipc`] when `ptr` is not exported; the deferred free's error.
    pub fn release_export(&self, ptr: u64) -> Result<()> {
        match self.exports.unpin(ptr as usize)? {
            Some(stream) => self.free(ptr, stream.as_ref()).map(|_| ()),
            None => Ok(()),
        }
    }

    /// A private pool retires holding `block`: `true` when the block is
    /// still exported, and its last release frees it instead (a
    /// stream-ordered one goes back in the book of live allocations for
    /// that free).
    pub(super) fn exported_outlives_graph(&self, block: Held) -> bool {
        self.exports.graph_lets_go(block.addr(), || {
            if let Held::StreamOrdered { addr, size, mode } = block {
                self.restore_stream_ordered(addr, size, mode);
            }
        })
    }

    /// How many blocks are exported (pinned) now.
    pub fn exported_blocks(&self) -> usize {
        self.exports.count()
    }

    /// A free of a pinned block: `Some(size)` when it is recorded for the
    /// last release, or, during a capture, handed to the capture's private
    /// pool like any block captured work freed (see the module docs).
    pub(super) fn defer_exported_free(&self, addr: usize, stream: Option<&Stream>) -> Result<Option<usize>> {
        if !self.exports.is_pinned(addr) {
            return Ok(None);
        }
        let capture = match stream {
            Some(s) if self.graphs.watching() => self.capture_for(s)?,
            _ => None,
        };
        let Some((_, p)) = capture else { return self.exports.defer_free(addr, stream) };
        let Some(size) = self.exports.give_to_graph(addr)? else {
            // Released meanwhile: an ordinary free, routed as usual.
            return Ok(None);
        };
        let held = match self.take_stream_ordered(addr) {
            Some((size, mode)) => Held::StreamOrdered { addr, size, mode },
            None => Held::Pool { addr, size },
        };
        if let Err(e) = self.graphs.hold(&p, held) {
            if let Held::StreamOrdered { size, mode, .. } = held {
                self.restore_stream_ordered(addr, size, mode);
            }
            self.exports.take_back_from_graph(addr);
            return Err(e);
        }
        Ok(Some(size))
    }
}

#[cfg(test)]
mod tests {
    use crate::{BackendChoice, Config, Error, MemoryManager, Stream};

    /// The pinning alone (exporting needs a GPU): a pinned block that its
    /// owner frees is never handed out again until the release, and is
    /// handed out at once after it.
    #[test]
    fn a_pinned_block_is_not_handed_out_again_until_its_release() {
        let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host)).unwrap();
        let d = mm.device(0).unwrap();
        let size = 64 << 10;
        let p = mm.allocate_device(size).unwrap();
        d.exports.pin(p as usize, size).unwrap();
        d.exports.pin(p as usize, size).unwrap(); // a second export of it
        assert_eq!(d.exported_blocks(), 1);
        mm.free_device_on(p, &Stream::host()).unwrap();
        // A second free is a double free, as without the pin.
        assert!(matches!(mm.free_device(p), Err(Error::DoubleFree { .. })));
        assert!(matches!(d.exports.pin(p as usize, size), Err(Error::DoubleFree { .. })));
        let mut held = Vec::new();
        for _ in 0..16 {
            let q = mm.allocate_device(size).unwrap();
            assert_ne!(q, p, "a pinned block was handed out again");
            held.push(q);
        }
        assert_eq!(d.stats().pool.live_blocks, 17);
        for q in held {
            mm.free_device(q).unwrap();
        }
        d.release_export(p).unwrap();
        assert_eq!(d.stats().pool.live_blocks, 1, "one export is still open");
        d.release_export(p).unwrap();
        assert_eq!((d.stats().pool.live_blocks, d.exported_blocks()), (0, 0));
        assert!(matches!(d.release_export(p), Err(Error::Ipc(_))));
        // Best fit hands the same block out now: the test above would see a
        // pinned block handed out.
        assert_eq!(mm.allocate_device(size).unwrap(), p);
    }

    /// Blocks of `size` allocated on `t` until one of them is `p` (at most
    /// 4); all freed again.
    fn reaches(mm: &MemoryManager, size: usize, t: &Stream, p: u64) -> bool {
        let got: Vec<u64> = (0..4).map(|_| mm.allocate_device_on(size, t).unwrap()).collect();
        let found = got.contains(&p);
        for q in got {
            mm.free_device_on(q, t).unwrap();
        }
        found
    }

    /// A pinned block freed during a capture follows the rule of every
    /// block captured work freed: the graph keeps it after its last export
    /// is released, until the graph is gone, whichever of the two goes
    /// first. Control: before the fix the release freed it eagerly (the
    /// first case failed with the block handed out while the graph lived).
    #[test]
    fn a_pinned_block_freed_during_a_capture_stays_the_graphs() {
        for graph_first in [false, true] {
            let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host)).unwrap();
            let d = mm.device(0).unwrap();
            let size = 8 << 20;
            let (s, t) = (Stream::host(), Stream::host());
            let p = mm.allocate_device_on(size, &s).unwrap();
            d.exports.pin(p as usize, size).unwrap();
            let pool = mm.graph_pool().unwrap();
            let capture = mm.begin_capture(&s, &pool).unwrap();
            mm.free_device_on(p, &s).unwrap(); // captured work used it
            assert!(matches!(mm.free_device_on(p, &s), Err(Error::DoubleFree { .. })));
            let graph = capture.end().unwrap();
            assert!(matches!(mm.free_device(p), Err(Error::DoubleFree { .. })));
            if graph_first {
                drop((graph, pool));
                assert_eq!(d.stats().graphs.held, 0);
                assert!(!reaches(&mm, size, &t, p), "an exported block was handed out after its graph went");
                d.release_export(p).unwrap();
            } else {
                d.release_export(p).unwrap();
                assert_eq!(d.exported_blocks(), 0);
                assert!(!reaches(&mm, size, &t, p), "the release freed a block the graph still holds");
                assert!(matches!(mm.free_device(p), Err(Error::DoubleFree { .. })));
                drop((graph, pool));
            }
            assert_eq!((d.stats().graphs.held, d.exported_blocks()), (0, 0), "graph first: {graph_first}");
            assert!(reaches(&mm, size, &t, p), "the block came back once the graph and the export were gone");
            assert_eq!(d.stats().pool.live_blocks, 0);
        }
    }

    #[test]
    fn exporting_needs_a_gpu_and_says_so() {
        let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host)).unwrap();
        let p = mm.allocate_device(4096).unwrap();
        assert!(matches!(mm.export_device(p), Err(Error::NeedsGpu(_))));
        assert_eq!(mm.device(0).unwrap().exported_blocks(), 0);
        mm.free_device(p).unwrap();
    }
}
