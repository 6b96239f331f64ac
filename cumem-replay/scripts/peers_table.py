"""The table of a `peers.sh` run: per trace, warm and cold ns per operation
of cumem, PyTorch's caching allocator and RMM's pool (best and median of
the rounds), the physical peak over peak live, and cumem's
allocating-thread driver calls in a warm pass.

    python3 peers_table.py OUTDIR
"""

import glob
import json
import statistics
import sys


def rounds(out):
    """{(allocator, trace): {"warm": [...], "cold": [...], "ratio": x, "calls": n}}"""
    got = {}

    def add(who, trace, key, value):
        got.setdefault((who, trace), {}).setdefault(key, []).append(value)

    for path in sorted(glob.glob(f"{out}/cumem-*-*.json")):
        warm = "-warm-" in path
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        for r in d.get("results", []):
            t = r["trace"]
            add("cumem", t, "warm" if warm else "cold", r["ns_per_op"])
            if warm:
                add("cumem", t, "ratio", r["ratio"])
                calls = (r.get("driver_calls") or {}).get("allocating", {}).get("total")
                if calls is not None:
                    add("cumem", t, "calls", calls)
            else:
                add("cumem", t, "cold_ratio", r["ratio"])
    for who, pattern in (("torch", "torch-*.jsonl"), ("rmm", "rmm-*.jsonl")):
        for path in sorted(glob.glob(f"{out}/{pattern}")):
            with open(path) as f:
                for line in f:
                    line = line.strip()
                    if not line.startswith("{"):
                        continue
                    r = json.loads(line)
                    t = r["trace"]
                    add(who, t, "warm", r["warm_ns_per_op"])
                    add(who, t, "cold", r["cold_ns_per_op"])
                    add(who, t, "ratio", r["warm_ratio"])
                    add(who, t, "cold_ratio", r["cold_ratio"])
    return got


def fmt(xs):
    if not xs:
        return "—"
    return f"{min(xs):,.0f} / {statistics.median(xs):,.0f}"


def main():
    out = sys.argv[1]
    got = rounds(out)
    traces = sorted({t for (_, t) in got})
    who = ("cumem", "torch", "rmm")
    print("warm ns per operation (best / median of the rounds), physical peak / peak live, "
          "cumem's allocating-thread driver calls in a warm pass")
    print()
    print("| trace | cumem | PyTorch | RMM pool | cumem / PyTorch (best) | ratio cumem / PyTorch / RMM | calls |")
    print("| --- | --- | --- | --- | ---: | --- | ---: |")
    for t in traces:
        g = {w: got.get((w, t), {}) for w in who}
        best = [min(g[w]["warm"]) if g[w].get("warm") else None for w in who]
        rel = f"{best[0] / best[1]:.2f}" if best[0] and best[1] else "—"
        ratios = " / ".join(f"{max(g[w]['ratio']):.3f}" if g[w].get("ratio") else "—" for w in who)
        calls = g["cumem"].get("calls")
        calls = (f"{min(calls)}" if min(calls) == max(calls) else f"{min(calls)}–{max(calls)}") if calls else None
        print(f"| {t} | {fmt(g['cumem'].get('warm'))} | {fmt(g['torch'].get('warm'))} | "
              f"{fmt(g['rmm'].get('warm'))} | {rel} | {ratios} | {calls or '—'} |")
    print()
    print("cold ns per operation (best / median of the rounds), physical peak / peak live of the cold pass")
    print()
    print("| trace | cumem | PyTorch | RMM pool | ratio cumem / PyTorch / RMM |")
    print("| --- | --- | --- | --- | --- |")
    for t in traces:
        g = {w: got.get((w, t), {}) for w in who}
        ratios = " / ".join(f"{max(g[w]['cold_ratio']):.3f}" if g[w].get("cold_ratio") else "—" for w in who)
        print(f"| {t} | {fmt(g['cumem'].get('cold'))} | {fmt(g['torch'].get('cold'))} | "
              f"{fmt(g['rmm'].get('cold'))} | {ratios} |")


if __name__ == "__main__":
    main()
