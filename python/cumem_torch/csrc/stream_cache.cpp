// Side streams' kept blocks (see backend.h).
//
// cumem's pool serves every stream from one set of free blocks: a block
// freed on stream A and handed to stream B comes with a GPU-side wait (B
// waits for the work A had queued when it was freed). For a prefetcher that
// copies batches on a side stream while the main stream computes, nearly
// every free block was freed on the main stream, whose work is never known
// complete without a host synchronisation: each prefetch copy then waits
// for the main stream's queued compute and no longer overlaps it.
// PyTorch's own allocator never reuses a block on another stream. Here a
// block that a stream other than the device's default stream allocated and
// other streams used through record_stream (a prefetched batch) is kept,
// once those streams' events are done, for that stream's next allocation of
// the same size, at most kKeptPerStream per stream. Its stream's own order
// makes the reuse safe with no wait. empty_cache and an out-of-memory retry
// give kept blocks back to cumem.
//
// Memory tags: a block allocated under a tag lives in the tag's arena,
// which sleeps and wakes as one; kept and handed to an allocation under
// another tag (or none), it would sleep with the wrong tag. Tagged blocks
// are never kept, and an allocation made under a tag never takes a kept
// block (malloc asks cumem_tag_is_set).
#include "backend.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cumem.h"

namespace cumem_torch {

namespace {

void give_back(const KeptBlock& k) {
  int st = cumem_torch_release(k.ptr, k.device, k.stream);
  if (st != CUMEM_STATUS_OK) {
    TORCH_WARN("cumem: freeing ", k.ptr, " failed: ", cumem_status_name(st), ": ", last_error());
  }
}

} // namespace

bool CumemAllocator::keep_for_stream(void* ptr, const Block& b) {
  if (b.pool || b.tagged || b.uses.empty() || context_count_.load(std::memory_order_acquire) > 0) return false;
  if (b.stream == c10::cuda::getDefaultCUDAStream(b.device).stream()) return false;
  KeptBlock evicted;
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    kept_.push_back(KeptBlock{ptr, b.size, b.requested, b.device, b.stream});
    size_t same = 0;
    for (const auto& k : kept_) same += k.stream == b.stream;
    if (same > kKeptPerStream) {
      auto oldest = std::find_if(kept_.begin(), kept_.end(), [&](const KeptBlock& k) { return k.stream == b.stream; });
      evicted = *oldest;
      kept_.erase(oldest);
    }
    kept_count_.store(kept_.size(), std::memory_order_release);
  }
  // Back to cumem with no lock held.
  if (evicted.ptr) give_back(evicted);
  return true;
}

void* CumemAllocator::take_kept(size_t size, size_t rounded, c10::DeviceIndex device, cudaStream_t stream) {
  if (kept_count_.load(std::memory_order_acquire) == 0) return nullptr;
  std::lock_guard<std::recursive_mutex> g(mutex_);
  // Oldest first: its memory has been idle longest.
  for (auto it = kept_.begin(); it != kept_.end(); ++it) {
    if (it->stream == stream && it->device == device && it->size == rounded && it->requested >= size) {
      void* p = it->ptr;
      kept_.erase(it);
      kept_count_.store(kept_.size(), std::memory_order_release);
      return p;
    }
  }
  return nullptr;
}

void CumemAllocator::release_kept(c10::DeviceIndex device, bool all_devices) {
  if (kept_count_.load(std::memory_order_acquire) == 0) return;
  std::vector<KeptBlock> out;
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    auto keep = std::stable_partition(kept_.begin(), kept_.end(),
                                      [&](const KeptBlock& k) { return !all_devices && k.device != device; });
    out.assign(keep, kept_.end());
    kept_.erase(keep, kept_.end());
    kept_count_.store(kept_.size(), std::memory_order_release);
  }
  for (const auto& k : out) give_back(k);
}

// Before a memory tag sleeps (install.cpp): the frees waiting for
// record_stream's events, completed.
void CumemAllocator::drain_pending_frees() {
  std::vector<PendingFree> all;
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    all.swap(pending_);
    pending_count_.store(0, std::memory_order_release);
  }
  for (auto& pf : all) {
    // Waited for with no lock held; the events then go back to the pool.
    for (auto e : pf.events) C10_CUDA_CHECK(cudaEventSynchronize(e));
    {
      std::lock_guard<std::recursive_mutex> g(mutex_);
      dev(pf.block.device);
      for (auto e : pf.events) events_[pf.block.device].push_back(e);
    }
    finish_free(pf.ptr, pf.block);
  }
}

} // namespace cumem_torch
