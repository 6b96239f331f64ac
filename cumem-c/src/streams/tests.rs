use std::ptr::null_mut;

use super::*;
use crate::{cumem_allocate_device_on, cumem_free_device_on};

fn table_size() -> usize {
    let mut n = usize::MAX;
    // SAFETY: `n` is valid for a write.
    assert_eq!(unsafe { cumem_stream_table_size(&mut n) }, CumemStatus::Ok);
    n
}

/// A program that makes streams, allocates and frees on them, and
/// destroys them, forever (host fallback: any value names a queue).
#[test]
fn streams_that_come_and_go_leave_the_raw_table_bounded() {
    if !cumem::MemoryManager::global().is_ok_and(|m| m.backend().is_host()) {
        println!("skipped: raw values stand for streams only on the host fallback");
        return;
    }
    let mut most = 0;
    for i in 0..5_000usize {
        let raw = (0x7000_0000 + i * 64) as CumemStream;
        let mut p = null_mut();
        // SAFETY: on the host fallback any value names a host queue;
        // `p` is valid for a write.
        assert_eq!(unsafe { cumem_allocate_device_on(4096, raw, &mut p) }, CumemStatus::Ok);
        // SAFETY: as above.
        assert_eq!(unsafe { cumem_free_device_on(p, raw) }, CumemStatus::Ok);
        // Half the program says it destroys its streams; the rest leave
        // them to the table's look for idle entries.
        if i % 2 == 0 {
            let before = table_size();
            assert_eq!(cumem_stream_forget(raw), CumemStatus::Ok);
            assert_eq!(table_size(), before - 1, "forgotten: its entry went");
            assert_eq!(cumem_stream_forget(raw), CumemStatus::Ok, "twice is fine");
        }
        most = most.max(table_size());
    }
    assert!(most <= 2 * PRUNE_FIRST, "the raw stream table reached {most} entries");
}

#[test]
fn forgetting_the_default_or_an_owned_stream_is_refused() {
    assert_eq!(cumem_stream_forget(null_mut()), CumemStatus::InvalidArgument);
    let mut s = null_mut();
    // SAFETY: `s` is valid for a write.
    assert_eq!(unsafe { cumem_stream_create(&mut s) }, CumemStatus::Ok);
    assert_eq!(cumem_stream_forget(s), CumemStatus::InvalidArgument);
    assert_eq!(cumem_stream_destroy(s), CumemStatus::Ok);
    // SAFETY: NULL is refused before any write.
    assert_eq!(unsafe { cumem_stream_table_size(null_mut()) }, CumemStatus::InvalidArgument);
}
