use std::ffi::c_void;
use std::ptr::{null, null_mut};

use super::*;
use crate::{cumem_device_stats, CumemDeviceStats};

const MIB: usize = 1 << 20;

fn create() -> *mut CumemGraphPool {
    let mut pool = null_mut();
    // SAFETY: `pool` is valid for a write.
    assert_eq!(unsafe { cumem_graph_pool_create(0, &mut pool) }, CumemStatus::Ok);
    assert!(!pool.is_null());
    pool
}

fn allocate(pool: *mut CumemGraphPool, size: usize) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: a live handle; `p` is valid for a write.
    assert_eq!(unsafe { cumem_graph_pool_allocate(pool, size, &mut p) }, CumemStatus::Ok);
    p
}

fn free(pool: *mut CumemGraphPool, p: *mut c_void) -> CumemStatus {
    // SAFETY: a live handle.
    unsafe { cumem_graph_pool_free(pool, p) }
}

fn free_blocks(pool: *mut CumemGraphPool) -> Vec<CumemFreeBlock> {
    let mut n = 0;
    // SAFETY: a live handle; no blocks asked for, `n` valid for a write.
    assert_eq!(unsafe { cumem_graph_pool_free_blocks(pool, null_mut(), 0, &mut n) }, CumemStatus::Ok);
    let mut v = vec![CumemFreeBlock::default(); n];
    // SAFETY: `v` holds `n` blocks.
    assert_eq!(unsafe { cumem_graph_pool_free_blocks(pool, v.as_mut_ptr(), n, &mut n) }, CumemStatus::Ok);
    v.truncate(n);
    v
}

fn graph_reserved() -> usize {
    let mut s = CumemDeviceStats::default();
    // SAFETY: `s` is valid for a write.
    assert_eq!(unsafe { cumem_device_stats(0, &mut s) }, CumemStatus::Ok);
    s.graph_reserved
}

/// What PyTorch's private pools need of one: freed blocks coalesce and
/// split for the pool's later requests of other sizes (a pool of whole
/// blocks grew for each new size), and a checkpoint's blocks go back at
/// their addresses.
#[test]
fn a_graph_pool_splits_and_coalesces_its_blocks_and_restores_them_in_place() {
    let before = graph_reserved();
    let pool = create();
    let a = allocate(pool, MIB);
    let b = allocate(pool, 2 * MIB);
    let c = allocate(pool, MIB);
    let held = graph_reserved();
    assert!(held >= before + 4 * MIB);
    assert_eq!(free(pool, a), CumemStatus::Ok);
    assert_eq!(free(pool, b), CumemStatus::Ok);
    assert_eq!(free_blocks(pool)[0], CumemFreeBlock { addr: a as u64, size: 3 * MIB }, "coalesced");
    let ab = allocate(pool, 3 * MIB);
    assert_eq!(ab, a, "the coalesced space serves a larger request");
    assert_eq!(free(pool, ab), CumemStatus::Ok);
    // Split: two requests of other sizes from the same space.
    let x = allocate(pool, 512 * 1024);
    let y = allocate(pool, 2 * MIB);
    assert_eq!(graph_reserved(), held, "the pool did not grow");
    assert_eq!(free(pool, x), CumemStatus::Ok);
    assert_eq!(free(pool, y), CumemStatus::Ok);

    // A checkpoint restored: `b`'s range again, at its address.
    // SAFETY: a live handle.
    assert_eq!(unsafe { cumem_graph_pool_allocate_at(pool, b, 2 * MIB) }, CumemStatus::Ok);
    // SAFETY: as above. Taken: a second claim changes nothing.
    assert_eq!(unsafe { cumem_graph_pool_allocate_at(pool, b, MIB) }, CumemStatus::Other);
    assert_eq!(allocate(pool, MIB), a, "the space before b is still free, and best fit takes it");

    // Bad input changes nothing.
    assert_eq!(free(pool, b.wrapping_byte_add(256)), CumemStatus::InteriorPointer);
    assert_eq!(free(pool, b), CumemStatus::Ok);
    assert_eq!(free(pool, b), CumemStatus::DoubleFree);
    assert_eq!(free(pool, 0x10 as *mut c_void), CumemStatus::UnknownPointer);
    // SAFETY: NULL handles and out-pointers are refused.
    unsafe {
        let mut p = null_mut();
        assert_eq!(cumem_graph_pool_allocate(null(), MIB, &mut p), CumemStatus::InvalidArgument);
        assert_eq!(cumem_graph_pool_allocate(pool, MIB, null_mut()), CumemStatus::InvalidArgument);
        assert_eq!(cumem_graph_pool_allocate(pool, 0, &mut p), CumemStatus::InvalidArgument);
        assert_eq!(cumem_graph_pool_destroy(null_mut()), CumemStatus::InvalidArgument);
        let mut n = 0;
        assert_eq!(cumem_graph_pool_free_blocks(pool, null_mut(), 1, &mut n), CumemStatus::InvalidArgument);
    }
    assert_eq!(free(pool, c), CumemStatus::Ok);
    assert_eq!(free(pool, a), CumemStatus::Ok);
    // SAFETY: a live handle, not used again.
    assert_eq!(unsafe { cumem_graph_pool_destroy(pool) }, CumemStatus::Ok);
    assert_eq!(graph_reserved(), before, "the pool's memory went back with the handle");
}
