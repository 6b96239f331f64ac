//! [`DeviceAllocatorMode::AsyncStreamOrdered`]: `cuMemAllocAsync` /
//! `cuMemFreeAsync` from the device's default pool, its release threshold
//! raised so memory stays cached.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::lazy::LazyPool;
use super::{Machinery, Mode, Routed};
use crate::cuda::Stream;
use crate::device::mode::DeviceAllocatorMode;
use crate::device::native_pool::{self, NativePool};
use crate::error::Result;

/// The default-pool mode: the device's default pool, configured on first
/// use.
pub(super) struct DefaultPool {
    release_threshold: u64,
    pool: LazyPool,
}

impl DefaultPool {
    pub(super) fn new(ctx: Option<Arc<CudaContext>>, release_threshold: u64) -> Self {
        DefaultPool { release_threshold, pool: LazyPool::new(ctx) }
    }

    /// The pool, made on first use.
    fn pool(&self) -> Result<&NativePool> {
        self.pool.get(|ctx| NativePool::device_default(ctx, self.release_threshold))
    }
}

impl Mode for DefaultPool {
    fn kind(&self) -> DeviceAllocatorMode {
        DeviceAllocatorMode::AsyncStreamOrdered
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
        dev.allocate_stream_ordered(size, stream, self.kind(), capture, &|on| {
            self.pool()?;
            native_pool::allocate_async(self.pool.ctx()?, size, on)
        })
    }

    fn driver_pool(&self) -> Result<Option<&NativePool>> {
        self.pool().map(Some)
    }

    fn made_pool(&self) -> Option<&NativePool> {
        self.pool.made()
    }
}
