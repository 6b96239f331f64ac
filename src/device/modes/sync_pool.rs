//! [`DeviceAllocatorMode::SyncPool`]: cumem's own best-fit pool over
//! driver memory, with stream-ordered reuse (the pool and its stream order
//! are the allocator's, `allocator.rs`).

use super::{Machinery, Mode, Routed};
use crate::cuda::Stream;
use crate::device::mode::DeviceAllocatorMode;
use crate::error::Result;

/// The sync pool mode.
pub(super) struct SyncPool;

impl Mode for SyncPool {
    fn kind(&self) -> DeviceAllocatorMode {
        DeviceAllocatorMode::SyncPool
    }

    fn stream_ordered(&self) -> bool {
        false
    }

    fn allocate(
        &self,
        dev: &dyn Machinery,
        size: usize,
        stream: Option<&Stream>,
        routed: Option<Routed<'_>>,
    ) -> Result<u64> {
        match routed {
            // A capture's allocations come from its graph-private pool.
            Some(r) => dev.allocate_private(r.pool, size, r.stream),
            None => dev.allocate_sync_pool(size, stream),
        }
    }
}
