"""cumem for PyTorch: CUDA memory from cumem's pools instead of PyTorch's
caching allocator.

    import cumem_torch
    cumem_torch.install()          # before the first CUDA allocation
    x = torch.randn(1024, device="cuda")
    print(cumem_torch.stats())     # cumem's own figures

Configuration is `CUMEM_CONF` (as for Rust programs), or `install(conf=...)`
with the same syntax. Under torchrun (`LOCAL_RANK` set) with several GPUs
and no `device=` in `CUMEM_CONF`, cumem's default device is the rank's GPU,
so no rank opens a context on GPU 0 that it does not use. `MemPool()` gives a `torch.cuda.MemPool` whose
segments come from cumem, for one region of a program
(`with torch.cuda.use_mem_pool(pool): ...`) while PyTorch's allocator
serves the rest.

What PyTorch does not tell a pluggable allocator, and what cumem does:
- `Tensor.record_stream(s)` never reaches it: call
  `cumem_torch.record_stream(tensor, s)` instead (the free then waits for
  the work queued on `s`), or order the streams yourself
  (`torch.cuda.current_stream().wait_stream(s)` before the tensor dies).
- CUDA graphs: PyTorch's graph pools (`torch.cuda.graph(pool=...)`) are not
  passed on; cumem notices a capture by itself (it asks the driver whether
  the stream captures) and gives the capture a private pool that lives as
  long as the graph. See docs/python.md.
"""

import ctypes
import os

from . import _lib
from ._lib import CumemError, library_path

__all__ = [
    "install", "is_installed", "init", "MemPool", "record_stream", "stats", "pinned_stats",
    "torch_counters", "memory_summary", "backend", "empty_cache", "reset_peak_stats",
    "shutdown", "library_path", "CumemError",
]

ALLOC_FN = "cumem_torch_alloc"
FREE_FN = "cumem_torch_free"

_pluggable = None
_installed = False


def init(conf=None):
    """Creates cumem's manager from `conf` (CUMEM_CONF's syntax, e.g.
    "mode=sync_pool,device_pool_size=1GiB"); None reads CUMEM_CONF. Only
    before any other cumem call; later calls raise CumemError
    (CUMEM_STATUS_ALREADY_INITIALIZED)."""
    _lib.check(_lib.lib().cumem_init(None if conf is None else conf.encode()))


def _allocator():
    """The CUDAPluggableAllocator over cumem (made once)."""
    global _pluggable
    if _pluggable is None:
        import torch
        _lib.lib()  # the same file PyTorch loads: one manager for both
        _pluggable = torch.cuda.memory.CUDAPluggableAllocator(library_path(), ALLOC_FN, FREE_FN)
    return _pluggable


def rank_conf(env_conf, local_rank, device_count):
    """The configuration `install()` uses under torchrun: `env_conf` (as
    CUMEM_CONF) with `device=<local_rank>` added when it names no device,
    `local_rank` is a number below `device_count`, and there are several
    devices; else None (CUMEM_CONF as it is)."""
    keys = [kv.split("=", 1)[0].strip() for kv in (env_conf or "").split(",") if kv.strip()]
    if "device" in keys or local_rank is None or not str(local_rank).isdigit():
        return None
    rank = int(local_rank)
    if device_count <= 1 or rank >= device_count:
        return None
    return ",".join(x for x in ((env_conf or "").strip(), f"device={rank}") if x)


def install(conf=None):
    """Makes cumem PyTorch's CUDA allocator. Must run before the first CUDA
    allocation (PyTorch refuses to swap an allocator it has used). `conf`
    configures cumem (else CUMEM_CONF). Returns the pluggable allocator."""
    global _installed
    import torch
    if _installed:
        return _allocator()
    if conf is not None:
        init(conf)
    elif os.environ.get("LOCAL_RANK") is not None:
        auto = rank_conf(os.environ.get("CUMEM_CONF"), os.environ.get("LOCAL_RANK"), torch.cuda.device_count())
        if auto is not None:
            try:
                init(auto)
            except CumemError as e:
                # cumem was already in use: its configuration stands.
                if e.status != "CUMEM_STATUS_ALREADY_INITIALIZED":
                    raise
    alloc = _allocator()
    torch.cuda.memory.change_current_allocator(alloc)
    _installed = True
    return alloc


