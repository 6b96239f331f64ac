// The seed's C++ usage, on cumem: the singleton, pinned and device memory,
// async copies on a stream, pool sizes, the allocator modes, stream-ordered
// allocation, shutdown. Runs on a GPU and on cumem's host fallback. Built
// and run by cumem-c/tests/c_abi.rs (static library) where a C++ compiler
// is present; by hand:
//   cargo build -p cumem-c
//   c++ -std=c++17 -Icumem-c/include cumem-c/examples/seed_usage.cpp
//       target/debug/libcumem_c.a -lpthread -ldl -lm -o seed_usage
#include <cstdio>
#include <cstring>
#include <vector>

#include "cumem.hpp"

int main() {
  using cumem::DeviceAllocatorMode;
  cumem::MemoryManager& mm = cumem::MemoryManager::getInstance();
  std::printf("running on %s\n", mm.backend().c_str());

  // Configure pool sizes before first allocation.
  mm.setPinnedPoolSize(128 * 1024 * 1024);  // 128MB
  mm.setDevicePoolSize(512 * 1024 * 1024);  // 512MB

  const size_t n = 1 << 20;
  const size_t size = n * sizeof(float);
  float* h_data = static_cast<float*>(mm.allocatePinned(size));
  for (size_t i = 0; i < n; i++) h_data[i] = static_cast<float>(i);
  void* d_data = mm.allocateDevice(size);

  CumemStream stream = nullptr;
  cumem::check(cumem_stream_create(&stream));

  // Host to device and back.
  float* h_back = static_cast<float*>(mm.allocatePinned(size));
  std::memset(h_back, 0, size);
  cumem::check(mm.copyToDeviceAsync(d_data, h_data, size, stream));
  cumem::check(mm.copyToHostAsync(h_back, d_data, size, stream));
  cumem::check(cumem_stream_synchronize(stream));
  if (std::memcmp(h_data, h_back, size) != 0) {
    std::fprintf(stderr, "round trip through device memory changed the data\n");
    return 1;
  }
  mm.freeDevice(d_data);

  // Stream-ordered allocation (v2).
  mm.setDeviceAllocatorMode(DeviceAllocatorMode::ASYNC_STREAM_ORDERED);
  std::printf("requested mode %d, effective mode %d, async supported: %s\n",
              static_cast<int>(mm.getRequestedDeviceAllocatorMode()),
              static_cast<int>(mm.getEffectiveDeviceAllocatorMode()),
              mm.supportsAsyncDeviceAllocator() ? "yes" : "no");
  void* d_async = mm.allocateDevice(size, stream);
  mm.freeDevice(d_async, stream);

  // The native CUDA memory pool where the device has one.
  mm.setDeviceAllocatorMode(DeviceAllocatorMode::CUDA_ASYNC_POOL);
  void* d_pool = mm.allocateDevice(size, stream);
  mm.freeDevice(d_pool, stream);
  cumem::check(cumem_stream_synchronize(stream));

  // Errors are exceptions, never crashes.
  try {
    mm.freePinned(h_back);
    mm.freePinned(h_back);
    std::fprintf(stderr, "a double free was not reported\n");
    return 1;
  } catch (const cumem::Error& e) {
    std::printf("double free reported: %s\n", e.what());
    if (e.status() != CUMEM_STATUS_DOUBLE_FREE) return 1;
  }
  mm.freePinned(h_data);

  std::printf("%s", mm.memorySummary().c_str());
  cumem::check(cumem_stream_destroy(stream));
  CumemShutdownReport r = mm.shutdown();
  std::printf("shutdown: %zu live allocations (%zu B), %zu B released\n", r.live_count, r.live_bytes,
              r.released_bytes);
  std::printf("seed usage: ok\n");
  return r.live_count == 0 ? 0 : 1;
}
