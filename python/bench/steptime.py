#!/usr/bin/env python3
"""Step time that resolves 1%, and the spread of the peak between
processes of one program.

    python3 steptime.py [--workloads encoder_bucketed,seq2seq_varlen,gpt2_varlen]
                        [--allocators pytorch,expandable,cuda_malloc_async,cumem] [--processes 5]
                        [--scale full | --fit-json fit.json [--free-gib G]] [--warmup 3] [--steps 12]
                        [--budget-s 460] [--json steptime.json] [--dry-run]

`--processes` rounds, each one new interpreter per allocator, alternated
(A B C D, D C B A, A B C D, ...); a process runs every workload in turn
(real_workloads.py's run_workload: cache emptied and peaks reset between
them), or with `--fit-json` one workload, as fit.py's probes do (after
another workload an allocator may hold memory the size leaves no room
for). Sizes are real_workloads.py's `--scale`, or with `--fit-json` the
largest size at which expandable segments fitted in fit.py's run, with the
same ballast (`--free-gib`, by default that run's). Per step, the wall
time between two device synchronisations and the time between two CUDA
events recorded on the current stream around the step; per process and
workload, the median step of each.

Across processes (stepstats.py): per allocator the median of its process
medians with an order-statistic interval (distribution-free; its coverage
is printed: 93.8% with five processes, 96.9% with six); against the
faster PyTorch setting (the lower median of `pytorch` and `expandable`),
a Hodges-Lehmann ratio with the distribution-free 95% interval of the
Mann-Whitney test (96.8% with five processes each) and its verdict:
"within 1%", "slower by X-Y%", "faster by X-Y%" or "can't tell". Also the
peak physical memory of each process (NVML sampled every 2 ms by a
thread, real_workloads.py's PhysicalSampler), its spread (max - min) / min
per allocator and the worst process, and the spread of the allocator's
own peak reserved bytes.

`--budget-s` starts no round that the last round's time says would end
after it, so every allocator has the same number of processes.
`--dry-run` prints the processes in order with their settings and sizes.
Every process's values (losses; for generation, logits or tokens) are
compared bit for bit with the first PyTorch process's. `--scale tiny
--processes 1` checks that everything runs.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probes  # noqa: E402
import real_workloads  # noqa: E402
import stepstats  # noqa: E402
from probes import GIB, HOLD_SLACK_GIB, MIB  # noqa: E402

WORKLOADS = ["encoder_bucketed", "seq2seq_varlen", "gpt2_varlen"]


def child(allocator, req):
    """One process: every workload of the request in turn, its results to
    req["out"]."""
    torch, kind = real_workloads.setup(allocator)
    held = None
    if req.get("free_bytes"):
        held = probes.leave_free(torch, req["free_bytes"], req.get("expect_free"))
    sampler = real_workloads.PhysicalSampler(torch)
    results = [real_workloads.run_workload(torch, sampler, w, params, allocator, kind)
               for w, params in req["workloads"]]
    sampler.close()
    if held:
        for r in results:
            r["free_before"], r["free_after"] = held["free_before"], held["free_after"]
    with open(req["out"], "w") as f:
        json.dump(results, f)


def sizes(a, workloads):
    """[(workload, params)] and the bytes to leave free (None: no ballast)."""
    if not a.fit_json:
        out = [(w, dict(real_workloads.SCALES[a.scale][w])) for w in workloads]
        for _, p in out:
            if a.warmup is not None:
                p["warmup"] = a.warmup
            if a.steps is not None and "steps" in p:
                p["steps"] = a.steps
        return out, None
    import fit
    with open(a.fit_json) as f:
        run = json.load(f)
    if run.get("dry_run") and not a.dry_run:
        raise SystemExit(f"{a.fit_json} is a dry run's made-up answers")
    out = []
    for w in workloads:
        row = next((r for r in run["summary"] if r["workload"] == w and r["allocator"] == "expandable"), None)
        if not row or not row["lo"]:
            print(f"-- {w}: expandable segments fitted no size in {a.fit_json}; left out")
            continue
        p = fit.KNOBS[w].params(row["lo"], a.steps if a.steps is not None else 12)
        p["warmup"] = a.warmup if a.warmup is not None else 3
        out.append((w, p))
    free = a.free_gib if a.free_gib is not None else run["free_gib"]
    return out, int(free * GIB)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--allocators", default=",".join(real_workloads.ALLOCATORS))
    ap.add_argument("--processes", type=int, default=5, help="processes per allocator (rounds); at least 5")
    ap.add_argument("--scale", default="full", choices=sorted(real_workloads.SCALES))
    ap.add_argument("--fit-json", help="sizes: the largest that expandable segments fitted in fit.py's run")
    ap.add_argument("--free-gib", type=float, help="with --fit-json: the memory left free (default: that run's)")
    ap.add_argument("--warmup", type=int, help="warm-up steps (default: the scale's; 3 with --fit-json)")
    ap.add_argument("--steps", type=int, help="timed steps (default: the scale's; 12 with --fit-json)")
    ap.add_argument("--budget-s", type=float, default=460, help="start no round that would end after this")
    ap.add_argument("--child-timeout", type=float, default=150.0, help="seconds one process may take")
    ap.add_argument("--json", default="steptime.json")
    ap.add_argument("--dry-run", action="store_true", help="print the processes and sizes, run nothing")
    ap.add_argument("--child", nargs=2, metavar=("ALLOCATOR", "REQUEST"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], json.loads(a.child[1]))
        return
    allocs = a.allocators.split(",")
    for al in allocs:
        real_workloads.env_for(al)  # refuses an unknown allocator
    if a.processes < 5:
        print(f"-- {a.processes} processes per allocator: fewer than 5 resolve little (the brief asks at least 5)")
    work, free = sizes(a, a.workloads.split(","))
    order = [allocs if r % 2 == 0 else allocs[::-1] for r in range(a.processes)]
    # At the sizes that fit, each workload starts in a process of its own,
    # as fit.py's probes do: after another workload in the same process an
    # allocator may hold memory that the size leaves no room for.
    groups = [[w] for w in work] if free else [work]
    if a.dry_run:
        print(f"steptime --dry-run: {a.processes} rounds x {len(allocs)} allocators x {len(groups)} = "
              f"{a.processes * len(allocs) * len(groups)} processes, budget {a.budget_s:.0f} s")
        if free:
            print(f"process: {probes.HERE} --hold {free + HOLD_SLACK_GIB * GIB}  (the ballast's bulk, whole run); "
                  f"each process then leaves {free / GIB:g} GiB free")
        for w, p in work:
            print(f"workload {w}: {json.dumps(p)[:400]}")
        for r, o in enumerate(order):
            for al in o:
                for g in groups:
                    print(f"round {r}: {sys.executable} {os.path.abspath(__file__)} --child {al} ...  "
                          f"({', '.join(w for w, _ in g)}; {probes.settings(al)})")
        return
    probes.prepare_cumem(allocs)
    holder = probes.Holder(free + HOLD_SLACK_GIB * GIB) if free else None
    runs, failures, most_free = [], [], 0
    t_all, last_round = time.time(), 0.0
    outdir = tempfile.mkdtemp(prefix="steptime-")
    try:
        if any("compiled" in w for w, _ in work):
            # One untimed process first fills Inductor's cache: a cold
            # compile allocates memory no later process does.
            print(f"warm-up: {allocs[0]} (the compile cache; not measured)", flush=True)
            req = {"workloads": work, "free_bytes": free, "out": os.path.join(outdir, "warm-up.json"),
                   "expect_free": None}
            try:
                subprocess.run([sys.executable, os.path.abspath(__file__), "--child", allocs[0], json.dumps(req)],
                               env=real_workloads.env_for(allocs[0]), timeout=a.child_timeout)
            except subprocess.TimeoutExpired:
                print("-- warm-up: the process ran past --child-timeout", flush=True)
        for r, o in enumerate(order):
            if time.time() - t_all + last_round > a.budget_s:
                print(f"-- budget: rounds {r}..{a.processes - 1} not run (a round takes about {last_round:.0f} s)")
                break
            t_round = time.time()
            for al, (g, group) in itertools.product(o, enumerate(groups)):
                out = os.path.join(outdir, f"{al}-{r}-{g}.json")
                req = {"workloads": group, "free_bytes": free, "out": out,
                       "expect_free": most_free - GIB if most_free else None}
                print(f"round {r}: {al}", flush=True)
                try:
                    rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", al, json.dumps(req)],
                                        env=real_workloads.env_for(al), timeout=a.child_timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = -9
                if rc != 0 or not os.path.exists(out):
                    failures.append({"allocator": al, "round": r, "rc": rc})
                    print(f"!! {al} round {r} failed (rc {rc})", flush=True)
                    continue
                with open(out) as f:
                    for res in json.load(f):
                        res["round"] = r
                        if "error" in res:
                            failures.append({"allocator": al, "round": r, "workload": res["workload"],
                                             "error": res["error"]})
                            continue
                        most_free = max(most_free, res.get("free_before", 0))
                        runs.append(res)
            last_round = time.time() - t_round
    finally:
        if holder:
            holder.close()
    table = summarise(runs, [w for w, _ in work], allocs)
    print(f"\ndevice: {runs[0]['device'] if runs else '?'}; sampler {runs[0]['sampler'] if runs else '?'}; "
          f"total {time.time() - t_all:.0f} s; failures: {failures or 'none'}")
    with open(a.json, "w") as f:
        json.dump({"runs": runs, "summary": table, "failures": failures, "free_bytes": free,
                   "sizes": work}, f, indent=1)
    sys.exit(1 if failures else 0)


def fmt_interval(row):
    return f"{row['median']:.2f} [{row['lo']:.2f}, {row['hi']:.2f}] ({row['coverage'] * 100:.1f}%)"


def fmt_spread(x):
    return "-" if x is None else f"{x * 100:.2f}%"


def summarise(runs, workloads, allocs):
    """The table: per workload and allocator, step time (wall and device)
    with intervals and verdicts, the peaks' spread over processes, and
    whether every process's values equal the first PyTorch process's."""
    rows = []
    print("\n| workload | allocator | processes | median step, ms [interval] (coverage) | vs faster PyTorch "
          "(wall) | median device step, ms [interval] | vs faster PyTorch (device) | peak physical, worst "
          "process (MiB) | spread of peak physical | spread of own peak reserved | values = PyTorch's |")
    print("| --- | --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: | --- |")
    for w in workloads:
        per = {al: [r for r in runs if r["workload"] == w and r["allocator"] == al] for al in allocs}
        wall = stepstats.compare({al: [r["median_step_ms"] for r in rs] for al, rs in per.items()})
        gpu = stepstats.compare({al: [r["median_gpu_step_ms"] for r in rs if r.get("median_gpu_step_ms")]
                                 for al, rs in per.items()})
        # Every process's values against the first PyTorch one's, bit for bit.
        ref = min(per.get("pytorch") or [{}], key=lambda r: r.get("round", 0)).get("values")
        for al in allocs:
            rs = per[al]
            if not rs:
                continue
            same = sum(r["values"] == ref for r in rs)
            values = "n/a" if ref is None else "yes" if same == len(rs) else f"NO ({same}/{len(rs)})"
            phys = [r["peak_physical_bytes"] for r in rs]
            own = [r["own_peak_reserved_bytes"] for r in rs]
            row = {"workload": w, "allocator": al, "wall": wall.get(al), "gpu": gpu.get(al),
                   "peak_physical": phys, "own_peak_reserved": own, "peak_physical_worst": max(phys),
                   "peak_physical_spread": stepstats.spread(phys), "own_peak_reserved_spread": stepstats.spread(own),
                   "worst_round": rs[phys.index(max(phys))]["round"], "values_same": values}
            rows.append(row)
            g = gpu.get(al)
            print(f"| {w} | {al} | {len(rs)} | {fmt_interval(wall[al])} | {wall[al]['verdict']} | "
                  f"{fmt_interval(g) if g else '-'} | {g['verdict'] if g else '-'} | "
                  f"{max(phys) / MIB:,.0f} (round {row['worst_round']}) | {fmt_spread(row['peak_physical_spread'])} | "
                  f"{fmt_spread(row['own_peak_reserved_spread'])} | {values} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
