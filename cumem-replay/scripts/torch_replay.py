"""Replays RMM-format allocation traces through PyTorch's caching allocator.

The baseline of `cumem-replay`'s cumem targets on a machine with PyTorch:
the same traces, the same warm protocol (one untimed pass, everything
freed, then a timed pass on the same allocator), each of the trace's
streams on a CUDA stream of its own. The allocation and free calls run in
C++ (torch.utils.cpp_extension, compiled on first use), so the time is the
allocator's, not Python's. Prints one JSON object per trace:
cold and warm ns per operation and the peak reserved bytes of each pass
(torch.cuda.max_memory_reserved), against the trace's peak live bytes.

    python3 torch_replay.py TRACE.csv.gz ...
"""

import csv
import gzip
import json
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <chrono>
#include <vector>

namespace alloc = c10::cuda::CUDACachingAllocator;

// Replays the ops once; returns the nanoseconds the calls took. `ptrs`
// holds each slot's pointer between passes.
int64_t pass(torch::Tensor kind, torch::Tensor slot, torch::Tensor size, torch::Tensor stream,
             int64_t nstreams, torch::Tensor ptrs) {
  static std::vector<c10::cuda::CUDAStream> streams;
  while ((int64_t)streams.size() < nstreams) streams.push_back(c10::cuda::getStreamFromPool());
  auto k = kind.data_ptr<int8_t>();
  auto s = slot.data_ptr<int64_t>();
  auto z = size.data_ptr<int64_t>();
  auto t = stream.data_ptr<int32_t>();
  auto p = reinterpret_cast<void**>(ptrs.data_ptr<int64_t>());
  int64_t n = kind.numel();
  auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    if (k[i] == 0) {
      p[s[i]] = alloc::raw_alloc_with_stream((size_t)z[i], streams[t[i]].stream());
    } else if (p[s[i]] != nullptr) {
      alloc::raw_delete(p[s[i]]);
      p[s[i]] = nullptr;
    }
  }
  auto end = std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
}

void free_all(torch::Tensor ptrs) {
  auto p = reinterpret_cast<void**>(ptrs.data_ptr<int64_t>());
  for (int64_t i = 0; i < ptrs.numel(); ++i) {
    if (p[i] != nullptr) {
      alloc::raw_delete(p[i]);
      p[i] = nullptr;
    }
  }
}
"""


def read(path):
    """The trace as op arrays: kind (0 allocate, 1 free), slot, size, stream
    index; frees of pointers never allocated are skipped (as cumem-replay)."""
    opener = gzip.open if path.endswith(".gz") else open
    kinds, slots, sizes, streams = [], [], [], []
    live, free_slots, nslots = {}, [], 0
    stream_ids = {}
    cur = peak = 0
    with opener(path, "rt") as f:
        for row in csv.DictReader(f):
            action = row["Action"]
            ptr = row["Pointer"]
            st = stream_ids.setdefault(row.get("Stream", "0"), len(stream_ids))
            if action == "allocate":
                if ptr in live:
                    continue
                if free_slots:
                    slot = free_slots.pop()
                else:
                    slot = nslots
                    nslots += 1
                size = int(row["Size"])
                live[ptr] = (slot, size)
                cur += size
                peak = max(peak, cur)
                kinds.append(0)
                slots.append(slot)
                sizes.append(size)
                streams.append(st)
            elif action == "free":
                if ptr not in live:
                    continue
                slot, size = live.pop(ptr)
                cur -= size
                free_slots.append(slot)
                kinds.append(1)
                slots.append(slot)
                sizes.append(0)
                streams.append(st)
    t = lambda xs, dt: torch.tensor(xs, dtype=dt)
    return (t(kinds, torch.int8), t(slots, torch.int64), t(sizes, torch.int64), t(streams, torch.int32),
            nslots, len(stream_ids), peak)


def main():
    ext = load_inline("torch_replay_ext", cpp_sources=CPP, functions=["pass", "free_all"], with_cuda=True,
                      extra_cflags=["-O2"], verbose=False)
    torch.cuda.init()
    for path in sys.argv[1:]:
        kind, slot, size, stream, nslots, nstreams, peak_live = read(path)
        ops = kind.numel()
        ptrs = torch.zeros(max(nslots, 1), dtype=torch.int64)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cold = getattr(ext, "pass")(kind, slot, size, stream, nstreams, ptrs)
        cold_peak = torch.cuda.max_memory_reserved()
        ext.free_all(ptrs)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        warm = getattr(ext, "pass")(kind, slot, size, stream, nstreams, ptrs)
        warm_peak = torch.cuda.max_memory_reserved()
        ext.free_all(ptrs)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        name = path.rsplit("/", 1)[-1].split(".")[0]
        print(json.dumps({
            "trace": name, "target": "torch_caching", "operations": ops, "streams": nstreams,
            "cold_ns_per_op": cold / ops, "warm_ns_per_op": warm / ops,
            "cold_peak_reserved": cold_peak, "warm_peak_reserved": warm_peak, "trace_peak_live": peak_live,
            "cold_ratio": cold_peak / peak_live, "warm_ratio": warm_peak / peak_live,
        }), flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"# torch_replay: {time.time() - t0:.1f} s", file=sys.stderr)
