#!/usr/bin/env python3
"""The statistics of python/bench/steptime.py (stepstats.py) on synthetic
samples, without PyTorch or a GPU: the exact Mann-Whitney intervals
against the published critical values, the order-statistic interval of
the median, the verdicts (including samples that must say "can't tell"),
the interval's coverage over many made-up experiments with a control
that breaks it and must be seen, and the peak's spread. Also fit.py's
search against made-up devices. Seeded: every run draws the same
numbers."""

import math
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import stepstats  # noqa: E402

failed = []


def check(cond, what):
    print(("ok      " if cond else "FAILED  ") + what)
    if not cond:
        failed.append(what)


# Two-sided 5% critical values of the Mann-Whitney U for equal samples of
# 5..10 (the largest U that rejects; tables in Siegel & Castellan, and
# every statistics text): the interval's k is one more.
for n, crit in {5: 2, 6: 5, 7: 8, 8: 13, 9: 17, 10: 23}.items():
    k, cov = stepstats.mann_whitney_k(n, n)
    check(k == crit + 1 and cov >= 0.95, f"Mann-Whitney n=m={n}: k={k} (table {crit + 1}), coverage {cov:.4f}")
check(stepstats.mann_whitney_k(3, 3) is None, "three processes each can't give a 95% interval")
check(sum(stepstats.u_counts(5, 5)) == math.comb(10, 5), "U's counts add up to C(10, 5)")
check(stepstats.u_counts(2, 2) == (1, 1, 2, 1, 1), "U's distribution for 2 and 2: 1 1 2 1 1")

# The median's order-statistic interval.
med, lo, hi, cov = stepstats.median_interval([5, 1, 4, 2, 3])
check((med, lo, hi) == (3, 1, 5) and abs(cov - 0.9375) < 1e-12, f"median of 5: [min, max] at 93.75% ({cov})")
med, lo, hi, cov = stepstats.median_interval(list(range(9)))
check((lo, hi) == (1, 7) and abs(cov - (1 - 2 * 10 / 512)) < 1e-12, f"median of 9: [x(2), x(8)] at {cov:.4f}")


def sample(rng, center, noise, n=5):
    """n process medians around `center`, spread log-normally by `noise`."""
    return [center * math.exp(rng.gauss(0, noise)) for _ in range(n)]


# Made-up process medians (ms) against a reference of five processes.
ref = [100.0, 100.1, 99.9, 100.05, 99.95]
cases = [
    ("the same, 0.1% apart", [100.02, 99.92, 100.08, 99.97, 100.12], "within 1%"),
    ("0.3% slower, 0.1% apart (excludes 1, inside 1%)", [100.3, 100.25, 100.4, 100.35, 100.2], "within 1%"),
    ("5% slower, 0.5% apart", [105.0, 104.6, 105.5, 104.8, 105.3], "slower by"),
    ("5% faster, 0.5% apart", [95.0, 94.6, 95.5, 94.8, 95.3], "faster by"),
    ("the same, 10% apart", [90.0, 95.0, 100.0, 105.0, 110.0], "can't tell"),
    ("2% slower, 10% apart", [92.0, 97.0, 102.0, 107.0, 112.0], "can't tell"),
    ("1.5% slower, 0.1% apart (outside 1%)", [101.5, 101.45, 101.6, 101.55, 101.4], "slower by"),
]
for what, xs, want in cases:
    v = stepstats.verdict(stepstats.ratio_interval(xs, ref))
    check(v.startswith(want), f"{what}: {v!r} (want {want!r})")
    check(any(ch.isdigit() for ch in v) and "%" in v, f"{what}: the verdict shows its interval")
# The same samples with the roles swapped give the mirrored verdict.
check(stepstats.verdict(stepstats.ratio_interval(ref, cases[2][1])).startswith("faster by"),
      "swapped: the reference is faster than the 5% slower one")
check(stepstats.verdict(stepstats.ratio_interval([1.0, 1.1, 1.2], [1.0, 1.1, 1.2])).startswith("can't tell"),
      "three processes each: can't tell")
check(stepstats.verdict((1.0, 0.995, 1.02, 0.96)).startswith("can't tell"),
      "an interval reaching past 1% on one side only: can't tell")
slow = stepstats.verdict((1.03, 1.012, 1.051, 0.968))
check(slow == "slower by 1.2-5.1%", f"slower's text: {slow!r}")

