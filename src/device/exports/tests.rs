use crate::cuda::Stream;
use crate::device::DeviceSetup;
use crate::error::Error;

/// The pinning alone (exporting needs a GPU): a pinned block that its
/// owner frees is never handed out again until the release, and is
/// handed out at once after it.
#[test]
fn a_pinned_block_is_not_handed_out_again_until_its_release() {
    let d = DeviceSetup::host_for_tests().build(0, None).unwrap();
    let size = 64 << 10;
    let p = d.allocate(size, None).unwrap();
    d.exports.pin(p as usize, size).unwrap();
    d.exports.pin(p as usize, size).unwrap(); // a second export of it
    assert_eq!(d.exported_blocks(), 1);
    d.free(p, Some(&Stream::host())).unwrap();
    // A second free is a double free, as without the pin.
    assert!(matches!(d.free(p, None), Err(Error::DoubleFree { .. })));
    assert!(matches!(d.exports.pin(p as usize, size), Err(Error::DoubleFree { .. })));
    let mut held = Vec::new();
    for _ in 0..16 {
        let q = d.allocate(size, None).unwrap();
        assert_ne!(q, p, "a pinned block was handed out again");
        held.push(q);
    }
    assert_eq!(d.stats().pool.live_blocks, 17);
    for q in held {
        d.free(q, None).unwrap();
    }
    d.release_export(p).unwrap();
    assert_eq!(d.stats().pool.live_blocks, 1, "one export is still open");
    d.release_export(p).unwrap();
    assert_eq!((d.stats().pool.live_blocks, d.exported_blocks()), (0, 0));
    assert!(matches!(d.release_export(p), Err(Error::Ipc(_))));
    // Best fit hands the same block out now: the test above would see a
    // pinned block handed out.
    assert_eq!(d.allocate(size, None).unwrap(), p);
}

#[test]
fn exporting_needs_a_gpu_and_says_so() {
    let d = DeviceSetup::host_for_tests().build(0, None).unwrap();
    let p = d.allocate(4096, None).unwrap();
    assert!(matches!(d.export(p), Err(Error::NeedsGpu(_))));
    assert_eq!(d.exported_blocks(), 0);
    d.free(p, None).unwrap();
}
