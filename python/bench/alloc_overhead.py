"""The host time of one allocation and free of a small CUDA tensor
(`torch.empty` then release) under PyTorch's allocator and under cumem's
native backend, each in a fresh process, alternated: what the backend's
per-call work (its lock, records, statistics, history check) and cumem's
allocation path add. No GPU work is queued, so the figure is host time.

    python3 alloc_overhead.py [--calls 200000] [--rounds 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(allocator, calls):
    if allocator == "cumem":
        import cumem_torch
        cumem_torch.install()
    import torch

    torch.empty(1, device="cuda")
    sizes = [4096, 65536, 1 << 20]
    out = {}
    for size in sizes:
        for _ in range(1000):
            torch.empty(size, dtype=torch.uint8, device="cuda")
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.empty(size, dtype=torch.uint8, device="cuda")
        out[size] = (time.perf_counter() - t0) / calls * 1e9
    # Eight tensors live at once, freed in another order than allocated.
    t0 = time.perf_counter()
    for _ in range(calls // 8):
        ts = [torch.empty(4096 * (i + 1), dtype=torch.uint8, device="cuda") for i in range(8)]
        del ts[::2]
        del ts
    out["8 live"] = (time.perf_counter() - t0) / (calls // 8 * 8) * 1e9
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.calls)
        return
    res = {"pytorch": [], "cumem": []}
    for r in range(a.rounds):
        for al in (["pytorch", "cumem"] if r % 2 == 0 else ["cumem", "pytorch"]):
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            p = subprocess.run([sys.executable, __file__, "--child", al, "--calls", str(a.calls)], env=env,
                               stdout=subprocess.PIPE, text=True, timeout=120)
            res[al].append(json.loads(p.stdout.strip().splitlines()[-1]))
    print("| tensor | PyTorch (ns per empty+free) | cumem native (ns) | difference |")
    print("| --- | ---: | ---: | ---: |")
    for k in res["pytorch"][0]:
        py = statistics.median(x[k] for x in res["pytorch"])
        cu = statistics.median(x[k] for x in res["cumem"])
        print(f"| {k} | {py:.0f} | {cu:.0f} | {cu - py:+.0f} |")


if __name__ == "__main__":
    main()
