//! The device allocator's modes: one type per [`DeviceAllocatorMode`]
//! behind the small [`Mode`] trait, and the registry that makes them.
//!
//! A new mode is a file here (a type implementing [`Mode`]), its variant
//! and name in `mode.rs`, and one line in [`make_all`]. The allocator
//! dispatches through the trait: allocation, the fallback when the device
//! can't allocate stream-ordered, exports, trimming, statistics and
//! shutdown ask the mode instead of matching on it. The machinery the
//! modes share stays in the allocator: the sync pool with its stream
//! order (`allocator.rs`), the book of stream-ordered allocations, which
//! routes every free to the mode that made the block whatever the mode is
//! now.

mod default_pool;
mod lazy;
mod native;
mod sync_pool;

use std::os::fd::OwnedFd;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::captures::PrivatePool;
use super::mode::DeviceAllocatorMode;
use super::native_pool::{NativePool, NativePoolOptions};
use crate::cuda::Stream;
use crate::error::{Error, Result};

/// A capture that an allocation takes part in: its id, the private pool
/// it is routed into, and the capturing stream.
pub(crate) struct Routed<'a> {
    /// The capture's id.
    pub(crate) capture: u64,
    /// The private pool the capture is routed into.
    pub(crate) pool: &'a PrivatePool,
    /// The capturing stream the allocation is for.
    pub(crate) stream: &'a Stream,
}

/// What the modes share, provided by the device allocator
/// (`allocator.rs`): the sync pool with its stream order, graph-private
/// pools, the book of stream-ordered allocations.
pub(crate) trait Machinery {
    /// Allocates from the device's sync pool, ordering the block's reuse
    /// on `stream` after the work of the stream that freed it.
    ///
    /// # Errors
    /// Invalid sizes, [`Error::OutOfMemory`], driver errors.
    fn allocate_sync_pool(&self, size: usize, stream: Option<&Stream>) -> Result<u64>;

    /// Allocates for work on capturing stream `stream` from the
    /// graph-private pool `pool`.
    ///
    /// # Errors
    /// As [`allocate_sync_pool`](Self::allocate_sync_pool).
    fn allocate_private(&self, pool: &PrivatePool, size: usize, stream: &Stream) -> Result<u64>;

    /// Allocates stream-ordered for `mode` with `attempt` (its
    /// `cuMemAllocAsync` on the stream it is given) and books the block so
    /// that its free reaches `mode` (`capture`: the capture the stream
    /// takes part in, 0 if none).
    ///
    /// # Errors
    /// As [`allocate_sync_pool`](Self::allocate_sync_pool).
    fn allocate_stream_ordered(
        &self,
        size: usize,
        stream: Option<&Stream>,
        mode: DeviceAllocatorMode,
        capture: u64,
        attempt: &dyn Fn(&Stream) -> Result<u64>,
    ) -> Result<u64>;
}

/// One way device memory is allocated.
pub(crate) trait Mode: Send + Sync {
    /// Which mode this is.
    fn kind(&self) -> DeviceAllocatorMode;

    /// Whether the mode allocates stream-ordered through the driver (a
    /// device without memory-pool support then falls back to the sync
    /// pool).
    fn stream_ordered(&self) -> bool;

    /// Allocates `size` bytes on `dev` for work on `stream` (`None`:
    /// usable at once by the host and any stream); `routed` when the
    /// stream captures a graph.
    ///
    /// # Errors
    /// Invalid sizes, [`Error::OutOfMemory`], driver errors.
    fn allocate(
        &self,
        dev: &dyn Machinery,
        size: usize,
        stream: Option<&Stream>,
        routed: Option<Routed<'_>>,
    ) -> Result<u64>;

    /// The driver pool the mode allocates from, made now if it does not
    /// exist yet; `None` for a mode with no driver pool.
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback; a driver error.
    fn driver_pool(&self) -> Result<Option<&NativePool>> {
        Ok(None)
    }

    /// The driver pool, if it exists (nothing is made).
    fn made_pool(&self) -> Option<&NativePool> {
        None
    }

    /// Whether blocks of this mode can be shared with other processes
    /// ([`export`](Self::export)).
    fn exportable(&self) -> bool {
        false
    }

    /// Exports the live block at `ptr` that this mode made: the pool's
    /// descriptor and the pointer's export data.
    ///
    /// # Errors
    /// [`Error::Ipc`] for a mode whose memory can't be exported; driver
    /// errors.
    fn export(&self, ptr: u64) -> Result<(OwnedFd, [u8; 64])> {
        Err(Error::Ipc(format!(
            "device block {ptr:#x} can't be exported: it comes from the {} mode, whose memory can't be exported; \
             use the cuda_async_pool mode",
            self.kind()
        )))
    }
}

/// Every mode of a device, in the order of [`DeviceAllocatorMode::ALL`]
/// (the registry: one line per mode).
pub(crate) fn make_all(ctx: Option<&Arc<CudaContext>>, options: NativePoolOptions) -> Box<[Box<dyn Mode>]> {
    let modes: Box<[Box<dyn Mode>]> = Box::new([
        Box::new(sync_pool::SyncPool),
        Box::new(default_pool::DefaultPool::new(ctx.cloned(), options.release_threshold)),
        Box::new(native::Native::new(ctx.cloned(), options)),
    ]);
    debug_assert!(modes.iter().map(|m| m.kind()).eq(DeviceAllocatorMode::ALL), "registry out of order");
    modes
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{make_all, DeviceAllocatorMode, NativePoolOptions};

    #[test]
    fn the_registry_holds_every_mode_in_order_and_host_modes_need_a_gpu() {
        let modes = make_all(None, NativePoolOptions { release_threshold: u64::MAX, exportable: false });
        let kinds: Vec<_> = modes.iter().map(|m| m.kind()).collect();
        assert_eq!(kinds, DeviceAllocatorMode::ALL);
        for m in modes.iter() {
            assert_eq!(m.stream_ordered(), m.kind() != DeviceAllocatorMode::SyncPool);
            if m.stream_ordered() {
                assert!(matches!(m.driver_pool(), Err(crate::error::Error::NeedsGpu(_))), "{}", m.kind());
            } else {
                assert!(m.driver_pool().unwrap().is_none());
            }
            assert!(m.made_pool().is_none());
            if !m.exportable() {
                assert!(matches!(m.export(0x1000), Err(crate::error::Error::Ipc(_))));
            }
        }
    }
}
