#!/usr/bin/env python3
"""Sleep and wake of a transformers model under cumem_torch on a GPU.

A small GPT-2 with random weights (seeded; nothing is downloaded) is loaded
under `cumem_torch.tag("weights")` and generates greedily under
`tag("kv_cache")` (its KV cache is kept alive); a CUDA graph of one forward
pass is captured (under a third tag, which must stay empty: captured
allocations go to the graph's private pool, untagged). Then:

1. sleep(offload_tags=("weights",), discard_tags=("kv_cache",)): the
   device's free memory (`torch.cuda.mem_get_info()`) must rise by at least
   99% of the two tags' mapped bytes before the sleep, and
   `torch.cuda.memory_reserved()` drop by as much; allocating under the
   sleeping tag must raise;
2. wake_up(["weights"]), wake_up(): the graph captured before the sleep
   replays with bit-identical output (it would read unmapped memory if an
   address had moved), and generation gives the same tokens;
3. `--cycles` more sleep/wake cycles (20): the process's RSS, cumem's
   pinned reservation, the tags' address space and PyTorch's reserved
   memory after wake must not grow after the first cycle; the graph and the
   tokens are checked again at the end.

Prints one JSON line of figures (sizes in bytes, times in seconds, copy
speeds in GB/s, with plain pinned copies of the same size in the same run
as their baseline) and exits non-zero on any failure. Without PyTorch, a GPU
or transformers it prints why and exits 0 (1 under CUMEM_REQUIRE_GPU=1).

On the device machine, with the wheel built here (`scripts/gpu-suite.sh
build` puts it in .whl/):

    python3 -m pip install --no-deps --no-index --target /tmp/cs .whl/*.whl
    PYTHONPATH=/tmp/cs python3 python/tests/smoke_sleep.py
    # memcheck, briefly:
    PYTHONPATH=/tmp/cs compute-sanitizer --tool memcheck python3 python/tests/smoke_sleep.py --cycles 2
"""

import argparse
import json
import os
import sys
import time

import cumem_torch

MIB = 1 << 20


def skip(why):
    print("skipped:", why)
    sys.exit(1 if os.environ.get("CUMEM_REQUIRE_GPU") == "1" else 0)


try:
    import torch
except ImportError:
    torch = None
if torch is None or not torch.cuda.is_available():
    skip("PyTorch with a CUDA device is needed")
try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError:
    skip("transformers is needed")

ap = argparse.ArgumentParser()
ap.add_argument("--cycles", type=int, default=20)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--new-tokens", type=int, default=32)
ap.add_argument("--rss-slack-mib", type=float, default=32.0,
                help="RSS growth allowed after the first cycle (Python's own allocations)")
args = ap.parse_args()

failures = []
fig = {"smoke_sleep": "cumem_torch"}


def step(what):
    print("step:", what, file=sys.stderr, flush=True)


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAILED:", what, flush=True)
    return cond


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def device_free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def usage(names=("weights", "kv_cache")):
    return {u["name"]: u for u in cumem_torch.tag_usage() if u["name"] in names}


# Before anything initialises CUDA in PyTorch (its allocator can't be
# swapped after).
fig["backend"] = cumem_torch.install()
fig["device"] = torch.cuda.get_device_name(0)
native = fig["backend"] == "native"
if not native:
    fig["native_error"] = cumem_torch.native_error()
torch.manual_seed(0)
config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64), n_positions=512,
                    vocab_size=50257)
try:
    model = GPT2LMHeadModel._from_config(config, attn_implementation="eager")
except (AttributeError, TypeError, ValueError):
    model = GPT2LMHeadModel(config)
model.eval()
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
weight_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
fig["weight_bytes"] = weight_bytes

# Untagged first: PyTorch's lazily made device memory (cuBLAS workspaces)
# lands in whatever tag is set at its first use; a workspace in a tag that
# sleeps would be unmapped under the next matmul.
gen = torch.Generator().manual_seed(1)
ids = torch.randint(0, config.vocab_size, (2, 24), generator=gen).cuda()
mask = torch.ones_like(ids)
with torch.no_grad():
    torch.nn.functional.linear(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))
