#!/usr/bin/env python3
"""cumem_torch's ctypes side without PyTorch or a GPU (CI runs it on the
host fallback): statistics, the summary, errors as CumemError, memory
tags with sleep and wake, shutdown.
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

# The native backend's configuration: captures routed by PyTorch's graph
# pools, unless the configuration says otherwise.
nc = cumem_torch.native_conf
assert nc(None) == "promise_registered_captures=true", nc(None)
assert nc("mode=sync_pool") == "mode=sync_pool,promise_registered_captures=true"
assert nc("mode=sync_pool, promise_registered_captures=false") == "mode=sync_pool, promise_registered_captures=false"

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

# Memory tags, sleep and wake (cumem_torch's API; here over the host
# fallback, whose committed pages stand in for the device's memory).
to_dev = lib.cumem_copy_to_device_async
to_dev.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
to_host = lib.cumem_copy_to_host_async
to_host.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
MIB = 1 << 20
assert cumem_torch.current_tag() is None
with cumem_torch.tag("weights") as t:
    assert t == "weights" and cumem_torch.current_tag() == "weights"
    w = alloc(3 * MIB, 0, None)
    with cumem_torch.tag("kv_cache"):
        assert cumem_torch.current_tag() == "kv_cache"
        kv = alloc(MIB, 0, None)
    assert cumem_torch.current_tag() == "weights", "nesting restores the tag before"
    with cumem_torch.tag(None):
        assert cumem_torch.current_tag() is None
        plain = alloc(4096, 0, None)
assert cumem_torch.current_tag() is None
assert w and kv and plain
for bad, err in (("", cumem_torch.CumemError), ("x" * 129, cumem_torch.CumemError), ("a\0b", ValueError),
                 (5, TypeError)):
    try:
        with cumem_torch.tag(bad):
            raise AssertionError(f"tag({bad!r}) was accepted")
    except err as e:
        assert not isinstance(e, cumem_torch.CumemError) or e.status == "CUMEM_STATUS_CONFIG", e
    assert cumem_torch.current_tag() is None
try:
    with cumem_torch.tag("weights"):
        raise KeyError("inside")
except KeyError:
    assert cumem_torch.current_tag() is None, "an exception in the block restores the tag"

data = bytes((i * 31 + 7) & 0xFF for i in range(3 * MIB))
assert lib.cumem_copy_to_device_async(w, data, len(data), None) == 0
usage = {u["name"]: u for u in cumem_torch.tag_usage()}
assert set(usage) == {"weights", "kv_cache"}, usage
u = usage["weights"]
assert u["state"] == "awake" and u["in_use"] == 3 * MIB and u["live_blocks"] == 1 and u["device"] == 0, u
assert u["mapped"] >= 3 * MIB and u["reserved"] >= u["mapped"] and u["offloaded"] == 0, u
s = cumem_torch.stats()
assert s["tagged_in_use"] == 4 * MIB and s["pool"]["live_blocks"] == 1, s  # the plain block only
mapped_before = s["tagged_mapped"]
assert mapped_before == usage["weights"]["mapped"] + usage["kv_cache"]["mapped"]

r = cumem_torch.sleep(offload_tags=("weights",), discard_tags="kv_cache")
assert r["tags"] == ["weights", "kv_cache"], r
assert r["offloaded"] == 3 * MIB and r["discarded"] == MIB and r["released"] == mapped_before, r
assert r["seconds"] >= r["copy_seconds"] >= 0.0
usage = {u["name"]: u for u in cumem_torch.tag_usage()}
assert usage["weights"]["state"] == "asleep" and usage["weights"]["mapped"] == 0, usage
assert usage["weights"]["offloaded"] == 3 * MIB and usage["kv_cache"]["offloaded"] == 0, usage
assert cumem_torch.stats()["tagged_mapped"] == 0
assert cumem_torch.pinned_stats()["in_use"] == 3 * MIB, "the offloaded copy is in pinned memory"
for call, status in ((lambda: cumem_torch.sleep("weights"), "CUMEM_STATUS_TAG"),
                     (lambda: cumem_torch.sleep(("never_used",)), "CUMEM_STATUS_TAG"),
                     (lambda: cumem_torch.sleep(("weights",), ("weights",)), "CUMEM_STATUS_CONFIG"),
                     (lambda: cumem_torch.wake_up(["kv_cache", "kv_cache"]), "CUMEM_STATUS_CONFIG")):
    try:
        call()
        raise AssertionError("a bad sleep or wake was accepted")
    except cumem_torch.CumemError as e:
        assert e.status == status, e
failures = cumem_torch.torch_counters()["alloc_failures"]
with cumem_torch.tag("weights"):
    assert not alloc(4096, 0, None), "allocating in a sleeping tag fails"
assert cumem_torch.torch_counters()["alloc_failures"] == failures + 1
assert "weights" in _lib.lib().cumem_last_error().decode()

r = cumem_torch.wake_up(["weights"])
assert r["tags"] == ["weights"] and r["restored"] == 3 * MIB and r["mapped"] >= 3 * MIB, r
back = ctypes.create_string_buffer(3 * MIB)
assert lib.cumem_copy_to_host_async(back, w, 3 * MIB, None) == 0
assert back.raw == data, "the weights came back whole"
assert cumem_torch.tag_usage()[0]["state"] == "awake"
r = cumem_torch.wake_up()
assert r["tags"] == ["kv_cache"] and r["restored"] == 0, r
r = cumem_torch.wake_up()
assert (r["tags"], r["restored"], r["mapped"]) == ([], 0, 0), "nothing asleep: nothing to do"
try:
    cumem_torch.wake_up("weights")
    raise AssertionError("waking an awake tag was accepted")
except cumem_torch.CumemError as e:
    assert e.status == "CUMEM_STATUS_TAG", e
assert cumem_torch.pinned_stats()["in_use"] == 0
for p in (w, kv, plain):
    free(p, 0, 0, None)
assert cumem_torch.torch_counters()["free_failures"] == 1  # the double free above
assert cumem_torch.stats()["tagged_in_use"] == 0
print("tags, sleep and wake: ok")

# The event log (`log=FILE`) is whole when the process exits: install()
# registers flush_log at exit, as this child does (install needs PyTorch).
# Without the flush the buffered end of the log was lost.
LOGS = r"""
import atexit, ctypes, sys
import cumem_torch
from cumem_torch import _lib
atexit.register(cumem_torch.flush_log)
lib = _lib.lib()
alloc, free = lib.cumem_torch_alloc, lib.cumem_torch_free
alloc.argtypes, alloc.restype = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
free.argtypes, free.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p], None
ps = [alloc(4096 + 256 * i, 0, None) for i in range(2000)]
for i, p in enumerate(ps):
    free(p, 4096 + 256 * i, 0, None)
"""
log = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"cumem-torch-log-{os.getpid()}.csv")
subprocess.run([sys.executable, "-c", LOGS], env=dict(os.environ, CUMEM_CONF=f"backend=host,log={log}"), check=True)
with open(log) as f:
    rows = f.read().splitlines()[1:]
os.remove(log)
actions = [r.split(",")[2] for r in rows if len(r.split(",")) == 6]
assert len(actions) == len(rows) == 4000, (len(rows), len(actions))
assert actions.count("allocate") == actions.count("free") == 2000
print("the event log is whole at exit: ok")

cumem_torch.empty_cache()
r = cumem_torch.shutdown()
assert r["live_count"] == 0, r
print("host ctypes test: ok")
