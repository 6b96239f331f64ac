//! Several devices: each device's allocator made on first use (from plain
//! configuration values, `DeviceSetup`), the device of a call, the device
//! that owns a pointer, peer access and peer copies.
//!
//! # Implementation details
//!
//! A call that takes a stream works on the stream's device: the stream
//! caches its device ordinal when it is made, so dispatch is an index into
//! the manager's device table, as for the default device. A free goes
//! first to the device the caller points at (the stream's, or the default
//! device); only when that device's pools don't know the pointer
//! ([`Error::UnknownPointer`], which changes nothing) are the other
//! initialised devices asked. Unified addressing gives every device its own
//! addresses, so at most one device knows a pointer. The single-device case
//! pays nothing for this: the fallback runs only on the error path.

use super::config::PeerAccess;
use super::{Backend, MemoryManager};
use crate::cuda::{self, Stream};
use crate::device::{DeviceAllocator, DeviceSetup, DeviceStats, NativePoolOptions};
use crate::error::{Error, PoolKind, Result};

impl MemoryManager {
    /// [`allocate_device`](Self::allocate_device) on device `ordinal`:
    /// usable at once by the host (copies) and any stream of that device.
    ///
    /// # Errors
    /// [`Error::NoSuchDevice`]; as [`allocate_device`](Self::allocate_device),
    /// with device errors naming `ordinal`.
    ///
    /// # Examples
    /// ```
    /// let mm = cumem::MemoryManager::global()?;
    /// let p = mm.allocate_device_for(0, 4096)?;
    /// mm.free_device(p)?; // finds the device that made it
    /// assert!(matches!(mm.allocate_device_for(7, 4096), Err(cumem::Error::NoSuchDevice { .. })));
    /// # Ok::<(), cumem::Error>(())
    /// ```
    pub fn allocate_device_for(&self, ordinal: usize, size: usize) -> Result<u64> {
        self.check_running("device allocation")?;
        let r = self.device(ordinal)?.allocate(size, None);
        self.device_allocated(r, ordinal, size, 0)
    }

