//! `cumem_flush_log` writes what the event log buffered, so a program that
//! exits right after (`cumem_torch` at interpreter exit) leaves a whole
//! log; before the manager exists it makes none. A process of its own:
//! the manager is process-wide.

use std::ffi::{c_void, CString};

use cumem_c::{cumem_allocate_device, cumem_flush_log, cumem_free_device, cumem_init, CumemStatus};

#[test]
fn a_flush_writes_every_event_and_makes_no_manager() {
    assert_eq!(cumem_flush_log(), CumemStatus::Ok, "nothing to flush before the manager exists");
    assert!(cumem::MemoryManager::global_if_made().is_none(), "a flush must not make the manager");

    let path = std::env::temp_dir().join(format!("cumem-flush-{}.csv", std::process::id()));
    let conf = CString::new(format!("backend=host,log={}", path.display())).unwrap();
    // SAFETY: `conf` is a valid C string for the call.
    assert_eq!(unsafe { cumem_init(conf.as_ptr()) }, CumemStatus::Ok);
    const N: usize = 500;
    let mut ptrs = Vec::with_capacity(N);
    for i in 0..N {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is valid for a write.
        assert_eq!(unsafe { cumem_allocate_device(4096 + i * 256, &mut p) }, CumemStatus::Ok);
        ptrs.push(p);
    }
    for p in ptrs {
        assert_eq!(cumem_free_device(p), CumemStatus::Ok);
    }
    assert_eq!(cumem_flush_log(), CumemStatus::Ok);
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let rows: Vec<&str> = text.lines().skip(1).collect();
    let count = |action: &str| rows.iter().filter(|r| r.split(',').nth(2) == Some(action)).count();
    assert_eq!((count("allocate"), count("free")), (N, N), "every event is in the file after the flush");
    assert!(rows.iter().all(|r| r.split(',').count() == 6), "no row is cut");
}
