#!/usr/bin/env python3
"""DistributedDataParallel training of a small GPT-2 on every GPU, with
PyTorch's caching allocator or with cumem (cumem_torch) as the allocator.

    torchrun --standalone --nproc_per_node=N ddp.py --allocator {torch,cumem} --out run.json
    python3 ddp.py --compare torch-1.json cumem-1.json [torch-2.json cumem-2.json ...]
    python3 ddp.py --self-test        # no torch needed: the schedule and the comparison

Each rank installs cumem before any CUDA allocation (`--allocator
cumem`), builds GPT-2 with random weights (4 layers, 512 wide; nothing is
downloaded), wraps it in DistributedDataParallel over NCCL and trains with
AdamW under bf16 autocast on batches seeded per rank and step, whose
length varies per step. Settings are deterministic (`deterministic()`), so
the losses with the two allocators compare bit for bit.

Rank 0 writes a JSON (`--out`): every rank's per-step losses, the median
step time after warm-up (the slowest rank's, between two synchronises),
and per rank the peak physical memory (`mem_get_info`'s used memory after
every step, less the baseline before the process group and the model) and
the allocator's own peak reserved bytes.

`--compare` prints one row per run against the first run with PyTorch's
allocator (losses equal, max abs difference, median step and difference,
peak memory per rank), then the median over runs per allocator. With two
runs of PyTorch's allocator it also says whether PyTorch repeats itself.
It exits 1 when any run's losses differ from the reference.

`--device cpu` runs the same loop on the CPU over gloo (no memory
figures, PyTorch's allocator only): a check of the script without a GPU.
"""

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import types

# cuBLAS reads this when its first handle is made: set it before torch.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_workloads import deterministic, mib  # noqa: E402
from workloads import length8, timed_step  # noqa: E402

ALLOCATORS = ["torch", "cumem"]

# Model and schedule sizes: "full" is the measurement (about half a
# minute per run on an H100, most of it imports and NCCL setup); "tiny"
# checks that everything runs.
SCALES = {
    "full": dict(n_layer=4, n_embd=512, n_head=8, vocab=50257, positions=1024,
                 batch=8, min_len=64, max_len=512, warmup=5, steps=60),
    "tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab=1000, positions=128,
                 batch=2, min_len=16, max_len=64, warmup=1, steps=4),
}


# ------------------------------------------------------------- schedule --

def seq_len(p, step):
    """The sequence length of `step`: the same on every rank (the ranks'
    work stays balanced), varying from step to step, a multiple of 8."""
    return length8(random.Random(1234 + step), p["min_len"], p["max_len"])


def batch_seed(rank, step):
    """The seed of rank `rank`'s tokens at `step`."""
    return 1_000_003 * step + 7919 * rank + 42


# ------------------------------------------------------------- training --

