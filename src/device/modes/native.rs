//! [`DeviceAllocatorMode::CudaAsyncPool`]: a dedicated native pool
//! (`cuMemPoolCreate`) with `cuMemAllocFromPoolAsync`, its release
//! threshold from the configuration; with exportable handles, its blocks
//! can be shared with other processes.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::lazy::LazyPool;
use super::{Machinery, Mode, Routed};
use crate::cuda::Stream;
use crate::device::mode::DeviceAllocatorMode;
use crate::device::native_pool::{NativePool, NativePoolOptions};
use crate::error::Result;

/// The native pool mode: a pool of cumem's own, made on first use.
pub(super) struct Native {
    options: NativePoolOptions,
    pool: LazyPool,
}

impl Native {
    pub(super) fn new(ctx: Option<Arc<CudaContext>>, options: NativePoolOptions) -> Self {
        Native { options, pool: LazyPool::new(ctx) }
    }

    /// The pool, made on first use.
    fn pool(&self) -> Result<&NativePool> {
        self.pool.get(|ctx| NativePool::create(ctx, self.options))
    }
}

impl Mode for Native {
    fn kind(&self) -> DeviceAllocatorMode {
        DeviceAllocatorMode::CudaAsyncPool
    }

    fn stream_ordered(&self) -> bool {
        true
    }

    fn allocate(
        &self,
        dev: &dyn Machinery,
        size: usize,
        stream: Option<&Stream>,
        routed: Option<Routed<'_>>,
    ) -> Result<u64> {
        let capture = routed.map_or(0, |r| r.capture);
        dev.allocate_stream_ordered(size, stream, self.kind(), capture, &|on| self.pool()?.allocate_async(size, on))
    }

    fn driver_pool(&self) -> Result<Option<&NativePool>> {
        self.pool().map(Some)
    }

    fn made_pool(&self) -> Option<&NativePool> {
        self.pool.made()
    }

    fn exportable(&self) -> bool {
        true
    }

    fn export(&self, ptr: u64) -> Result<(OwnedFd, [u8; 64])> {
        self.pool()?.export(ptr)
    }
}
