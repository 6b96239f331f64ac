// Frees: the deleter's path, record_stream's frees that wait for other
// streams' events, and frees deferred past a capture (see backend.h).
#include "backend.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cumem.h"

namespace cumem_torch {

namespace {

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return st != cudaStreamCaptureStatusNone;
}

} // namespace

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
  if (!ptr.get() || ptr.get_deleter() != raw_deleter()) return;
  std::lock_guard<std::recursive_mutex> g(mutex_);
  auto it = live_.find(ptr.get());
  TORCH_CHECK(it != live_.end(), "record_stream: ", ptr.get(), " is not a live allocation of cumem's allocator");
  cudaStream_t s = stream.stream();
  Block& b = it->second;
  if (s == b.stream) return;
  if (std::find(b.uses.begin(), b.uses.end(), s) == b.uses.end()) b.uses.push_back(s);
}

} // namespace cumem_torch
