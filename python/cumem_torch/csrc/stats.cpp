// Statistics (PyTorch's DeviceStats, counted here for what PyTorch
// asked for, with cumem's figures for what it holds), the cache, the
// memory fraction and the device-wide calls (see backend.h).
#include "backend.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cumem.h"

namespace cumem_torch {

namespace {

// The statistics' pool kinds for a block of `size` bytes.
c10::CachingAllocator::StatTypes types_for(size_t size) {
  c10::CachingAllocator::StatTypes t{};
  t[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)] = true;
  t[static_cast<size_t>(size <= kSmallSize ? c10::CachingAllocator::StatType::SMALL_POOL
                                           : c10::CachingAllocator::StatType::LARGE_POOL)] = true;
  return t;
}

} // namespace

// ---- counting ----

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
