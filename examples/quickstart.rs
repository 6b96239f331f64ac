//! cumem in a few lines: configure the manager, fill a pinned vector, copy
//! it to the GPU and back, print the memory summary.
//!
//! Runs on a GPU when one is present and on the host fallback otherwise
//! (and says which).

use cumem::{Config, DeviceAllocatorMode, DeviceBuffer, MemoryManager, PinnedAlloc, PinnedVec, Stream};

fn main() -> Result<(), cumem::Error> {
    let mm = MemoryManager::init(
        Config::new().pinned_pool_size(64 << 20).device_pool_size(256 << 20).mode(DeviceAllocatorMode::SyncPool),
    )?;
    println!("cumem runs on: {}", mm.backend());
    if mm.backend().is_host() {
        println!("NOTE: no GPU in use; host memory stands in for pinned and device memory.");
    }
    println!(
        "device allocator mode: requested {}, effective {} (stream-ordered allocation supported: {})",
        mm.requested_device_allocator_mode(),
        mm.effective_device_allocator_mode(),
        mm.supports_async_device_allocator()
    );

    // A vector in pinned host memory.
    let n = 1 << 20;
    let mut host: PinnedVec<f32> = PinnedVec::with_capacity_in(n, PinnedAlloc);
    host.extend((0..n).map(|i| i as f32 * 0.5));

    // Device memory, filled from the pinned vector on a stream, copied back.
    let stream = Stream::new()?;
    let mut dev = DeviceBuffer::<f32>::new_on(n, &stream)?;
    let mut back: PinnedVec<f32> = PinnedVec::with_capacity_in(n, PinnedAlloc);
    back.resize(n, 0.0);
    // SAFETY: `host` and `back` outlive the copies, and nothing touches them
    // until the stream is synchronised below.
    unsafe {
        dev.copy_from_host_async(&host, &stream)?;
        dev.copy_to_host_async(&mut back, &stream)?;
    }
    stream.synchronize()?;
    assert_eq!(host[..], back[..], "round trip through the device changed the data");
    println!("round trip of {} MiB through device memory: ok", (n * 4) >> 20);

    // Raw seed-style API too.
    let raw = mm.allocate_device(1 << 20)?;
    mm.free_device(raw)?;

    drop(dev);
    drop(host);
    drop(back);
    println!("{}", mm.memory_summary());
    let report = mm.shutdown()?;
    print!("{report}");
    Ok(())
}
