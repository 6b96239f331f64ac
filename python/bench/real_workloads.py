#!/usr/bin/env python3
"""Real PyTorch workloads on three allocators: PyTorch's caching allocator,
PyTorch's cudaMallocAsync backend, and cumem (through cumem_torch).

    python3 real_workloads.py [--workloads gpt2_varlen,resnet50,llama_generate]
                              [--allocators pytorch,cuda_malloc_async,cumem]
                              [--scale full|tiny] [--json results.json]

Each (workload, allocator) pair runs in a fresh process (this script with
--child), so no allocator sees another's state. Models are built from
configs with random weights (no downloads), seeded, under deterministic
settings: the loss (or, for generation, the logit) sequence of every
allocator must equal PyTorch's own bit for bit.

Per pair it reports: the median step time; the peak physical device memory
(the device's used memory from torch.cuda.mem_get_info, sampled after every
step, minus the baseline taken before the model was built; the same
measure for all three); the allocator's own peak reserved bytes
(torch.cuda.max_memory_reserved for PyTorch's two, cumem's pool figures
for cumem); whether the sequence matches PyTorch's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# "pytorch_repeat" is PyTorch's allocator again: whether a workload repeats
# itself bit for bit at all.
ALLOCATORS = ["pytorch", "cuda_malloc_async", "cumem"]
EXTRA_ALLOCATORS = ["pytorch_repeat"]
# Generation runs with eager attention: with SDPA, PyTorch's own allocator
# does not repeat its own logits bit for bit from one process to the next
# (measured on the H100: `--workloads llama_generate --allocators
# pytorch,pytorch_repeat`), so no allocator could be checked against it.
WORKLOADS = ["gpt2_varlen", "resnet50", "llama_generate_eager"]

# Sizes per scale: "tiny" checks that everything runs; "full" is the
# measurement (about 8 minutes for all nine processes on an H100).
SCALES = {
    "full": {
        "gpt2_varlen": dict(warmup=5, steps=60, batch=8, min_len=64, max_len=1024),
        "resnet50": dict(warmup=5, steps=60, batch=64, image=224),
        "llama_generate": dict(warmup=8, rounds=3, new_tokens=100, batch=16, min_prompt=128, max_prompt=640,
                               hidden=1024, layers=16, heads=16, kv_heads=16, intermediate=2816),
        # The same with eager attention (matmul + softmax) instead of SDPA.
        "llama_generate_eager": dict(warmup=8, rounds=3, new_tokens=100, batch=16, min_prompt=128,
                                     max_prompt=640, hidden=1024, layers=16, heads=16, kv_heads=16,
                                     intermediate=2816, attn="eager"),
    },
    "tiny": {
        "gpt2_varlen": dict(warmup=1, steps=3, batch=2, min_len=16, max_len=128),
        "resnet50": dict(warmup=1, steps=3, batch=4, image=64),
        "llama_generate": dict(warmup=2, rounds=2, new_tokens=4, batch=2, min_prompt=8, max_prompt=32,
                               hidden=256, layers=2, heads=4, kv_heads=4, intermediate=512),
        "llama_generate_eager": dict(warmup=2, rounds=2, new_tokens=4, batch=2, min_prompt=8, max_prompt=32,
                                     hidden=256, layers=2, heads=4, kv_heads=4, intermediate=512, attn="eager"),
    },
}


# ---------------------------------------------------------------- child --

def child(workload, allocator, scale, out_path):
    if allocator == "cumem":
        import cumem_torch
        cumem_torch.install()
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.init()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    baseline = total - free
    params = SCALES[scale][workload]
    samples, times, values = [], [], []

    def sample():
        f, t = torch.cuda.mem_get_info()
        samples.append(t - f - baseline)

    run = {"gpt2_varlen": gpt2_varlen, "resnet50": resnet50, "llama_generate": llama_generate,
           "llama_generate_eager": llama_generate}[workload]
    run(torch, params, sample, times, values)

    if allocator == "cumem":
        import cumem_torch
        own_peak = cumem_torch.peak_reserved()
        extra = {"cumem_stats": cumem_torch.stats(), "cumem_torch_counters": cumem_torch.torch_counters()}
    else:
        own_peak = torch.cuda.max_memory_reserved()
        extra = {}
    result = {
        "workload": workload,
        "allocator": allocator,
        "device": torch.cuda.get_device_name(),
        "steps": len(times),
        "median_step_ms": statistics.median(times) * 1e3,
        "mean_step_ms": statistics.fmean(times) * 1e3,
        "peak_physical_bytes": max(samples),
        "own_peak_reserved_bytes": own_peak,
        "values": [v.hex() for v in values],
        **extra,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


def timed_step(torch, fn, sample, times, record):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    value = fn()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    sample()
    if record:
        times.append(dt)
    return value


def gpt2_varlen(torch, p, sample, times, values):
    """GPT-2 small training, batches of varying sequence length."""
    from transformers import GPT2Config, GPT2LMHeadModel
    import random

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257,
                     attn_implementation="eager")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(1234)
    gen = torch.Generator(device="cuda").manual_seed(42)

    def step():
        length = rng.randrange(p["min_len"] // 8, p["max_len"] // 8 + 1) * 8
        ids = torch.randint(0, cfg.vocab_size, (p["batch"], length), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for i in range(p["warmup"] + p["steps"]):
        values.append(timed_step(torch, step, sample, times, i >= p["warmup"]))


def resnet50(torch, p, sample, times, values):
    """ResNet-50 training, fixed batch."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).cuda()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator(device="cuda").manual_seed(7)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        x = torch.randn(p["batch"], 3, p["image"], p["image"], device="cuda", generator=gen)
        y = torch.randint(0, 1000, (p["batch"],), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for i in range(p["warmup"] + p["steps"]):
        values.append(timed_step(torch, step, sample, times, i >= p["warmup"]))


def llama_generate(torch, p, sample, times, values):
    """Greedy generation with a Llama-style model and a growing KV cache
    (transformers' DynamicCache): rounds of prompts of varying length, one
    step per new token; the value of a step is the sum of its last logits."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    import random

    cfg = LlamaConfig(hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                      num_key_value_heads=p["kv_heads"], intermediate_size=p["intermediate"], vocab_size=32000,
                      max_position_embeddings=4096, attn_implementation=p.get("attn", "sdpa"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.eval()
    rng = random.Random(99)
    gen = torch.Generator(device="cuda").manual_seed(3)
    done = 0
    with torch.inference_mode():
        for _ in range(p["rounds"]):
            length = rng.randrange(p["min_prompt"], p["max_prompt"] + 1)
            ids = torch.randint(0, cfg.vocab_size, (p["batch"], length), device="cuda", generator=gen)
            cache = DynamicCache()
            state = {"next": ids}

            def step():
                out = model(input_ids=state["next"], past_key_values=cache, use_cache=True, logits_to_keep=1)
                logits = out.logits[:, -1, :]
                state["next"] = logits.argmax(dim=-1, keepdim=True)
                return logits.float().sum().item()

            for _ in range(p["new_tokens"]):
                values.append(timed_step(torch, step, sample, times, done >= p["warmup"]))
                done += 1
            del cache, state, ids


# --------------------------------------------------------------- driver --

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
    return env


def mib(b):
    return f"{b / 2**20:,.0f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--scale", default="full", choices=sorted(SCALES))
    ap.add_argument("--json", default="real_workloads.json")
    ap.add_argument("--child-timeout", type=float, default=150.0, help="seconds one process may take")
    ap.add_argument("--child", nargs=3, metavar=("WORKLOAD", "ALLOCATOR", "OUT"))
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.scale, a.child[2])
        return
    results, failures = [], []
    t_all = time.time()
    for w in a.workloads.split(","):
        for al in a.allocators.split(","):
            out = f"/tmp/real_workloads_{w}_{al}.json"
            if os.path.exists(out):
                os.remove(out)
            t0 = time.time()
            try:
                r = subprocess.run([sys.executable, __file__, "--scale", a.scale, "--child", w, al, out],
                                   env=env_for(al), capture_output=True, text=True, timeout=a.child_timeout)
            except subprocess.TimeoutExpired as e:
                r = subprocess.CompletedProcess(e.cmd, -9, "", f"timed out after {a.child_timeout} s\n{e.stderr or ''}")
            took = time.time() - t0
            if r.returncode != 0 or not os.path.exists(out):
                failures.append((w, al))
                print(f"!! {w} / {al} failed (rc {r.returncode}) after {took:.0f} s:\n{r.stderr[-3000:]}", flush=True)
                continue
            with open(out) as f:
                res = json.load(f)
            res["wall_s"] = took
            results.append(res)
            print(f"{w:15} {al:18} {res['median_step_ms']:8.2f} ms  phys {mib(res['peak_physical_bytes']):>7} MiB  "
                  f"own {mib(res['own_peak_reserved_bytes']):>7} MiB  ({took:.0f} s)", flush=True)
    # Compare every allocator's sequence with PyTorch's own.
    by = {(r["workload"], r["allocator"]): r for r in results}
    print(f"\n| workload | allocator | median step (ms) | vs PyTorch | peak physical (MiB) | vs PyTorch | "
          f"own peak reserved (MiB) | values = PyTorch's |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in results:
        base = by.get((r["workload"], "pytorch"))
        same = "n/a" if base is None else ("yes" if r["values"] == base["values"] else "NO")
        if base is not None and same == "NO":
            first = next(i for i, (x, y) in enumerate(zip(r["values"], base["values"])) if x != y) \
                if any(x != y for x, y in zip(r["values"], base["values"])) else min(len(r["values"]), len(base["values"]))
            same = f"NO (first differs at step {first})"
        r["values_match_pytorch"] = same
        dt = "" if base is None else f"{(r['median_step_ms'] / base['median_step_ms'] - 1) * 100:+.1f}%"
        dm = "" if base is None else f"{(r['peak_physical_bytes'] / base['peak_physical_bytes'] - 1) * 100:+.1f}%"
        print(f"| {r['workload']} | {r['allocator']} | {r['median_step_ms']:.2f} | {dt} | "
              f"{mib(r['peak_physical_bytes'])} | {dm} | {mib(r['own_peak_reserved_bytes'])} | {same} |")
    print(f"\ndevice: {results[0]['device'] if results else '?'}; total {time.time() - t_all:.0f} s")
    with open(a.json, "w") as f:
        json.dump({"results": results, "failures": failures}, f, indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
