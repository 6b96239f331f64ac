//! The driver's pools behind the two stream-ordered modes, each made on
//! first use: the device's default pool (`async_stream_ordered`:
//! `cuMemAllocAsync`, its release threshold raised so memory stays cached)
//! and a pool of cumem's own (`cuda_async_pool`: `cuMemPoolCreate`,
//! `cuMemAllocFromPoolAsync`, exportable when configured so).
//!
//! The allocator calls down into this file; nothing here calls back.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use once_cell::sync::OnceCell;

use super::mode::DeviceAllocatorMode;
use super::native_pool::{self, NativePool, NativePoolOptions};
use crate::cuda::{RelaxedCaptureMode, Stream};
use crate::error::{Error, Result};

/// The driver pools of one device.
pub(super) struct DriverPools {
    ctx: Option<Arc<CudaContext>>,
    options: NativePoolOptions,
    /// The device's default pool, configured on first use.
    default: OnceCell<NativePool>,
    /// cumem's own native pool.
    native: OnceCell<NativePool>,
}

impl DriverPools {
    pub(super) fn new(ctx: Option<Arc<CudaContext>>, options: NativePoolOptions) -> Self {
        DriverPools { ctx, options, default: OnceCell::new(), native: OnceCell::new() }
    }

    fn ctx(&self) -> Result<&Arc<CudaContext>> {
        self.ctx.as_ref().ok_or(Error::NeedsGpu("stream-ordered allocation"))
    }

    /// The driver pool of `mode`, made now if it does not exist yet
    /// (`None` for the sync pool, which has none). Making it is legal even
    /// while this thread captures a graph (relaxed capture mode).
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback; a driver error.
    pub(super) fn get(&self, mode: DeviceAllocatorMode) -> Result<Option<&NativePool>> {
        let cell = match mode {
            DeviceAllocatorMode::SyncPool => return Ok(None),
            DeviceAllocatorMode::AsyncStreamOrdered => &self.default,
            DeviceAllocatorMode::CudaAsyncPool => &self.native,
        };
        let ctx = self.ctx()?;
        cell.get_or_try_init(|| {
            let _relaxed = RelaxedCaptureMode::enter();
            match mode {
                DeviceAllocatorMode::CudaAsyncPool => NativePool::create(ctx.clone(), self.options),
                _ => NativePool::device_default(ctx.clone(), self.options.release_threshold),
            }
        })
        .map(Some)
    }

    /// The driver pool of `mode` if it was made.
    pub(super) fn made(&self, mode: DeviceAllocatorMode) -> Option<&NativePool> {
        match mode {
            DeviceAllocatorMode::SyncPool => None,
            DeviceAllocatorMode::AsyncStreamOrdered => self.default.get(),
            DeviceAllocatorMode::CudaAsyncPool => self.native.get(),
        }
    }

    /// The pools that were made.
    pub(super) fn all_made(&self) -> impl Iterator<Item = &NativePool> {
        self.default.get().into_iter().chain(self.native.get())
    }

    /// Allocates `size` bytes on `on` from stream-ordered `mode`'s pool.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`], driver errors.
    pub(super) fn allocate(&self, mode: DeviceAllocatorMode, size: usize, on: &Stream) -> Result<u64> {
        let pool = self.stream_ordered(mode)?;
        match mode {
            DeviceAllocatorMode::CudaAsyncPool => pool.allocate_async(size, on),
            // `cuMemAllocAsync` draws on the default pool configured above.
            _ => native_pool::allocate_async(self.ctx()?, size, on),
        }
    }

    /// The pool of stream-ordered `mode`, made now if need be.
    fn stream_ordered(&self, mode: DeviceAllocatorMode) -> Result<&NativePool> {
        self.get(mode)?.ok_or(Error::InvalidState("the sync pool has no driver pool".into()))
    }

    /// Exports the live block at `ptr` that `mode` made: the pool's
    /// descriptor and the pointer's export data.
    ///
    /// # Errors
    /// [`Error::Ipc`] for a mode whose memory can't be exported; driver errors.
    pub(super) fn export(&self, mode: DeviceAllocatorMode, ptr: u64) -> Result<(OwnedFd, [u8; 64])> {
        Self::check_exportable(mode, ptr)?;
        self.stream_ordered(mode)?.export(ptr)
    }

    /// Whether blocks `mode` made can be shared with other processes
    /// (those of `cuda_async_pool`); else [`Error::Ipc`] naming `ptr`.
    pub(super) fn check_exportable(mode: DeviceAllocatorMode, ptr: u64) -> Result<()> {
        if mode == DeviceAllocatorMode::CudaAsyncPool {
            return Ok(());
        }
        Err(Error::Ipc(format!(
            "device block {ptr:#x} can't be exported: it comes from the {mode} mode, whose memory can't be \
             exported; use the cuda_async_pool mode"
        )))
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
