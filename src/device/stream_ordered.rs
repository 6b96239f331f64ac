//! The device allocator's stream-ordered allocations (the async and
//! native-pool modes): `cuMemAllocAsync` and `cuMemFreeAsync` on an
//! ordering stream, each in the allocator's book (`async_book.rs`).

use super::allocator::DeviceAllocator;
use super::async_book::AsyncBlock;
use super::captures::StreamOrderedFree;
use super::mode::DeviceAllocatorMode;
use super::native_pool;
use crate::cuda::Stream;
use crate::error::{Error, Result};
use crate::pool;
use crate::sync::{lock, Ordering};
use crate::upstream::BLOCK_ALIGN;

impl DeviceAllocator {
    /// Allocates `size` bytes stream-ordered from `mode`'s driver pool for
    /// work on `stream` and books the block so that its free reaches
    /// `mode` whatever the mode is then (`capture`: the capture the stream
    /// takes part in, 0 if none; the driver makes an allocation in a
    /// capture a graph memory node).
    ///
    /// # Errors
    /// Invalid sizes, [`Error::OutOfMemory`], driver errors.
    pub(super) fn allocate_stream_ordered(
        &self,
        size: usize,
        stream: Option<&Stream>,
        mode: DeviceAllocatorMode,
        capture: u64,
    ) -> Result<u64> {
        pool::validate(size, BLOCK_ALIGN)?;
        self.require_ctx()?;
        let on = self.ordering_stream(stream)?;
        let attempt = || self.driver_pools().allocate(mode, size, on);
        let ptr = match attempt() {
            Ok(p) => p,
            Err(Error::OutOfMemory { .. }) if !self.capture_under_way()? => {
                // Release what this device caches anywhere, then retry once.
                lock(&self.async_book).stats.oom_retries += 1;
                self.release_cached()?;
                attempt()?
            }
            Err(e) => return Err(e),
        };
        match stream {
            Some(s) if !s.is_host() && s.id() != on.id() => s.wait_for(on)?,
            Some(s) if !s.is_host() => {}
            _ => on.synchronize()?,
        }
        let mut book = lock(&self.async_book);
        book.record(ptr as usize, AsyncBlock { size, mode, capture });
        self.async_live.fetch_add(1, Ordering::Release);
        Ok(ptr)
    }

    /// [`free`](Self::free) of a stream-ordered allocation (`None`: not one).
    #[inline(never)]
    pub(super) fn free_if_stream_ordered(&self, ptr: u64, stream: Option<&Stream>) -> Option<Result<usize>> {
        let addr = ptr as usize;
        let block = lock(&self.async_book).live.remove(&addr)?;
        // Freed during a capture that did not make it: the graph keeps it.
        match self.hold_stream_ordered(addr, block.size, block.mode, block.capture, stream) {
            Ok(StreamOrderedFree::Held) => return Some(Ok(block.size)),
            Ok(StreamOrderedFree::InCapture) => {}
            Ok(StreamOrderedFree::Eager) => self.settle_graph_releases(),
            Err(e) => {
                lock(&self.async_book).live.insert(addr, block);
                return Some(Err(e));
            }
        }
        let r = self.ordering_stream(stream).and_then(|on| {
            if let Some(s) = stream.filter(|s| !s.is_host() && s.id() != on.id()) {
                // Another device's stream: the free waits for its work.
                on.wait_for(s)?;
            }
            self.free_stream_ordered(ptr, on)
        });
        if let Err(e) = r {
            lock(&self.async_book).live.insert(addr, block);
            return Some(Err(e));
        }
        self.count_stream_ordered_free(block.size);
        Some(Ok(block.size))
    }

    /// Size, mode and capture of a stream-ordered allocation at `addr`.
    pub(super) fn stream_ordered_block(&self, addr: usize) -> Option<(usize, DeviceAllocatorMode, u64)> {
        if self.async_live.load(Ordering::Acquire) == 0 {
            return None;
        }
        lock(&self.async_book).live.get(&addr).map(|b| (b.size, b.mode, b.capture))
    }

    /// Takes the live stream-ordered allocation at `addr` out of the book
    /// for a graph to hold (its size and mode; it still counts as live
    /// until [`free_stream_ordered_now`](Self::free_stream_ordered_now)).
    pub(super) fn take_stream_ordered(&self, addr: usize) -> Option<(usize, DeviceAllocatorMode)> {
        if self.async_live.load(Ordering::Acquire) == 0 {
            return None;
        }
        lock(&self.async_book).live.remove(&addr).map(|b| (b.size, b.mode))
    }

    /// Puts a stream-ordered allocation taken with
    /// [`take_stream_ordered`](Self::take_stream_ordered) back in the book,
    /// live and made outside any capture.
    pub(super) fn restore_stream_ordered(&self, addr: usize, size: usize, mode: DeviceAllocatorMode) {
        lock(&self.async_book).live.insert(addr, AsyncBlock { size, mode, capture: 0 });
    }

    /// `cuMemFreeAsync` of a stream-ordered allocation on `on`.
    fn free_stream_ordered(&self, ptr: u64, on: &Stream) -> Result<()> {
        let ctx = self.require_ctx()?;
        // SAFETY: `ptr` was allocated stream-ordered on this context and has
        // just been taken out of the live map, so it is freed once; the
        // caller guarantees work after this free on `on` does not use it.
        unsafe { native_pool::free_async(ctx, ptr, on) }
    }

    fn count_stream_ordered_free(&self, size: usize) {
        self.async_live.fetch_sub(1, Ordering::Release);
        lock(&self.async_book).count_free(size);
    }

    /// Frees a stream-ordered allocation a graph held, the device idle.
    pub(super) fn free_stream_ordered_now(&self, addr: usize, size: usize, _mode: DeviceAllocatorMode) -> Result<()> {
        self.free_stream_ordered(addr as u64, self.internal_stream()?)?;
        self.count_stream_ordered_free(size);
        Ok(())
    }
}
