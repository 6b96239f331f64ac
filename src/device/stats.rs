//! The device allocator's [`DeviceStats`] and one mode's [`ModeMemory`].

use super::captures::GraphStats;
use super::mode::DeviceAllocatorMode;
use super::native_pool::NativePoolAttributes;
use super::tags::TagUsage;
use crate::pool::PoolStats;

/// Figures of the stream-ordered modes (counted by cumem).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AsyncStats {
    /// Bytes in live stream-ordered allocations.
    pub in_use: usize,
    /// The largest `in_use` since the last peak reset.
    pub peak_in_use: usize,
    /// Live stream-ordered allocations.
    pub live: usize,
    /// Allocations served.
    pub allocations: u64,
    /// Frees served.
    pub frees: u64,
    /// Allocations that were retried after releasing cached memory.
    pub oom_retries: u64,
}

/// One device's statistics across its modes.
#[derive(Debug, Clone, Default)]
pub struct DeviceStats {
    /// The sync pool.
    pub pool: PoolStats,
    /// The stream-ordered modes together.
    pub stream_ordered: AsyncStats,
    /// The dedicated native pool's attributes, once it exists.
    pub native_pool: Option<NativePoolAttributes>,
    /// The device default pool's attributes, once `cuMemAllocAsync` is used.
    pub default_pool: Option<NativePoolAttributes>,
    /// The graph-private pools (CUDA graphs).
    pub graphs: GraphStats,
    /// Sync-pool reuses of a block freed on another stream that had to wait
    /// for that stream's work (`cuEventRecord` + `cuStreamWaitEvent`, or
    /// the host waiting when no stream was given).
    pub stream_waits: u64,
    /// The nanoseconds spent issuing those waits.
    pub stream_wait_ns: u64,
    /// Cross-stream reuses that needed no wait because the using stream had
    /// already waited for a later point of the freeing stream.
    pub stream_waits_elided: u64,
    /// Every memory tag's pool on this device (`MemoryManager::tag`),
    /// in the order they were made: not counted in `pool`.
    pub tags: Vec<TagUsage>,
}

/// What one mode holds from the driver and served, from a
/// [`DeviceStats`] ([`DeviceStats::mode_memory`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModeMemory {
    /// Bytes held now: the sync pool's reserved chunks, or the driver
    /// pool's reserved memory (0 before it exists).
    pub reserved: usize,
    /// The most physical memory held (the sync pool's mapped pages, the
    /// driver pool's reserved high), when known.
    pub peak_reserved: Option<usize>,
    /// The most bytes live at once (as requested).
    pub peak_live: usize,
}

impl DeviceStats {
    /// What `mode` holds and served, in one shape for every mode.
    pub fn mode_memory(&self, mode: DeviceAllocatorMode) -> ModeMemory {
        let driver = |pool: Option<NativePoolAttributes>| ModeMemory {
            reserved: pool.map_or(0, |a| a.reserved_current as usize),
            peak_reserved: pool.map(|a| a.reserved_high as usize),
            peak_live: self.stream_ordered.peak_in_use,
        };
        match mode {
            DeviceAllocatorMode::SyncPool => ModeMemory {
                reserved: self.pool.reserved,
                peak_reserved: Some(self.pool.peak_mapped),
                peak_live: self.pool.peak_requested,
            },
            DeviceAllocatorMode::AsyncStreamOrdered => driver(self.default_pool),
            DeviceAllocatorMode::CudaAsyncPool => driver(self.native_pool),
        }
    }
}
