#!/usr/bin/env python3
"""What fits: the largest workload each allocator runs in a fixed budget of
device memory.

    python3 fit.py [--free-gib 8] [--workloads encoder_bucketed,...] [--allocators expandable,cumem,...]
                   [--steps 3] [--start W=N,...] [--budget-s 450] [--json fit.json] [--dry-run] [--spawn]

Each probe (probes.py) is a process of its own that leaves `--free-gib`
of the device free with a ballast no allocator sees, builds one workload
at one size and runs `--steps` steps; the size fits when none runs out of
memory (`torch.cuda.OutOfMemoryError`). Any other error stops that
allocator's search and is reported.

The size is a knob, `n`, whose tokens per step (`tokens(n)`: batch x
length of the largest step) grow in steps of at most about 2% where the
answer lies; KNOBS describes each workload's shapes.

The search (`search`): the first of `--allocators` (expandable segments
by default) starts at a guess, moves up or down until one size fits and a
larger one does not, then bisects until the two are at most 2% apart;
each other allocator starts from that bracket (its two ends first), and
their probes alternate (B C D, D C B, ...). The result per allocator is
the largest size that fitted and the smallest that did not, and its
tokens against expandable segments'.

`--dry-run` prints the plan without a GPU, with the probes the search
would make on a made-up device where the allocators fit 5-10% apart.
"""

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import namedtuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probes  # noqa: E402
import real_workloads  # noqa: E402
from probes import GIB, HOLD_SLACK_GIB, MIB  # noqa: E402
from real_workloads import GPT_COMPILED, LLAMA  # noqa: E402

ALLOCATORS = ["expandable", "cumem", "pytorch", "cuda_malloc_async"]
WORKLOADS = ["encoder_bucketed", "seq2seq_varlen", "gpt2_varlen", "gpt_compiled", "generate_padded"]
RATIO = 1.02  # a bracket is closed when its ends are at most 2% apart (in tokens)


def r8(x):
    """x rounded to a multiple of 8, at least 8."""
    return max(8, int(round(x / 8)) * 8)


class Knob(namedtuple("Knob", "unit start most tokens shape")):
    """A workload's size as one integer `n`: `tokens(n)` tokens per step
    (batch x length of its largest step), `params(n, steps)` the
    workload's parameters (workloads.py; `shape(n)` without the steps),
    `start` a first guess of the answer with 8 GiB free, `most` the
    largest n the model allows."""

    def params(self, n, steps):
        return dict(self.shape(n), warmup=0, steps=steps)


BERT = dict(hidden=768, layers=12, heads=12, positions=4096)
T5 = dict(d_model=512, layers=6, heads=8)
# Generation through SDPA attention (eager attention's n^2 scores would
# make this a benchmark of the prefill's attention).
LLAMA_SDPA = {**LLAMA, "attn": "sdpa", "positions": 16384}
NEW_TOKENS = 24
# The prompts of the generation's three calls: 16, 32 and 24 rows, each
# row's length a fixed fraction of the longest (drawn once, seeded); one
# row of the widest call is the longest.
_rng = random.Random(17)
PROMPT_FRACTIONS = [[_rng.uniform(0.125, 1.0) for _ in range(rows)] for rows in (16, 32, 24)]
PROMPT_FRACTIONS[1][0] = 1.0

KNOBS = {
    # Longest length 8n (4 rows); buckets of a quarter, all and half of it.
    "encoder_bucketed": Knob(
        "longest length / 8", 96, 512, lambda n: 32 * n,
        lambda n: dict(BERT, tokens=32 * n, shapes=[r8(2 * n), 8 * n, r8(4 * n)])),
    # Source up to 8n, target up to half of it, 4 rows.
    "seq2seq_varlen": Knob(
        "longest source / 8", 135, 1024, lambda n: 4 * (8 * n + r8(4 * n)),
        lambda n: dict(T5, batch=4, shapes=[(r8(4 * n), r8(4 * n)), (8 * n, r8(4 * n)), (r8(6 * n), r8(2 * n))])),
    # GPT-2 small, 4 rows of lengths 4n, 8n and 6n (the 512/1024/768).
    "gpt2_varlen": Knob(
        "longest length / 8", 85, 512, lambda n: 32 * n,
        lambda n: dict(batch=4, positions=4096, shapes=[r8(4 * n), 8 * n, r8(6 * n)])),
    # Batch 8 x length 8n, compiled once for any length (dynamic), so that
    # probes of other lengths reuse the compile cache.
    "gpt_compiled": Knob(
        "length / 8", 150, 512, lambda n: 64 * n,
        lambda n: dict(GPT_COMPILED, positions=4096, length=8 * n, dynamic=True)),
    # The longest prompt, n tokens; 24 new tokens a call.
    "generate_padded": Knob(
        "longest prompt", 2000, 16000, lambda n: 32 * (n + NEW_TOKENS),
        lambda n: dict(LLAMA_SDPA, new_tokens=NEW_TOKENS,
                       shapes=[[max(1, round(n * f)) for f in rows] for rows in PROMPT_FRACTIONS])),
}


