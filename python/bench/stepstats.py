"""The statistics of `steptime.py`, as pure functions (standard library
only; `python/tests/host_steptime_stats.py` checks them).

The unit is a process: each process gives one number per workload, the
median of its steps' times, and the processes of one allocator are taken
as independent draws (they alternate with the other allocators' in time).
"""

import math
import statistics
from functools import lru_cache

LEVEL = 0.95


def median_interval(xs, level=LEVEL):
    """(median, lo, hi, coverage) of `xs` (process medians), with a
    distribution-free interval from their order statistics: [x(k),
    x(n+1-k)] covers the true median with probability 1 - 2 P(B <= k-1),
    B ~ Binomial(n, 1/2), whatever the distribution. k is the largest
    whose coverage is at least `level`; with too few values for `level`,
    the smallest and largest and their (lower) coverage: five processes
    give 93.75%, six 96.9%."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("no values")
    k, cov = 1, 1 - 2 / 2 ** n
    below = 0
    for j in range(1, n // 2 + 1):
        below += math.comb(n, j - 1)  # P(B <= j - 1) * 2^n
        c = 1 - 2 * below / 2 ** n
        if c < level:
            break
        k, cov = j, c
    return statistics.median(s), s[k - 1], s[n - k], cov


@lru_cache(maxsize=None)
def u_counts(n, m):
    """How many of the C(n+m, n) equally likely orderings of two samples of
    sizes n and m give each value 0..n*m of the Mann-Whitney U (the
    coefficients of the Gaussian binomial [n+m choose n])."""
    if n == 0 or m == 0:
        return (1,)
    # U counts pairs (a, b) with a > b; the largest of all n + m values is
    # either an a (beating all m b's) or a b (beating none).
    counts = [0] * (n * m + 1)
    for u, c in enumerate(u_counts(n - 1, m)):
        counts[u + m] += c
    for u, c in enumerate(u_counts(n, m - 1)):
        counts[u] += c
    return tuple(counts)


def mann_whitney_k(n, m, level=LEVEL):
    """(k, coverage): the order k of the interval's ends among the n*m
    differences (k-1 the largest u with 2 P(U <= u) <= 1 - `level` under
    the exact null distribution of U), and its exact coverage; None when
    no k reaches `level`."""
    counts = u_counts(n, m)
    total = math.comb(n + m, n)
    alpha = (1 - level) / 2
    below, best = 0, None
    for u, c in enumerate(counts):
        below += c
        if below / total > alpha:
            break
        best = (u + 1, 1 - 2 * below / total)
    return best


def ratio_interval(a, b, level=LEVEL):
    """(estimate, lo, hi, coverage) of the ratio of `a`'s times to `b`'s
    (how much slower or faster), distribution-free: the Hodges-Lehmann
    estimate and the interval of the Mann-Whitney (Wilcoxon rank-sum) test
    inverted (Lehmann 1963; Hollander & Wolfe, "Nonparametric Statistical
    Methods", 4.3), on logarithms: of all n*m differences log a_i - log
    b_j, the median is the estimate and [D(k), D(nm+1-k)] the interval. It
    assumes only that one allocator's log-times are the other's shifted;
    five processes each give 96.8% coverage. None when the samples are too
    small for `level`."""
    found = mann_whitney_k(len(a), len(b), level)
    if found is None:
        return None
    k, cov = found
    d = sorted(math.log(x) - math.log(y) for x in a for y in b)
    return math.exp(statistics.median(d)), math.exp(d[k - 1]), math.exp(d[len(d) - k]), cov


def pct(r):
    """A ratio as a signed percentage (1.012 -> "+1.2%")."""
    return f"{(r - 1) * 100:+.1f}%"


def verdict(interval, tol=0.01):
    """The verdict on a ratio interval (estimate, lo, hi, coverage), or on
    None (too few processes): "within 1%" when it lies within [0.99,
    1.01], "slower by X-Y%" or "faster by X-Y%" when it lies wholly above
    or below 1, else "can't tell"; never a bare percentage."""
    if interval is None:
        return "can't tell (too few processes for a 95% interval)"
    _, lo, hi, _ = interval
    if lo >= 1 - tol and hi <= 1 + tol:
        return f"within {tol * 100:g}% ({pct(lo)} to {pct(hi)})"
    if lo > 1:
        return f"slower by {(lo - 1) * 100:.1f}-{(hi - 1) * 100:.1f}%"
    if hi < 1:
        return f"faster by {(1 - hi) * 100:.1f}-{(1 - lo) * 100:.1f}%"
    return f"can't tell ({pct(lo)} to {pct(hi)})"


def spread(xs):
    """(max - min) / min, of the processes' peaks; None where one is 0."""
    return (max(xs) - min(xs)) / min(xs) if min(xs) > 0 else None


def compare(medians, candidates=("pytorch", "expandable"), level=LEVEL):
    """Per allocator of `medians` ({allocator: [process medians]}): its
    median and interval, its ratio interval against the faster candidate
    (the lowest median of process medians) and the verdict ("reference"
    for that candidate itself)."""
    have = [c for c in candidates if medians.get(c)]
    ref = min(have, key=lambda c: statistics.median(medians[c])) if have else None
    out = {}
    for al, xs in medians.items():
        if not xs:
            continue
        med, lo, hi, cov = median_interval(xs, level)
        row = {"processes": len(xs), "median": med, "lo": lo, "hi": hi, "coverage": cov, "reference": ref}
        if ref is None:
            row["verdict"] = "can't tell (no PyTorch setting ran)"
        elif al == ref:
            row["verdict"] = "reference (the faster PyTorch setting)"
        else:
            r = ratio_interval(xs, medians[ref], level)
            row["ratio"] = r
            row["verdict"] = verdict(r)
        out[al] = row
    return out
