// cumem for C++: the seed's MemoryManager API over cumem's C ABI
// (cumem.h). Header-only; link libcumem_c (shared or static). Failures
// throw cumem::Error, which carries the status and cumem's message.
#ifndef CUMEM_HPP
#define CUMEM_HPP

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "cumem.h"

namespace cumem {

// A failed cumem call: its status and message.
class Error : public std::runtime_error {
 public:
  Error(CumemStatus status, const std::string& what)
      : std::runtime_error(std::string(cumem_status_name(status)) + ": " + what), status_(status) {}
  CumemStatus status() const { return status_; }

 private:
  CumemStatus status_;
};

inline void check(CumemStatus s) {
  if (s != CUMEM_STATUS_OK) throw Error(s, cumem_last_error());
}

enum class DeviceAllocatorMode {
  SYNC_POOL = CUMEM_MODE_SYNC_POOL,
  ASYNC_STREAM_ORDERED = CUMEM_MODE_ASYNC_STREAM_ORDERED,
  CUDA_ASYNC_POOL = CUMEM_MODE_CUDA_ASYNC_POOL,
};

// The process-wide manager (configured from CUMEM_CONF on first use, or
// by cumem_init before). Every method may be called from any thread.
class MemoryManager {
 public:
  static MemoryManager& getInstance() {
    static MemoryManager instance;
    return instance;
  }
  MemoryManager(const MemoryManager&) = delete;
  MemoryManager& operator=(const MemoryManager&) = delete;

  // Pinned host memory.
  void* allocatePinned(size_t size) { return out<void*>(cumem_allocate_pinned, size); }
  void freePinned(void* ptr) { check(cumem_free_pinned(ptr)); }

  // Device memory: usable at once by any stream, or (with a stream)
  // stream-ordered.
  void* allocateDevice(size_t size) { return out<void*>(cumem_allocate_device, size); }
  void* allocateDevice(size_t size, CumemStream stream) {
    return out<void*>(cumem_allocate_device_on, size, stream);
  }
  void freeDevice(void* ptr) { check(cumem_free_device(ptr)); }
  void freeDevice(void* ptr, CumemStream stream) { check(cumem_free_device_on(ptr, stream)); }

  // Asynchronous transfers (the seed returns cudaError_t; these return
  // cumem's status, with the message in cumem_last_error()).
  CumemStatus copyToDeviceAsync(void* dst, const void* src, size_t size, CumemStream stream) {
    return cumem_copy_to_device_async(dst, src, size, stream);
  }
  CumemStatus copyToHostAsync(void* dst, const void* src, size_t size, CumemStream stream) {
    return cumem_copy_to_host_async(dst, src, size, stream);
  }

  // Pool management (before first use).
  void setPinnedPoolSize(size_t size) { check(cumem_set_pinned_pool_size(size)); }
  void setDevicePoolSize(size_t size) { check(cumem_set_device_pool_size(size)); }

  // Allocator mode.
  void setDeviceAllocatorMode(DeviceAllocatorMode mode) {
    check(cumem_set_device_allocator_mode(static_cast<int>(mode), nullptr));
  }
  DeviceAllocatorMode getRequestedDeviceAllocatorMode() const {
    return static_cast<DeviceAllocatorMode>(out<CumemMode>(cumem_requested_device_allocator_mode));
  }
  DeviceAllocatorMode getEffectiveDeviceAllocatorMode() const {
    return static_cast<DeviceAllocatorMode>(out<CumemMode>(cumem_effective_device_allocator_mode));
  }
  bool supportsAsyncDeviceAllocator() const { return out<int>(cumem_supports_async_device_allocator) != 0; }

  // What the manager runs on, and every pool's state.
  std::string backend() const { return text(cumem_backend); }
  std::string memorySummary() const { return text(cumem_memory_summary); }

  // Memory tags (see TagScope): puts tags to sleep (offloaded to pinned
  // memory, or discarded; their pages go back to the driver) and wakes
  // them at the same addresses (no names: every sleeping tag).
  CumemSleepReport sleep(const std::vector<std::string>& offload, const std::vector<std::string>& discard) {
    std::vector<const char*> o = c_names(offload), d = c_names(discard);
    CumemSleepReport r{};
    check(cumem_sleep(o.data(), o.size(), d.data(), d.size(), &r));
    return r;
  }
  CumemWakeReport wake(const std::vector<std::string>& tags = {}) {
    std::vector<const char*> t = c_names(tags);
    CumemWakeReport r{};
    check(cumem_wake(t.data(), t.size(), &r));
    return r;
  }
  // Every tag on every device in use.
  std::vector<CumemTagUsage> tagUsage() const {
    size_t count = 0;
    CumemStatus s = cumem_tag_usage(nullptr, 0, &count);
    if (s != CUMEM_STATUS_BUFFER_TOO_SMALL) check(s);
    for (;;) {
      std::vector<CumemTagUsage> v(count + 4);
      s = cumem_tag_usage(v.data(), v.size(), &count);
      if (s == CUMEM_STATUS_BUFFER_TOO_SMALL) continue;  // tags were made meanwhile
      check(s);
      v.resize(count);
      return v;
    }
  }

  // Cleanup: releases what is free; live memory stays valid.
  CumemShutdownReport shutdown() { return out<CumemShutdownReport>(cumem_shutdown); }

 private:
  MemoryManager() = default;

  // Calls `f(args..., &value)` and returns the value it stores.
  template <typename T, typename F, typename... A>
  static T out(F f, A... args) {
    T value{};
    check(f(args..., &value));
    return value;
  }

  static std::vector<const char*> c_names(const std::vector<std::string>& names) {
    std::vector<const char*> out;
    for (const auto& n : names) out.push_back(n.c_str());
    return out;
  }

  template <typename F>
  static std::string text(F f) {
    size_t needed = 0;
    CumemStatus s = f(nullptr, 0, &needed);
    if (s != CUMEM_STATUS_BUFFER_TOO_SMALL) check(s);
    std::vector<char> buf(needed);
    check(f(buf.data(), buf.size(), nullptr));
    return std::string(buf.data());
  }
};

// Sets a memory tag on the calling thread until the scope ends, when the
// tag set before comes back (scopes nest): the thread's device allocations
// meanwhile come from the tag's memory, which MemoryManager::sleep and
// wake put away and bring back as one.
class TagScope {
 public:
  explicit TagScope(const std::string& name) : previous_(current()) { check(cumem_tag_set(name.c_str())); }
  ~TagScope() { (void)cumem_tag_set(previous_.empty() ? nullptr : previous_.c_str()); }
  TagScope(const TagScope&) = delete;
  TagScope& operator=(const TagScope&) = delete;

  // The calling thread's tag ("" when none is set).
  static std::string current() {
    char buf[CUMEM_TAG_NAME_CAP];
    check(cumem_tag_get(buf, sizeof buf, nullptr));
    return std::string(buf);
  }

 private:
  std::string previous_;
};

}  // namespace cumem

#endif  // CUMEM_HPP
