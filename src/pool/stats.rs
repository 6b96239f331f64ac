//! Pool statistics.

/// What a pool holds and has done. Sizes in bytes.
///
/// # Examples
/// ```
/// let mm = cumem::MemoryManager::global()?;
/// let p = mm.allocate_pinned(1000)?;
/// let s = mm.pinned_stats();
/// assert!(s.in_use >= 1024 && s.reserved >= s.in_use);
/// mm.free_pinned(p.as_ptr())?;
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes in live blocks (requests rounded up to 256 B).
    pub in_use: usize,
    /// The largest `in_use` since creation or the last peak reset. With
    /// thread caches it is taken at the shared pool, so it counts cached
    /// blocks as in use (an upper bound).
    pub peak_in_use: usize,
    /// Bytes the callers asked for, summed over live blocks.
    pub requested: usize,
    /// The largest `requested` since creation or the last peak reset.
    pub peak_requested: usize,
    /// Bytes reserved from the upstream.
    pub reserved: usize,
    /// The largest `reserved` since creation or the last peak reset.
    pub peak_reserved: usize,
    /// Bytes of physical memory held from the driver: mapped, and with
    /// page remapping (`remap.rs`) also the memory unmapped and kept for
    /// the next map (`kept`). With page remapping it can be less than
    /// `reserved`, the address space of the chunks; otherwise equal.
    pub mapped: usize,
    /// The largest `mapped` since creation or the last peak reset: the
    /// figure fragmentation is measured by.
    pub peak_mapped: usize,
    /// Bytes of the pages (of the remapping page size) that live blocks
    /// touch: the least physical memory the pool's placement allows, what
    /// `mapped` would be if every page lying wholly in free space were
    /// unmapped. 0 for a pool that doesn't remap.
    pub touched: usize,
    /// The largest `touched` since creation or the last peak reset: the
    /// page floor `peak_mapped` is measured against. (The remap budget
    /// rests on the largest `touched` ever, which a peak reset leaves
    /// alone: resetting statistics changes no behaviour.)
    pub peak_touched: usize,
    /// Map calls (one per piece mapped; without remapping, upstream allocs).
    pub map_calls: u64,
    /// Unmap calls (one per piece unmapped; without remapping, upstream frees).
    pub unmap_calls: u64,
    /// Nanoseconds the pool's allocating threads spent moving pages (page
    /// remapping): unmapping and mapping for their requests, with the
    /// waits for the device and for the address space those need (the
    /// background mapper's work is not counted). 0 without remapping.
    pub page_move_ns: u64,
    /// Page moves (page remapping) that waited for the device before they
    /// took memory, because work on another stream than the request's may
    /// still have used it. Memory freed on the requesting stream moves
    /// with no wait (`pool/remap.rs`). 0 without remapping.
    pub move_waits: u64,
    /// Of `mapped`, the bytes of memory unmapped and kept for the next map
    /// (page remapping: the background mapper's reserve), held with no
    /// address.
    pub kept: usize,
    /// Bytes in blocks parked in thread caches: freed by their users, not
    /// yet back in the shared pool (counted neither in `in_use` nor in
    /// `free_blocks`; [`Pool::release_cached`](super::Pool::release_cached)
    /// returns them).
    pub cached: usize,
    /// Live blocks.
    pub live_blocks: usize,
    /// Free blocks.
    pub free_blocks: usize,
    /// Chunks held from the upstream.
    pub chunks: usize,
    /// The largest free block.
    pub largest_free: usize,
    /// Allocations served.
    pub allocations: u64,
    /// Frees served.
    pub frees: u64,
    /// Chunks obtained from the upstream (including in-place extensions).
    pub upstream_allocs: u64,
    /// Chunks returned to the upstream.
    pub upstream_frees: u64,
    /// Allocations that failed upstream, released cached chunks and retried.
    pub oom_retries: u64,
    /// Allocations that failed for good.
    pub failed_allocations: u64,
}

impl PoolStats {
    /// Bytes reserved but not in use.
    pub fn free(&self) -> usize {
        self.reserved - self.in_use
    }

    /// External fragmentation: 1 − largest free block / total free bytes
    /// (0 when nothing is free).
    pub fn fragmentation(&self) -> f64 {
        let free = self.free();
        if free == 0 {
            0.0
        } else {
            1.0 - self.largest_free as f64 / free as f64
        }
    }

    /// Sets every peak to its current value.
    pub fn reset_peaks(&mut self) {
        self.peak_in_use = self.in_use;
        self.peak_requested = self.requested;
        self.peak_reserved = self.reserved;
        self.peak_mapped = self.mapped;
        self.peak_touched = self.touched;
    }
}
