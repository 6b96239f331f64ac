"""Memory tags, sleep and wake (cumem's C ABI: cumem_tag_set, cumem_sleep,
cumem_wake, cumem_tag_usage), shaped like an LLM engine's own sleep mode:

    with cumem_torch.tag("weights"):
        model = build().cuda()           # weights in the "weights" tag
    with cumem_torch.tag("kv_cache"):
        cache = allocate_kv_cache()
    cumem_torch.sleep(offload_tags=("weights",), discard_tags=("kv_cache",))
    ...                                  # the GPU's memory is free for others
    cumem_torch.wake_up(["weights"])     # same addresses, same weights
    cumem_torch.wake_up()                # every sleeping tag (the cache, empty)

A tag is the calling thread's: tensors made inside `with tag(...)` on this
thread are the tag's, those made on other threads (autograd's backward
thread, a data loader's) are not. Allocations during a CUDA graph capture
go to the graph's private pool and are never tagged.
"""

import contextlib
import ctypes
import gc

from . import _lib


def current_tag():
    """The calling thread's memory tag, or None."""
    buf = ctypes.create_string_buffer(_lib.TAG_NAME_CAP)
    _lib.check(_lib.lib().cumem_tag_get(buf, len(buf), None))
    return buf.value.decode() or None


def _set(name):
    _lib.check(_lib.lib().cumem_tag_set(None if name is None else name.encode()))


@contextlib.contextmanager
def tag(name):
    """Sets `name` (None: no tag) as the calling thread's memory tag inside
    the block (a context manager, or a decorator): the CUDA memory PyTorch
    allocates on this thread then comes from the tag's own address space,
    which `sleep()` and `wake_up()` put away and bring back as one. Blocks
    nest. Under asyncio the tag stays set while the block awaits: other
    tasks of the thread get it.

    Raises CumemError (CUMEM_STATUS_CONFIG) for a name that is empty or
    longer than 128 bytes, ValueError for a name holding a NUL."""
    if name is not None:
        _lib.names(name, "tag")  # type and NUL checks
    previous = current_tag()
    _set(name)
    try:
        yield name
    finally:
        _set(previous)


def _drain_native_frees():
    """With the native backend: completes the frees that wait for
    record_stream's events, so that sleep does not offload dropped tensors
    as live (the backend keeps no other tagged memory)."""
    from . import _native
    l = _native._lib_native
    if l is None or not _native.active():
        return
    f = _lib.declare(l, "cumem_torch_native_drain_frees", [ctypes.c_char_p, ctypes.c_size_t])
    buf = ctypes.create_string_buffer(2048)
    if f(buf, len(buf)) != 0:
        raise RuntimeError("cumem_torch: completing pending frees before sleep failed: "
                           + buf.value.decode(errors="replace"))


def sleep(offload_tags=(), discard_tags=(), *, collect=True):
    """Puts memory tags to sleep: the live tensors' memory of each tag in
    `offload_tags` is copied to pinned host memory, that of each tag in
    `discard_tags` is dropped; then every physical page of these tags goes
    back to the driver. Tensors keep their addresses: `wake_up()` brings
    memory back under them, and graphs captured before replay after it.
    Until then the program must not touch these tensors (work queued before
    the call is waited for); allocating in a sleeping tag raises. Only the
    named tags sleep (vLLM's allocator discards every tag not offloaded).

    `collect` runs the garbage collector first, so that tensors nobody
    holds are freed rather than offloaded. Returns a dict: tags (the names),
    offloaded, discarded and released bytes, copy_seconds, seconds.

    Raises CumemError: CUMEM_STATUS_TAG for a tag that holds no memory or
    is not awake, or when pinned memory is short (nothing was released);
    CUMEM_STATUS_CONFIG for a bad or repeated name; CUMEM_STATUS_CAPTURE
    during a graph capture."""
    offload, n_offload = _lib.names(offload_tags, "offload_tags")
    discard, n_discard = _lib.names(discard_tags, "discard_tags")
    if collect:
        gc.collect()
    _drain_native_frees()
    out = _lib.fill(_lib.SleepReport, _lib.lib().cumem_sleep, offload, n_offload, discard, n_discard)
    out["tags"] = [t.decode() for t in offload[:n_offload]] + [t.decode() for t in discard[:n_discard]]
    return out


def wake_up(tags=None):
    """Wakes sleeping tags (None: every sleeping tag; a tag or a list of
    tags): physical memory is mapped again under their tensors at the same
    addresses and offloaded contents are copied back (a discarded tag's
    tensors hold garbage until written). Returns a dict: tags (the names),
    restored and mapped bytes, copy_seconds, seconds.

    Raises CumemError: CUMEM_STATUS_TAG for a tag that is not asleep,
    CUMEM_STATUS_OUT_OF_MEMORY when the device lacks the memory (the tags
    stay asleep, nothing lost: free memory and call again)."""
    if tags is None:
        names = sorted({u["name"] for u in tag_usage() if u["state"] == "asleep"})
        arr, n = _lib.names((), "tags")
    else:
        arr, n = _lib.names(tags, "tags")
        names = [t.decode() for t in arr[:n]]
    out = _lib.fill(_lib.WakeReport, _lib.lib().cumem_wake, arr, n)
    out["tags"] = names
    return out


def tag_usage():
    """Every memory tag on every device in use, as a list of dicts: name,
    device, state ("awake", "sleeping", "asleep", "waking"), in_use and
    requested (bytes of its live tensors), mapped (physical bytes now: 0
    while asleep), reserved (address space, kept while asleep),
    live_blocks, offloaded (bytes held in pinned memory while asleep)."""
    l = _lib.lib()
    count = ctypes.c_size_t(0)
    s = l.cumem_tag_usage(None, 0, ctypes.byref(count))
    if s != _lib.BUFFER_TOO_SMALL:
        _lib.check(s)
    while True:
        cap = count.value + 4
        arr = (_lib.TagUsage * cap)()
        s = l.cumem_tag_usage(arr, cap, ctypes.byref(count))
        if s == _lib.BUFFER_TOO_SMALL:
            continue  # tags were made meanwhile
        _lib.check(s)
        out = []
        for u in arr[:count.value]:
            d = _lib.as_dict(u)
            d["state"] = _lib.TAG_STATES[u.state] if 0 <= u.state < len(_lib.TAG_STATES) else str(u.state)
            out.append(d)
        return out