    /// Exports the device block at `ptr` (a live block's start, on any
    /// device) to other processes and pins it until the returned
    /// [`Export`](crate::ipc::Export) is released: see [`crate::ipc`] for
    /// the protocol, the kinds of memory that can be shared and how.
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback; [`Error::UnknownPointer`]
    /// (and the other bad-pointer errors) for a pointer that is not a live
    /// block's start; [`Error::Ipc`] for memory that can't be exported;
    /// driver errors. Nothing changes on an error.
    pub fn export_device(&self, ptr: u64) -> Result<crate::ipc::Export<'_>> {
        self.check_running("exporting device memory")?;
        let first = self.device(self.config.device)?;
        let others = self.initialised_devices().filter(|d| d.ordinal() != first.ordinal());
        let mut unknown = None;
        for d in std::iter::once(first).chain(others) {
            match d.export(ptr) {
                Err(e @ Error::UnknownPointer { .. }) => unknown = unknown.or(Some(e)),
                r => return r.map(|h| crate::ipc::Export::new(d, ptr, h)).map_err(|e| e.on_device(d.ordinal())),
            }
        }
        Err(unknown.unwrap_or(Error::UnknownPointer { pool: PoolKind::Device, addr: ptr as usize }))
    }

    /// The device of a stream's calls: its own (a host queue's: the default).
    #[inline]
    pub(crate) fn ordinal_of(&self, stream: &Stream) -> usize {
        stream.device().unwrap_or(self.config.device)
    }

    /// Bookkeeping after a device allocation on device `ordinal`; an error
    /// names the device. The result is matched, not moved whole: an
    /// allocation's common case carries no error through.
    #[inline]
    pub(super) fn device_allocated(&self, r: Result<u64>, ordinal: usize, size: usize, stream: u64) -> Result<u64> {
        let addr = match r {
            Ok(addr) => addr,
            Err(e) => return self.device_allocation_failed(e, ordinal, size, stream),
        };
        self.note_allocation(PoolKind::Device, &Ok::<u64, ()>(addr), size, stream);
        Ok(addr)
    }

    #[cold]
    #[inline(never)]
    fn device_allocation_failed(&self, e: Error, ordinal: usize, size: usize, stream: u64) -> Result<u64> {
        let r = Err(e.on_device(ordinal));
        self.note_allocation(PoolKind::Device, &r, size, stream);
        r
    }

    /// After a free on device `ordinal`: a pointer it lacks is tried elsewhere.
    #[inline]
    pub(super) fn device_freed(
        &self,
        r: Result<usize>,
        ptr: u64,
        stream: Option<&Stream>,
        ordinal: usize,
    ) -> Result<()> {
        let size = match r {
            Ok(size) => size,
            Err(e) => return self.device_free_failed(e, ptr, stream, ordinal),
        };
        self.note_free(PoolKind::Device, &Ok::<usize, ()>(size), ptr, stream.map_or(0, |s| s.cu_stream() as u64));
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn device_free_failed(&self, e: Error, ptr: u64, stream: Option<&Stream>, ordinal: usize) -> Result<()> {
        let r = match e {
            e @ Error::UnknownPointer { .. } if self.devices.len() > 1 => self.free_on_owner(ptr, stream, ordinal, e),
            e => Err(e),
        };
        self.note_free(PoolKind::Device, &r, ptr, stream.map_or(0, |s| s.cu_stream() as u64));
        r.map(|_| ())
    }

    /// After device `tried` did not know `ptr`: frees it on the initialised
    /// device that does. Returns the first answer other than "unknown
    /// pointer", else `unknown`.
    pub(crate) fn free_on_owner(
        &self,
        ptr: u64,
        stream: Option<&Stream>,
        tried: usize,
        unknown: Error,
    ) -> Result<usize> {
        for (ordinal, cell) in self.devices.iter().enumerate() {
            let Some(d) = cell.get().filter(|_| ordinal != tried) else { continue };
            match d.free(ptr, stream) {
                Err(Error::UnknownPointer { .. }) => continue,
                r => return r.map_err(|e| e.on_device(ordinal)),
            }
        }
        Err(unknown)
    }

    /// The device that owns `ptr`, among the initialised devices whose sync
    /// pools hold it as a live block, or `None`.
    pub fn owner_of(&self, ptr: u64) -> Option<usize> {
        self.initialised_devices().find(|d| d.pool().block_size(ptr as usize).is_some()).map(|d| d.ordinal())
    }

    /// How many devices the manager can serve (1 on the host fallback).
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// The statistics of every initialised device, by ordinal.
    pub fn all_device_stats(&self) -> Vec<(usize, DeviceStats)> {
        self.initialised_devices().map(|d| (d.ordinal(), d.stats())).collect()
    }

    /// Lets kernels on device `accessor` read and write every block of
    /// device `owner`'s memory that cumem hands out, now and later: sync
    /// pool chunks (`cuCtxEnablePeerAccess`), expandable segments and
    /// growable buffers (`cuMemSetAccess` on every mapping, present and
    /// future), the default and dedicated native pools
    /// (`cuMemPoolSetAccess`), and so the arena's blocks. One-way: call it
    /// with the roles swapped for the other direction. Granting twice, or
    /// `accessor == owner`, is harmless. The grant is process-wide (the
    /// devices' primary contexts are shared): every manager and every
    /// growable buffer sees it. On the host fallback it only checks the
    /// ordinals.
    ///
    /// # Errors
    /// [`Error::NoSuchDevice`]; [`Error::PeerAccess`] when the two devices
    /// have no peer path; a driver error naming the call.
    pub fn enable_peer_access(&self, accessor: usize, owner: usize) -> Result<()> {
        let count = self.devices.len();
        for ordinal in [accessor, owner] {
            if ordinal >= count {
                return Err(Error::NoSuchDevice { ordinal, count });
            }
        }
        match self.backend {
            Backend::Host { .. } => Ok(()),
            Backend::Cuda { .. } => cuda::enable_peer_access(accessor, owner),
        }
    }

    /// Applies the configuration's `peer_access` to the pairs that involve
    /// device `ordinal` (before its allocator is created). With
    /// [`PeerAccess::All`], pairs without a peer path are skipped.
    pub(crate) fn apply_peer_config(&self, ordinal: usize) -> Result<()> {
        if self.backend.is_host() {
            return Ok(());
        }
        let count = self.devices.len();
        match &self.config.peer_access {
            PeerAccess::None => Ok(()),
            PeerAccess::All => {
                for other in (0..count).filter(|&o| o != ordinal) {
                    for (a, b) in [(ordinal, other), (other, ordinal)] {
                        if cuda::can_access_peer(a, b)? {
                            cuda::enable_peer_access(a, b)?;
                        }
                    }
                }
                Ok(())
            }
            PeerAccess::Pairs(pairs) => {
                for &(a, b) in pairs.iter().filter(|(a, b)| *a == ordinal || *b == ordinal) {
                    if a >= count || b >= count {
                        return Err(Error::Config(format!(
                            "peer_access: {a}:{b} names a device past the last ({count} present)"
                        )));
                    }
                    cuda::enable_peer_access(a, b)?;
                }
                Ok(())
            }
        }
    }
}

impl MemoryManager {
    /// The allocator of device `ordinal`, created on first use.
    ///
    /// # Errors
    /// [`Error::NoSuchDevice`]; a driver error creating its context.
    pub fn device(&self, ordinal: usize) -> Result<&DeviceAllocator> {
        // Not `ok_or`: the error is built only when needed (a hot path).
        let Some(cell) = self.devices.get(ordinal) else {
            return Err(Error::NoSuchDevice { ordinal, count: self.devices.len() });
        };
        cell.get_or_try_init(|| self.make_device(ordinal))
    }

    /// The allocator of the default device.
    ///
    /// # Errors
    /// As [`device`](Self::device).
    pub fn default_device(&self) -> Result<&DeviceAllocator> {
        self.device(self.config.device)
    }

    fn make_device(&self, ordinal: usize) -> Result<DeviceAllocator> {
        self.apply_peer_config(ordinal)?;
        let ctx = match self.backend {
            Backend::Cuda { .. } => crate::cuda::device_context(ordinal)?,
            Backend::Host { .. } => None,
        };
        let mut pool = self.config.device_pool_config();
        // A size set with `set_device_pool_size` wins over the config's.
        pool.initial_size = *crate::sync::lock(&self.device_pool_size);
        // A mode set with `set_device_allocator_mode` (recorded on the
        // default device, which it creates) holds for devices made later.
        let mode = match self.devices[self.config.device].get() {
            Some(d) if ordinal != self.config.device => d.requested_mode(),
            _ => self.config.mode,
        };
        let setup = DeviceSetup {
            pool,
            graph_pool: self.config.graph_pool_config(),
            expandable: self.config.expandable,
            mode,
            native: NativePoolOptions {
                release_threshold: self.config.release_threshold,
                exportable: self.config.exportable_native_pool,
            },
            promise_registered_captures: self.config.promise_registered_captures,
        };
        setup.build(ordinal, ctx)
    }
}
