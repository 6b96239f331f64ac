use super::{DeviceAllocatorMode, DriverPools, NativePoolOptions};
use crate::error::Error;

#[test]
fn the_host_fallback_has_no_driver_pool_and_exports_only_the_native_one() {
    let pools = DriverPools::new(None, NativePoolOptions { release_threshold: u64::MAX, exportable: false });
    assert!(pools.get(DeviceAllocatorMode::SyncPool).unwrap().is_none());
    for mode in [DeviceAllocatorMode::AsyncStreamOrdered, DeviceAllocatorMode::CudaAsyncPool] {
        assert!(matches!(pools.get(mode), Err(Error::NeedsGpu(_))), "{mode}");
        assert!(pools.made(mode).is_none());
    }
    assert_eq!(pools.all_made().count(), 0);
    assert!(matches!(pools.export(DeviceAllocatorMode::AsyncStreamOrdered, 0x1000), Err(Error::Ipc(_))));
    assert!(matches!(pools.export(DeviceAllocatorMode::CudaAsyncPool, 0x1000), Err(Error::NeedsGpu(_))));
}
