"""cumem for PyTorch: CUDA memory from cumem's pools instead of PyTorch's
caching allocator.

    import cumem_torch
    cumem_torch.install()          # before the first CUDA allocation
    x = torch.randn(1024, device="cuda")
    print(torch.cuda.memory_stats()["allocated_bytes.all.peak"])

`install()` makes cumem PyTorch's allocator through the native backend: a
C++ allocator built against the installed PyTorch (see `_native`) that
implements PyTorch's whole allocator interface over cumem (statistics,
`empty_cache`, the memory fraction, `record_stream`, graph pools and
`MemPool`, snapshots, `OutOfMemoryError`). Where it can't be built or
loaded, `install()` warns and falls back to PyTorch's
CUDAPluggableAllocator over cumem's two C entry points, where much of that
does not work (the warning lists it; `record_stream`, `stats()` and
`empty_cache()` here stand in for some).

Sleep and wake (`tag`, `sleep`, `wake_up`, `tag_usage`; see `_sleep`):
tensors allocated inside `with cumem_torch.tag("weights"):` can give
their GPU memory back (`sleep(offload_tags=("weights",))`, contents kept in
pinned host memory, or dropped with `discard_tags`) and get it back at the
same addresses (`wake_up()`), so CUDA graphs captured before still replay.

Configuration is `CUMEM_CONF` (as for Rust programs), or `install(conf=...)`
with the same syntax; the native backend adds
`promise_registered_captures=true` (`native_conf`). Under torchrun with
several GPUs and no `device=`, cumem's default device is the rank's GPU.
"""

import atexit
import ctypes
import os
import sys

from . import _lib
from ._lib import CumemError, library_path
from ._sleep import current_tag, sleep, tag, tag_usage, wake_up

__all__ = [
    "install", "is_installed", "native_error", "native_conf", "init", "MemPool", "record_stream",
    "current_device", "stats", "pinned_stats",
    "torch_counters", "memory_summary", "backend", "empty_cache", "reset_peak_stats",
    "shutdown", "flush_log", "library_path", "CumemError", "tag", "current_tag", "sleep", "wake_up", "tag_usage",
]

ALLOC_FN = "cumem_torch_alloc"
FREE_FN = "cumem_torch_free"

_pluggable = None
_installed = None


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
    if "device" in conf_keys(env_conf) or local_rank is None or not str(local_rank).isdigit():
        return None
    rank = int(local_rank)
    if device_count <= 1 or rank >= device_count:
        return None
    return ",".join(x for x in ((env_conf or "").strip(), f"device={rank}") if x)


def native_conf(conf):
    """The configuration the native backend runs cumem with: `conf` with
    `promise_registered_captures=true` added where it does not name it."""
    extra = [] if "promise_registered_captures" in conf_keys(conf) else ["promise_registered_captures=true"]
    return ",".join(x for x in [(conf or "").strip()] + extra if x)


def conf_keys(conf):
    """The keys a configuration string (CUMEM_CONF's syntax) sets."""
    return [kv.split("=", 1)[0].strip() for kv in (conf or "").split(",") if kv.strip()]


_native_error = None


def install(conf=None, native=True):
    """Makes cumem PyTorch's CUDA allocator, before the first CUDA
    allocation (PyTorch refuses to swap an allocator it has used). `conf`
    configures cumem (else CUMEM_CONF). `native=False` (or
    CUMEM_TORCH_NATIVE=0) takes the pluggable path. Returns which.

    One cumem manager per process: where a second copy of libcumem_c.so is
    in the process (a native library linked against another install's),
    this raises RuntimeError (`_native.TwoManagers`) naming both files, and
    installs nothing."""
    global _installed, _native_error
    import torch
    if _installed:
        return _installed
    if os.environ.get("CUMEM_TORCH_NATIVE", "1") == "0":
        native = False
    base = conf if conf is not None else os.environ.get("CUMEM_CONF")
    if os.environ.get("LOCAL_RANK") is not None:
        base = rank_conf(base, os.environ.get("LOCAL_RANK"), torch.cuda.device_count()) or base
    if native:
        from . import _native
        try:
            _native.library()
        except _native.TwoManagers:
            # Never run with a second manager, nor fall back beside it.
            raise
        except Exception as e:  # noqa: BLE001 - any other failure means the fallback
            _native_error = f"{type(e).__name__}: {e}"
            native = False
            import warnings
            warnings.warn(
                "cumem_torch: the native backend is unavailable (" + _native_error[:2000] + "); falling back to "
                "PyTorch's CUDAPluggableAllocator, where torch.cuda.memory_stats() and the calls built on it, "
                "memory snapshots, Tensor.record_stream, CUDA graph pools (torch.cuda.graph(pool=...), "
                "torch.compile(mode='reduce-overhead')), MemPool, set_per_process_memory_fraction and "
                "cudnn.benchmark do not work", RuntimeWarning, stacklevel=2)
    want = native_conf(base) if native else base
    if want is not None and (conf is not None or want != os.environ.get("CUMEM_CONF")):
        try:
            init(want)
        except CumemError as e:
            # cumem was already in use: its configuration stands.
            if e.status != "CUMEM_STATUS_ALREADY_INITIALIZED":
                raise
    if native:
        _native.install()  # imported above, where the native backend loaded
        _installed = "native"
    else:
        torch.cuda.memory.change_current_allocator(_allocator())
        _installed = "pluggable"
    atexit.register(flush_log)
    return _installed


