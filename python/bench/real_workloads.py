#!/usr/bin/env python3
"""Real PyTorch workloads on four allocators: PyTorch's caching allocator
(`pytorch`), the same with `expandable_segments:True` (`expandable`),
PyTorch's cudaMallocAsync backend, and cumem (`cumem_torch.install()`, the
native backend).

    python3 real_workloads.py [--workloads encoder_bucketed,...] [--allocators pytorch,expandable,...]
                              [--rounds 3] [--scale full|tiny] [--json results.json]

Each allocator runs in fresh processes (this script with --child): one
process runs every workload in turn, emptying the cache and resetting the
peaks between them; `--rounds` processes per allocator, the allocators
alternated (A B C D, D C B A, A B C D). Models are built from configs with
random weights (no downloads), seeded, under deterministic settings: the
loss (for generation, logit or token) sequence of every process is compared
with the first PyTorch process's, bit for bit.

Per workload and allocator: the median over processes of the median step
time, and each process's; the peak physical device memory (the device's
used memory, NVML's figure when pynvml imports, sampled every 2 ms by a
thread over the whole workload, minus the figure just before the model is
built); the allocator's own peak reserved bytes
(`torch.cuda.max_memory_reserved()`, which cumem's native backend
answers); whether the values equal PyTorch's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from workloads import RUNNERS

# "pytorch_repeat" is PyTorch's allocator again: whether a workload repeats
# itself bit for bit at all.
ALLOCATORS = ["pytorch", "expandable", "cuda_malloc_async", "cumem"]
# "cumem_slack" and "cumem_noremap" tell whether page remapping costs step
# time: remapped memory may rise to 11 times the page floor before pages
# move (remap_slack=10: maps, no moves within a run), or no remapping at all
# (expandable=false: chunks from cuMemAlloc).
EXTRA_ALLOCATORS = ["pytorch_repeat", "cumem_slack", "cumem_noremap"]
# "cumem_base": cumem from the package directory named by
# CUMEM_BASE_PYTHONPATH (another build, for a before/after comparison).
EXTRA_ALLOCATORS.append("cumem_base")
EXTRA_CONF = {
    "cumem_slack": "remap_slack=10",
    "cumem_noremap": "expandable=false",
}
# Generation runs with eager attention: with SDPA, PyTorch's own allocator
# does not repeat its own logits bit for bit from one process to the next
# (measured on the H100: `--workloads llama_generate --allocators
# pytorch,pytorch_repeat`), so no allocator could be checked against it.
WORKLOADS = ["encoder_bucketed", "seq2seq_varlen", "vit_prefetch", "generate_padded", "gpt2_varlen", "resnet50",
             "llama_generate_eager"]

# Sizes per scale: "tiny" checks that everything runs; "full" is the
# measurement (about 8 minutes for all nine processes on an H100).
LLAMA = dict(hidden=1024, layers=16, heads=16, kv_heads=16, intermediate=2816, attn="eager")
# The compiled run of issue 56: a 4-layer GPT, 1024 wide, batch 8 x 512.
GPT_COMPILED = dict(hidden=1024, layers=4, heads=16, vocab=50257, positions=1024, batch=8, length=512)
LLAMA_TINY = dict(hidden=256, layers=2, heads=4, kv_heads=4, intermediate=512, attn="eager")
SCALES = {
    # The measurement: every workload in one process per allocator, about
    # 25 s of work per process on an H100.
    "full": {
        "encoder_bucketed": dict(warmup=3, steps=24, hidden=768, layers=12, heads=12, tokens=16384,
                                 buckets=[64, 128, 256, 512]),
        "seq2seq_varlen": dict(warmup=3, steps=24, d_model=512, layers=6, heads=8, batch=32, min_src=32,
                               max_src=512, min_tgt=16, max_tgt=256),
        "vit_prefetch": dict(warmup=3, steps=20, batch=64, image=224),
        "generate_padded": dict(warmup=1, steps=6, min_batch=4, max_batch=32, min_prompt=16, max_prompt=384,
                                new_tokens=24, **LLAMA),
        "gpt2_varlen": dict(warmup=3, steps=24, batch=8, min_len=64, max_len=1024),
        "resnet50": dict(warmup=3, steps=20, batch=64, image=224),
        "llama_generate": dict(warmup=8, rounds=2, new_tokens=48, batch=16, min_prompt=128, max_prompt=640,
                               **{**LLAMA, "attn": "sdpa"}),
        "llama_generate_eager": dict(warmup=8, rounds=2, new_tokens=48, batch=16, min_prompt=128, max_prompt=640,
                                     **LLAMA),
        # Not in the default list (its compile takes most of a process):
        # name it in --workloads.
        "gpt_compiled": dict(warmup=3, steps=27, **GPT_COMPILED),
    },
    "tiny": {
        "encoder_bucketed": dict(warmup=1, steps=3, hidden=128, layers=2, heads=2, tokens=1024, buckets=[16, 64]),
        "seq2seq_varlen": dict(warmup=1, steps=3, d_model=128, layers=2, heads=2, batch=4, min_src=8, max_src=64,
                               min_tgt=8, max_tgt=32),
        "vit_prefetch": dict(warmup=1, steps=3, batch=4, image=64),
        "generate_padded": dict(warmup=1, steps=2, min_batch=2, max_batch=4, min_prompt=4, max_prompt=16,
                                new_tokens=4, **LLAMA_TINY),
        "gpt2_varlen": dict(warmup=1, steps=3, batch=2, min_len=16, max_len=128),
        "resnet50": dict(warmup=1, steps=3, batch=4, image=64),
        "llama_generate": dict(warmup=2, rounds=2, new_tokens=4, batch=2, min_prompt=8, max_prompt=32,
                               **{**LLAMA_TINY, "attn": "sdpa"}),
        "llama_generate_eager": dict(warmup=2, rounds=2, new_tokens=4, batch=2, min_prompt=8, max_prompt=32,
                                     **LLAMA_TINY),
        "gpt_compiled": dict(warmup=3, steps=2, **{**GPT_COMPILED, "hidden": 128, "layers": 2, "heads": 2,
                                                    "batch": 2, "length": 64}),
    },
}


# ---------------------------------------------------------------- child --

class PhysicalSampler:
    """Samples the device's used memory every `interval` seconds on a thread
    of its own (NVML when importable, else cudaMemGetInfo), so a peak inside
    a step is seen too. `start_phase()` takes the baseline and restarts the
    maximum; `peak()` is the largest sample since, minus that baseline."""

    def __init__(self, torch, interval=0.002):
        import threading
        self.torch = torch
        self.interval = interval
        self.read = self._reader()
        self.base = self.read()
        self.high = 0
        self.count = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _reader(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            index = self.torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                index = int(visible.split(",")[index])
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.source = "nvml"
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used
        except Exception:  # noqa: BLE001 - any failure: the CUDA runtime's figure
            self.source = "cudaMemGetInfo"

            def read():
                f, t = self.torch.cuda.mem_get_info()
                return t - f
            return read

    def _loop(self):
        while not self.stop.is_set():
            v = self.read()
            if v > self.high:
                self.high = v
            self.count += 1
            self.stop.wait(self.interval)

    def start_phase(self):
        self.base = self.read()
        self.high = self.base
        self.count = 0

    def peak(self):
        return max(self.high, self.read()) - self.base

    def close(self):
        self.stop.set()
        self.thread.join()


def setup(allocator):
    """A benchmark process's start: cumem installed for the cumem
    allocators (before anything touches CUDA), deterministic settings, the
    CUDA context made. Returns (torch, the cumem backend or None)."""
    if allocator.startswith("cumem"):
        import cumem_torch
        kind = cumem_torch.install()
    else:
        kind = None
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.init()
    torch.cuda.synchronize()
    return torch, kind


def run_workload(torch, sampler, workload, params, allocator, kind):
    """Runs one workload in this process, the cache emptied and the peaks
    reset first; its result (or {"error": ...}) as a dict."""
    import gc
    from workloads import StepTimes

    times, values = StepTimes(), []
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    sampler.start_phase()
    before = driver_counts(torch, kind)
    t0 = time.time()
    try:
        RUNNERS[workload](torch, params, times, values)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the other workloads still run
        import traceback
        traceback.print_exc()
        print(f"  {workload:22} {allocator:18} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"workload": workload, "allocator": allocator, "error": f"{type(e).__name__}: {e}"}
    took = time.time() - t0
    phys = sampler.peak()
    result = {
        "workload": workload,
        "allocator": allocator,
        "backend": kind,
        "device": torch.cuda.get_device_name(),
        "steps": len(times),
        "median_step_ms": statistics.median(times) * 1e3,
        "mean_step_ms": statistics.fmean(times) * 1e3,
        "step_ms": [t * 1e3 for t in times],
        "gpu_step_ms": [t * 1e3 for t in times.gpu],
        "median_gpu_step_ms": statistics.median(times.gpu) * 1e3 if times.gpu else None,
        "peak_physical_bytes": phys,
        "samples": sampler.count,
        "sampler": sampler.source,
        "own_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "values": [float(v).hex() for v in values],
        "workload_s": took,
    }
    if kind is not None:
        import cumem_torch
        result["cumem_pool"] = cumem_torch.stats()["pool"]
    # Driver calls (cumem: page maps/unmaps) and cumem's cross-stream
    # waits over the workload (warm-up included).
    result["counts"] = {k: v - before[k] for k, v in driver_counts(torch, kind).items()}
    print(f"  {workload:22} {allocator:18} {result['median_step_ms']:8.2f} ms  phys {mib(phys):>7} MiB "
          f"peak allocated {mib(result['peak_allocated_bytes']):>7} MiB ({sampler.count} samples, {took:.1f} s) "
          f"{' '.join(f'{k}={v}' for k, v in result['counts'].items())}", flush=True)
    return result


def child(workloads, allocator, scale, out_path):
    torch, kind = setup(allocator)
    sampler = PhysicalSampler(torch)
    results = [run_workload(torch, sampler, w, SCALES[scale][w], allocator, kind) for w in workloads]
    sampler.close()
    with open(out_path, "w") as f:
        json.dump(results, f)


def driver_counts(torch, kind):
    """Device allocation/free calls so far (PyTorch's statistics; with
    cumem: page maps and unmaps) and, with cumem, its cross-stream waits."""
    m = torch.cuda.memory_stats()
    c = {"device_allocs": m.get("num_device_alloc", 0), "device_frees": m.get("num_device_free", 0)}
    if kind is not None:
        import cumem_torch
        st = cumem_torch.stats()
        c["stream_waits"] = st["stream_waits"]
        c["waits_elided"] = st["stream_waits_elided"]
        c["move_waits"] = st.get("move_waits", -1)
    return c


def env_for(allocator):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    if allocator not in ALLOCATORS + EXTRA_ALLOCATORS:
        raise SystemExit(f"unknown allocator {allocator}")
    if allocator == "cuda_malloc_async":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if allocator == "cumem_base":
        env["PYTHONPATH"] = os.environ["CUMEM_BASE_PYTHONPATH"]
    if allocator in EXTRA_CONF:
        env["CUMEM_CONF"] = EXTRA_CONF[allocator]
    return env


def mib(b):
    return f"{b / 2**20:,.0f}"


def pct(a, b):
    return f"{(a / b - 1) * 100:+.1f}%"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--scale", default="full", choices=sorted(SCALES))
    ap.add_argument("--rounds", type=int, default=3, help="processes per allocator, in alternated order")
    ap.add_argument("--json", default="real_workloads.json")
    ap.add_argument("--child-timeout", type=float, default=150.0, help="seconds one process may take")
    ap.add_argument("--deadline", type=float, default=0, help="start no process after this many seconds")
    ap.add_argument("--child", nargs=3, metavar=("WORKLOADS", "ALLOCATOR", "OUT"))
    a = ap.parse_args()
    if a.child:
        child(a.child[0].split(","), a.child[1], a.scale, a.child[2])
        return
    workloads = a.workloads.split(",")
    allocs = a.allocators.split(",")
    runs, failures = [], []
    t_all = time.time()
    for rnd in range(a.rounds):
        order = allocs if rnd % 2 == 0 else list(reversed(allocs))
        for al in order:
            if a.deadline and time.time() - t_all > a.deadline:
                print(f"-- deadline: {al} of round {rnd} not run", flush=True)
                continue
            out = f"/tmp/real_workloads_{al}_{rnd}.json"
            if os.path.exists(out):
                os.remove(out)
            t0 = time.time()
            print(f"round {rnd}: {al}", flush=True)
            try:
                r = subprocess.run([sys.executable, __file__, "--scale", a.scale, "--child", ",".join(workloads), al,
                                    out], env=env_for(al), stdout=None, stderr=subprocess.PIPE, text=True,
                                   timeout=a.child_timeout)
            except subprocess.TimeoutExpired as e:
                r = subprocess.CompletedProcess(e.cmd, -9, "", f"timed out after {a.child_timeout} s\n{e.stderr or ''}")
            took = time.time() - t0
            if r.returncode != 0 or not os.path.exists(out):
                failures.append((al, rnd))
                print(f"!! {al} round {rnd} failed (rc {r.returncode}) after {took:.0f} s:\n{(r.stderr or '')[-3000:]}",
                      flush=True)
                continue
            with open(out) as f:
                for res in json.load(f):
                    res["round"] = rnd
                    if "error" in res:
                        failures.append((al, rnd, res["workload"], res["error"]))
                        continue
                    res["process_s"] = took
                    runs.append(res)
    table = summarise(runs, workloads, allocs)
    print(f"\ndevice: {runs[0]['device'] if runs else '?'}; sampler {runs[0]['sampler'] if runs else '?'}; "
          f"total {time.time() - t_all:.0f} s")
    with open(a.json, "w") as f:
        json.dump({"runs": runs, "summary": table, "failures": failures}, f, indent=1)
    sys.exit(1 if failures else 0)


def summarise(runs, workloads, allocs):
    """One row per (workload, allocator): medians over its processes, their
    spread, the peak physical memory, and whether each process's values
    equal the first PyTorch process's."""
    rows = []
    print("\n| workload | allocator | median step (ms) | spread (ms) | vs faster PyTorch | peak physical (MiB) "
          "| vs default | vs expandable | own peak reserved (MiB) | values = PyTorch's |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for w in workloads:
        ref = next((r for r in runs if r["workload"] == w and r["allocator"] == "pytorch"), None)
        per = {}
        for al in allocs:
            rs = [r for r in runs if r["workload"] == w and r["allocator"] == al]
            if not rs:
                continue
            meds = [r["median_step_ms"] for r in rs]
            per[al] = {
                "median_ms": statistics.median(meds), "medians_ms": meds,
                "peak_physical": max(r["peak_physical_bytes"] for r in rs),
                "own_peak": max(r["own_peak_reserved_bytes"] for r in rs),
                "same": "n/a" if ref is None else
                ("yes" if all(r["values"] == ref["values"] for r in rs) else
                 f"NO ({sum(r['values'] == ref['values'] for r in rs)}/{len(rs)})"),
            }
        fastest = min((per[k]["median_ms"] for k in ("pytorch", "expandable") if k in per), default=None)
        for al, v in per.items():
            d, e = per.get("pytorch"), per.get("expandable")
            row = {"workload": w, "allocator": al, **v}
            rows.append(row)
            print(f"| {w} | {al} | {v['median_ms']:.2f} | {' / '.join(f'{m:.2f}' for m in v['medians_ms'])} | "
                  f"{pct(v['median_ms'], fastest) if fastest else ''} | {mib(v['peak_physical'])} | "
                  f"{pct(v['peak_physical'], d['peak_physical']) if d else ''} | "
                  f"{pct(v['peak_physical'], e['peak_physical']) if e else ''} | {mib(v['own_peak'])} | {v['same']} |",
                  flush=True)
    return rows


if __name__ == "__main__":
    main()
