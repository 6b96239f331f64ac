// cumem_torch's native backend: PyTorch's CUDAAllocator interface over
// cumem's C ABI (libcumem_c.so). cumem serves and frees the memory
// (stream-ordered); this layer keeps what PyTorch's interface needs on top:
// per-allocation records (statistics, snapshots, record_stream), PyTorch's
// private pools (CUDA graphs, MemPool) and their checkpoints, history.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cumem.h"

namespace cumem_torch {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::TraceEntry;

// PyTorch rounds requests to 512 bytes; the statistics count the same.
constexpr size_t kRound = 512;
// PyTorch's small/large pool boundary (its statistics' two pool kinds).
constexpr size_t kSmallSize = 1 << 20;

struct PrivatePool;

// One live allocation handed to PyTorch.
struct Block {
  size_t size = 0; // rounded
  size_t requested = 0;
  c10::DeviceIndex device = 0;
  cudaStream_t stream = nullptr; // the allocation's stream
  PrivatePool* pool = nullptr; // nullptr: cumem's own pools
  // Allocated while the thread had a memory tag set (cumem_tag_set): the
  // block lives in the tag's arena and is never kept for another
  // allocation (stream_cache.cpp), which could be under another tag.
  bool tagged = false;
  std::vector<cudaStream_t> uses; // record_stream's other streams
  std::shared_ptr<c10::GatheredContext> context;
};

// A free of a block used on other streams, waiting for their events.
struct PendingFree {
  void* ptr;
  Block block;
  std::vector<cudaEvent_t> events;
};

// PyTorch's private pool (CUDA graphs, MemPool): a cumem graph pool of its
// own (address space that grows at its end, blocks split and coalesced),
// whose memory only allocations routed to this pool reuse, kept until
// the pool is released and emptied. A checkpoint puts blocks back at
// their addresses (cumem_graph_pool_allocate_at).
struct PrivatePool {
  c10::MempoolId_t id;
  c10::DeviceIndex device = 0;
  int use_count = 0;
  CumemGraphPool* handle = nullptr; // made at the pool's first allocation
  // The blocks handed out and not yet freed into the pool, with their sizes.
  std::unordered_map<void*, size_t> owned;
};

// A block a side stream allocated and other streams used through
// record_stream, kept for that stream's next allocation of the same size
// once the other streams' work is done (stream_cache.cpp). Never a tagged
// block, and never handed to an allocation made under a memory tag.
struct KeptBlock {
  void* ptr = nullptr;
  size_t size = 0; // rounded
  size_t requested = 0; // what cumem was asked for (the block holds at least this)
  c10::DeviceIndex device = 0;
  cudaStream_t stream = nullptr;
};

// At most this many kept blocks per stream (the oldest goes back to cumem).
constexpr size_t kKeptPerStream = 8;

struct PoolContext {
  c10::DeviceIndex device;
  c10::MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
};

struct CheckpointState : cca::AllocatorState {
  c10::DeviceIndex device = 0;
  c10::MempoolId_t id;
  std::vector<std::pair<void*, Block>> live;
};

struct DeviceRecord {
  DeviceStats stats;
  size_t limit = 0; // set_per_process_memory_fraction (0: none)
  double fraction = 1.0;
  int64_t retries = 0; // this layer's retries (cumem counts its own)
};

class CumemAllocator final : public cca::CUDAAllocator {
 public:
  CumemAllocator();

  // c10::Allocator
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // DeviceAllocator
  bool initialized() override;
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;

  // CUDAAllocator
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void init(int device_count) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override;
  void enable(bool value) override;
  bool isEnabled() const override;
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  cca::SnapshotInfo snapshot(c10::MempoolId_t mempool_id = {0, 0}, bool include_traces = true) override;
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator = nullptr) override;
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override;
  cca::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  bool isHistoryEnabled() override;
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override;
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override;
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override;
  std::string name() override;

  // The deleter of every DataPtr this allocator makes.
  void free_from_deleter(void* ptr) noexcept;

  // Completes every free waiting for record_stream's events, waiting for
  // those events (before a memory tag sleeps: its blocks freed by the
  // program then go back to cumem instead of being offloaded as live).
  void drain_pending_frees();

 private:
  void* malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream);
  // Frees a live pointer; false if it is not one (nothing changed).
  bool free(void* ptr);
  void release_block(void* ptr, Block& b); // to its pool or to cumem
  void finish_free(void* ptr, Block& b); // after record_stream's events
  void process_pending();
  // stream_cache.cpp: whether a freed block is kept for its stream; the
  // kept block for an allocation (nullptr: none); the kept blocks back to
  // cumem (all, or those of `device`).
  bool keep_for_stream(void* ptr, const Block& b);
  void* take_kept(size_t size, size_t rounded, c10::DeviceIndex device, cudaStream_t stream);
  void release_kept(c10::DeviceIndex device, bool all_devices);
  void flush_deferred(bool all_captures_over);
  PrivatePool* routed_pool(c10::DeviceIndex device, cudaStream_t stream); // under mutex_
  void* pool_alloc(PrivatePool& p, size_t rounded, c10::DeviceIndex device); // under mutex_
  void release_freeable_pools(bool sync);
  [[noreturn]] void raise_oom(size_t size, c10::DeviceIndex device, const char* why);
  void count_alloc(const Block& b);
  void count_free(const Block& b, bool still_active);
  void trace(TraceEntry::Action action, c10::DeviceIndex device, size_t addr, size_t size, cudaStream_t stream,
             c10::MempoolId_t pool, std::shared_ptr<c10::GatheredContext> ctx);
  std::shared_ptr<c10::GatheredContext> gather(bool for_free);
  DeviceRecord& dev(c10::DeviceIndex device); // under mutex_
  cudaEvent_t take_event(); // under mutex_
  c10::DeviceIndex device_of_current();

  std::recursive_mutex mutex_;
  std::unordered_map<void*, Block> live_;
  std::vector<DeviceRecord> devices_;
  std::vector<PendingFree> pending_;
  // Side streams' kept blocks, oldest first (stream_cache.cpp).
  std::vector<KeptBlock> kept_;
  std::atomic<size_t> kept_count_{0};
  // Whether any device has a memory fraction set (malloc's first lock is
  // skipped while none has and no capture routes allocations).
  std::atomic<bool> any_limit_{false};
  std::atomic<size_t> pending_count_{0};
  // Frees of blocks whose stream was capturing: done when it stops.
  std::vector<std::pair<void*, Block>> deferred_;
  std::map<c10::MempoolId_t, std::unique_ptr<PrivatePool>> pools_;
  std::vector<PoolContext> contexts_;
  std::atomic<size_t> context_count_{0};
  std::vector<std::vector<cudaEvent_t>> events_; // per device, free
  bool enabled_ = true;
  // History.
  std::atomic<bool> history_{false};
  // Read without the lock on every allocation and free (atomics: set by
  // recordHistory on another thread).
  std::atomic<cca::CreateContextFn> recorder_{nullptr};
  std::atomic<cca::RecordContext> when_{cca::RecordContext::NEVER};
  size_t max_entries_ = 0;
  std::vector<std::vector<TraceEntry>> traces_; // per device, ring
  std::vector<size_t> trace_next_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::atomic<bool> tracing_{false};
  // IPC: handles opened here, shared while a tensor uses them.
  std::mutex ipc_mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_opened_;
};

// The allocator install() made (nullptr before).
CumemAllocator* instance();

// cumem's last error message ("" when it has none).
std::string last_error();

} // namespace cumem_torch