# --------------------------------------------------------------- search --

def search(tokens, most, start=None, bracket=None, step=1.06, ratio=RATIO):
    """The search for one allocator, as a generator: it yields the size to
    probe next and is sent that probe's result (a dict: "fits", and where
    known "peak_reserved_bytes" or "peak_allocated_bytes", and
    "free_after"); it returns (lo, hi), the largest size that fitted (0:
    none did) and the smallest that did not (None: all up to `most` did).

    It probes `bracket`'s ends first (another allocator's answer), else
    `start`. Then, until a size fits and a larger one does not, it moves
    away from what it knows: down by `step`, `step`^2, `step`^4, ...; up
    to where the peak memory of the last two sizes that fitted, drawn as a
    line, meets 97% of the memory left free, or with one such size half
    way there (in ratio, assuming memory grows with the size alone), or
    else by `step`, `step`^2, ... (always at least `ratio`, at most 2x).
    Then it bisects until tokens(hi) <= ratio * tokens(lo) or the two
    sizes are neighbours."""
    lo, hi = 0, None
    queue = [n for n in (bracket or [start]) if n]
    gallops = 0
    fitted = []  # (n, peak memory, memory left free) of the sizes that fitted
    while True:
        if hi is not None and hi <= 1:
            return lo, hi
        if hi is not None and lo > 0 and (hi - lo <= 1 or tokens(hi) <= ratio * tokens(lo)):
            return lo, hi
        if hi is None and lo >= most:
            return lo, None
        queue = [q for q in queue if lo < q <= most and (hi is None or q < hi)]
        if queue:
            n = queue.pop(0)
        elif lo > 0 and hi is not None:
            n = min(hi - 1, max(lo + 1, round(math.sqrt(lo * hi))))
        elif hi is None:
            up = step ** (2 ** gallops)
            gallops += 1
            if len(fitted) >= 2 and fitted[-1][1] > fitted[-2][1] and fitted[-1][0] > fitted[-2][0]:
                (n1, m1, _), (n2, m2, free) = fitted[-2:]
                up = (n2 + (0.97 * free - m2) * (n2 - n1) / (m2 - m1)) / n2
            elif fitted:
                up = math.sqrt(0.97 * fitted[-1][2] / fitted[-1][1])
            up = min(2.0, max(ratio, up))
            n = min(most, max(lo + 1, math.floor(lo * up)))
        else:
            n = max(1, min(hi - 1, math.ceil(hi / step ** (2 ** gallops))))
            gallops += 1
        res = yield n
        if res["fits"]:
            lo = n
            peak = res.get("peak_reserved_bytes") or res.get("peak_allocated_bytes")
            if peak and res.get("free_after"):
                fitted.append((n, peak, res["free_after"]))
        else:
            hi = n