allocated_untagged = torch.cuda.memory_allocated() if native else 0

with cumem_torch.tag("weights"):
    model.to("cuda")
torch.cuda.synchronize()
u = usage()
check(u.get("weights", {}).get("in_use", 0) >= weight_bytes, f"the weights are in the 'weights' tag: {u}")
if native:
    check(torch.cuda.memory_allocated() - allocated_untagged >= weight_bytes,
          "torch.cuda.memory_allocated() counts the tagged weights")


def generate():
    with torch.no_grad(), cumem_torch.tag("kv_cache"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                             pad_token_id=config.eos_token_id, return_dict_in_generate=True)
    # The tokens leave the tag (its memory is discarded at sleep); the
    # cache stays alive in it.
    return out.sequences.cpu().tolist(), out


tokens, kept = generate()
step("generated")
check(len(tokens[0]) > ids.shape[1], "generation made tokens")

# A CUDA graph of one forward pass, captured before any sleep.
static_ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen).cuda()


def forward_full():
    return model(input_ids=static_ids, use_cache=False).logits


def forward_part():
    # One block's MLP and the tied head: weights read from the tag.
    t = model.transformer
    h = t.wte(static_ids) + t.wpe.weight[: static_ids.shape[1]]
    return model.lm_head(t.ln_f(h + t.h[0].mlp(t.h[0].ln_2(h))))


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    # The tag is set inside the capture only: PyTorch makes the graph's
    # RNG seed and offset tensors as the capture begins, outside it, and
    # those would rightly be tagged.
    with torch.no_grad(), torch.cuda.graph(g), cumem_torch.tag("capture_probe"):
        out = fn()
    return g, out


graph = None
step("capture")
for name, fn in (("full_model", forward_full), ("mlp_and_head", forward_part)):
    try:
        graph, static_out = capture(fn)
        fig["graph"] = name
        break
    except Exception as e:  # noqa: BLE001 - the next, smaller forward
        fig.setdefault("graph_errors", []).append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.synchronize()
check(graph is not None, f"a CUDA graph was captured: {fig.get('graph_errors')}")
if graph is not None:
    graph.replay()
    torch.cuda.synchronize()
    graph_ref = static_out.clone()
    probe = [u for u in cumem_torch.tag_usage() if u["name"] == "capture_probe"]
    check(not probe, f"allocations during capture are untagged (the graph's private pool): {probe}")


def graph_same():
    if graph is None:
        return False
    static_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(static_out, graph_ref))


# 1. Sleep.
step("sleep")
before = usage()
mapped_before = sum(u["mapped"] for u in before.values())
fig["mapped_before"] = mapped_before
free_before = device_free()
reserved_before = torch.cuda.memory_reserved() if native else 0
t0 = time.perf_counter()
slept = cumem_torch.sleep(offload_tags=("weights",), discard_tags=("kv_cache",))
fig["sleep_s"] = time.perf_counter() - t0
free_rise = device_free() - free_before
fig.update(free_rise=free_rise, release_ratio=free_rise / max(mapped_before, 1), offloaded=slept["offloaded"],
           discarded=slept["discarded"], released=slept["released"])
check(free_rise >= 0.99 * mapped_before, f"the device's free memory rose by {free_rise} B, "
      f"under 99% of the {mapped_before} B the tags had mapped")
check(slept["offloaded"] >= weight_bytes, f"the weights were offloaded: {slept}")
asleep = usage()
check(all(u["state"] == "asleep" and u["mapped"] == 0 for u in asleep.values()), f"both tags asleep: {asleep}")
if native:
    drop = reserved_before - torch.cuda.memory_reserved()
    fig["reserved_drop"] = drop
    check(drop >= 0.99 * mapped_before, f"torch.cuda.memory_reserved() dropped by {drop} B only")
if native:
    # (The pluggable path hands PyTorch a NULL, which it does not check.)
    try:
        with cumem_torch.tag("weights"):
            torch.empty(1024, device="cuda")
        check(False, "allocating under a sleeping tag did not raise")
    except RuntimeError as e:
        check("CUMEM_STATUS_TAG" in str(e), f"the error names the tag's state: {e}")

