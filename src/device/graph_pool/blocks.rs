//! A graph pool's blocks handed out directly, to a program that routes
//! its captures' memory itself (cumem_torch: PyTorch's private pools and
//! `MemPool`). They split and coalesce as in any pool and stay the pool's,
//! out of everyone else's reach, until the pool is gone.

use super::GraphPool;
use crate::error::Result;
use crate::tag::StreamTag;
use crate::upstream::BLOCK_ALIGN;

impl GraphPool<'_> {
    /// A block of `size` bytes from the pool, capture or not. Nothing
    /// orders its reuse: the caller orders the work of the streams that
    /// use it, as PyTorch's allocator does for its private pools.
    ///
    /// # Errors
    /// [`Error::InvalidSize`](crate::Error::InvalidSize),
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory), a driver error.
    pub fn allocate(&self, size: usize) -> Result<u64> {
        Ok(self.inner.pool.allocate(size, BLOCK_ALIGN)?.addr as u64)
    }

    /// Takes `size` bytes at `addr` out of one free block of the pool, as
    /// a checkpoint restores a block where it was.
    ///
    /// # Errors
    /// [`Error::InvalidState`](crate::Error::InvalidState) when the range
    /// is not free in one block (nothing changes).
    pub fn allocate_at(&self, addr: u64, size: usize) -> Result<()> {
        self.inner.pool.allocate_at(addr as usize, size).map(|_| ())
    }

    /// Frees a block of the pool into it, for its later allocations.
    ///
    /// # Errors
    /// A double free, an interior or unknown pointer (nothing changes).
    pub fn free(&self, addr: u64) -> Result<()> {
        self.inner.pool.deallocate(addr as usize, StreamTag::NONE).map(|_| ())
    }

    /// The pool's free blocks as `(address, size)`, in address order.
    pub fn free_blocks(&self) -> Vec<(u64, usize)> {
        self.inner.pool.with_fit(|f| f.free_list()).into_iter().map(|(a, s)| (a as u64, s)).collect()
    }
}
