// Allocation, free, record_stream, statistics and the simple parts of
// PyTorch's CUDAAllocator interface (see backend.h).
#include "backend.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/ApproximateClock.h>

#include <algorithm>
#include <cstdio>

#include "cumem.h"

namespace cumem_torch {

namespace {

size_t round_size(size_t n) {
  return n < kRound ? kRound : (n + kRound - 1) / kRound * kRound;
}

std::string last_error() {
  const char* e = cumem_last_error();
  return e ? std::string(e) : std::string();
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

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return st != cudaStreamCaptureStatusNone;
}

// The statistics' pool kinds for a block of `size` bytes.
c10::CachingAllocator::StatTypes types_for(size_t size) {
  c10::CachingAllocator::StatTypes t{};
  t[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)] = true;
  t[static_cast<size_t>(size <= kSmallSize ? c10::CachingAllocator::StatType::SMALL_POOL
                                           : c10::CachingAllocator::StatType::LARGE_POOL)] = true;
  return t;
}

} // namespace

CumemAllocator* instance() {
  return g_instance;
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

void CumemAllocator::count_alloc(const Block& b) {
  DeviceRecord& r = dev(b.device);
  auto t = types_for(b.size);
  c10::CachingAllocator::for_each_selected_stat_type(t, [&](size_t i) {
    r.stats.allocation[i].increase(1);
    r.stats.allocated_bytes[i].increase(b.size);
    r.stats.active[i].increase(1);
    r.stats.active_bytes[i].increase(b.size);
    r.stats.requested_bytes[i].increase(b.requested);
  });
}

void CumemAllocator::count_free(const Block& b, bool still_active) {
  DeviceRecord& r = dev(b.device);
  auto t = types_for(b.size);
  c10::CachingAllocator::for_each_selected_stat_type(t, [&](size_t i) {
    if (still_active) {
      r.stats.allocation[i].decrease(1);
      r.stats.allocated_bytes[i].decrease(b.size);
      r.stats.requested_bytes[i].decrease(b.requested);
    } else {
      r.stats.active[i].decrease(1);
      r.stats.active_bytes[i].decrease(b.size);
    }
  });
}

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
    // A size no machine has is refused as invalid by cumem: out of memory
    // for PyTorch.
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

// ---- free ----

bool CumemAllocator::free(void* ptr) {
  Block b;
  // Gathered with no lock held (it takes the GIL).
  std::shared_ptr<c10::GatheredContext> ctx;
  if (history_.load(std::memory_order_relaxed) && when_ == cca::RecordContext::ALL) ctx = gather(true);
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return false;
    b = std::move(it->second);
    live_.erase(it);
    count_free(b, true);
    if (history_.load(std::memory_order_relaxed) || tracing_.load(std::memory_order_relaxed)) {
      trace(TraceEntry::FREE_REQUESTED, b.device, reinterpret_cast<size_t>(ptr), b.size, b.stream,
            b.pool ? b.pool->id : c10::MempoolId_t{0, 0},
            std::move(ctx));
    }
  }
  release_block(ptr, b);
  return true;
}

void CumemAllocator::release_block(void* ptr, Block& b) {
  const bool captures = context_count_.load(std::memory_order_acquire) > 0;
  if (captures) {
    bool any = capturing(b.stream);
    for (auto s : b.uses) any = any || capturing(s);
    if (any && (!b.pool || !b.uses.empty())) {
      // Events can't be recorded into someone's capture, and a block last
      // used by captured work is reused only after the capture ends.
      std::lock_guard<std::recursive_mutex> g(mutex_);
      deferred_.emplace_back(ptr, std::move(b));
      return;
    }
  }
  if (!b.uses.empty()) {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    PendingFree pf{ptr, std::move(b), {}};
    c10::cuda::CUDAGuard guard(pf.block.device);
    for (auto s : pf.block.uses) {
      cudaEvent_t e = take_event();
      C10_CUDA_CHECK(cudaEventRecord(e, s));
      pf.events.push_back(e);
    }
    pending_.push_back(std::move(pf));
    pending_count_.store(pending_.size(), std::memory_order_release);
    return;
  }
  finish_free(ptr, b);
}

