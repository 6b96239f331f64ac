//! `PinnedAlloc` when the manager refuses: a pinned pool with a size limit,
//! then a shut-down manager. Every refusal reaches the collection as an
//! error through the fallible forms (`try_reserve`, `Box::try_new_in`),
//! with its reason in `PinnedAlloc::last_error()`; nothing aborts. (One
//! test: it configures the process-wide manager.)

use allocator_api2::alloc::Allocator;
use cumem::{Config, MemoryManager, PinnedAlloc, PinnedBox, PinnedVec};

const MIB: usize = 1 << 20;

#[test]
fn a_full_or_shut_down_pinned_pool_is_an_error_not_an_abort() {
    // The suite's CUMEM_CONF (e.g. device=1) still applies; only the limit
    // is added.
    let config =
        Config::from_env().expect("CUMEM_CONF parses").max_pinned_pool_size(8 * MIB).pinned_thread_cache(false);
    let mm = MemoryManager::init(config).unwrap_or_else(|e| panic!("the global manager: {e}"));

    let mut v: PinnedVec<u8> = PinnedVec::new_in(PinnedAlloc);
    v.try_reserve(4 * MIB).expect("within the limit");
    v.extend_from_slice(&[9; 1000]);
    let e = v.try_reserve(16 * MIB).expect_err("over the pool's 8 MiB limit");
    println!("refused: {e:?}; reason: {:?}", PinnedAlloc::last_error());
    let why = PinnedAlloc::last_error().expect("a reason");
    assert!(why.contains("out of memory"), "{why}");
    assert!(v.iter().all(|&b| b == 9) && v.len() == 1000, "the vector is unchanged");
    let big = std::alloc::Layout::from_size_align(16 * MIB, 256).unwrap();
    assert!(PinnedAlloc.allocate(big).is_err(), "the allocator itself refuses");
    drop(v);

    let report = mm.shutdown().unwrap();
    assert!(report.is_clean(), "{report}");
    let mut w: PinnedVec<u32> = PinnedVec::new_in(PinnedAlloc);
    assert!(w.try_reserve(16).is_err(), "no pinned memory after shutdown");
    let why = PinnedAlloc::last_error().unwrap();
    assert!(why.contains("shut down"), "{why}");
    assert!(PinnedBox::try_new_in(7u64, PinnedAlloc).is_err());
}