# 2. Wake: the weights first, then the rest.
step("wake")
t0 = time.perf_counter()
woke = cumem_torch.wake_up(["weights"])
fig["wake_weights_s"] = time.perf_counter() - t0
check(woke["restored"] == slept["offloaded"], f"every offloaded byte came back: {woke} after {slept}")
check(usage()["kv_cache"]["state"] == "asleep", "a partial wake leaves the other tag asleep")
rest = cumem_torch.wake_up()
check(rest["tags"] == ["kv_cache"], f"wake_up() wakes the sleeping tag: {rest}")
fig["offload_gbps"] = slept["offloaded"] / max(slept["copy_seconds"], 1e-9) / 1e9
fig["restore_gbps"] = woke["restored"] / max(woke["copy_seconds"], 1e-9) / 1e9
check(graph_same(), "the graph captured before sleep replays with identical output after wake")
del kept  # its cache was discarded
again, kept = generate()
fig["tokens_equal"] = again == tokens
check(again == tokens, "the same tokens after sleep and wake")

# 3. Cycles: nothing grows after the first.
step("cycles")
series = {"rss": [], "pinned_reserved": [], "tags_reserved": [], "torch_reserved": [], "sleep_s": [], "wake_s": []}
for i in range(args.cycles):
    t0 = time.perf_counter()
    cumem_torch.sleep(offload_tags=("weights",), discard_tags=("kv_cache",))
    t1 = time.perf_counter()
    cumem_torch.wake_up()
    t2 = time.perf_counter()
    series["sleep_s"].append(t1 - t0)
    series["wake_s"].append(t2 - t1)
    series["rss"].append(rss())
    series["pinned_reserved"].append(cumem_torch.pinned_stats()["reserved"])
    series["tags_reserved"].append(sum(u["reserved"] for u in usage().values()))
    series["torch_reserved"].append(torch.cuda.memory_reserved() if native else 0)
if args.cycles > 1:
    grow = max(series["rss"][1:]) - series["rss"][0]
    fig["rss_growth_mib"] = grow / MIB
    check(grow <= args.rss_slack_mib * MIB, f"RSS grew by {grow / MIB:.1f} MiB after the first cycle")
    for k in ("pinned_reserved", "tags_reserved", "torch_reserved"):
        check(max(series[k][1:]) <= series[k][0], f"{k} grew after the first cycle: {series[k]}")
fig["cycle_sleep_s_median"] = sorted(series["sleep_s"])[len(series["sleep_s"]) // 2] if series["sleep_s"] else None
fig["cycle_wake_s_median"] = sorted(series["wake_s"])[len(series["wake_s"]) // 2] if series["wake_s"] else None
fig["pinned_reserved"] = series["pinned_reserved"][-1] if series["pinned_reserved"] else None
check(all(u["offloaded"] == 0 and u["state"] == "awake" for u in usage().values()), "awake, nothing held away")
check(graph_same(), "the graph still replays identically after the cycles")
final, kept = generate()
check(final == tokens, "the same tokens after the cycles")

# The baseline of the copy speeds above, in the same run: plain pinned
# host-to-device and device-to-host copies of the offloaded size (PyTorch's
# pinned memory, untagged device memory), best of three.
n = max(slept["offloaded"], MIB)
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
for direction, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
    best = None
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        secs = start.elapsed_time(end) / 1e3
        best = secs if best is None else min(best, secs)
    fig[f"pinned_{direction}_gbps"] = n / best / 1e9
del host, dev
fig["restore_vs_h2d"] = fig["restore_gbps"] / fig["pinned_h2d_gbps"]
fig["offload_vs_d2h"] = fig["offload_gbps"] / fig["pinned_d2h_gbps"]

fig["failures"] = failures
print(json.dumps(fig, sort_keys=True))
print("smoke sleep: " + ("ok" if not failures else f"{len(failures)} FAILED"))
sys.exit(1 if failures else 0)