void CumemAllocator::finish_free(void* ptr, Block& b) {
  if (b.pool) {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    b.pool->owned.erase(ptr);
    int st = cumem_graph_pool_free(b.pool->handle, ptr);
    if (st != CUMEM_STATUS_OK) TORCH_WARN("cumem: freeing ", ptr, " into its private pool failed: ", last_error());
  } else if (!keep_for_stream(ptr, b)) {
    int st = cumem_torch_release(ptr, b.device, b.stream);
    if (st != CUMEM_STATUS_OK) {
      TORCH_WARN("cumem: freeing ", ptr, " failed: ", cumem_status_name(st), ": ", last_error());
    }
  }
  std::lock_guard<std::recursive_mutex> g(mutex_);
  count_free(b, false);
  if (history_.load(std::memory_order_relaxed) || tracing_.load(std::memory_order_relaxed)) {
    trace(TraceEntry::FREE_COMPLETED, b.device, reinterpret_cast<size_t>(ptr), b.size, b.stream,
          b.pool ? b.pool->id : c10::MempoolId_t{0, 0}, nullptr);
  }
}

cudaEvent_t CumemAllocator::take_event() {
  int d = 0;
  C10_CUDA_CHECK(cudaGetDevice(&d));
  auto& pool = events_[static_cast<size_t>(d) < events_.size() ? d : 0];
  if (!pool.empty()) {
    cudaEvent_t e = pool.back();
    pool.pop_back();
    return e;
  }
  cudaEvent_t e;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void CumemAllocator::process_pending() {
  if (pending_count_.load(std::memory_order_acquire) == 0) return;
  std::vector<PendingFree> done;
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    // Oldest first, and no further than the first free still waiting (as
    // PyTorch does): one event query per allocation while work is queued,
    // not one per waiting free. A later free whose events are done waits
    // a little longer; nothing is reused early.
    size_t n = 0;
    for (; n < pending_.size(); ++n) {
      bool ready = true;
      for (auto e : pending_[n].events) {
        cudaError_t q = cudaEventQuery(e);
        if (q == cudaErrorNotReady) {
          (void)cudaGetLastError();
          ready = false;
          break;
        }
        C10_CUDA_CHECK(q);
      }
      if (!ready) break;
      for (auto e : pending_[n].events) events_[pending_[n].block.device].push_back(e);
      done.push_back(std::move(pending_[n]));
    }
    pending_.erase(pending_.begin(), pending_.begin() + n);
    pending_count_.store(pending_.size(), std::memory_order_release);
  }
  for (auto& pf : done) finish_free(pf.ptr, pf.block);
}

void CumemAllocator::flush_deferred(bool all_captures_over) {
  std::vector<std::pair<void*, Block>> ready;
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    for (size_t i = 0; i < deferred_.size();) {
      auto& d = deferred_[i];
      bool busy = !all_captures_over && capturing(d.second.stream);
      for (auto s : d.second.uses) busy = busy || (!all_captures_over && capturing(s));
      if (!busy) {
        ready.push_back(std::move(d));
        deferred_.erase(deferred_.begin() + i);
      } else {
        ++i;
      }
    }
  }
  for (auto& d : ready) release_block(d.first, d.second);
}

void CumemAllocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
  if (!ptr.get() || ptr.get_deleter() != &raw_deleter_fn) return;
  std::lock_guard<std::recursive_mutex> g(mutex_);
  auto it = live_.find(ptr.get());
  TORCH_CHECK(it != live_.end(), "record_stream: ", ptr.get(), " is not a live allocation of cumem's allocator");
  cudaStream_t s = stream.stream();
  Block& b = it->second;
  if (s == b.stream) return;
  if (std::find(b.uses.begin(), b.uses.end(), s) == b.uses.end()) b.uses.push_back(s);
}

// ---- statistics ----

DeviceStats CumemAllocator::getDeviceStats(c10::DeviceIndex device) {
  DeviceStats s;
  int64_t retries = 0;
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    DeviceRecord& r = dev(device);
    s = r.stats;
    retries = r.retries;
  }
  CumemTorchFigures f{};
  if (cumem_torch_figures(device, &f) == CUMEM_STATUS_OK) {
    const size_t large = static_cast<size_t>(c10::CachingAllocator::StatType::LARGE_POOL);
    for (size_t i : {size_t(0), large}) {
      s.reserved_bytes[i].current = static_cast<int64_t>(f.reserved);
      s.reserved_bytes[i].peak = std::max<int64_t>(f.peak_reserved, f.reserved);
      s.segment[i].current = static_cast<int64_t>(f.chunks);
      s.segment[i].peak = std::max(s.segment[i].peak, s.segment[i].current);
      s.segment[i].allocated = static_cast<int64_t>(f.device_allocs);
      s.segment[i].freed = static_cast<int64_t>(f.device_frees);
    }
    s.num_device_alloc = static_cast<int64_t>(f.device_allocs);
    s.num_device_free = static_cast<int64_t>(f.device_frees);
    s.num_alloc_retries = retries + static_cast<int64_t>(f.alloc_retries);
  } else {
    s.num_alloc_retries = retries;
  }
  s.max_split_size = -1;
  return s;
}

