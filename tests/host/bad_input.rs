//! Every bad input gets its error, and the pools keep working afterwards.
//! Runs on whatever backend is present (CUDA on a GPU machine, the host
//! fallback here), each test on a manager of its own.

use cumem::{Config, DeviceAllocatorMode, Error, MemoryManager, PoolKind};

fn manager() -> MemoryManager {
    MemoryManager::new(Config::new().min_chunk(1 << 20)).expect("a manager")
}

/// The pools still serve and free after whatever a test did.
fn still_works(mm: &MemoryManager) {
    let p = mm.allocate_pinned(1000).expect("pinned pool still serves");
    mm.free_pinned(p.as_ptr()).expect("and frees");
    let d = mm.allocate_device(1000).expect("device pool still serves");
    mm.free_device(d).expect("and frees");
    mm.pinned_pool().with_fit(|f| f.check_invariants()).expect("pinned pool intact");
    mm.default_device().unwrap().pool().with_fit(|f| f.check_invariants()).expect("device pool intact");
}

#[test]
fn double_free_is_reported_and_harmless() {
    let mm = manager();
    let p = mm.allocate_pinned(4096).unwrap();
    mm.free_pinned(p.as_ptr()).unwrap();
    let e = mm.free_pinned(p.as_ptr()).unwrap_err();
    assert!(matches!(e, Error::DoubleFree { pool: PoolKind::Pinned, addr } if addr == p.as_ptr() as usize), "{e}");
    assert!(e.to_string().contains("double free"), "{e}");

    let d = mm.allocate_device(4096).unwrap();
    mm.free_device(d).unwrap();
    let e = mm.free_device(d).unwrap_err();
    assert!(matches!(e, Error::DoubleFree { pool: PoolKind::Device, .. }), "{e}");
    still_works(&mm);
}

#[test]
fn pointers_never_given_out_are_refused() {
    let mm = manager();
    let mut local = 0u64;
    let e = mm.free_pinned(&mut local as *mut u64 as *mut u8).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer { pool: PoolKind::Pinned, .. }), "{e}");
    let e = mm.free_device(0xdead_0000).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer { pool: PoolKind::Device, addr: 0xdead_0000 }), "{e}");
    let e = mm.free_pinned(std::ptr::null_mut()).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer { .. }), "{e}");
    still_works(&mm);
}

#[test]
fn interior_pointers_are_refused() {
    let mm = manager();
    let p = mm.allocate_pinned(4096).unwrap();
    // SAFETY: 256 bytes into a 4096-byte block is inside it.
    let inner = unsafe { p.as_ptr().add(256) };
    let e = mm.free_pinned(inner).unwrap_err();
    assert!(
        matches!(e, Error::InteriorPointer { pool: PoolKind::Pinned, block, size: 4096, .. } if block == p.as_ptr() as usize),
        "{e}"
    );
    let d = mm.allocate_device(8192).unwrap();
    let e = mm.free_device(d + 512).unwrap_err();
    assert!(matches!(e, Error::InteriorPointer { pool: PoolKind::Device, .. }), "{e}");
    // The blocks are still live and free normally.
    mm.free_pinned(p.as_ptr()).unwrap();
    mm.free_device(d).unwrap();
    still_works(&mm);
}

#[test]
fn pointers_from_the_other_pool_are_refused() {
    let mm = manager();
    let p = mm.allocate_pinned(4096).unwrap();
    let d = mm.allocate_device(4096).unwrap();
    let e = mm.free_device(p.as_ptr() as u64).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer { pool: PoolKind::Device, .. }), "{e}");
    let e = mm.free_pinned(d as usize as *mut u8).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer { pool: PoolKind::Pinned, .. }), "{e}");
    mm.free_pinned(p.as_ptr()).unwrap();
    mm.free_device(d).unwrap();
    still_works(&mm);
}

#[test]
fn zero_and_absurd_sizes_are_refused() {
    let mm = manager();
    for size in [0usize, usize::MAX, usize::MAX - 100, isize::MAX as usize] {
        let e = mm.allocate_pinned(size).unwrap_err();
        assert!(matches!(e, Error::InvalidSize { .. }), "pinned {size}: {e}");
        let e = mm.allocate_device(size).unwrap_err();
        assert!(matches!(e, Error::InvalidSize { .. }), "device {size}: {e}");
    }
    still_works(&mm);
}