def is_installed():
    """Whether `install()` made cumem PyTorch's allocator."""
    return _installed


def MemPool(**kwargs):
    """A `torch.cuda.MemPool` whose memory comes from cumem: PyTorch's
    allocator caches blocks inside the segments cumem hands it. Use with
    `torch.cuda.use_mem_pool(pool)`; keyword arguments go to MemPool. For
    programs that keep PyTorch's allocator (no `install()`): PyTorch's
    pluggable allocator can't hold pools, so with cumem installed this
    raises RuntimeError."""
    import torch
    if _installed:
        raise RuntimeError(
            "cumem_torch.MemPool() needs PyTorch's own allocator as the current one: PyTorch's pluggable "
            "allocator can't hold memory pools (with cumem installed, all memory comes from cumem already)")
    return torch.cuda.MemPool(allocator=_allocator().allocator(), **kwargs)


def record_stream(tensor, stream):
    """What `tensor.record_stream(stream)` does for PyTorch's allocator:
    when the tensor's memory is freed, the free first waits for the work
    queued on `stream` (PyTorch does not pass record_stream on to a
    pluggable allocator)."""
    ptr = tensor.untyped_storage().data_ptr()
    if ptr == 0:
        return
    _lib.check(_lib.lib().cumem_record_stream(ptr, tensor.device.index or 0, stream.cuda_stream))


def stats(device=0):
    """Device `device`'s figures (bytes, counts) as a dict: "pool" (the
    sync pool: in_use, peak_in_use, reserved, peak_reserved, ...), the
    stream-ordered modes' and the graph pools' figures."""
    s = _lib.DeviceStats()
    _lib.check(_lib.lib().cumem_device_stats(device, ctypes.byref(s)))
    return _lib.as_dict(s)


def peak_reserved(device=0):
    """The most device memory cumem held from the driver since the last
    `reset_peak_stats()`: the sync pool's physical peak, plus the driver
    pools' and the graph pools' peaks."""
    s = stats(device)
    return s["pool"]["peak_reserved"] + s["native_peak_reserved"] + s["graph_peak_reserved"]


def pinned_stats():
    """The pinned host pool's figures as a dict."""
    s = _lib.PoolStats()
    _lib.check(_lib.lib().cumem_pinned_stats(ctypes.byref(s)))
    return _lib.as_dict(s)


def torch_counters():
    """Failures of the PyTorch entry points (which can't report them) and
    the waits `record_stream` added."""
    c = _lib.TorchCounters()
    _lib.check(_lib.lib().cumem_torch_counters(ctypes.byref(c)))
    return _lib.as_dict(c)


def memory_summary():
    """A readable table of every cumem pool."""
    return _lib.text(_lib.lib().cumem_memory_summary)


def backend():
    """What cumem runs on ("CUDA (1 device(s))" or the host fallback and why)."""
    return _lib.text(_lib.lib().cumem_backend)


def empty_cache():
    """Returns cumem's cached free memory to the driver (torch.cuda.empty_cache()
    does not reach a pluggable allocator). Returns the bytes released."""
    n = ctypes.c_size_t(0)
    _lib.check(_lib.lib().cumem_release_cached(ctypes.byref(n)))
    return n.value


def reset_peak_stats():
    """Sets cumem's peak figures to their current values."""
    _lib.check(_lib.lib().cumem_reset_peak_stats())


def shutdown():
    """Stops cumem serving memory and releases what is free; returns what is
    still live as a dict. Only at the very end of a program."""
    r = _lib.ShutdownReport()
    _lib.check(_lib.lib().cumem_shutdown(ctypes.byref(r)))
    return _lib.as_dict(r)