def fit_workload(workload, allocators, ask, start, out_of_time):
    """Finds the largest size of `workload` for each allocator: the first
    one's search alone, then the others from its bracket, their probes
    alternating. `ask(allocator, workload, n)` returns a probe's result
    (a dict with "fits", or "error"); `out_of_time()` whether to stop."""
    knob = KNOBS[workload]
    found = {al: {"workload": workload, "allocator": al, "lo": 0, "hi": None, "probes": []} for al in allocators}

    def drive(searches, order):
        # The size each unfinished search probes next. A search probes only
        # between the largest size that fitted and the smallest that did
        # not, so its last probes are its answer, also when it is cut short.
        current = {}

        def advance(al, res=None):
            try:
                current[al] = searches[al].send(res)
            except StopIteration:
                current.pop(al, None)

        for al in searches:
            advance(al)
        rnd = 0
        while current:
            for al in (order if rnd % 2 == 0 else order[::-1]):
                if al not in current:
                    continue
                if out_of_time():
                    for a in current:
                        found[a]["stopped"] = "out of time"
                    return
                n, f = current[al], found[al]
                res = ask(al, workload, n)
                f["probes"].append({"n": n, "tokens": knob.tokens(n), "fits": res.get("fits"),
                                    "error": res.get("error")})
                if "error" in res:
                    f["error"] = res["error"]
                    del current[al]
                    continue
                f["lo" if res["fits"] else "hi"] = n
                advance(al, res)
            rnd += 1

    first, rest = allocators[0], allocators[1:]
    drive({first: search(knob.tokens, knob.most, start=start)}, [first])
    lo, hi = found[first]["lo"], found[first]["hi"]
    bracket = [b for b in (lo, hi) if b] or None
    drive({al: search(knob.tokens, knob.most, start=start, bracket=bracket, step=1.04 if bracket else 1.06)
           for al in rest}, rest)
    for f in found.values():
        f["lo_tokens"] = knob.tokens(f["lo"]) if f["lo"] else 0
        f["hi_tokens"] = knob.tokens(f["hi"]) if f["hi"] else None
    return [found[al] for al in allocators]


# --------------------------------------------------------------- driver --

def start_of(workload, free_gib, given):
    """The first size to probe: --start's, else the knob's guess scaled to
    the budget (memory grows a little faster than the size)."""
    if workload in given:
        return given[workload]
    knob = KNOBS[workload]
    return max(1, min(knob.most, round(knob.start * (free_gib / 8) ** 0.75)))


def summarise(found):
    print("\n| workload | allocator | largest that fits (tokens/step) | smallest that does not | "
          "vs expandable | probes | note |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for f in found:
        ref = next((g for g in found if g["workload"] == f["workload"] and g["allocator"] == "expandable"), None)
        ratio = f"{f['lo_tokens'] / ref['lo_tokens']:.3f}" if ref and ref["lo_tokens"] and f["lo_tokens"] else ""
        note = []
        if f.get("error"):
            note.append(f"error: {f['error'][:120]}")
        if f.get("stopped"):
            note.append(f["stopped"])
        if f["hi"] is None and not f.get("error") and not f.get("stopped"):
            note.append("fits at the knob's largest size")
        hi = f"{f['hi_tokens']:,}" if f["hi_tokens"] else "-"
        print(f"| {f['workload']} | {f['allocator']} | {f['lo_tokens']:,} (n={f['lo']}) | {hi} | {ratio} | "
              f"{len(f['probes'])} | {'; '.join(note)} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--free-gib", type=float, default=8.0, help="device memory left free by the ballast")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--allocators", default=",".join(ALLOCATORS),
                    help="the first one's search runs first; the others start from its answer")
    ap.add_argument("--steps", type=int, default=3, help="steps a size must run without running out of memory")
    ap.add_argument("--start", default="", help="first sizes, e.g. gpt2_varlen=80,generate_padded=1800 (n)")
    ap.add_argument("--budget-s", type=float, default=450, help="start no probe after this many seconds")
    ap.add_argument("--probe-timeout", type=float, default=240, help="seconds one probe may take")
    ap.add_argument("--json", default="fit.json")
    ap.add_argument("--spawn", action="store_true", help="a new interpreter per probe instead of forks")
    ap.add_argument("--dry-run", action="store_true", help="print the plan against a made-up device")
    a = ap.parse_args()
    workloads = a.workloads.split(",")
    allocs = a.allocators.split(",")
    for w in workloads:
        if w not in KNOBS:
            raise SystemExit(f"unknown workload {w} (known: {', '.join(KNOBS)})")
    for al in allocs:
        real_workloads.env_for(al)  # refuses an unknown allocator
    given = {k: int(v) for k, v in (kv.split("=") for kv in a.start.split(",") if kv)}
    t_all = time.time()
    found, done, holder, runner = [], [], None, None
    if a.dry_run:
        ask = dry_run_plan(a, allocs, workloads)
    else:
        outdir = tempfile.mkdtemp(prefix="fit-")
        print(f"fit: {a.free_gib} GiB free, {a.steps} steps a probe; logs in {outdir}", flush=True)
        probes.prepare_cumem(allocs)
        holder = probes.Holder(int((a.free_gib + HOLD_SLACK_GIB) * GIB))
        print(f"memory holder: {holder.info['held'] / GIB:.1f} GiB held of {holder.info['total'] / GIB:.1f}",
              flush=True)
        runner = probes.Runner(allocs, outdir, a.spawn, int(a.free_gib * GIB), a.probe_timeout)

        def ask(al, w, n):
            res = runner.ask(al, w, n, KNOBS[w].params(n, a.steps))
            done.append(res)
            what = ("fits" if res.get("fits") else "out of memory") if "error" not in res else "ERROR"
            print(f"[{time.time() - t_all:5.0f} s] {al:18} {w:17} n={n:<6} {KNOBS[w].tokens(n):>8,} tokens  "
                  f"{what:13} peak allocated {res.get('peak_allocated_bytes', 0) / MIB:9,.0f} MiB  "
                  f"({res['wall_s']:.1f} s{', waited %.1f s' % res['waited_s'] if res.get('waited_s') else ''})"
                  f"{'  ' + res['error'][:300] if 'error' in res else ''}", flush=True)
            return res
    try:
        for w in workloads:
            found += fit_workload(w, allocs, ask, start_of(w, a.free_gib, given),
                                  lambda: time.time() - t_all > a.budget_s)
    finally:
        for r in (runner, holder):
            if r is not None:
                r.close()
        summarise(found)
        print(f"\n{'planned' if a.dry_run else 'took'} {sum(len(f['probes']) for f in found)} probes"
              f"{'' if a.dry_run else f' in {time.time() - t_all:.0f} s'}")
        with open(a.json, "w") as f:
            json.dump({"free_gib": a.free_gib, "steps": a.steps, "allocators": allocs, "summary": found,
                       "probes": done, "knobs": {w: KNOBS[w].unit for w in workloads}, "dry_run": a.dry_run},
                      f, indent=1)
        print(f"wrote {a.json}{' (made-up answers)' if a.dry_run else ''}")


