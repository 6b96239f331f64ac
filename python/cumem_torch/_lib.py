"""ctypes bindings of cumem's C ABI (cumem-c/include/cumem.h)."""

import ctypes
import os
import threading

_lock = threading.Lock()
_lib = None

# CumemStatus values (cumem.h).
OK = 0
BUFFER_TOO_SMALL = 13


def library_path():
    """The shared library this package uses: `CUMEM_TORCH_LIB` when set,
    else the `libcumem_c.so` installed with the package."""
    env = os.environ.get("CUMEM_TORCH_LIB")
    if env:
        return os.path.abspath(env)
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libcumem_c.so")


def sizes(*names):  # Structure fields of type size_t
    return [(n, ctypes.c_size_t) for n in names]


def u64s(*names):  # and of type uint64_t
    return [(n, ctypes.c_uint64) for n in names]


class PoolStats(ctypes.Structure):
    _fields_ = sizes("in_use", "peak_in_use", "requested", "peak_requested", "reserved", "peak_reserved",
                     "cached", "live_blocks", "free_blocks", "chunks", "largest_free")


class DeviceStats(ctypes.Structure):
    _fields_ = ([("pool", PoolStats)]
                + sizes("stream_ordered_in_use", "stream_ordered_peak_in_use", "stream_ordered_live")
                + u64s("native_reserved", "native_peak_reserved")
                + sizes("graph_reserved", "graph_peak_reserved")
                + u64s("stream_waits", "stream_waits_elided")
                + sizes("tagged_in_use", "tagged_mapped", "tagged_peak_mapped")
                + u64s("move_waits"))

# CUMEM_TAG_NAME_CAP (cumem.h): the longest tag name and its NUL.
TAG_NAME_CAP = 129
# CumemTagState values, by name.
TAG_STATES = ("awake", "sleeping", "asleep", "waking")


class TagUsage(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * TAG_NAME_CAP), ("device", ctypes.c_int), ("state", ctypes.c_int)] + sizes(
        "in_use", "requested", "mapped", "reserved", "live_blocks", "offloaded")


SECONDS = [("copy_seconds", ctypes.c_double), ("seconds", ctypes.c_double)]


class SleepReport(ctypes.Structure):
    _fields_ = sizes("tags", "offloaded", "discarded", "released") + SECONDS


class WakeReport(ctypes.Structure):
    _fields_ = sizes("tags", "restored", "mapped") + SECONDS


class TorchCounters(ctypes.Structure):
    _fields_ = u64s("alloc_failures", "free_failures", "recorded_stream_waits")


class ShutdownReport(ctypes.Structure):
    _fields_ = sizes("live_count", "live_bytes", "released_bytes")


def _declare(lib):
    c_int, c_size, vp, cp = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
    P = ctypes.POINTER
    sigs = {
        "cumem_init": [cp],
        "cumem_backend": [cp, c_size, P(c_size)],
        "cumem_memory_summary": [cp, c_size, P(c_size)],
        "cumem_pinned_stats": [P(PoolStats)],
        "cumem_device_stats": [c_int, P(DeviceStats)],
        "cumem_default_device": [P(c_int)],
        "cumem_reset_peak_stats": [],
        "cumem_flush_log": [],
        "cumem_release_cached": [P(c_size)],
        "cumem_shutdown": [P(ShutdownReport)],
        "cumem_record_stream": [vp, c_int, vp],
        "cumem_torch_counters": [P(TorchCounters)],
        "cumem_ipc_export": [vp, c_int, P(ctypes.c_uint64)],
        "cumem_ipc_wait_closed": [c_int, ctypes.c_uint64],
        "cumem_ipc_release": [ctypes.c_uint64],
        "cumem_ipc_import": [c_int, c_int, P(vp), P(c_size), P(ctypes.c_uint64)],
        "cumem_ipc_close": [vp, c_int],
        "cumem_tag_set": [cp],
        "cumem_tag_get": [cp, c_size, P(c_size)],
        "cumem_tag_is_set": [P(c_int)],
        "cumem_sleep": [P(cp), c_size, P(cp), c_size, P(SleepReport)],
        "cumem_wake": [P(cp), c_size, P(WakeReport)],
        "cumem_tag_usage": [P(TagUsage), c_size, P(c_size)],
    }
    for name, args in sigs.items():
        declare(lib, name, args)
    declare(lib, "cumem_last_error", [], cp)
    declare(lib, "cumem_status_name", [ctypes.c_int32], cp)
    declare(lib, "cumem_instance_id", [], ctypes.c_uint64)
    return lib


def declare(lib, name, argtypes, restype=ctypes.c_int):
    """Sets the C signature of `lib`'s function `name`; returns it."""
    f = getattr(lib, name)
    f.argtypes, f.restype = argtypes, restype
    return f


def lib():
    """The loaded library (loaded once; PyTorch's allocator hook loads the
    same file, and the native backend names it by its soname, so all see
    one cumem manager: `_native` checks that they do)."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = _declare(ctypes.CDLL(library_path()))
        return _lib


class CumemError(RuntimeError):
    """A failed cumem call: `status` is the CumemStatus name."""

    def __init__(self, status, message):
        self.status = status
        super().__init__(f"{status}: {message}")


def check(status):
    if status != OK:
        l = lib()
        raise CumemError(l.cumem_status_name(status).decode(), l.cumem_last_error().decode(errors="replace"))


def fill(struct, fn, *args):
    """Calls `fn(*args, &s)` for a new `struct` s; checks, returns s as a dict."""
    s = struct()
    check(fn(*args, ctypes.byref(s)))
    return as_dict(s)


def text(fn):
    """A string from an entry point that fills a caller's buffer."""
    needed = ctypes.c_size_t(0)
    s = fn(None, 0, ctypes.byref(needed))
    if s != BUFFER_TOO_SMALL:
        check(s)
    buf = ctypes.create_string_buffer(needed.value)
    check(fn(buf, needed.value, None))
    return buf.value.decode(errors="replace")


def as_dict(s):
    out = {}
    for name, _ in s._fields_:
        v = getattr(s, name)
        if isinstance(v, ctypes.Structure):
            out[name] = as_dict(v)
        elif isinstance(v, bytes):
            out[name] = v.decode(errors="replace")
        else:
            out[name] = v if isinstance(v, float) else int(v)
    return out


def names(tags, what):
    """A C array of tag names (NUL-terminated UTF-8) from a string or an
    iterable of strings, and its length."""
    if isinstance(tags, (str, bytes)):
        tags = (tags,)
    encoded = []
    for t in tags:
        if not isinstance(t, str):
            raise TypeError(f"{what}: a memory tag's name is a str (got {type(t).__name__})")
        if "\0" in t:
            raise ValueError(f"{what}: a memory tag's name holds no NUL (got {t!r})")
        encoded.append(t.encode())
    return (ctypes.c_char_p * max(len(encoded), 1))(*encoded), len(encoded)
