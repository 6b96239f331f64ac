// Replays RMM-format allocation traces through RMM's pool_memory_resource.
//
// The RMM baseline of `cumem-replay`'s cumem targets, measured the way
// `torch_replay.py` measures PyTorch's caching allocator: per trace a
// fresh pool (over cuda_memory_resource, no initial size, no maximum: it
// grows by what the request needs or by doubling), each of the trace's
// streams on a CUDA stream of its own; a cold pass, everything freed, then
// a warm pass on the same pool. Only the allocate and deallocate calls are
// timed. Prints one JSON object per trace: cold and warm ns per operation,
// and the memory the pool took from CUDA (its peak, after each pass)
// against the trace's peak live bytes.
//
// Built by `rmm_replay.sh` against RMM's headers (see there).
//
//     rmm_replay TRACE.csv[.gz] ...

#include <rmm/cuda_stream_view.hpp>
#include <rmm/mr/device/cuda_memory_resource.hpp>
#include <rmm/mr/device/pool_memory_resource.hpp>
#include <rmm/mr/device/statistics_resource_adaptor.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Op {
  bool free;
  uint32_t slot;
  uint32_t stream;
  uint64_t size;  // allocations only
};

struct Trace {
  std::vector<Op> ops;
  uint32_t slots{0};
  uint32_t streams{0};
  uint64_t peak_live{0};
};

// Splits a CSV line into at most `n` fields.
std::vector<std::string> fields(std::string const& line, std::size_t n)
{
  std::vector<std::string> out;
  std::size_t at = 0;
  while (out.size() < n) {
    auto comma = line.find(',', at);
    if (comma == std::string::npos) {
      out.push_back(line.substr(at));
      break;
    }
    out.push_back(line.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

// Reads the trace as ops; frees of pointers never seen allocated, and
// allocations of pointers already live, are skipped (as cumem-replay and
// torch_replay.py do). Slots are reused as they free.
bool read(char const* path, Trace& t)
{
  std::string cmd = std::string("zcat -f '") + path + "'";
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) { return false; }
  std::unordered_map<std::string, std::pair<uint32_t, uint64_t>> live;
  std::unordered_map<std::string, uint32_t> stream_ids;
  std::vector<uint32_t> free_slots;
  uint64_t cur = 0;
  char* buf    = nullptr;
  size_t cap   = 0;
  bool header  = true;
  int col_action = 2, col_ptr = 3, col_size = 4, col_stream = 5;
  while (getline(&buf, &cap, f) > 0) {
    std::string line(buf);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) { line.pop_back(); }
    auto v = fields(line, 16);
    if (header) {
      header = false;
      for (int i = 0; i < static_cast<int>(v.size()); ++i) {
        if (v[i] == "Action") { col_action = i; }
        if (v[i] == "Pointer") { col_ptr = i; }
        if (v[i] == "Size") { col_size = i; }
        if (v[i] == "Stream") { col_stream = i; }
      }
      continue;
    }
    if (static_cast<int>(v.size()) <= std::max({col_action, col_ptr, col_size})) { continue; }
    std::string const stream_name = col_stream < static_cast<int>(v.size()) ? v[col_stream] : "0";
    auto [it, added] = stream_ids.emplace(stream_name, static_cast<uint32_t>(stream_ids.size()));
    uint32_t const stream = it->second;
    std::string const& ptr = v[col_ptr];
    if (v[col_action] == "allocate") {
      if (live.count(ptr) != 0) { continue; }
      uint32_t slot;
      if (!free_slots.empty()) {
        slot = free_slots.back();
        free_slots.pop_back();
      } else {
        slot = t.slots++;
      }
      uint64_t const size = std::strtoull(v[col_size].c_str(), nullptr, 10);
      live[ptr]           = {slot, size};
      cur += size;
      t.peak_live = std::max(t.peak_live, cur);
      t.ops.push_back(Op{false, slot, stream, size});
    } else if (v[col_action] == "free") {
      auto found = live.find(ptr);
      if (found == live.end()) { continue; }
      auto [slot, size] = found->second;
      live.erase(found);
      cur -= size;
      free_slots.push_back(slot);
      t.ops.push_back(Op{true, slot, stream, 0});
    }
  }
  free(buf);
  int const rc = pclose(f);
  t.streams    = static_cast<uint32_t>(std::max<std::size_t>(stream_ids.size(), 1));
  return rc == 0 && !t.ops.empty();
}

using upstream_t = rmm::mr::statistics_resource_adaptor<rmm::mr::cuda_memory_resource>;
using pool_t     = rmm::mr::pool_memory_resource<upstream_t>;

struct Slot {
  void* ptr{nullptr};
  uint64_t size{0};
  uint32_t stream{0};
};

// One pass over the ops; returns the nanoseconds the calls took.
int64_t pass(pool_t& pool, Trace const& t, std::vector<cudaStream_t> const& streams, std::vector<Slot>& slots)
{
  auto const start = std::chrono::steady_clock::now();
  for (auto const& op : t.ops) {
    Slot& s = slots[op.slot];
    if (!op.free) {
      s.ptr    = pool.allocate(op.size, rmm::cuda_stream_view{streams[op.stream]});
      s.size   = op.size;
      s.stream = op.stream;
    } else if (s.ptr != nullptr) {
      // Freed on the stream of the free, as the program freed it.
      pool.deallocate(s.ptr, s.size, rmm::cuda_stream_view{streams[op.stream]});
      s.ptr = nullptr;
    }
  }
  auto const end = std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
}

void free_all(pool_t& pool, std::vector<cudaStream_t> const& streams, std::vector<Slot>& slots)
{
  for (auto& s : slots) {
    if (s.ptr != nullptr) {
      pool.deallocate(s.ptr, s.size, rmm::cuda_stream_view{streams[s.stream]});
      s.ptr = nullptr;
    }
  }
}

std::string name_of(char const* path)
{
  std::string p(path);
  auto slash = p.rfind('/');
  if (slash != std::string::npos) { p = p.substr(slash + 1); }
  auto dot = p.find('.');
  return dot == std::string::npos ? p : p.substr(0, dot);
}

}  // namespace

