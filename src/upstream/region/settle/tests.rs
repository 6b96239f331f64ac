use super::*;
use crate::upstream::region::{Region, VmBackend};

fn host_region() -> Region {
    let mut region = Region::reserve(&VmBackend::Host, 1 << 20, false).unwrap();
    let gran = region.granularity();
    region.map(0, gran).unwrap();
    region.map(gran, 2 * gran).unwrap();
    region
}

fn leaked_here() -> u64 {
    LEAKED_HERE.with(|l| l.get())
}

#[test]
fn a_failed_unmap_while_dropping_leaks_the_region_instead_of_crashing() {
    let before = leaked_here();
    FAIL_UNMAPS.with(|f| f.set(1));
    drop(host_region());
    assert_eq!(FAIL_UNMAPS.with(|f| f.get()), 0, "the drop reached the unmap");
    assert_eq!(leaked_here(), before + 1, "the remains were leaked, not released half-unmapped");
}

#[test]
fn a_region_without_failures_is_released_not_leaked() {
    let before = leaked_here();
    FAIL_UNMAPS.with(|f| f.set(0));
    drop(host_region());
    assert_eq!(leaked_here(), before);
}

#[test]
fn a_failed_unmap_leaks_everything_once() {
    let before = leaked_here();
    let mut region = host_region();
    let gran = region.granularity();
    region.map(4 * gran, gran).unwrap();
    // The first of three unmaps fails: none of the memory is released.
    FAIL_UNMAPS.with(|f| f.set(0));
    let remains = region.remains_of(true);
    assert_eq!(remains.maps.len(), 3);
    FAIL_UNMAPS.with(|f| f.set(1));
    remains.release();
    assert_eq!(leaked_here(), before + 1);
    drop(region);
    assert_eq!(leaked_here(), before + 1, "the emptied region gives nothing back twice");
}
