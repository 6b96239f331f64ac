#!/usr/bin/env python3
"""cumem as PyTorch's allocator on a GPU through the pluggable fallback
(`install(native=False)`; the native backend has probe_torch_api.py):
tensors, a side stream with
cumem_torch.record_stream, a CUDA graph captured and replayed (cumem gives
the capture a private pool by itself), a MemPool refused while installed, statistics.
Exits non-zero on the first wrong result. Needs PyTorch and a GPU (it
says so and exits 0 where there is none, unless CUMEM_REQUIRE_GPU=1)."""

import os
import sys

import cumem_torch

try:
    import torch
except ImportError:
    torch = None
if torch is None or not torch.cuda.is_available():
    print("skipped: PyTorch with a CUDA device is needed")
    sys.exit(1 if os.environ.get("CUMEM_REQUIRE_GPU") == "1" else 0)

assert cumem_torch.install(native=False) == "pluggable"
assert cumem_torch.is_installed()
print("cumem backend:", cumem_torch.backend())

# Plain tensors, checked against the CPU.
a = torch.randn(512, 512, device="cuda")
b = torch.randn(512, 512, device="cuda")
c = a @ b
assert torch.allclose(c.cpu(), a.cpu() @ b.cpu(), atol=1e-3, rtol=1e-3)
s = cumem_torch.stats()
assert s["pool"]["in_use"] >= 3 * 512 * 512 * 4, s
print("in use after three tensors:", s["pool"]["in_use"])

# A tensor made on the main stream, read on a side stream, then dropped:
# record_stream makes its free wait for the side stream.
side = torch.cuda.Stream()
x = torch.full((1 << 22,), 3.0, device="cuda")
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    total = (x * 2).sum()
cumem_torch.record_stream(x, side)
del x
y = torch.zeros(1 << 22, device="cuda")  # may reuse x's block: only after `side`
torch.cuda.synchronize()
assert total.item() == 6.0 * (1 << 22), total.item()
assert cumem_torch.torch_counters()["recorded_stream_waits"] >= 1

# A CUDA graph: allocations during capture come from a private pool.
static_in = torch.randn(256, 256, device="cuda")
w = torch.randn(256, 256, device="cuda")
g = torch.cuda.CUDAGraph()
cap = torch.cuda.Stream()
cap.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(cap):
    for _ in range(2):  # warm up outside the capture
        static_out = torch.relu(static_in @ w) + 1
torch.cuda.current_stream().wait_stream(cap)
with torch.cuda.graph(g):
    static_out = torch.relu(static_in @ w) + 1
graph_stats = cumem_torch.stats()
assert graph_stats["graph_reserved"] > 0, graph_stats
for i in range(3):
    static_in.copy_(torch.randn(256, 256, device="cuda"))
    eager = torch.relu(static_in @ w) + 1  # eager work must not disturb the graph's memory
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(static_out, eager, rtol=1e-4, atol=1e-4), f"replay {i} differs"
del g, static_out
print("graph: ok, private pool", graph_stats["graph_reserved"], "B")

# cumem_torch.MemPool() needs PyTorch's own allocator as the current one:
# with cumem installed it refuses with a clear error.
try:
    cumem_torch.MemPool()
    raise AssertionError("MemPool with cumem installed should be refused")
except RuntimeError as e:
    print("MemPool refused as expected:", str(e)[:80])

counters = cumem_torch.torch_counters()
assert counters["alloc_failures"] == 0 and counters["free_failures"] == 0, counters
print(cumem_torch.memory_summary())
print("smoke test: ok")
