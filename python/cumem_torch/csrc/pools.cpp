// PyTorch's private pools (CUDA graphs, MemPool) and their checkpoints,
// snapshots and history, IPC (see backend.h).
#include "backend.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/ApproximateClock.h>
#include <cuda.h>

#include <cstring>

#include "cumem.h"

namespace cumem_torch {

namespace {

constexpr char kHandleVersion = 2; // PyTorch's shareable-handle layout
constexpr char kHandleCudaMalloc = 'c';

} // namespace

// ---- pools ----

void* CumemAllocator::pool_alloc(PrivatePool& p, size_t rounded, c10::DeviceIndex device) {
  void* ptr = nullptr;
  int st = CUMEM_STATUS_OK;
  {
    // Memory for a capture: legal while this or another thread captures
    // (cumem's driver calls don't touch the capturing streams).
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    if (!p.handle) st = cumem_graph_pool_create(device, &p.handle);
    if (st == CUMEM_STATUS_OK) st = cumem_graph_pool_allocate(p.handle, rounded, &ptr);
  }
  if (st == CUMEM_STATUS_OUT_OF_MEMORY || st == CUMEM_STATUS_INVALID_ARGUMENT) {
    return nullptr; // the caller raises, with no lock held
  }
  TORCH_CHECK(st == CUMEM_STATUS_OK, "cumem could not allocate ", rounded, " bytes for a private pool: ",
              cumem_status_name(st), ": ", last_error());
  p.owned.emplace(ptr, rounded);
  return ptr;
}

void CumemAllocator::createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                                        std::shared_ptr<cca::CUDAAllocator> allocator) {
  TORCH_CHECK(!allocator || allocator.get() == this,
              "cumem's allocator can't hold a MemPool backed by another allocator (", allocator->name(),
              "): with cumem installed, make MemPool() without an allocator");
  std::lock_guard<std::recursive_mutex> g(mutex_);
  auto& p = pools_[id];
  if (!p) {
    p = std::make_unique<PrivatePool>();
    p->id = id;
    p->device = device;
  }
  p->use_count++;
}

void CumemAllocator::beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id,
                                         std::function<bool(cudaStream_t)> filter) {
  createOrIncrefPool(device, id, nullptr);
  std::lock_guard<std::recursive_mutex> g(mutex_);
  for (auto& c : contexts_) {
    TORCH_CHECK(!(c.id == id && c.device == device), "beginAllocateToPool: already recording to mempool_id");
  }
  contexts_.push_back(PoolContext{device, id, std::move(filter)});
  context_count_.store(contexts_.size(), std::memory_order_release);
}

void CumemAllocator::endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) {
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    for (auto it = contexts_.begin(); it != contexts_.end(); ++it) {
      if (it->id == id && it->device == device) {
        contexts_.erase(it);
        break;
      }
    }
    context_count_.store(contexts_.size(), std::memory_order_release);
  }
  flush_deferred(context_count_.load() == 0);
}

void CumemAllocator::releasePool(c10::DeviceIndex /*device*/, c10::MempoolId_t id) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  auto it = pools_.find(id);
  TORCH_CHECK(it != pools_.end(), "releasePool: no private pool ", id.first, ",", id.second);
  TORCH_CHECK(it->second->use_count > 0, "releasePool: the pool's use count is already 0");
  it->second->use_count--;
  // Its free blocks go back at the next empty_cache (or when an
  // allocation runs out of memory), as with PyTorch's allocator.
}

int CumemAllocator::getPoolUseCount(c10::DeviceIndex, c10::MempoolId_t id) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  auto it = pools_.find(id);
  return it == pools_.end() ? 0 : it->second->use_count;
}

void CumemAllocator::setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool) {
  // A pool's free blocks serve only its own allocations; out of memory
  // elsewhere first releases freeable pools (nothing else to switch).
}

void CumemAllocator::setNoSplit(c10::DeviceIndex, c10::MempoolId_t) {
  // cumem's graph pools split blocks: nothing asks them to keep whole.
}

