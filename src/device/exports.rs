//! Blocks exported to other processes ([`crate::ipc`]): the exporter keeps
//! each one pinned (allocated, where it is) until its exports are released.
//!
//! # Implementation details
//! The pins are booked in `pins.rs` (`Pins`) under its own lock, with the
//! rule for a pinned block freed during a capture; the driver calls (the
//! export itself, the deferred free) happen here, outside that lock.

use std::os::fd::OwnedFd;

use super::allocator::DeviceAllocator;
use super::captures::Held;
use super::driver_pools::DriverPools;
use crate::cuda::{ipc, vmm, Stream};
use crate::error::{Error, Result};
use crate::ipc::{Exporter, HandleKind, IpcHandle};
use crate::sync::{Ordering, StaticAtomicU64};

/// Export ids, unique in the process.
static NEXT_ID: StaticAtomicU64 = StaticAtomicU64::new(1);

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
        let (size, mode) = match self.stream_ordered_block(addr) {
            Some((_, _, capture)) if capture != 0 => {
                return Err(Error::Ipc(format!("device block {ptr:#x} can't be exported: it belongs to a CUDA graph")));
            }
            Some((size, mode, _)) => {
                DriverPools::check_exportable(mode, ptr)?;
                (size, Some(mode))
            }
            None => match self.pool.check_live(addr) {
                Err(e @ Error::UnknownPointer { .. }) => {
                    // Not the sync pool's: a tag's block is refused by name.
                    self.refuse_tagged_export(addr)?;
                    return Err(e);
                }
                r => (r?, None),
            },
        };
        self.exports.pin(addr, size)?;
        // The handle reports what was asked for: an importer reading
        // `size()` bytes must not read past the exporter's data. The block
        // (and the pieces mapped over it) may be larger.
        let asked =
            if mode.is_some() { size } else { self.pool.requested_size(addr).filter(|r| *r <= size).unwrap_or(size) };
        let made = (|| {
            let (kind, offset, fds) = if let Some(mode) = mode {
                let (fd, data) = self.driver_pools().export(mode, ptr)?;
                (HandleKind::NativePool { data }, 0, vec![fd])
            } else if let Some(pieces) = self.pool.upstream().mapped_pieces(addr, size) {
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

    /// Releases an export of `ptr`; at the last, a pending free takes effect.
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
    #[inline]
    pub(super) fn defer_exported_free(&self, addr: usize, stream: Option<&Stream>) -> Result<Option<usize>> {
        if !self.exports.is_pinned(addr) {
            return Ok(None);
        }
        self.defer_pinned_free(addr, stream)
    }

    /// [`defer_exported_free`](Self::defer_exported_free) of a pinned block.
    #[cold]
    fn defer_pinned_free(&self, addr: usize, stream: Option<&Stream>) -> Result<Option<usize>> {
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

impl Exporter for DeviceAllocator {
    fn release_export(&self, ptr: u64) -> Result<()> {
        DeviceAllocator::release_export(self, ptr)
    }
}

#[cfg(test)]
impl DeviceAllocator {
    /// Pins the block at `ptr` as an export does (exporting itself needs a
    /// GPU), for tests of the pin rules outside this module.
    pub(crate) fn pin_for_tests(&self, ptr: u64, size: usize) -> Result<()> {
        self.exports.pin(ptr as usize, size)
    }
}

#[cfg(test)]
mod tests;