# The ratio interval's coverage: 2,000 made-up experiments of five
# processes each with no difference and 5% noise; the true ratio (1) must
# be inside at least 95% of the time, less a little for the sampling
# (the exact coverage is 96.8%). Control: a 50% interval must miss often.
rng = random.Random(4)


def coverage(level):
    inside = 0
    for _ in range(2000):
        a, b = sample(rng, 50.0, 0.05), sample(rng, 50.0, 0.05)
        _, lo, hi, _ = stepstats.ratio_interval(a, b, level)
        inside += lo <= 1.0 <= hi
    return inside / 2000


c95 = coverage(0.95)
check(c95 >= 0.95, f"95% interval covers the true ratio in {c95:.3f} of 2,000 experiments")
c50 = coverage(0.50)
check(c50 < 0.7, f"control: a 50% interval covers it in only {c50:.3f} (the coverage check can fail)")

# compare(): the faster PyTorch setting is the reference.
rows = stepstats.compare({"pytorch": [10.0, 10.1, 10.2, 10.0, 10.1], "expandable": [9.0, 9.1, 9.0, 9.2, 9.1],
                          "cumem": [9.05, 9.1, 9.0, 9.15, 9.1]})
check(rows["cumem"]["reference"] == "expandable" and rows["expandable"]["verdict"].startswith("reference"),
      "compare(): the faster of pytorch and expandable is the reference")
check(rows["pytorch"]["verdict"].startswith("slower by"), f"compare(): pytorch {rows['pytorch']['verdict']!r}")

# The peak's spread.
check(abs(stepstats.spread([1000, 1005, 1002]) - 0.005) < 1e-12, "spread (max - min) / min")

# fit.py's search, against made-up devices (fits while n <= cap).
import fit  # noqa: E402


def run(gen, cap, free=None):
    """Drives a search: the probes it made and its (lo, hi)."""
    made = []
    try:
        n = next(gen)
        while True:
            made.append(n)
            fits = n <= cap
            res = {"fits": fits}
            if free and fits:
                res.update(peak_reserved_bytes=free * (0.3 + 0.6 * n / cap), free_after=free)
            n = gen.send(res)
    except StopIteration as stop:
        return made, stop.value


tokens = lambda n: 32 * n  # noqa: E731


def closed(lo, hi, cap, most=512):
    """Whether (lo, hi) is a right answer for a device that fits n <= cap:
    lo fits, hi does not, at most 2% apart (or neighbours)."""
    if cap >= most:
        return lo == most and hi is None
    return 0 < lo <= cap < hi and (hi == lo + 1 or tokens(hi) <= 1.02 * tokens(lo))


for cap, start in [(120, 96), (120, 200), (57, 96), (1000, 96), (500, 480), (60, 400)]:
    made, (lo, hi) = run(fit.search(tokens, 512, start=start), cap)
    check(closed(lo, hi, cap), f"search cap {cap} from {start}: ({lo}, {hi}) in {len(made)} probes")
    check(sorted(made) == sorted(set(made)), f"search cap {cap} from {start}: no size probed twice")
made, (lo, hi) = run(fit.search(tokens, 512, start=96), 120, free=8 << 30)
check(closed(lo, hi, 120) and len(made) <= 7, f"search with memory figures: ({lo}, {hi}) in {len(made)} probes")
for cap in (119, 118, 121, 112, 130):
    made, (lo, hi) = run(fit.search(tokens, 512, bracket=[118, 120], step=1.04), cap)
    check(closed(lo, hi, cap) and made[0] == 118, f"from the bracket [118, 120], cap {cap}: {made} -> ({lo}, {hi})")
    if cap in (118, 119):
        check(len(made) == 2, "the bracket's own answer takes its two probes")
made, (lo, hi) = run(fit.search(tokens, 512, start=10), 0)
check((lo, hi) == (0, 1), f"nothing fits: ({lo}, {hi}) after {made}")
found = fit.fit_workload("gpt2_varlen", ["expandable", "cumem"], lambda al, w, n: {"fits": n <= 100}, 96,
                         lambda: False)
check(all(closed(f["lo"], f["hi"], 100) for f in found) and len(found[1]["probes"]) == 2,
      f"fit_workload: both closed, the second in two probes ({[len(f['probes']) for f in found]})")

print(f"{len(failed)} failed" if failed else "host_steptime_stats: ok")
sys.exit(1 if failed else 0)