void CumemAllocator::release_freeable_pools(bool sync) {
  std::vector<CumemGraphPool*> handles;
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    if (!contexts_.empty()) return;
    for (auto it = pools_.begin(); it != pools_.end();) {
      PrivatePool& p = *it->second;
      // A pool goes once it is released and none of its blocks is live
      // (nor waiting for events or a capture's end).
      if (p.use_count > 0 || !p.owned.empty()) {
        ++it;
        continue;
      }
      if (p.handle) handles.push_back(p.handle);
      it = pools_.erase(it);
    }
  }
  if (handles.empty()) return;
  // A graph that used them may still be replaying.
  if (sync) C10_CUDA_CHECK(cudaDeviceSynchronize());
  for (CumemGraphPool* h : handles) {
    int st = cumem_graph_pool_destroy(h);
    if (st != CUMEM_STATUS_OK) TORCH_WARN("cumem: releasing a private pool failed: ", last_error());
  }
}

bool CumemAllocator::checkPoolLiveAllocations(c10::DeviceIndex /*device*/, c10::MempoolId_t id,
                                              const std::unordered_set<void*>& expected) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  auto it = pools_.find(id);
  if (it == pools_.end()) return expected.empty();
  PrivatePool* p = it->second.get();
  size_t n = 0;
  for (auto& [ptr, b] : live_) {
    if (b.pool != p) continue;
    if (!expected.count(ptr)) return false;
    ++n;
  }
  return n == expected.size();
}

// ---- checkpoints (CUDA graph trees) ----

std::shared_ptr<cca::AllocatorState> CumemAllocator::getCheckpointState(c10::DeviceIndex device,
                                                                       c10::MempoolId_t id) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  auto it = pools_.find(id);
  TORCH_CHECK(it != pools_.end(), "getCheckpointState: no private pool ", id.first, ",", id.second);
  auto state = std::make_shared<CheckpointState>();
  state->device = device;
  state->id = id;
  for (auto& [ptr, b] : live_) {
    if (b.pool == it->second.get()) state->live.emplace_back(ptr, b);
  }
  return state;
}

cca::CheckpointDelta CumemAllocator::setCheckpointPoolState(c10::DeviceIndex device,
                                                            std::shared_ptr<cca::AllocatorState> pps) {
  auto state = std::dynamic_pointer_cast<CheckpointState>(pps);
  TORCH_CHECK(state, "setCheckpointPoolState: not a checkpoint of cumem's allocator");
  std::lock_guard<std::recursive_mutex> g(mutex_);
  auto it = pools_.find(state->id);
  TORCH_CHECK(it != pools_.end(), "setCheckpointPoolState: the pool is gone");
  PrivatePool* p = it->second.get();
  cca::CheckpointDelta delta;
  // Free every live block of the pool, then allocate the checkpoint's.
  for (auto lit = live_.begin(); lit != live_.end();) {
    if (lit->second.pool != p) {
      ++lit;
      continue;
    }
    Block& b = lit->second;
    TORCH_CHECK(b.uses.empty(), "setCheckpointPoolState: a live block has record_stream uses");
    count_free(b, true);
    count_free(b, false);
    p->owned.erase(lit->first);
    int st = cumem_graph_pool_free(p->handle, lit->first);
    TORCH_CHECK(st == CUMEM_STATUS_OK, "setCheckpointPoolState: freeing a live block failed: ", last_error());
    delta.ptrs_freed.push_back(lit->first);
    lit = live_.erase(lit);
  }
  for (auto& [ptr, b] : state->live) {
    // Back at its address, out of the memory just freed.
    TORCH_CHECK(p->handle && cumem_graph_pool_allocate_at(p->handle, ptr, b.size) == CUMEM_STATUS_OK,
                "setCheckpointPoolState: a checkpointed block is not free in the pool: ", last_error());
    p->owned.emplace(ptr, b.size);
    Block nb = b;
    nb.pool = p;
    nb.uses.clear();
    count_alloc(nb);
    live_.emplace(ptr, std::move(nb));
    delta.dataptrs_allocd.emplace_back(ptr, ptr, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device));
  }
  return delta;
}

// ---- history and snapshots ----