int main(int argc, char** argv)
{
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TRACE.csv[.gz] ...\n", argv[0]);
    return 2;
  }
  if (cudaFree(nullptr) != cudaSuccess) {
    std::fprintf(stderr, "rmm_replay: no CUDA device\n");
    return 1;
  }
  int failed = 0;
  for (int i = 1; i < argc; ++i) {
    Trace t;
    if (!read(argv[i], t)) {
      std::fprintf(stderr, "rmm_replay: can't read %s\n", argv[i]);
      failed = 1;
      continue;
    }
    std::vector<cudaStream_t> streams(t.streams, nullptr);
    bool made = true;
    for (auto& s : streams) { made = made && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess; }
    if (!made) {
      std::fprintf(stderr, "rmm_replay: %s: can't create %u streams\n", argv[i], t.streams);
      for (auto& s : streams) { if (s != nullptr) { cudaStreamDestroy(s); } }
      failed = 1;
      continue;
    }
    std::vector<Slot> slots(std::max<uint32_t>(t.slots, 1));
    int64_t cold = 0, warm = 0;
    int64_t cold_peak = 0, warm_peak = 0;
    bool ok = true;
    try {
      rmm::mr::cuda_memory_resource cuda;
      upstream_t upstream{&cuda};
      {
        pool_t pool{&upstream, 0};
        cold      = pass(pool, t, streams, slots);
        cold_peak = upstream.get_bytes_counter().peak;
        free_all(pool, streams, slots);
        cudaDeviceSynchronize();
        warm      = pass(pool, t, streams, slots);
        warm_peak = upstream.get_bytes_counter().peak;
        free_all(pool, streams, slots);
        cudaDeviceSynchronize();
      }
    } catch (std::exception const& e) {
      std::fprintf(stderr, "rmm_replay: %s: %s\n", argv[i], e.what());
      ok     = false;
      failed = 1;
    }
    for (auto& s : streams) { cudaStreamDestroy(s); }
    if (!ok) { continue; }
    double const ops  = static_cast<double>(t.ops.size());
    double const live = static_cast<double>(std::max<uint64_t>(t.peak_live, 1));
    std::printf(
      "{\"trace\": \"%s\", \"target\": \"rmm_pool\", \"operations\": %zu, \"streams\": %u, "
      "\"cold_ns_per_op\": %.1f, \"warm_ns_per_op\": %.1f, \"cold_peak_reserved\": %lld, "
      "\"warm_peak_reserved\": %lld, \"trace_peak_live\": %llu, \"cold_ratio\": %.4f, "
      "\"warm_ratio\": %.4f}\n",
      name_of(argv[i]).c_str(), t.ops.size(), t.streams, cold / ops, warm / ops,
      static_cast<long long>(cold_peak), static_cast<long long>(warm_peak),
      static_cast<unsigned long long>(t.peak_live), cold_peak / live, warm_peak / live);
    std::fflush(stdout);
  }
  return failed;
}
