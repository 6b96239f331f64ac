//! Graph-private pools for a program that routes its captures' memory
//! itself (cumem_torch: PyTorch's private pools for CUDA graphs and
//! `MemPool`): a pool per handle, over address space that grows at its
//! end, whose blocks split and coalesce and whose memory goes back when
//! the handle is destroyed and no block is live.

use std::ffi::{c_int, c_void};

use cumem::GraphPool;

use crate::ffi::{allocate_into, answer, manager, ordinal, put};
use crate::status::{guard, Failure, Outcome};
use crate::CumemStatus;

/// A graph-private pool (opaque), from `cumem_graph_pool_create`.
pub struct CumemGraphPool {
    pool: GraphPool<'static>,
}

/// One free block of a graph pool.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CumemFreeBlock {
    /// Its first address.
    pub addr: u64,
    /// Its size in bytes.
    pub size: usize,
}

/// The pool behind a handle.
///
/// # Safety
/// `pool` is NULL (an error) or a live handle.
unsafe fn pool_of<'a>(pool: *const CumemGraphPool) -> Outcome<&'a GraphPool<'static>> {
    // SAFETY: the caller's promise: NULL or a live handle.
    Ok(&unsafe { pool.as_ref() }.ok_or_else(|| Failure::null("pool"))?.pool)
}

/// Makes a graph-private pool on device `device` in `*out`.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT`, `CUMEM_STATUS_NO_SUCH_DEVICE`,
/// `CUMEM_STATUS_SHUT_DOWN`, `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `out` is NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_create(device: c_int, out: *mut *mut CumemGraphPool) -> CumemStatus {
    let pool = || Ok(Box::into_raw(Box::new(CumemGraphPool { pool: manager()?.graph_pool_on(ordinal(device)?)? })));
    // SAFETY: the caller's promise about `out`.
    unsafe { answer(out, pool) }
}

/// Allocates `size` bytes from `pool` into `*out`, growing the pool when
/// no free block holds them. The caller orders the block's reuse.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT`, `CUMEM_STATUS_OUT_OF_MEMORY`,
/// `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `pool` is NULL (an error) or a live handle; `out` NULL (an error) or
/// valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_allocate(
    pool: *const CumemGraphPool,
    size: usize,
    out: *mut *mut c_void,
) -> CumemStatus {
    // SAFETY: the caller's promises about `pool` and `out`.
    unsafe { allocate_into(out, || Ok(pool_of(pool)?.allocate(size)?)) }
}

/// Takes `size` bytes at `ptr` out of `pool`'s free memory (all of it in
/// one free block), as a checkpoint restores a block where it was.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT`; `CUMEM_STATUS_OTHER` when the range
/// is not free in one block (nothing changes).
///
/// # Safety
/// `pool` is NULL (an error) or a live handle.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_allocate_at(
    pool: *const CumemGraphPool,
    ptr: *mut c_void,
    size: usize,
) -> CumemStatus {
    // SAFETY: the caller's promise about `pool`.
    guard(|| Ok(unsafe { pool_of(pool) }?.allocate_at(ptr as u64, size)?))
}

/// Frees a block of `pool` into it, for the pool's later allocations.
///
/// # Errors
/// `CUMEM_STATUS_DOUBLE_FREE`, `CUMEM_STATUS_INTERIOR_POINTER`,
/// `CUMEM_STATUS_UNKNOWN_POINTER` (nothing changes).
///
/// # Safety
/// `pool` is NULL (an error) or a live handle.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_free(pool: *const CumemGraphPool, ptr: *mut c_void) -> CumemStatus {
    // SAFETY: the caller's promise about `pool`.
    guard(|| Ok(unsafe { pool_of(pool) }?.free(ptr as u64)?))
}

/// Stores up to `cap` of `pool`'s free blocks, in address order, in
/// `out`, and how many there are in `*count`.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `pool` or `count`, NULL `out`
/// with `cap` > 0).
///
/// # Safety
/// `pool` is NULL (an error) or a live handle; `out` valid for `cap`
/// writes; `count` NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_free_blocks(
    pool: *const CumemGraphPool,
    out: *mut CumemFreeBlock,
    cap: usize,
    count: *mut usize,
) -> CumemStatus {
    guard(|| {
        if out.is_null() && cap > 0 {
            return Err(Failure::null("out"));
        }
        // SAFETY: the caller's promise about `pool`.
        let blocks = unsafe { pool_of(pool) }?.free_blocks();
        // SAFETY: the caller's promise about `count`.
        unsafe { put(count, "count", blocks.len()) }?;
        for (i, &(addr, size)) in blocks.iter().take(cap).enumerate() {
            // SAFETY: `i < cap`, and `out` is valid for `cap` writes.
            unsafe { out.add(i).write(CumemFreeBlock { addr, size }) };
        }
        Ok(())
    })
}

/// Destroys the handle; the pool's memory goes back once none of its
/// blocks is live. The caller first waits for the work that used it.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `pool`).
///
/// # Safety
/// `pool` is NULL (an error) or a live handle, never used after this.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_destroy(pool: *mut CumemGraphPool) -> CumemStatus {
    guard(|| {
        if pool.is_null() {
            return Err(Failure::null("pool"));
        }
        // SAFETY: the caller's promise: a live handle (a `Box`), unused after.
        drop(unsafe { Box::from_raw(pool) });
        Ok(())
    })
}

#[cfg(test)]
mod tests;