std::shared_ptr<c10::GatheredContext> CumemAllocator::gather(bool for_free) {
  cca::CreateContextFn r = recorder_;
  if (!r) return nullptr;
  if (for_free && when_ != cca::RecordContext::ALL) return nullptr;
  return r();
}

void CumemAllocator::trace(TraceEntry::Action action, c10::DeviceIndex device, size_t addr, size_t size,
                           cudaStream_t stream, c10::MempoolId_t pool, std::shared_ptr<c10::GatheredContext> ctx) {
  TraceEntry e(action, device, addr, size, stream, pool, c10::getApproximateTime(), std::move(ctx));
  for (auto& t : trackers_) t(e);
  if (!history_.load(std::memory_order_relaxed) || max_entries_ == 0) return;
  dev(device);
  auto& ring = traces_[device];
  if (ring.size() < max_entries_) {
    ring.push_back(std::move(e));
  } else {
    ring[trace_next_[device]] = std::move(e);
    trace_next_[device] = (trace_next_[device] + 1) % max_entries_;
  }
}

bool CumemAllocator::isHistoryEnabled() {
  return history_.load();
}

void CumemAllocator::recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                                   size_t alloc_trace_max_entries, cca::RecordContext when, bool clearHistory,
                                   const std::vector<std::string>&) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  recorder_ = context_recorder;
  when_ = enabled ? when : cca::RecordContext::NEVER;
  max_entries_ = std::max<size_t>(1, alloc_trace_max_entries);
  if (clearHistory) {
    for (auto& t : traces_) t.clear();
    std::fill(trace_next_.begin(), trace_next_.end(), 0);
  }
  history_.store(enabled);
}

void CumemAllocator::attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  oom_observers_.push_back(std::move(observer));
}

void CumemAllocator::attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  trackers_.push_back(std::move(tracker));
  tracing_.store(true);
}

cca::SnapshotInfo CumemAllocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  std::lock_guard<std::recursive_mutex> g(mutex_);
  cca::SnapshotInfo info;
  const bool all = mempool_id == c10::MempoolId_t{0, 0};
  // Each cumem block handed out is shown as a segment of one block (cumem
  // does not tell this layer how its pools group blocks); a private pool's
  // free blocks (cumem_graph_pool_free_blocks) are one-block segments.
  auto add = [&](void* ptr, const Block& b, bool allocated, bool active) {
    c10::MempoolId_t owner = b.pool ? b.pool->id : c10::MempoolId_t{0, 0};
    if (!all && owner != mempool_id) return;
    c10::CachingDeviceAllocator::SegmentInfo s;
    s.device = b.device;
    s.address = reinterpret_cast<size_t>(ptr);
    s.total_size = b.size;
    s.requested_size = allocated ? b.requested : 0;
    s.allocated_size = allocated ? b.size : 0;
    s.active_size = active ? b.size : 0;
    s.stream = b.stream;
    s.is_large = b.size > kSmallSize;
    s.owner_private_pool_id = owner;
    c10::CachingDeviceAllocator::BlockInfo bi;
    bi.size = b.size;
    bi.requested_size = s.requested_size;
    bi.allocated = allocated;
    bi.active = active;
    if (allocated) {
      bi.context_when_allocated = b.context;
      s.context_when_allocated = b.context;
    }
    s.blocks.push_back(std::move(bi));
    info.segments.push_back(std::move(s));
  };
  for (auto& [ptr, b] : live_) add(ptr, b, true, true);
  // Freed, waiting for record_stream's events or the end of a capture.
  for (auto& pf : pending_) add(pf.ptr, pf.block, false, true);
  for (auto& d : deferred_) add(d.first, d.second, false, true);
  for (auto& [id, p] : pools_) {
    if ((!all && id != mempool_id) || !p->handle) continue;
    size_t n = 0;
    if (cumem_graph_pool_free_blocks(p->handle, nullptr, 0, &n) != CUMEM_STATUS_OK) continue;
    std::vector<CumemFreeBlock> free_blocks(n);
    if (n && cumem_graph_pool_free_blocks(p->handle, free_blocks.data(), n, &n) != CUMEM_STATUS_OK) continue;
    free_blocks.resize(std::min(n, free_blocks.size()));
    for (auto& f : free_blocks) {
      Block b;
      b.size = f.size;
      b.device = p->device;
      b.pool = p.get();
      add(reinterpret_cast<void*>(f.addr), b, false, false);
    }
  }
  std::sort(info.segments.begin(), info.segments.end(),
            [](const auto& a, const auto& b) { return a.address < b.address; });
  if (include_traces) {
    for (size_t d = 0; d < traces_.size(); ++d) {
      std::vector<TraceEntry> out;
      auto& ring = traces_[d];
      size_t start = ring.size() < max_entries_ ? 0 : trace_next_[d];
      for (size_t i = 0; i < ring.size(); ++i) out.push_back(ring[(start + i) % ring.size()]);
      info.device_traces.push_back(std::move(out));
    }
  }
  info.config_metadata.expandable_segments = false;
  info.config_metadata.last_allocator_settings = "cumem";
  return info;
}