#[test]
fn sizes_larger_than_the_device_are_out_of_memory() {
    let mm = manager();
    // 1 PiB: representable, but more than any device or this machine has.
    let e = mm.allocate_device(1 << 50).unwrap_err();
    match &e {
        Error::OutOfMemory { pool: PoolKind::Device, requested, .. } => assert_eq!(*requested, 1 << 50),
        other => panic!("expected OutOfMemory, got {other}"),
    }
    assert!(e.to_string().contains("requested 1125899906842624 B"), "{e}");
    still_works(&mm);
}

#[test]
fn bad_alignments_are_refused() {
    let mm = manager();
    for align in [0usize, 3, 100, 1 << 30] {
        let e = mm.allocate_pinned_aligned(4096, align).unwrap_err();
        assert!(matches!(e, Error::InvalidAlignment { .. }), "align {align}: {e}");
    }
    let p = mm.allocate_pinned_aligned(100, 4096).unwrap();
    assert_eq!(p.as_ptr() as usize % 4096, 0);
    let q = mm.allocate_pinned_aligned(100, 1 << 16).unwrap();
    assert_eq!(q.as_ptr() as usize % (1 << 16), 0);
    mm.free_pinned(p.as_ptr()).unwrap();
    mm.free_pinned(q.as_ptr()).unwrap();
    still_works(&mm);
}

#[test]
fn configuration_after_first_use_is_refused() {
    let mm = manager();
    mm.set_pinned_pool_size(8 << 20).unwrap();
    mm.set_device_pool_size(8 << 20).unwrap();
    still_works(&mm);
    let e = mm.set_pinned_pool_size(16 << 20).unwrap_err();
    assert!(matches!(e, Error::ConfigTooLate { .. }), "{e}");
    let e = mm.set_device_pool_size(16 << 20).unwrap_err();
    assert!(matches!(e, Error::ConfigTooLate { .. }), "{e}");
    // The sizes set in time took effect: one chunk of 8 MiB each.
    assert_eq!(mm.pinned_stats().peak_reserved, 8 << 20);
    still_works(&mm);
}

#[test]
fn shutdown_reports_live_memory_refuses_new_and_accepts_late_frees() {
    let mm = manager();
    let p = mm.allocate_pinned(1000).unwrap();
    let d = mm.allocate_device(3000).unwrap();
    let q = mm.allocate_pinned(10).unwrap();
    mm.free_pinned(q.as_ptr()).unwrap();
    let report = mm.shutdown().unwrap();
    assert_eq!(report.live_count, 2, "{report}");
    assert_eq!(report.live_bytes, 1024 + 3072, "{report}");
    assert!(report
        .live
        .iter()
        .any(|a| a.pool == PoolKind::Pinned && a.addr == p.as_ptr() as usize && a.requested == 1000));
    assert!(report.live.iter().any(|a| a.pool == PoolKind::Device && a.addr as u64 == d));

    // Live memory stays valid: write and read the pinned block.
    // SAFETY: `p` is a live 1000-byte pinned allocation.
    unsafe {
        p.as_ptr().write_bytes(0xab, 1000);
        assert_eq!(*p.as_ptr().add(999), 0xab);
    }
    let e = mm.allocate_pinned(10).unwrap_err();
    assert!(matches!(e, Error::ShutDown(_)), "{e}");
    let e = mm.allocate_device(10).unwrap_err();
    assert!(matches!(e, Error::ShutDown(_)), "{e}");

    // Frees after shutdown work and give the chunks back at once.
    mm.free_pinned(p.as_ptr()).unwrap();
    mm.free_device(d).unwrap();
    assert_eq!(mm.pinned_stats().reserved, 0);
    assert_eq!(mm.device_stats(0).unwrap().pool.reserved, 0);
    // A double free after shutdown is still caught.
    assert!(mm.free_pinned(p.as_ptr()).is_err());
    // Twice is fine.
    let again = mm.shutdown().unwrap();
    assert!(again.is_clean(), "{again}");
}

