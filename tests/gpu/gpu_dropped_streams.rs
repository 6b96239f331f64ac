//! GPU: threads that come and go with streams of their own, and drop
//! them without synchronising, leave blocks tagged with those streams.
//! Once such a stream is idle, reusing its blocks on another stream needs
//! no wait (one `cuStreamQuery` settles all of them), and so do the blocks
//! of streams that stay alive but idle. Skips without a GPU;
//! fails instead under `CUMEM_REQUIRE_GPU=1`.

use cumem::device::gpu_for_test;
use cumem::{Config, MemoryManager, Stream};

#[test]
fn blocks_of_dropped_idle_streams_are_reused_with_no_wait() {
    let Some(_ctx) = gpu_for_test("blocks_of_dropped_idle_streams_are_reused_with_no_wait") else { return };
    let mm = MemoryManager::new(Config::new()).unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let st = Stream::new().unwrap();
                let v: Vec<u64> = (1..=64).map(|i| mm.allocate_device_on(i << 16, &st).unwrap()).collect();
                for p in v {
                    mm.free_device_on(p, &st).unwrap();
                }
                // The stream goes with the thread, never synchronised.
            });
        }
    });
    let waits = waits_reusing(&mm);
    assert_eq!(waits, 0, "reuses of idle dropped streams' blocks waited {waits} times");
}

/// Reuses the sizes the threads freed (64 KiB to 4 MiB) on a new stream
/// 256 times; returns the stream waits that took.
fn waits_reusing(mm: &MemoryManager) -> u64 {
    let user = Stream::new().unwrap();
    let before = mm.device_stats(0).unwrap().stream_waits;
    for i in 0..256usize {
        let p = mm.allocate_device_on(((i % 64) + 1) << 16, &user).unwrap();
        mm.free_device_on(p, &user).unwrap();
    }
    let waits = mm.device_stats(0).unwrap().stream_waits - before;
    user.synchronize().unwrap();
    waits
}

#[test]
fn blocks_of_live_idle_streams_are_reused_with_no_wait() {
    // As above, but the threads' streams stay alive (never synchronised,
    // idle): their frees merge with each other's when they are not known
    // complete, and every reuse of such a block waited for every stream.
    let Some(_ctx) = gpu_for_test("blocks_of_live_idle_streams_are_reused_with_no_wait") else { return };
    let mm = MemoryManager::new(Config::new()).unwrap();
    let streams: Vec<Stream> = (0..4).map(|_| Stream::new().unwrap()).collect();
    std::thread::scope(|s| {
        for st in &streams {
            let mm = &mm;
            s.spawn(move || {
                let v: Vec<u64> = (1..=64).map(|i| mm.allocate_device_on(i << 16, st).unwrap()).collect();
                for p in v {
                    mm.free_device_on(p, st).unwrap();
                }
            });
        }
    });
    let waits = waits_reusing(&mm);
    assert_eq!(waits, 0, "reuses of idle live streams' blocks waited {waits} times");
    drop(streams);
}