def train(a):
    p = SCALES[a.scale]
    rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    cpu = a.device == "cpu"
    if cpu and a.allocator != "torch":
        raise SystemExit("--device cpu runs PyTorch's allocator only")

    # cumem first: PyTorch refuses to swap an allocator it has initialised
    # (set_device initialises CUDA, and with it the allocator). Under
    # torchrun, install() makes the rank's GPU cumem's default device.
    cumem_torch = None
    if a.allocator == "cumem":
        import cumem_torch
        cumem_torch.install()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel

    deterministic(torch)

    if cpu:
        device = torch.device("cpu")
        sync_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))
        baseline = 0
    else:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        torch.cuda.init()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        baseline = total - free
        sync_torch = torch

    init = dict(backend="gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=a.pg_timeout))
    if not cpu:
        init["device_id"] = device  # the communicator is made now, on this rank's GPU
    try:
        dist.init_process_group(**init)
    except TypeError:  # a PyTorch without device_id
        init.pop("device_id", None)
        dist.init_process_group(**init)
    samples = []

    def sample():
        if not cpu:
            f, t = torch.cuda.mem_get_info()
            samples.append(t - f - baseline)

    sample()
    after_init = samples[-1] if samples else 0

    cfg = GPT2Config(n_layer=p["n_layer"], n_embd=p["n_embd"], n_head=p["n_head"], vocab_size=p["vocab"],
                     n_positions=p["positions"], bos_token_id=p["vocab"] - 1, eos_token_id=p["vocab"] - 1,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     attn_implementation="eager")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(device)
    model.train()
    ddp = DDP(model, device_ids=None if cpu else [local])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def run(step):
        gen = torch.Generator(device=device).manual_seed(batch_seed(rank, step))
        ids = torch.randint(0, cfg.vocab_size, (p["batch"], seq_len(p, step)), device=device, generator=gen)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses, times = [], []
    for step in range(p["warmup"] + p["steps"]):
        losses.append(timed_step(sync_torch, lambda: run(step), times, step >= p["warmup"]))
        sample()

    mine = {
        "rank": rank,
        "local_rank": local,
        "device": "cpu" if cpu else torch.cuda.get_device_name(device),
        "losses": [v.hex() for v in losses],
        "step_ms": [t * 1e3 for t in times],
        "median_step_ms": statistics.median(times) * 1e3,
        "baseline_bytes": baseline,
        "after_init_bytes": after_init,
        "peak_physical_bytes": max(samples) if samples else 0,
    }
    if cumem_torch is not None:
        mine["own_peak_reserved_bytes"] = cumem_torch.peak_reserved(local)
        mine["cumem_stats"] = cumem_torch.stats(local)
        mine["cumem_torch_counters"] = cumem_torch.torch_counters()
    elif not cpu:
        mine["own_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        mine["own_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    else:
        mine["own_peak_reserved_bytes"] = 0

    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        # A DDP step ends when its slowest rank does.
        per_step = [max(r["step_ms"][i] for r in everyone) for i in range(len(times))]
        result = {
            "allocator": a.allocator,
            "world_size": world,
            "scale": a.scale,
            "params": p,
            "device": everyone[0]["device"],
            "torch": torch.__version__,
            "nccl": None if cpu else ".".join(map(str, torch.cuda.nccl.version())),
            "env": {k: os.environ.get(k) for k in ("CUMEM_CONF", "NCCL_DEBUG", "CUBLAS_WORKSPACE_CONFIG",
                                                   "PYTORCH_CUDA_ALLOC_CONF")},
            "median_step_ms": statistics.median(per_step),
            "mean_step_ms": statistics.fmean(per_step),
            "ranks": everyone,
        }
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        peaks = ", ".join(f"rank {r['rank']} {mib(r['peak_physical_bytes'])} MiB" for r in everyone)
        print(f"ddp {a.allocator}: {world} rank(s), {len(losses)} steps, median step {result['median_step_ms']:.2f} ms, "
              f"last loss {losses[-1]:.4f}, peak physical {peaks} -> {a.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------- comparison --

def loss_values(run):
    """Every rank's losses as floats, rank by rank."""
    return [[float.fromhex(v) for v in r["losses"]] for r in sorted(run["ranks"], key=lambda r: r["rank"])]


def losses_match(run, ref):
    """(equal bit for bit, max abs difference, first (rank, step) that differs)."""
    a, b = loss_values(run), loss_values(ref)
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return False, float("inf"), "a different number of ranks or steps"
    diff, first = 0.0, None
    for rank, (xs, ys) in enumerate(zip(a, b)):
        for step, (x, y) in enumerate(zip(xs, ys)):
            if x.hex() != y.hex():
                diff = max(diff, abs(x - y))
                first = first or f"rank {rank}, step {step}"
    return first is None, diff, first


def per_rank(run, key):
    return " / ".join(mib(r.get(key, 0)) for r in sorted(run["ranks"], key=lambda r: r["rank"]))


def compare(runs, names):
    """Prints the comparison; whether all runs' losses equal the reference's."""
    ref_i = next((i for i, r in enumerate(runs) if r["allocator"] == "torch"), 0)
    ref = runs[ref_i]
    print(f"reference: {names[ref_i]} ({ref['allocator']}); {ref['world_size']} rank(s) on {ref['device']}, "
          f"torch {ref['torch']}, NCCL {ref['nccl']}")
    print("\n| run | allocator | median step (ms) | vs reference | peak physical per rank (MiB) | "
          "own peak reserved per rank (MiB) | losses = reference's | max abs diff |")
    print("| --- | --- | ---: | ---: | --- | --- | --- | ---: |")
    all_equal = True
    for name, r in zip(names, runs):
        same, diff, first = losses_match(r, ref)
        all_equal &= same
        dt = (r["median_step_ms"] / ref["median_step_ms"] - 1) * 100
        print(f"| {name} | {r['allocator']} | {r['median_step_ms']:.2f} | {dt:+.1f}% | "
              f"{per_rank(r, 'peak_physical_bytes')} | {per_rank(r, 'own_peak_reserved_bytes')} | "
              f"{'yes' if same else 'NO (first at ' + str(first) + ')'} | {diff:.3g} |")

    by = {}
    for r in runs:
        by.setdefault(r["allocator"], []).append(r)
    print("\n| allocator | runs | median of the runs' median steps (ms) | vs PyTorch's | "
          "highest peak physical per rank (MiB) | vs PyTorch's |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    base = by.get("torch")

    def summary(rs):
        step = statistics.median(r["median_step_ms"] for r in rs)
        n = len(rs[0]["ranks"])
        peak = [max(sorted(r["ranks"], key=lambda x: x["rank"])[i]["peak_physical_bytes"] for r in rs) for i in range(n)]
        return step, peak

    base_step, base_peak = summary(base) if base else (None, None)
    for alloc, rs in sorted(by.items(), key=lambda kv: ALLOCATORS.index(kv[0]) if kv[0] in ALLOCATORS else 99):
        step, peak = summary(rs)
        dt = "" if not base_step else f"{(step / base_step - 1) * 100:+.1f}%"
        dm = "" if not base_peak or not sum(base_peak) else f"{(sum(peak) / sum(base_peak) - 1) * 100:+.1f}%"
        print(f"| {alloc} | {len(rs)} | {step:.2f} | {dt} | {' / '.join(mib(b) for b in peak)} | {dm} |")
    if len(by.get("torch", [])) > 1:
        same = all(losses_match(r, ref)[0] for r in runs if r["allocator"] == "torch")
        print(f"\nPyTorch's allocator repeats its own losses bit for bit across runs: {'yes' if same else 'NO'}")
    if ref["world_size"] == 1:
        print("one rank: DDP's all-reduce is a copy on one GPU; this compares the allocators, not communication")
    print(f"\nlosses of every run equal the reference's bit for bit: {'yes' if all_equal else 'NO'}")
    return all_equal


# ------------------------------------------------------------ self-test --

def self_test():
    """The schedule and the comparison, on made-up results (no torch)."""
    p = SCALES["full"]
    lens = [seq_len(p, s) for s in range(p["warmup"] + p["steps"])]
    assert all(p["min_len"] <= n <= p["max_len"] and n % 8 == 0 for n in lens), lens
    assert len(set(lens)) > 10, "lengths vary"
    assert lens == [seq_len(p, s) for s in range(len(lens))], "the schedule repeats"
    assert len({batch_seed(r, s) for r in range(8) for s in range(100)}) == 800, "seeds differ per rank and step"

    def run(alloc, losses, step_ms, peak):
        return {"allocator": alloc, "world_size": len(losses), "device": "test", "torch": "x", "nccl": "y",
                "median_step_ms": step_ms,
                "ranks": [{"rank": i, "losses": [v.hex() for v in ls], "peak_physical_bytes": peak + i,
                           "own_peak_reserved_bytes": peak} for i, ls in enumerate(losses)]}

    base = [[2.5, 2.25, 2.0], [2.5, 2.125, 2.0]]
    off = [[2.5, 2.25, 2.0], [2.5, 2.125, 2.0 + 2 ** -20]]
    t1, c1 = run("torch", base, 20.0, 3 << 30), run("cumem", base, 21.0, 2 << 30)
    assert compare([t1, c1], ["torch-1", "cumem-1"]) is True
    same, diff, first = losses_match(run("cumem", off, 1.0, 0), t1)
    assert not same and diff == 2 ** -20 and first == "rank 1, step 2", (same, diff, first)
    assert compare([c1, t1, run("cumem", off, 19.0, 1 << 30), run("torch", base, 20.5, 3 << 30)],
                   ["cumem-1", "torch-1", "cumem-2", "torch-2"]) is False
    print("\nself-test passed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocator", choices=ALLOCATORS, default="torch")
    ap.add_argument("--out", default="ddp.json")
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--pg-timeout", type=float, default=180.0, help="seconds a collective may wait")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="compare the results of earlier runs")
    ap.add_argument("--self-test", action="store_true", help="check the schedule and the comparison, no torch")
    a = ap.parse_args()
    if a.self_test:
        self_test()
        return 0
    if a.compare:
        runs = []
        for path in a.compare:
            with open(path) as f:
                runs.append(json.load(f))
        names = [os.path.splitext(os.path.basename(p))[0] for p in a.compare]
        return 0 if compare(runs, names) else 1
    if "RANK" not in os.environ:
        ap.error("run under torchrun (torchrun --standalone --nproc_per_node=N ddp.py ...), or use --compare / --self-test")
    train(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
