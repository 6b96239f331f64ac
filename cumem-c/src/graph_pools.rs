//! Graph-private pools for a program that routes its captures' memory
//! itself (cumem_torch: PyTorch's private pools for CUDA graphs and
//! `MemPool`): a pool of its own per handle, over address space that
//! grows at its end, whose blocks split and coalesce, and whose memory
//! goes back only when the handle is destroyed.

use std::ffi::{c_int, c_void};

use cumem::GraphPool;

use crate::ffi::{allocate_into, manager, ordinal, put};
use crate::status::{guard, Failure, Outcome};
use crate::CumemStatus;

/// A graph-private pool (opaque): made by `cumem_graph_pool_create`,
/// given back by `cumem_graph_pool_destroy`.
pub struct CumemGraphPool {
    pool: GraphPool<'static>,
}

/// The pool behind a handle from C.
///
/// # Safety
/// `pool` must be NULL (an error) or a live handle from
/// `cumem_graph_pool_create`.
unsafe fn pool_of<'a>(pool: *const CumemGraphPool) -> Outcome<&'a GraphPool<'static>> {
    // SAFETY: the caller's promise: NULL or a live handle.
    let handle = unsafe { pool.as_ref() }.ok_or_else(|| Failure::null("pool"))?;
    Ok(&handle.pool)
}

/// Makes a graph-private pool on device `device`, storing its handle in
/// `*out`. Its memory serves only `cumem_graph_pool_allocate` and
/// `cumem_graph_pool_allocate_at` on it, and goes back at
/// `cumem_graph_pool_destroy`.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `out`, a negative device),
/// `CUMEM_STATUS_NO_SUCH_DEVICE`, `CUMEM_STATUS_SHUT_DOWN`,
/// `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_create(device: c_int, out: *mut *mut CumemGraphPool) -> CumemStatus {
    guard(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let pool = manager()?.graph_pool_on(ordinal(device)?)?;
        let handle = Box::into_raw(Box::new(CumemGraphPool { pool }));
        // SAFETY: non-null, and the caller's promise about `out`.
        unsafe { put(out, "out", handle) }
    })
}

/// Allocates `size` bytes from `pool`, storing the pointer in `*out`.
/// Nothing orders the block's reuse: the caller orders the work of the
/// streams that use it. The pool grows when no free block holds the
/// request.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `pool` or `out`, size 0),
/// `CUMEM_STATUS_OUT_OF_MEMORY`, `CUMEM_STATUS_DRIVER`.
///
/// # Safety
/// `pool` as in `cumem_graph_pool_destroy`; `out` NULL (an error) or
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
/// one free block): a block put back where it was, as a checkpoint of the
/// pool restores it. Free it with `cumem_graph_pool_free`.
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `pool`, size 0);
/// `CUMEM_STATUS_OTHER` when the range is not free in one block of the
/// pool (nothing changes then).
///
/// # Safety
/// `pool` as in `cumem_graph_pool_destroy`.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_allocate_at(
    pool: *const CumemGraphPool,
    ptr: *mut c_void,
    size: usize,
) -> CumemStatus {
    // SAFETY: the caller's promise about `pool`.
    guard(|| Ok(unsafe { pool_of(pool) }?.allocate_at(ptr as usize as u64, size)?))
}

/// Frees a block of `pool` into it: the pool's later allocations may
/// reuse it at once. The memory stays the pool's.
///
/// # Errors
/// `CUMEM_STATUS_DOUBLE_FREE`, `CUMEM_STATUS_INTERIOR_POINTER`,
/// `CUMEM_STATUS_UNKNOWN_POINTER`; nothing changes then.
///
/// # Safety
/// `pool` as in `cumem_graph_pool_destroy`.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_free(pool: *const CumemGraphPool, ptr: *mut c_void) -> CumemStatus {
    // SAFETY: the caller's promise about `pool`.
    guard(|| Ok(unsafe { pool_of(pool) }?.free(ptr as usize as u64)?))
}

/// Stores the bytes `pool` holds from the driver in `*reserved` and those
/// in its live blocks in `*in_use` (either may be NULL).
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `pool`).
///
/// # Safety
/// `pool` as in `cumem_graph_pool_destroy`; `reserved` and `in_use` NULL
/// or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_usage(
    pool: *const CumemGraphPool,
    reserved: *mut usize,
    in_use: *mut usize,
) -> CumemStatus {
    guard(|| {
        // SAFETY: the caller's promise about `pool`.
        let s = unsafe { pool_of(pool) }?.stats();
        // SAFETY: the caller's promises about `reserved` and `in_use`.
        unsafe {
            crate::ffi::put_opt(reserved, s.reserved);
            crate::ffi::put_opt(in_use, s.in_use);
        }
        Ok(())
    })
}

/// One free block of a graph pool ([`cumem_graph_pool_free_blocks`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CumemFreeBlock {
    /// Its first address.
    pub addr: u64,
    /// Its size in bytes.
    pub size: usize,
}

/// Stores up to `cap` of `pool`'s free blocks, in address order, in
/// `out`, and how many it has in `*count` (which may exceed `cap`: call
/// again with room for them all).
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `pool` or `count`, NULL `out`
/// with `cap` > 0).
///
/// # Safety
/// `pool` as in `cumem_graph_pool_destroy`; `out` valid for writes of
/// `cap` blocks (or NULL with `cap` 0); `count` NULL (an error) or valid
/// for a write.
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

/// Destroys the handle: the pool's memory goes back once none of its
/// blocks is live (at once when none is; a block freed later through
/// `cumem_free_device` gives it back then). The caller first waits for
/// the work that used the pool's memory (graphs replayed from it).
///
/// # Errors
/// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `pool`).
///
/// # Safety
/// `pool` must be NULL (an error) or a live handle from
/// `cumem_graph_pool_create`, not used again after this call.
#[no_mangle]
pub unsafe extern "C" fn cumem_graph_pool_destroy(pool: *mut CumemGraphPool) -> CumemStatus {
    guard(|| {
        if pool.is_null() {
            return Err(Failure::null("pool"));
        }
        // SAFETY: the caller's promise: a live handle from
        // `cumem_graph_pool_create` (a `Box`), never used again.
        drop(unsafe { Box::from_raw(pool) });
        Ok(())
    })
}

#[cfg(test)]
mod tests;