// ---- base allocations and IPC ----

void* CumemAllocator::getBaseAllocation(void* ptr, size_t* size) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<GetRange>(nullptr);
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  {
    std::lock_guard<std::recursive_mutex> g(mutex_);
    TORCH_CHECK(live_.count(ptr), "getBaseAllocation: ", ptr, " is not a live allocation of cumem's allocator");
  }
  TORCH_CHECK(get_range, "getBaseAllocation: cuMemGetAddressRange is not available");
  CUdeviceptr base = 0;
  size_t len = 0;
  CUresult r = get_range(&base, &len, reinterpret_cast<CUdeviceptr>(ptr));
  TORCH_CHECK(r == CUDA_SUCCESS, "getBaseAllocation: cuMemGetAddressRange failed (", int(r), ")");
  if (size) *size = len;
  return reinterpret_cast<void*>(base);
}

cca::ShareableHandle CumemAllocator::shareIpcHandle(void* ptr) {
  size_t len = 0;
  void* base = getBaseAllocation(ptr, &len);
  cudaIpcMemHandle_t h;
  cudaError_t err = cudaIpcGetMemHandle(&h, base);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "cumem: this memory can't be shared through cudaIpc (", cudaGetErrorString(err),
                "): cumem's expandable pages (the default) are not cudaMalloc memory. Install with "
                "conf='expandable=false' to share CUDA tensors through torch.multiprocessing, or use "
                "cumem_torch.ipc.share_tensor");
  }
  std::string handle;
  handle.push_back(kHandleVersion);
  handle.push_back(kHandleCudaMalloc);
  handle.append(reinterpret_cast<const char*>(&h), sizeof h);
  return {static_cast<ptrdiff_t>(static_cast<char*>(ptr) - static_cast<char*>(base)), handle};
}

std::shared_ptr<void> CumemAllocator::getIpcDevPtr(std::string handle) {
  TORCH_CHECK(handle.size() == 2 + sizeof(cudaIpcMemHandle_t) && handle[1] == kHandleCudaMalloc,
              "cumem: an IPC handle of an unknown kind (only cudaMalloc-style handles open here)");
  std::lock_guard<std::mutex> g(ipc_mutex_);
  auto it = ipc_opened_.find(handle);
  if (it != ipc_opened_.end()) {
    if (auto sp = it->second.lock()) return sp;
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data() + 2, sizeof h);
  void* dev_ptr = nullptr;
  C10_CUDA_CHECK(cudaIpcOpenMemHandle(&dev_ptr, h, cudaIpcMemLazyEnablePeerAccess));
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::shared_ptr<void> sp(dev_ptr, [this, handle, device](void* p) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    std::lock_guard<std::mutex> g2(ipc_mutex_);
    if (cudaIpcCloseMemHandle(p) != cudaSuccess) (void)cudaGetLastError();
    auto f = ipc_opened_.find(handle);
    if (f != ipc_opened_.end() && f->second.expired()) ipc_opened_.erase(f);
  });
  ipc_opened_[handle] = sp;
  return sp;
}

} // namespace cumem_torch
