#!/usr/bin/env python3
"""cumem_torch.ipc between two processes on a GPU: the parent shares a
tensor (a strided view of a bf16 storage, and a float32 one); the child
(this script with --child) checks the values and doubles them in place;
the parent sees its own tensor doubled. Then the parent frees a shared
tensor before the child closes it and allocates more of the same size:
none may land on the shared memory. Exits non-zero on the first wrong
result. Needs PyTorch and a GPU (it says so and exits 0 where there is
none, unless CUMEM_REQUIRE_GPU=1)."""

import os
import socket
import struct
import subprocess
import sys

import cumem_torch
import cumem_torch.ipc as ipc

try:
    import torch
except ImportError:
    torch = None

N = 1 << 20
TIMEOUT = struct.pack("ll", 120, 0)  # SO_RCVTIMEO: nobody waits forever


def ramp(dtype):
    return (torch.arange(N, device="cuda") % 251).to(dtype) * 3


def child(fd):
    cumem_torch.install()
    sock = socket.socket(fileno=fd)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, TIMEOUT)
    for round_ in range(3):
        shared = ipc.receive_tensor(sock)
        t = shared.tensor
        want = ramp(t.dtype)[: t.numel()].reshape(t.shape) if round_ != 1 else ramp(t.dtype)[::2][:1000]
        if not bool((t == want).all()):
            print(f"child: round {round_}: wrong values", flush=True)
            return 1
        t.mul_(2)
        del t
        shared.close(sock)
    return 0


def main():
    if torch is None or not torch.cuda.is_available():
        print("skipped: PyTorch with a CUDA device is needed")
        return 1 if os.environ.get("CUMEM_REQUIRE_GPU") == "1" else 0
    cumem_torch.install()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, TIMEOUT)
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        # Round 0: a float32 tensor, shared and written by the child.
        x = ramp(torch.float32)
        ipc.share_tensor(x, mine).wait_closed(mine)
        assert bool((x == ramp(torch.float32) * 2).all()), "the child's writes reach the parent's tensor"
        # Round 1: a strided bf16 view into the middle of its storage.
        base = ramp(torch.bfloat16)
        view = base[::2][:1000]
        ipc.share_tensor(view, mine).wait_closed(mine)
        assert bool((base[::2][:1000] == ramp(torch.bfloat16)[::2][:1000] * 2).all()), "bf16 view written"
        assert bool((base[1::2] == ramp(torch.bfloat16)[1::2]).all()), "the rest of the storage untouched"
        # Round 2: freed while the child holds it: never handed out again
        # before the child's close.
        y = ramp(torch.float32)
        shared_ptr = y.untyped_storage().data_ptr()
        export = ipc.share_tensor(y, mine)
        del y
        others = [torch.full((N,), 7.0, device="cuda") for _ in range(8)]
        assert all(o.untyped_storage().data_ptr() != shared_ptr for o in others), "pinned memory handed out"
        export.wait_closed(mine)
        # The control: released, the memory is the next of its size again,
        # so memory handed out before the release would have been seen.
        z = torch.empty(N, device="cuda")
        assert z.untyped_storage().data_ptr() == shared_ptr, "the released memory is reused"
        del z, others
    finally:
        mine.close()
        rc = proc.wait(timeout=120)
    assert rc == 0, f"the child failed ({rc})"
    print("OK: tensors shared, written back, and pinned until the child closed them")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(child(int(sys.argv[2])))
    sys.exit(main())
