#!/usr/bin/env python3
"""cumem_torch's ctypes side without PyTorch or a GPU (CI runs it on the
host fallback): statistics, the summary, errors as CumemError, shutdown.
The library is CUMEM_TORCH_LIB's, else the installed package's."""

import ctypes
import os
import subprocess
import sys

import cumem_torch
from cumem_torch import _lib

# stats() without a device asks about the current device and creates
# nothing on another: cumem's default device (here 1 of two host devices),
# or PyTorch's current device once PyTorch has initialised CUDA (a stand-in
# module here). Before, it asked about device 0 in every process (every
# torchrun rank opened a context on GPU 0). In a process of its own: the
# configuration is read once.
ONE_OF_TWO = r"""
import sys, types
import cumem_torch
s = cumem_torch.stats()
assert s["pool"]["in_use"] == 0, s
summary = cumem_torch.memory_summary()
assert "device 1 pool" in summary and "device 0" not in summary, summary
assert cumem_torch.current_device() == 1, cumem_torch.current_device()
fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True, current_device=lambda: 0))
sys.modules["torch"] = fake
assert cumem_torch.current_device() == 0
cumem_torch.stats()
assert "device 0 pool" in cumem_torch.memory_summary()
print("stats() follows the current device: ok")
"""
env = dict(os.environ, CUMEM_CONF="host_devices=2,device=1")
subprocess.run([sys.executable, "-c", ONE_OF_TWO], env=env, check=True)

# torchrun's rank picks cumem's default device, unless CUMEM_CONF names one.
rc = cumem_torch.rank_conf
assert rc("", "1", 2) == "device=1", rc("", "1", 2)
assert rc("mode=sync_pool", "3", 8) == "mode=sync_pool,device=3"
assert rc("device=0,mode=sync_pool", "1", 2) is None
assert rc(" device = 1 ", "0", 2) is None
assert rc("", "1", 1) is None  # one visible GPU per rank: it is device 0
assert rc("", "2", 2) is None and rc("", "x", 2) is None and rc(None, None, 4) is None

# The native backend's configuration: one pool for all threads, captures
# routed by PyTorch's graph pools, unless the configuration says otherwise.
nc = cumem_torch.native_conf
assert nc(None) == "arenas=1,promise_registered_captures=true", nc(None)
assert nc("mode=sync_pool") == "mode=sync_pool,arenas=1,promise_registered_captures=true"
assert nc("arenas=4, promise_registered_captures=false") == "arenas=4, promise_registered_captures=false"

lib = _lib.lib()
print("cumem backend:", cumem_torch.backend())
try:
    cumem_torch.init("no_such_key=1")
    raise AssertionError("a bad configuration was accepted")
except cumem_torch.CumemError as e:
    assert e.status == "CUMEM_STATUS_CONFIG" and "no_such_key" in str(e), e

# Allocate through PyTorch's entry points, as PyTorch would.
alloc = lib.cumem_torch_alloc
alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
alloc.restype = ctypes.c_void_p
free = lib.cumem_torch_free
free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
free.restype = None
p = alloc(1 << 20, 0, None)
assert p and p % 256 == 0, p
s = cumem_torch.stats()
assert s["pool"]["in_use"] >= 1 << 20 and s["pool"]["live_blocks"] == 1, s
free(p, 1 << 20, 0, None)
free(p, 1 << 20, 0, None)  # a double free: counted, nothing else
c = cumem_torch.torch_counters()
assert c["free_failures"] == 1 and c["alloc_failures"] == 0, c
assert cumem_torch.stats()["pool"]["in_use"] == 0
assert cumem_torch.peak_reserved() >= 1 << 20
cumem_torch.reset_peak_stats()
assert "device 0" in cumem_torch.memory_summary()
assert cumem_torch.pinned_stats()["in_use"] == 0
cumem_torch.empty_cache()
r = cumem_torch.shutdown()
assert r["live_count"] == 0, r
print("host ctypes test: ok")
