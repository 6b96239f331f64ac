use std::ptr::null_mut;

use super::*;
use crate::{cumem_allocate_device_on, cumem_free_device_on, cumem_release_cached};

/// A program's own stream, used for memory, said forgotten, then
/// destroyed: cumem never touches the handle again (before, the raw
/// stream table and the stream registry kept it, and release_cached
/// synchronised the destroyed handle). `CUMEM_CONTROL_NO_FORGET=1`
/// leaves the forget out (the control: the release then fails or
/// worse).
#[test]
fn a_forgotten_raw_stream_is_never_touched_after_the_program_destroys_it() {
    let Some(ctx) = cumem::device::gpu_for_test("a_forgotten_raw_stream_is_never_touched") else { return };
    let device = crate::ffi::manager().unwrap().config().device;
    if ctx.ordinal() != device {
        println!("skipped: the test's device is not the C ABI's default device");
        return;
    }
    for round in 0..20 {
        let own = ctx.new_stream().unwrap();
        let raw = own.cu_stream() as CumemStream;
        let mut ptrs = Vec::new();
        for i in 0..8 {
            let mut p = null_mut();
            // SAFETY: `raw` is a live stream of the device's primary
            // context; `p` is valid for a write.
            assert_eq!(unsafe { cumem_allocate_device_on(4096 << i, raw, &mut p) }, CumemStatus::Ok);
            ptrs.push(p);
        }
        for p in ptrs {
            // SAFETY: as above.
            assert_eq!(unsafe { cumem_free_device_on(p, raw) }, CumemStatus::Ok);
        }
        if std::env::var_os("CUMEM_CONTROL_NO_FORGET").is_none() {
            assert_eq!(cumem_stream_forget(raw), CumemStatus::Ok, "round {round}");
        }
        // The program destroys its stream.
        drop(own);
        let mut released = 0;
        // SAFETY: `released` is valid for a write.
        assert_eq!(unsafe { cumem_release_cached(&mut released) }, CumemStatus::Ok, "round {round}");
    }
    assert!(table_size_now() < 20, "forgotten streams left the table");
}

fn table_size_now() -> usize {
    let mut n = 0;
    // SAFETY: `n` is valid for a write.
    unsafe { cumem_stream_table_size(&mut n) };
    n
}