// Calls `f` on every Stat of the arrays in `s`.
template <typename F>
void for_each_stat(DeviceStats& s, F f) {
  for (auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
                  &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
    for (auto& st : *a) f(st);
  }
}

void CumemAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  DeviceRecord& r = dev(device);
  for_each_stat(r.stats, [](c10::CachingAllocator::Stat& st) { st.reset_accumulated(); });
  r.stats.num_alloc_retries = 0;
  r.stats.num_ooms = 0;
  r.stats.num_sync_all_streams = 0;
  r.retries = 0;
  r.stats.oversize_allocations.reset_accumulated();
  r.stats.oversize_segments.reset_accumulated();
}

void CumemAllocator::resetPeakStats(c10::DeviceIndex device) {
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    DeviceRecord& r = dev(device);
    for_each_stat(r.stats, [](c10::CachingAllocator::Stat& st) { st.reset_peak(); });
    r.stats.oversize_allocations.reset_peak();
    r.stats.oversize_segments.reset_peak();
  }
  (void)cumem_reset_peak_stats();
}

// ---- cache, limits, devices ----

void CumemAllocator::emptyCache(c10::MempoolId_t mempool_id) {
  if (mempool_id != c10::MempoolId_t{0, 0}) {
    release_freeable_pools(true);
    return;
  }
  if (context_count_.load() > 0) return; // would synchronize a capture
  process_pending();
  release_kept(0, true);
  release_freeable_pools(true);
  size_t released = 0;
  int st = cumem_release_cached(&released);
  if (st != CUMEM_STATUS_OK && st != CUMEM_STATUS_CAPTURE) {
    TORCH_WARN("cumem: empty_cache: ", cumem_status_name(st), ": ", last_error());
  }
}

double CumemAllocator::getMemoryFraction(c10::DeviceIndex device) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  return dev(device).fraction;
}

void CumemAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK(fraction >= 0 && fraction <= 1, "invalid fraction: ", fraction, ". Please set within [0, 1].");
  size_t device_free = 0, device_total = 0;
  {
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaMemGetInfo(&device_free, &device_total));
  }
  std::lock_guard<std::recursive_mutex> g(mutex_);
  DeviceRecord& r = dev(device);
  r.fraction = fraction;
  r.limit = fraction >= 1.0 ? 0 : static_cast<size_t>(fraction * static_cast<double>(device_total));
  bool any = false;
  for (const auto& d : devices_) any = any || d.limit != 0;
  any_limit_.store(any, std::memory_order_release);
}

std::vector<cca::StreamSegmentSize> CumemAllocator::getExpandableSegmentSizes(c10::DeviceIndex) {
  return {};
}

void CumemAllocator::enable(bool value) {
  enabled_ = value;
}

bool CumemAllocator::isEnabled() const {
  return enabled_;
}

void CumemAllocator::cacheInfo(c10::DeviceIndex device, size_t* largestBlock) {
  CumemTorchFigures f{};
  size_t largest = 0;
  if (cumem_torch_figures(device, &f) == CUMEM_STATUS_OK) largest = f.largest_free;
  if (largest == 0) {
    // Nothing cached: what the driver has free (PyTorch's answer too).
    size_t device_free = 0, device_total = 0;
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaMemGetInfo(&device_free, &device_total));
    largest = device_free;
  }
  *largestBlock = std::max(*largestBlock, largest);
}

void CumemAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  c10::cuda::CUDAGuard guard(dev);
  cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
  } else {
    C10_CUDA_CHECK(err);
  }
  // cumem maps memory for the peers whose context is active at its next
  // mapping; memory mapped before dev's context existed needs the grant
  // now, before PyTorch's peer copy or kernel reads it.
  int st = cumem_enable_peer_access(dev, dev_to_access);
  TORCH_CHECK(st == CUMEM_STATUS_OK, "cumem: enabling peer access from device ", static_cast<int>(dev), " to device ",
              static_cast<int>(dev_to_access), ": ", cumem_status_name(st), ": ", last_error());
}

cudaError_t CumemAllocator::memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                                        cudaStream_t stream, bool p2p_enabled) {
  if (p2p_enabled || dstDevice == srcDevice) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
}

std::string CumemAllocator::name() {
  return "cumem";
}

} // namespace cumem_torch
