//! The book of stream-ordered allocations (the async and native-pool
//! modes): the allocations live now (address → size, mode, capture) and
//! their figures. The device allocator keeps one under a lock; its
//! stream-ordered calls (`stream_ordered.rs`) write it.

use super::mode::DeviceAllocatorMode;
use super::stats::AsyncStats;

/// A live stream-ordered allocation.
#[derive(Debug, Clone, Copy)]
pub(super) struct AsyncBlock {
    pub(super) size: usize,
    pub(super) mode: DeviceAllocatorMode,
    /// The capture that made it (0: none).
    pub(super) capture: u64,
}

/// Live stream-ordered allocations (address → block), figures, one lock.
#[derive(Debug, Default)]
pub(super) struct AsyncBook {
    pub(super) live: hashbrown::HashMap<usize, AsyncBlock>,
    pub(super) stats: AsyncStats,
}

impl AsyncBook {
    /// Records a new allocation at `addr`, live, and counts it.
    pub(super) fn record(&mut self, addr: usize, block: AsyncBlock) {
        self.live.insert(addr, block);
        let st = &mut self.stats;
        st.in_use += block.size;
        st.peak_in_use = st.peak_in_use.max(st.in_use);
        st.live += 1;
        st.allocations += 1;
    }

    /// Counts the free of a `size`-byte allocation, already out of the map.
    pub(super) fn count_free(&mut self, size: usize) {
        let st = &mut self.stats;
        st.in_use -= size;
        st.live -= 1;
        st.frees += 1;
    }
}
