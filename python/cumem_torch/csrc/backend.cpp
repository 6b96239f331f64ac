// Allocation and the simple parts of PyTorch's CUDAAllocator interface
// (see backend.h; frees in frees.cpp, statistics in stats.cpp).
#include "backend.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/ApproximateClock.h>

#include <cstdio>

#include "cumem.h"

namespace cumem_torch {

namespace {

size_t round_size(size_t n) {
  return n < kRound ? kRound : (n + kRound - 1) / kRound * kRound;
}

// A size as PyTorch's messages write it.
std::string format_size(size_t n) {
  char buf[64];
  if (n < 1024) {
    std::snprintf(buf, sizeof buf, "%zu bytes", n);
  } else if (n < (size_t(1) << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", n / 1024.0);
  } else if (n < (size_t(1) << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", n / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", n / 1073741824.0);
  }
  return buf;
}

CumemAllocator* g_instance = nullptr;

void raw_deleter_fn(void* ptr) {
  if (g_instance) g_instance->free_from_deleter(ptr);
}

} // namespace

CumemAllocator* instance() {
  return g_instance;
}

std::string last_error() {
  const char* e = cumem_last_error();
  return e ? std::string(e) : std::string();
}

CumemAllocator::CumemAllocator() {
  g_instance = this;
}

DeviceRecord& CumemAllocator::dev(c10::DeviceIndex device) {
  if (device < 0) device = 0;
  if (static_cast<size_t>(device) >= devices_.size()) {
    devices_.resize(device + 1);
    traces_.resize(device + 1);
    trace_next_.resize(device + 1, 0);
    events_.resize(device + 1);
  }
  return devices_[device];
}

c10::DeviceIndex CumemAllocator::device_of_current() {
  return c10::cuda::current_device();
}

// ---- c10::Allocator ----

c10::DataPtr CumemAllocator::allocate(size_t n) {
  c10::DeviceIndex device = device_of_current();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  void* p = n == 0 ? nullptr : malloc(n, device, stream);
  return {p, p, &raw_deleter_fn, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr CumemAllocator::raw_deleter() const {
  return &raw_deleter_fn;
}

void CumemAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

void* CumemAllocator::raw_alloc(size_t nbytes) {
  if (nbytes == 0) return nullptr;
  c10::DeviceIndex device = device_of_current();
  return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* CumemAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  if (nbytes == 0) return nullptr;
  return malloc(nbytes, device_of_current(), stream);
}

void CumemAllocator::raw_delete(void* ptr) {
  if (!ptr) return;
  TORCH_CHECK(free(ptr), "invalid device pointer: ", ptr,
              " (not a live allocation of cumem's PyTorch allocator: freed already, or never allocated by it)");
}

void CumemAllocator::free_from_deleter(void* ptr) noexcept {
  try {
    if (ptr && !free(ptr)) {
      TORCH_WARN("cumem: a tensor's memory ", ptr, " is not a live allocation (ignored)");
    }
  } catch (const std::exception& e) {
    TORCH_WARN("cumem: freeing ", ptr, " failed: ", e.what());
  }
}

void CumemAllocator::init(int device_count) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  if (device_count > 0) dev(static_cast<c10::DeviceIndex>(device_count - 1));
}

bool CumemAllocator::initialized() {
  return true;
}

// ---- allocation ----

PrivatePool* CumemAllocator::routed_pool(c10::DeviceIndex device, cudaStream_t stream) {
  for (auto it = contexts_.rbegin(); it != contexts_.rend(); ++it) {
    if (it->device == device && it->filter(stream)) {
      auto p = pools_.find(it->id);
      if (p != pools_.end()) return p->second.get();
    }
  }
  return nullptr;
}

void* CumemAllocator::malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
  if (context_count_.load(std::memory_order_acquire) == 0) {
    process_pending();
  }
  constexpr size_t one_exa_bytes = 1152921504606846976ULL;
  TORCH_CHECK_WITH(OutOfMemoryError, size < one_exa_bytes,
                   "CUDA out of memory. Tried to allocate more than 1EB memory.");
  const size_t rounded = round_size(size);
  std::shared_ptr<c10::GatheredContext> ctx;
  if (history_.load(std::memory_order_relaxed) && when_ != cca::RecordContext::NEVER) ctx = gather(false);
  void* p = nullptr;
  PrivatePool* pool = nullptr;
  bool over_limit = false;
  if (any_limit_.load(std::memory_order_acquire) || context_count_.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    DeviceRecord& r = dev(device);
    over_limit = r.limit != 0 && static_cast<size_t>(r.stats.allocated_bytes[0].current) + rounded > r.limit;
    if (!over_limit && context_count_.load(std::memory_order_acquire) > 0) {
      pool = routed_pool(device, stream);
      if (pool) p = pool_alloc(*pool, rounded, device);
    }
  }
  // Raised with no lock held: PyTorch's out-of-memory observers take the GIL.
  if (over_limit) raise_oom(size, device, "the request would pass the limit set with set_per_process_memory_fraction");
  if (pool && !p) raise_oom(size, device, nullptr);
  // Under a memory tag the block comes from the tag's arena (cumem reads
  // the thread's tag), never from the untagged kept blocks.
  int tagged = 0;
  if (!pool && cumem_tag_is_set(&tagged) != CUMEM_STATUS_OK) tagged = 0;
  if (!pool && !tagged) p = take_kept(size, rounded, device, stream);
  if (!pool && !p) {
    int st = cumem_torch_allocate(size, device, stream, &p);
    if (st == CUMEM_STATUS_OUT_OF_MEMORY) {
      // What PyTorch does before giving up: return what is cached (freed
      // private pools, cumem's free memory) and try once more.
      {
        std::lock_guard<std::recursive_mutex> g(mutex_);
        dev(device).retries++;
      }
      if (context_count_.load() == 0) {
        release_kept(device, true);
        release_freeable_pools(true);
        size_t released = 0;
        (void)cumem_release_cached(&released);
      }
      st = cumem_torch_allocate(size, device, stream, &p);
    }
    // A size no machine has is invalid to cumem: out of memory for PyTorch.
    if (st == CUMEM_STATUS_OUT_OF_MEMORY || st == CUMEM_STATUS_INVALID_ARGUMENT) raise_oom(size, device, nullptr);
    TORCH_CHECK(st == CUMEM_STATUS_OK, "cumem could not allocate ", size, " bytes on device ", int(device), ": ",
                cumem_status_name(st), ": ", last_error());
  }
  Block b;
  b.size = rounded;
  b.requested = size;
  b.device = device;
  b.stream = stream;
  b.pool = pool;
  b.tagged = tagged != 0;
  b.context = ctx;
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    count_alloc(b);
    if (history_.load(std::memory_order_relaxed) || tracing_.load(std::memory_order_relaxed)) {
      trace(TraceEntry::ALLOC, device, reinterpret_cast<size_t>(p), rounded, stream,
            pool ? pool->id : c10::MempoolId_t{0, 0},
            when_ >= cca::RecordContext::ALLOC ? ctx : nullptr);
    }
    live_.emplace(p, std::move(b));
  }
  return p;
}

void CumemAllocator::raise_oom(size_t size, c10::DeviceIndex device, const char* why) {
  std::string diag = why ? std::string(why) : last_error();
  size_t device_free = 0, device_total = 0;
  {
    c10::cuda::CUDAGuard guard(device);
    if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) (void)cudaGetLastError();
  }
  size_t allocated = 0;
  std::vector<cca::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    DeviceRecord& r = dev(device);
    r.stats.num_ooms++;
    allocated = r.stats.allocated_bytes[0].current;
    if (history_.load() || tracing_.load()) {
      trace(TraceEntry::OOM, device, device_free, size, nullptr, {0, 0}, nullptr);
    }
    observers = oom_observers_;
  }
  for (auto& o : observers) o(device, allocated, device_total, device_free);
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", format_size(size), ". GPU ",
                   int(device), " has a total capacity of ", format_size(device_total), " of which ", format_size(device_free),
                   " is free. Of the allocated memory ", format_size(allocated),
                   " is allocated by PyTorch through cumem. cumem: ", diag);
}

} // namespace cumem_torch