#[test]
fn pool_size_limit_gives_out_of_memory_without_touching_the_device() {
    let mm = MemoryManager::new(Config::new().max_device_pool_size(4 << 20).min_chunk(1 << 20)).unwrap();
    let a = mm.allocate_device(3 << 20).unwrap();
    let e = mm.allocate_device(2 << 20).unwrap_err();
    match &e {
        Error::OutOfMemory { state, .. } => {
            assert_eq!(state.limit, Some(4 << 20));
            assert!(state.in_use >= 3 << 20);
        }
        other => panic!("expected OutOfMemory, got {other}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("pool limit") && msg.contains("hint"), "{msg}");
    mm.free_device(a).unwrap();
    let b = mm.allocate_device(4 << 20).expect("fits once the first block is freed");
    mm.free_device(b).unwrap();
}

#[test]
fn unsupported_modes_fall_back_visibly() {
    let mm = manager();
    for mode in DeviceAllocatorMode::ALL {
        let effective = mm.set_device_allocator_mode(mode).unwrap();
        assert_eq!(mm.requested_device_allocator_mode(), mode);
        assert_eq!(mm.effective_device_allocator_mode(), effective);
        if mm.supports_async_device_allocator() {
            assert_eq!(effective, mode);
        } else {
            assert_eq!(effective, DeviceAllocatorMode::SyncPool);
        }
        let d = mm.allocate_device(1 << 16).unwrap();
        mm.free_device(d).unwrap();
    }
}

#[test]
fn a_device_that_does_not_exist_is_an_error() {
    let mm = manager();
    let e = mm.device(1000).unwrap_err();
    assert!(matches!(e, Error::NoSuchDevice { ordinal: 1000, .. }), "{e}");
    let e = MemoryManager::new(Config::new().device(1000)).unwrap_err();
    assert!(matches!(e, Error::NoSuchDevice { ordinal: 1000, .. }), "{e}");
}

#[test]
fn shutdown_report_says_where_live_memory_was_allocated() {
    let mm = MemoryManager::new(Config::new().track_allocations(true)).unwrap();
    let leaked = mm.allocate_pinned(4096).unwrap();
    let freed = mm.allocate_device(4096).unwrap();
    mm.free_device(freed).unwrap();
    let report = mm.shutdown().unwrap();
    assert_eq!(report.live_count, 1, "{report}");
    let site = report.live[0].site.as_deref().expect("tracking records a site");
    // Optimised, stripped builds inline the test function and lack line
    // info; with line info the site names this file.
    assert!(site.contains("bad_input.rs") || site.ends_with(" at ?"), "{site}");
    if cfg!(debug_assertions) {
        assert!(site.contains("shutdown_report_says_where_live_memory_was_allocated"), "{site}");
    }
    assert!(report.to_string().contains("allocated in"), "{report}");
    mm.free_pinned(leaked.as_ptr()).unwrap();
}

/// The seed's pool size is memory the pool holds: after
/// `set_device_pool_size(512 MiB)` and a first allocation the device pool
/// holds 512 MiB of memory (mapped, on a pool that remaps pages), not just
/// the pages the first block touched; a later release of cached memory
/// gives it back.
#[test]
fn a_device_pool_size_is_memory_the_pool_holds() {
    let mm = manager();
    mm.set_device_pool_size(512 << 20).unwrap();
    let d = mm.allocate_device(1 << 20).unwrap();
    let s = mm.device_stats(0).unwrap().pool;
    assert!(s.reserved >= 512 << 20, "address space {}", s.reserved);
    assert!(s.mapped >= 512 << 20, "the pool holds {} B of a 512 MiB pool", s.mapped);
    // Blocks inside the pool's size map nothing more.
    let more: Vec<u64> = (0..100).map(|_| mm.allocate_device(4 << 20).unwrap()).collect();
    let t = mm.device_stats(0).unwrap().pool;
    assert_eq!((t.mapped, t.map_calls), (s.mapped, s.map_calls), "blocks within the pool's size");
    for p in more.into_iter().chain([d]) {
        mm.free_device(p).unwrap();
    }
    mm.release_cached().unwrap();
    assert_eq!(mm.device_stats(0).unwrap().pool.mapped, 0, "released with the cached memory");
    still_works(&mm);
}