def flush_log():
    """Waits until every allocation and free recorded so far is in cumem's
    event log (`log=FILE`); `install()` runs it at exit, lest the end be lost."""
    _lib.check(_lib.lib().cumem_flush_log())


def native_error():
    """Why the native backend was not used (None when it was, or before `install()`)."""
    return _native_error


def is_installed():
    """Whether `install()` made cumem PyTorch's allocator."""
    return bool(_installed)


def MemPool(**kwargs):
    """A `torch.cuda.MemPool` whose memory comes from cumem (keyword
    arguments go to MemPool). With the native backend installed, a plain
    `torch.cuda.MemPool()`; without `install()`, PyTorch's allocator caches
    blocks inside segments cumem hands it. With the pluggable allocator
    installed (which can't hold pools) this raises RuntimeError."""
    import torch
    if _installed == "native":
        return torch.cuda.MemPool(**kwargs)
    if _installed:
        raise RuntimeError(
            "cumem_torch.MemPool() needs PyTorch's own allocator as the current one: PyTorch's pluggable "
            "allocator can't hold memory pools (with cumem installed, all memory comes from cumem already)")
    return torch.cuda.MemPool(allocator=_allocator().allocator(), **kwargs)


def record_stream(tensor, stream):
    """`tensor.record_stream(stream)`, which PyTorch does not pass on to a
    pluggable allocator: the tensor's free first waits for `stream`'s work."""
    if _installed == "native":
        tensor.record_stream(stream)
        return
    ptr = tensor.untyped_storage().data_ptr()
    if ptr == 0:
        return
    _lib.check(_lib.lib().cumem_record_stream(ptr, tensor.device.index or 0, stream.cuda_stream))


def current_device():
    """The device `stats()` describes when given none: PyTorch's current
    device once PyTorch has initialised CUDA, else cumem's default device.
    Opens no context on any other GPU."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    d = ctypes.c_int()
    _lib.check(_lib.lib().cumem_default_device(ctypes.byref(d)))
    return d.value


def stats(device=None):
    """Device `device`'s figures (default: `current_device()`) as a dict of
    CumemDeviceStats' fields: "pool" (the sync pool's), the stream-ordered
    modes', the graph pools' and the memory tags' figures."""
    return _lib.fill(_lib.DeviceStats, _lib.lib().cumem_device_stats, current_device() if device is None else device)


def peak_reserved(device=None):
    """The most device memory cumem held from the driver since the last
    `reset_peak_stats()`: the sync pool's physical peak, plus the driver
    pools', the graph pools' and the memory tags' peaks."""
    s = stats(device)
    return (s["pool"]["peak_reserved"] + s["native_peak_reserved"] + s["graph_peak_reserved"]
            + s["tagged_peak_mapped"])


def pinned_stats():
    """The pinned host pool's figures as a dict."""
    return _lib.fill(_lib.PoolStats, _lib.lib().cumem_pinned_stats)


def torch_counters():
    """Failures of the PyTorch entry points (which can't report them) and
    the waits `record_stream` added."""
    return _lib.fill(_lib.TorchCounters, _lib.lib().cumem_torch_counters)


def memory_summary():
    """A readable table of every cumem pool."""
    return _lib.text(_lib.lib().cumem_memory_summary)


def backend():
    """What cumem runs on ("CUDA (1 device(s))" or the host fallback and why)."""
    return _lib.text(_lib.lib().cumem_backend)


def empty_cache():
    """Returns cumem's cached free memory to the driver, and the bytes
    released (torch.cuda.empty_cache() does it with the native backend)."""
    n = ctypes.c_size_t(0)
    _lib.check(_lib.lib().cumem_release_cached(ctypes.byref(n)))
    return n.value


def reset_peak_stats():
    """Sets cumem's peak figures to their current values."""
    _lib.check(_lib.lib().cumem_reset_peak_stats())


def shutdown():
    """Stops cumem serving memory and releases what is free; returns what is
    still live as a dict. Only at the very end of a program."""
    return _lib.fill(_lib.ShutdownReport, _lib.lib().cumem_shutdown)
