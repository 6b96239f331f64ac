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

fn usage(pool: *mut CumemGraphPool) -> (usize, usize) {
    let (mut reserved, mut in_use) = (0, 0);
    // SAFETY: a live handle; both valid for writes.
    assert_eq!(unsafe { cumem_graph_pool_usage(pool, &mut reserved, &mut in_use) }, CumemStatus::Ok);
    (reserved, in_use)
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
    let pool = create();
    let a = allocate(pool, MIB);
    let b = allocate(pool, 2 * MIB);
    let c = allocate(pool, MIB);
    let (held, in_use) = usage(pool);
    assert_eq!(in_use, 4 * MIB);
    assert_eq!(free(pool, a), CumemStatus::Ok);
    assert_eq!(free(pool, b), CumemStatus::Ok);
    // Three MiB from the two freed blocks, coalesced: no growth.
    let ab = allocate(pool, 3 * MIB);
    assert_eq!(ab, a, "the coalesced space serves a larger request");
    assert_eq!(usage(pool), (held, 4 * MIB), "the pool did not grow");
    assert_eq!(free(pool, ab), CumemStatus::Ok);
    let (mut n, mut blocks) = (0, [CumemFreeBlock::default(); 4]);
    // SAFETY: a live handle; `blocks` holds 4, `n` is valid for a write.
    assert_eq!(unsafe { cumem_graph_pool_free_blocks(pool, blocks.as_mut_ptr(), 4, &mut n) }, CumemStatus::Ok);
    assert!(n >= 1 && blocks[0] == CumemFreeBlock { addr: a as u64, size: 3 * MIB }, "{:?}", &blocks[..n.min(4)]);
    // Split: two requests of other sizes from the same space.
    let x = allocate(pool, 512 * 1024);
    let y = allocate(pool, 2 * MIB);
    assert_eq!(usage(pool).0, held, "both fit in what the pool holds");
    assert_eq!(free(pool, x), CumemStatus::Ok);
    assert_eq!(free(pool, y), CumemStatus::Ok);

    // A checkpoint restored: `b`'s range again, at its address.
    // SAFETY: a live handle.
    assert_eq!(unsafe { cumem_graph_pool_allocate_at(pool, b, 2 * MIB) }, CumemStatus::Ok);
    // SAFETY: as above. Taken: a second claim changes nothing.
    assert_eq!(unsafe { cumem_graph_pool_allocate_at(pool, b, MIB) }, CumemStatus::Other);
    assert_eq!(usage(pool).1, 3 * MIB, "b and c are live");
    let d = allocate(pool, MIB);
    assert_eq!(d, a, "the space before b is still free, and best fit takes it");

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
        assert_eq!(cumem_graph_pool_create(-1, &mut p.cast()), CumemStatus::InvalidArgument);
    }
    assert_eq!(usage(pool).1, 2 * MIB, "c and d are live");
    assert_eq!(free(pool, c), CumemStatus::Ok);
    assert_eq!(free(pool, d), CumemStatus::Ok);

    let before = graph_reserved();
    assert!(before >= held);
    // SAFETY: a live handle, not used again.
    assert_eq!(unsafe { cumem_graph_pool_destroy(pool) }, CumemStatus::Ok);
    assert!(graph_reserved() <= before - held, "the pool's memory went back with the handle");
}