def dry_run_plan(a, allocs, workloads):
    """Prints the processes and returns the made-up device's probe answers,
    printing each planned probe. On that device expandable segments fit
    25% more than the start guess (scaled to the budget), cumem 5% more
    than that, PyTorch's default 10% less, cudaMallocAsync 5% less; a
    third of the budget is the model's, the rest grows with the tokens."""
    me = probes.HERE
    print(f"fit --dry-run: {a.free_gib} GiB free, {a.steps} steps a probe, budget {a.budget_s:.0f} s")
    if any(al.startswith("cumem") for al in allocs):
        print("process: python3 -c 'from cumem_torch import _native; _native.library()'  (the native backend, once)")
    print(f"process: {sys.executable} {me} --hold {int((a.free_gib + HOLD_SLACK_GIB) * GIB)}  (holds all but "
          f"{a.free_gib + HOLD_SLACK_GIB:g} GiB of the device for the whole run; each probe's ballast takes the rest "
          f"but {a.free_gib:g} GiB)")
    how = "spawned per probe" if a.spawn else "a probe server, forking each probe"
    for al in allocs:
        print(f"process: {sys.executable} {me} --zygote {al}  ({how}; {probes.settings(al)})")
    for w in workloads:
        k = KNOBS[w]
        n = start_of(w, a.free_gib, {})
        print(f"workload {w}: n = {k.unit}, tokens(n) = {k.tokens(n):,} at the start n={n}; "
              f"params {json.dumps(k.params(n, a.steps))[:300]}")
    factor = {"expandable": 1.0, "cumem": 1.05, "pytorch": 0.9, "cuda_malloc_async": 0.95}
    budget = a.free_gib * GIB
    count = [0]

    def planned(al, w, n):
        count[0] += 1
        knob = KNOBS[w]
        cap = knob.tokens(start_of(w, a.free_gib, {})) * 1.25 * factor.get(al, 1.0)
        peak = budget / 3 + 2 * budget / 3 * knob.tokens(n) / cap
        print(f"  probe {count[0]:3}: {al:18} {w:17} n={n:<6} {knob.tokens(n):>8,} tokens -> "
              f"{'fits' if peak <= budget else 'out of memory'} (made up)")
        return {"fits": peak <= budget, "peak_reserved_bytes": peak * 0.98, "free_after": budget}
    return planned


if __name__ == "__main__":
    main()
