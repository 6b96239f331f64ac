//! The device malloc heap (`CU_LIMIT_MALLOC_HEAP_SIZE`). A test binary of
//! its own: the heap can only be sized before kernels that call `malloc`
//! run in the context, so nothing else may load modules here first. The
//! GPU steps run in one test, in order.

#[path = "../examples/device_malloc/kernels.rs"]
mod kernels;

use cumem::{BackendChoice, Config, Error, MemoryManager};
use kernels::{MallocKernels, BYTES_USED, NUM_BLOCKS};

const MIB: usize = 1 << 20;

#[test]
fn heap_calls_need_a_gpu_on_the_host_fallback() {
    let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host)).unwrap();
    assert!(matches!(mm.device_malloc_heap_size(), Err(Error::NeedsGpu(_))));
    assert!(matches!(mm.set_device_malloc_heap_size(64 * MIB), Err(Error::NeedsGpu(_))));
    let global = MemoryManager::global().unwrap();
    if global.backend().is_host() {
        assert!(matches!(global.device_malloc_heap_size(), Err(Error::NeedsGpu(_))));
        assert!(matches!(global.set_device_malloc_heap_size(MIB), Err(Error::NeedsGpu(_))));
    }
}

#[test]
fn heap_is_sized_before_malloc_kernels_and_fixed_after() {
    let Some(ctx) = cumem::device::gpu_for_test("heap_is_sized_before_malloc_kernels_and_fixed_after") else {
        return;
    };
    let mm = MemoryManager::global().unwrap();
    let default = mm.device_malloc_heap_size().unwrap();
    println!("default heap: {default} B");

    // Before any module: set, read back; the driver may round up, never down.
    let small = mm.set_device_malloc_heap_size(MIB).unwrap();
    assert!(small >= MIB);
    assert_eq!(mm.device_malloc_heap_size().unwrap(), small);
    println!("asked 1 MiB, granted {small} B");
    let granted = mm.set_device_malloc_heap_size(64 * MIB).unwrap();
    assert_eq!(granted, 64 * MIB);
    assert_eq!(mm.device_malloc_heap_size().unwrap(), 64 * MIB);

    let kernels = MallocKernels::load(&ctx).unwrap();
    assert_eq!(mm.device_malloc_heap_size().unwrap(), 64 * MIB, "loading the module kept the size");
    // Driver 580 fixes the size at the first launch, not at load: this is
    // allowed there. Only printed, as the guide's rule is the earlier one.
    println!("setting it again after the load, before a launch: {:?}", mm.set_device_malloc_heap_size(64 * MIB));

    // Every block gets its buffer and computes the right values.
    let round = kernels.round(BYTES_USED).unwrap();
    assert_eq!(round.check(), Ok(NUM_BLOCKS));
    assert_eq!(round.failures, 0);

    // 64 blocks x 4 MiB can't all fit in 64 MiB: some mallocs return NULL,
    // the kernel counts them, and the blocks that got memory are right.
    let round = kernels.round(4 * MIB as u64).unwrap();
    let served = round.check().unwrap();
    println!("64 x 4 MiB from a 64 MiB heap: {served} served, {} NULL", round.failures);
    assert!(round.failures > 0 && served > 0, "{round:?}");

    // The heap is fixed now: a clear error, and the size is unchanged.
    match mm.set_device_malloc_heap_size(128 * MIB) {
        Err(e @ Error::ConfigTooLate { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("malloc") && msg.contains("before loading"), "{msg}");
            println!("{msg}");
        }
        other => panic!("resizing the heap after a malloc kernel ran: {other:?}"),
    }
    assert_eq!(mm.device_malloc_heap_size().unwrap(), 64 * MIB);
    // Shrinking, or repeating the same size, is refused as well.
    assert!(matches!(mm.set_device_malloc_heap_size(8 * MIB), Err(Error::ConfigTooLate { .. })));
}
