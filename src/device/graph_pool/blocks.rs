//! A graph pool's blocks handed out directly, for a program that routes
//! its captures' memory itself (cumem_torch: PyTorch's private pools,
//! `torch.cuda.graph(pool=...)` and `MemPool`). The pool splits and
//! coalesces them as any pool does, over address space of its own that
//! grows at its end (expandable segments), and they stay the pool's,
//! out of everyone else's reach, until the pool is gone.

use super::GraphPool;
use crate::error::Result;
use crate::tag::StreamTag;
use crate::upstream::BLOCK_ALIGN;

impl GraphPool<'_> {
    /// A block of `size` bytes from the pool, whether or not a capture is
    /// under way. Nothing orders its reuse: the caller orders the work of
    /// every stream that uses it, as PyTorch's allocator does for its
    /// private pools. The pool grows when no free block holds the
    /// request.
    ///
    /// # Errors
    /// [`Error::InvalidSize`](crate::Error::InvalidSize);
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory); a driver error.
    pub fn allocate(&self, size: usize) -> Result<u64> {
        Ok(self.inner.pool.allocate(size, BLOCK_ALIGN)?.addr as u64)
    }

    /// Takes `size` bytes at `addr` out of the pool's free memory (all of
    /// it in one free block): a block put back where it was, as a
    /// checkpoint of the pool restores it.
    ///
    /// # Errors
    /// [`Error::InvalidState`](crate::Error::InvalidState) when the range
    /// is not free in one block of the pool; nothing changes then.
    pub fn allocate_at(&self, addr: u64, size: usize) -> Result<()> {
        self.inner.pool.allocate_at(addr as usize, size).map(|_| ())
    }

    /// Frees a block of the pool (from [`allocate`](Self::allocate) or
    /// [`allocate_at`](Self::allocate_at)) into it: the pool's later
    /// allocations may reuse it at once (the caller orders the work that
    /// used it, as for `allocate`). The memory stays the pool's.
    ///
    /// # Errors
    /// A double free, an interior or unknown pointer: nothing changes.
    pub fn free(&self, addr: u64) -> Result<()> {
        self.inner.pool.deallocate(addr as usize, StreamTag::NONE).map(|_| ())
    }

    /// The pool's free blocks as `(address, size)`, in address order (a
    /// picture of the pool for snapshots).
    pub fn free_blocks(&self) -> Vec<(u64, usize)> {
        self.inner.pool.with_fit(|f| f.free_list()).into_iter().map(|(a, s)| (a as u64, s)).collect()
    }
}
