//! The device allocator's [`DeviceStats`], gathered from its modes, graph
//! pools, stream registry and memory tags' pools.

use super::allocator::DeviceAllocator;
use super::mode::DeviceAllocatorMode;
use super::stats::DeviceStats;
use crate::sync::lock;

impl DeviceAllocator {
    /// Statistics of every mode.
    pub fn stats(&self) -> DeviceStats {
        self.settle_graph_releases();
        DeviceStats {
            pool: self.pool.stats(),
            stream_ordered: lock(&self.async_book).stats.clone(),
            native_pool: self.driver_pools().made(DeviceAllocatorMode::CudaAsyncPool).and_then(|p| p.attributes().ok()),
            default_pool: self
                .driver_pools()
                .made(DeviceAllocatorMode::AsyncStreamOrdered)
                .and_then(|p| p.attributes().ok()),
            graphs: self.graphs_stats(),
            stream_waits: self.streams.waits().0,
            stream_wait_ns: self.streams.waits().1,
            stream_waits_elided: self.streams.waits_elided(),
            tags: self.tags.all().iter().map(|a| a.usage(self.ordinal())).collect(),
        }
    }

    /// Sets every peak to its current value.
    pub fn reset_peaks(&self) {
        self.pool.reset_peaks();
        let mut book = lock(&self.async_book);
        book.stats.peak_in_use = book.stats.in_use;
        drop(book);
        for p in self.driver_pools().all_made() {
            let _ = p.reset_high_watermarks();
        }
    }
}
