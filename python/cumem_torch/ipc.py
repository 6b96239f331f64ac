"""CUDA tensors shared with another process through cumem.

PyTorch shares CUDA tensors between processes (torch.multiprocessing)
through its allocator, and refuses to with any pluggable allocator
("CUDAPluggableAllocator does not yet support shareIPcHandle"). With cumem
installed, share them through cumem instead, over a connected Unix stream
socket (`socket.socketpair()`, or `socket.AF_UNIX` + `connect`):

    # exporter
    export = cumem_torch.ipc.share_tensor(t, sock)   # t's memory stays put
    ...                                              # t may be freed now
    export.wait_closed(sock)                         # the importer is done

    # importer (another process)
    shared = cumem_torch.ipc.receive_tensor(sock)    # shared.tensor: same memory
    ...
    shared.close(sock)                               # tells the exporter

The exporter's memory stays allocated where it is until the importer has
closed it and said so (`wait_closed`), even if the exporter frees the
tensor meanwhile. `close` synchronises the device first; tensors made from
`shared.tensor` must not be used after it. The tensor's shape, strides,
dtype and storage offset travel with the handle (a small JSON message).
"""

import ctypes
import json
import struct

from . import _lib

_MAX_META = 1 << 20


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("the peer closed the connection")
        buf += part
    return bytes(buf)


class Export:
    """A tensor's memory shared with another process, pinned until the
    importer closed it (`wait_closed`) or `release` is called."""

    def __init__(self, export_id, nbytes):
        self.export_id = export_id
        self.nbytes = nbytes
        self._open = True

    def wait_closed(self, sock):
        """Waits on `sock` for the importer's "closed" message, then lets
        cumem free and reuse the memory (once the tensor is gone too)."""
        if self._open:
            # On an error the export stays open: `release()` once the
            # importer is known to be gone (its process exited).
            _lib.check(_lib.lib().cumem_ipc_wait_closed(sock.fileno(), self.export_id))
            self._open = False

    def release(self):
        """Releases the memory without a message: the caller knows no
        importer uses it any more."""
        if self._open:
            self._open = False
            _lib.check(_lib.lib().cumem_ipc_release(self.export_id))


def share_tensor(tensor, sock):
    """Sends `tensor` (a CUDA tensor whose storage cumem allocated) over the
    Unix stream socket `sock` and returns its `Export`."""
    if not tensor.is_cuda:
        raise ValueError("share_tensor takes a CUDA tensor")
    storage = tensor.untyped_storage()
    meta = {
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "storage_offset": tensor.storage_offset(),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "nbytes": storage.nbytes(),
    }
    data = json.dumps(meta).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)
    export_id = ctypes.c_uint64(0)
    _lib.check(_lib.lib().cumem_ipc_export(storage.data_ptr(), sock.fileno(), ctypes.byref(export_id)))
    return Export(export_id.value, meta["nbytes"])


class _Raw:
    """Bytes of device memory, for torch.as_tensor (CUDA array interface)."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2, "strides": None,
        }


class SharedTensor:
    """Another process's tensor opened here (`tensor`, until `close`)."""

    def __init__(self, ptr, size, export_id, device, tensor):
        self.ptr, self.size, self.export_id, self.device = ptr, size, export_id, device
        self.tensor = tensor

    def close(self, sock=None):
        """Waits for this device's work, closes the memory and, with `sock`,
        tells the exporter. Tensors made from `tensor` must be gone."""
        import torch
        if self.ptr is None:
            return
        torch.cuda.synchronize(self.device)
        self.tensor = None
        ptr, self.ptr = self.ptr, None
        _lib.check(_lib.lib().cumem_ipc_close(ptr, -1 if sock is None else sock.fileno()))


def receive_tensor(sock, device=None):
    """Receives a tensor sent with `share_tensor` on `sock` and opens its
    memory for CUDA device `device` (default: the current device)."""
    import torch
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > _MAX_META:
        raise ValueError(f"a {n} B tensor description")
    meta = json.loads(_recv_exact(sock, n))
    if device is None:
        device = torch.cuda.current_device()
    ptr, size, export_id = ctypes.c_void_p(0), ctypes.c_size_t(0), ctypes.c_uint64(0)
    _lib.check(_lib.lib().cumem_ipc_import(sock.fileno(), device, ctypes.byref(ptr), ctypes.byref(size),
                                           ctypes.byref(export_id)))
    dtype = getattr(torch, meta["dtype"])
    raw = torch.as_tensor(_Raw(ptr.value, meta["nbytes"]), device=f"cuda:{device}")
    tensor = raw.view(dtype).as_strided(meta["shape"], meta["stride"], meta["storage_offset"])
    return SharedTensor(ptr.value, size.value, export_id.value, device, tensor)
