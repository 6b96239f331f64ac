//! GPU: threads that come and go with streams of their own, and drop
//! them without synchronising, leave blocks tagged with those streams.
//! Once such a stream is idle, reusing its blocks on another stream needs
//! no wait (one `cuStreamQuery` settles all of them). Skips without a GPU;
//! fails instead under `CUMEM_REQUIRE_GPU=1`.

use cumem::device::gpu_for_test;
use cumem::{Config, MemoryManager, Stream};

#[test]
fn blocks_of_dropped_idle_streams_are_reused_with_no_wait() {
    let Some(_ctx) = gpu_for_test("blocks_of_dropped_idle_streams_are_reused_with_no_wait") else { return };
    let mm = MemoryManager::new(Config::new().arenas(1)).unwrap();
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
    let user = Stream::new().unwrap();
    let before = mm.device_stats(0).unwrap().stream_waits;
    for i in 0..256usize {
        let p = mm.allocate_device_on(((i % 64) + 1) << 16, &user).unwrap();
        mm.free_device_on(p, &user).unwrap();
    }
    let waits = mm.device_stats(0).unwrap().stream_waits - before;
    assert_eq!(waits, 0, "reuses of idle dropped streams' blocks waited {waits} times");
    user.synchronize().unwrap();
}
