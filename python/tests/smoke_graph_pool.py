#!/usr/bin/env python3
"""Graph pools at expandable segments' memory: two CUDA graphs captured
into one private pool (`torch.cuda.graph(pool=...)`), at two batch sizes,
as CUDA graph trees record a model at several shapes, then a `MemPool`
region. Run in a fresh process under cumem and in one under PyTorch's
allocator with `expandable_segments:True`:

- the replayed values are bit-identical between the two;
- the memory the private pools hold (cumem: `graph_reserved`; PyTorch:
  the snapshot's segments owned by a private pool) is at or below
  expandable segments' for cumem;
- the second graph, at another size, reuses the first one's freed memory
  in cumem (the pool holds less than the two graphs' peaks added up).
  The comparison with expandable segments is the control that the
  figures can differ; no build that breaks the reuse was run through it.

cumem_torch comes from the wheel given as the argument, else
.whl/cumem_torch-*.whl of the checkout, installed into a temporary folder.
Needs PyTorch with a CUDA device: without one it says so and exits 0,
unless CUMEM_REQUIRE_GPU=1 (then it fails)."""

import glob
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REQUIRE = os.environ.get("CUMEM_REQUIRE_GPU") == "1"
MIB = 1 << 20
# Per layer: the output width of a Linear and whether the output stays
# alive to the end (an activation kept for backward) or goes at once.
LAYERS = [(3072, True), (1024, False), (4096, True), (768, False), (2048, True), (1536, False), (1024, True)]


def child(kind):
    """Captures and replays the graphs in this process; prints its figures
    as JSON."""
    if kind == "cumem":
        import cumem_torch
        assert cumem_torch.install() == "native", "cumem's native backend is needed"
    import torch

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    weights, width = [], 1024
    for out, _ in LAYERS:
        weights.append(torch.randn(width, out, device=dev) / width**0.5)
        width = out

    def body(x):
        kept, h = [], x
        for w, (_, keep) in zip(weights, LAYERS):
            h = torch.relu(h @ w)
            if keep:
                kept.append(h)
        return sum(k.sum(dim=1) for k in kept) + h.sum(dim=1)

    inputs = {b: torch.randn(b, 1024, device=dev) for b in (2048, 1536)}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in inputs.values():
            body(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs, outs, peaks = [], [], []
    for b in (2048, 1536):
        g = torch.cuda.CUDAGraph()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.cuda.graph(g, pool=pool):
            outs.append(body(inputs[b]))
        peaks.append(torch.cuda.max_memory_allocated() - before)
        graphs.append(g)
    for x in inputs.values():
        x.normal_()
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    digest = hashlib.sha256(b"".join(o.cpu().numpy().tobytes() for o in outs)).hexdigest()
    mem_pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(mem_pool):
        region = [torch.empty(n * MIB, dtype=torch.uint8, device=dev) for n in (6, 10, 6)]
        del region[1]
        region.append(torch.empty(9 * MIB, dtype=torch.uint8, device=dev))
    if kind == "cumem":
        import cumem_torch
        held = cumem_torch.stats()["graph_reserved"]
    else:
        held = sum(s["total_size"] for s in torch.cuda.memory._snapshot()["segments"]
                   if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    print(json.dumps({"digest": digest, "held": held, "peaks": peaks}))


def main():
    try:
        import torch
    except ImportError as e:
        return skip(f"PyTorch is needed ({e})")
    if not torch.cuda.is_available():
        return skip("a CUDA device is needed")
    repo = pathlib.Path(__file__).resolve().parents[2]
    wheels = sys.argv[1:] or sorted(glob.glob(str(repo / ".whl" / "cumem_torch-*.whl")))
    env = dict(os.environ)
    env.pop("CUMEM_CONF", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if wheels:
        site = pathlib.Path(tempfile.mkdtemp(prefix="cumem-graph-pool-")) / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                        str(site), wheels[0]], check=True)
        env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])
    results = {}
    for kind in ("cumem", "expandable"):
        e = dict(env, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True") if kind == "expandable" else env
        p = subprocess.run([sys.executable, __file__, "--child", kind], env=e, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=900)
        if p.returncode != 0:
            sys.exit(f"FAILED: the {kind} process failed (exit {p.returncode}):\n{p.stdout[-4000:]}")
        results[kind] = json.loads(p.stdout.strip().splitlines()[-1])
        r = results[kind]
        print(f"{kind}: private pools hold {r['held'] / MIB:.1f} MiB; the graphs' peaks "
              f"{', '.join(f'{x / MIB:.1f}' for x in r['peaks'])} MiB")
    c, x = results["cumem"], results["expandable"]
    failed = []
    if c["digest"] != x["digest"]:
        failed.append("the replayed values differ from expandable segments'")
    if c["held"] > x["held"]:
        failed.append(f"cumem's private pools hold {c['held']:,} B, above expandable segments' {x['held']:,} B")
    if c["held"] >= sum(c["peaks"]):
        failed.append(f"the second graph did not reuse the first one's memory ({c['held']:,} B held, "
                      f"{sum(c['peaks']):,} B of peaks)")
    if failed:
        print("\n".join("FAILED: " + f for f in failed))
        sys.exit(1)
    print("smoke_graph_pool: ok")


def skip(why):
    print(("FAILED: " if REQUIRE else "skipped: ") + why)
    sys.exit(1 if REQUIRE else 0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        main()
