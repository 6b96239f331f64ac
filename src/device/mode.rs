//! The ways device memory is allocated, as the public names programs
//! choose among (the sync pool is `allocator.rs`'s; the stream-ordered
//! modes allocate from `driver_pools.rs`).

use crate::error::{Error, Result};

/// How device memory is allocated.
///
/// # Examples
/// ```
/// use cumem::{DeviceAllocatorMode, MemoryManager};
/// let mm = MemoryManager::global()?;
/// let effective = mm.set_device_allocator_mode(DeviceAllocatorMode::AsyncStreamOrdered)?;
/// // Without memory-pool support (or a GPU) the sync pool stands in.
/// assert!(effective == DeviceAllocatorMode::AsyncStreamOrdered || effective == DeviceAllocatorMode::SyncPool);
/// mm.set_device_allocator_mode(DeviceAllocatorMode::SyncPool)?;
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DeviceAllocatorMode {
    /// cumem's own best-fit pool over driver memory, stream-ordered reuse.
    #[default]
    SyncPool,
    /// `cuMemAllocAsync` / `cuMemFreeAsync` from the device's default pool,
    /// its release threshold raised so memory stays cached.
    AsyncStreamOrdered,
    /// A dedicated native pool (`cuMemPoolCreate`) with
    /// `cuMemAllocFromPoolAsync`, its release threshold from the config.
    CudaAsyncPool,
}

impl DeviceAllocatorMode {
    /// The name used in `CUMEM_CONF` (`sync_pool`, `async_stream_ordered`,
    /// `cuda_async_pool`).
    pub fn name(self) -> &'static str {
        match self {
            DeviceAllocatorMode::SyncPool => "sync_pool",
            DeviceAllocatorMode::AsyncStreamOrdered => "async_stream_ordered",
            DeviceAllocatorMode::CudaAsyncPool => "cuda_async_pool",
        }
    }

    /// All modes.
    pub const ALL: [DeviceAllocatorMode; 3] =
        [DeviceAllocatorMode::SyncPool, DeviceAllocatorMode::AsyncStreamOrdered, DeviceAllocatorMode::CudaAsyncPool];

    pub(super) fn to_u8(self) -> u8 {
        self as u8
    }

    pub(super) fn from_u8(v: u8) -> Self {
        DeviceAllocatorMode::ALL.get(usize::from(v)).copied().unwrap_or_default()
    }
}

impl std::fmt::Display for DeviceAllocatorMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DeviceAllocatorMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DeviceAllocatorMode::ALL.into_iter().find(|m| m.name().eq_ignore_ascii_case(s)).ok_or_else(|| {
            Error::Config(format!("mode: '{s}' is not one of sync_pool, async_stream_ordered, cuda_async_pool"))
        })
    }
}
