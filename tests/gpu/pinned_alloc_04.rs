//! `PinnedAlloc` and `ManagedAlloc` through allocator-api2 0.4's collections (feature
//! `allocator-api2-04`; CI runs it with the feature on).

use allocator_api2_04::vec::Vec;
use cumem::{MemoryManager, PinnedAlloc};

#[test]
fn vec_of_the_04_line_lives_in_the_pinned_pool() {
    let mm = MemoryManager::global().unwrap();
    let before = mm.pinned_stats().allocations;
    let mut v: Vec<u64, PinnedAlloc> = Vec::new_in(PinnedAlloc);
    for i in 0..100_000u64 {
        v.push(i * 3);
    }
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64 * 3));
    assert!(mm.pinned_stats().allocations > before, "the vector's memory came from the pinned pool");
    v.truncate(10);
    v.shrink_to_fit();
    assert_eq!(v[9], 27);
}

#[test]
fn vec_of_the_04_line_lives_in_the_managed_pool() {
    use cumem::ManagedAlloc;
    let mut v: Vec<u32, ManagedAlloc> = Vec::new_in(ManagedAlloc);
    v.extend(0..50_000u32);
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
    let stats = MemoryManager::global().unwrap().managed_stats().expect("the managed pool was used");
    assert!(stats.in_use >= 50_000 * 4);
}
