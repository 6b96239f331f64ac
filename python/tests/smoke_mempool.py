#!/usr/bin/env python3
"""cumem_torch.MemPool with PyTorch's own allocator as the current one (a
MemPool needs it: PyTorch's pluggable allocator can't hold pools): a region
of the program takes its memory from cumem. Needs PyTorch and a GPU."""

import os
import sys

import cumem_torch
import torch

if not torch.cuda.is_available():
    print("skipped: no CUDA device")
    sys.exit(1 if os.environ.get("CUMEM_REQUIRE_GPU") == "1" else 0)

before = cumem_torch.stats()["pool"]["reserved"]
pool = cumem_torch.MemPool()
with torch.cuda.use_mem_pool(pool):
    z = torch.ones(1 << 22, device="cuda")
outside = torch.ones(1 << 22, device="cuda")
assert (z + outside).sum().item() == 2.0 * (1 << 22)
inside = cumem_torch.stats()["pool"]
assert inside["in_use"] >= 4 << 22 and inside["reserved"] > before, inside
del z
print("MemPool region served by cumem:", inside["in_use"], "B in use")
print("smoke MemPool: ok")
