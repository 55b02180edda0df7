"""Solving a placement: which MILP, the time limit and its proven gap, and the bottleneck search.

`least_latency` answers "the least per-token latency with every stage and hop ≤ τ" and proves
how far its answer can be from the optimum:

- interior layers alike (the usual case): the counts model (`engine.placement.counts`), exact
  and small - 30 devices × 128 layers solves to optimality in well under the default 10 s;
- interior layers of different sizes: the counts model twice, as a relaxation (a proven lower
  bound; its plan is optimal if its split fits) and as a restriction (a plan that fits), each
  order also re-split exactly for the real layer sizes; if a gap remains, the cuts model
  (`engine.placement.milp`, any sizes) runs for the time left and can close it;
- ``formulation="cuts"`` forces the cuts model alone (the benchmark compares the two).

Every answer carries a lower bound, so a plan cut short by the time limit says how far from the
optimum it may be at most (``Plan.gap``), and only a plan with no proof left is "optimal".

Throughput for N interleaved streams: a token leaves the ring every
cycle = max(bottleneck, latency / N) ms, where the bottleneck is the slowest stage or hop. A
minimax MILP is slow to prove (flat LP bound), so the solver searches the bottleneck instead:
with Lmin(τ) = least latency when every stage and hop takes ≤ τ,
    T* = min over τ in {stage, hop and coordinator times} of max(τ, Lmin(τ) / N),
and max(increasing, non-increasing) is minimised where the two cross, found by bisection in
O(log #values) latency MILPs (most skipped: one solved plan settles a whole range of τ). The
plan found at T* also has the least latency among plans with cycle T* (exact tie-break). Its
lower bound: Lmin's bound / N, and every τ a probe proved impossible (no plan has cycle ≤ τ).
With alike layers the counts model minimises the cycle directly first (`_direct_cycle`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from engine.errors import PlacementTimeout
from engine.placement.counts import LayerSizes, layer_sizes, solve_counts
from engine.placement.fleet import Fleet, Stage, Timing, stage_ms, time_stages
from engine.placement.milp import build_milp, extract_stages, run_milp, twin_pairs

__all__ = ["Formulation", "Search", "Solved", "best_cycle", "least_latency", "relative_gap"]

Formulation = Literal["auto", "cuts"]
_TIE = 1e-9  # relative: a plan this close to its bound is optimal (HiGHS's mip_rel_gap here)
_CUTS_MIN_S = 1.0  # time the cuts model needs at least to be worth building after the counts model
# Range columns up to which the cuts model proves a gap away faster than the restriction and
# re-splits narrow it (measured: 6 devices x 14 layers, 630 columns, 0.06 s).
_CUTS_SMALL = 5_000
_CUTS_SHARE, _CUTS_RESERVE_S = 0.7, 1.0  # of the time left, and kept back from it (HiGHS overshoots)


@dataclass(frozen=True)
class Search:
    """The limits every solve of one placement shares."""

    max_stages: int | None
    min_stages: int
    n_streams: int
    time_limit_s: float  # for messages; the solves obey ``deadline``
    deadline: float  # time.monotonic() when the whole solve must end
    break_symmetry: bool
    formulation: Formulation = "auto"


@dataclass(frozen=True)
class Solved:
    """A least-latency answer: stages in layer order (None: proven that no plan meets the
    limits), whether it is proven optimal, and a proven lower bound on the least latency (ms)."""

    stages: list[Stage] | None
    optimal: bool
    bound_ms: float


def relative_gap(value: float, bound: float) -> float:
    """(value - bound) / value, at least 0: how much better than ``value`` the optimum may be."""
    if value <= 0 or not math.isfinite(value):
        return 0.0
    return max(0.0, (value - bound) / value)


def _remaining(s: Search) -> float:
    return s.deadline - time.monotonic()


def _timeout(s: Search, why: str) -> PlacementTimeout:
    return PlacementTimeout(f"no placement found within {s.time_limit_s:g} s ({why}); raise the "
                            "time limit or set max_stages to shrink the search")


def least_latency(f: Fleet, s: Search, cap_ms: float | None = None,
                  max_latency: float | None = None) -> Solved:
    """Least-latency stages with every stage and hop ≤ ``cap_ms`` and latency ≤ ``max_latency``
    (module doc). Raises `PlacementTimeout` when the time ran out before any plan was found."""
    sizes = layer_sizes(f) if s.formulation == "auto" else None
    if sizes is None:
        return _cuts(f, s, cap_ms, max_latency)
    twins = twin_pairs(f) if s.break_symmetry else []

    def counts(relax: bool, share: float = 1.0):
        return solve_counts(f, sizes, relax=relax, time_limit_s=share * _remaining(s), max_stages=s.max_stages,
                            min_stages=s.min_stages, cap_ms=cap_ms, max_latency=max_latency, twins=twins)

    if sizes.uniform:
        r = counts(True)
        if r.timed_out:
            raise _timeout(s, "time limit reached in the counts model")
        return Solved(r.stages, r.optimal, r.bound_ms)
    return _sandwich(f, s, sizes, counts, cap_ms, max_latency)


def _sandwich(f: Fleet, s: Search, sizes: LayerSizes, counts, cap_ms: float | None,
              max_latency: float | None) -> Solved:
    """Interior layers of different sizes: relaxation, restriction, exact re-splits, then the
    cuts model for the time left (module doc)."""
    lo = counts(True, 0.3)
    if lo.stages is None and not lo.timed_out:
        return Solved(None, True, math.inf)  # not even the relaxation has a plan
    bound = lo.bound_ms
    if lo.stages is not None and lo.optimal and admissible(f, s, lo.stages, cap_ms, max_latency):
        return Solved(lo.stages, True, bound)  # the relaxation's optimum fits: it is the optimum
    if len(f.device_ids) * f.n_layers * (f.n_layers + 1) // 2 <= _CUTS_SMALL:
        return _cuts(f, s, cap_ms, max_latency)  # small enough to solve exactly at once
    found: list[list[Stage]] = []
    hi = counts(False, 0.4)
    for r in (lo, hi):
        if r.stages is not None:
            found.append(r.stages)
            split = split_in_order(f, [d for d, _, _ in r.stages], cap_ms)
            if split is not None:
                found.append(split)
    plans = [st for st in found if admissible(f, s, st, cap_ms, max_latency)]
    best = min(plans, key=lambda st: latency_ms(f, st), default=None)
    if best is not None and latency_ms(f, best) <= bound * (1 + _TIE) + 1e-12:
        return Solved(best, True, bound)
    if _remaining(s) >= _CUTS_MIN_S:
        # HiGHS overshoots its limit by up to ~1.5 s on the largest cuts models (setup before
        # its first clock check; measured at 30 devices x 128 layers): keep a reserve.
        until = time.monotonic() + max(0.05, _CUTS_SHARE * _remaining(s) - _CUTS_RESERVE_S)
        try:
            cut = _cuts(f, s, cap_ms, max_latency, until)
        except PlacementTimeout:
            cut = None
        if cut is not None:
            if cut.stages is None and cut.optimal:
                return cut  # the cuts model proved there is no plan
            bound = max(bound, cut.bound_ms)
            if cut.stages is not None and (best is None or latency_ms(f, cut.stages) < latency_ms(f, best)):
                best = cut.stages
    if best is None:
        raise _timeout(s, "time limit reached before a plan that fits was found")
    return Solved(best, latency_ms(f, best) <= bound * (1 + _TIE) + 1e-12, bound)


def _cuts(f: Fleet, s: Search, cap_ms: float | None, max_latency: float | None,
          until: float | None = None) -> Solved:
    m = build_milp(f, s.max_stages, min_stages=s.min_stages, cap_ms=cap_ms, max_latency=max_latency,
                   break_symmetry=s.break_symmetry)
    if len(m.cols.dev) == 0:
        return Solved(None, True, math.inf)
    res = run_milp(m, s.deadline if until is None else until)
    if res.status == 2:
        return Solved(None, True, math.inf)
    if res.x is None:
        raise _timeout(s, res.message)
    bound = getattr(res, "mip_dual_bound", None)
    optimal = res.status == 0
    bound = float(res.fun) if optimal else float(bound) if bound is not None and math.isfinite(bound) else 0.0
    return Solved(extract_stages(m, res.x), optimal, bound)


# --- checking and re-splitting a chain -------------------------------------------------------

def latency_ms(f: Fleet, stages: Sequence[Stage]) -> float:
    return time_stages(f, stages, 1, True).per_token_ms


def admissible(f: Fleet, s: Search, stages: Sequence[Stage], cap_ms: float | None,
               max_latency: float | None) -> bool:
    """Does the chain keep every limit: memory of each device and PC, the stage count, every
    stage and hop ≤ ``cap_ms``, latency ≤ ``max_latency``?"""
    if not s.min_stages <= len(stages) <= (s.max_stages or len(stages)):
        return False
    used = np.zeros(len(f.pc_ids))
    for d, first, last in stages:
        b = float(f.stage_bytes(d, first, last))
        p = f.dev_pc[d]
        if b > min(f.dev_cap[d], f.pc_cap[p]):
            return False
        used[p] += b
    if np.any(used > f.pc_cap):
        return False
    t = time_stages(f, stages, 1, True)
    if cap_ms is not None and t.bottleneck_ms > cap_ms:
        return False
    return max_latency is None or t.per_token_ms <= max_latency * (1 + _TIE)


def split_in_order(f: Fleet, order: Sequence[int], cap_ms: float | None) -> list[Stage] | None:
    """The least-latency chain over a subsequence of ``order`` (devices in this order, each
    used at most once, any of them skipped), with the real layer sizes: a dynamic programme
    over (last device used, layers covered). Each stage fits its device and its PC alone; the
    caller checks a PC shared by two stages. None when no split fits."""
    L, k = f.n_layers, len(order)
    first, last = np.triu_indices(L)
    best = np.full((k, L + 1), math.inf)  # best[j, c]: layers 0..c-1 covered, the last on order[j]
    back = np.full((k, L + 1, 2), -1)
    stage = []
    for d in order:
        ms = np.full((L, L), math.inf)  # ms[a, b]: layers a..b on d
        fits = f.stage_bytes(d, first, last) <= min(f.dev_cap[d], f.pc_cap[f.dev_pc[d]])
        val = stage_ms(f, d, first, last)
        if cap_ms is not None:
            fits &= val <= cap_ms
        ms[first[fits], last[fits]] = val[fits]
        stage.append(ms)
    pcs = [int(f.dev_pc[d]) for d in order]
    for j in range(k):
        hop = f.coord[pcs[j]]
        if cap_ms is None or hop <= cap_ms:
            best[j, 1:] = hop + stage[j][0]
        for i in range(j):
            hop = f.lat[pcs[i], pcs[j]]
            if cap_ms is not None and hop > cap_ms:
                continue
            # total[c, b]: layers 0..c-1 on a chain ending with order[i], then c..b on order[j]
            total = best[i, 1:L, None] + hop + stage[j][1:L, :]
            c_best = np.argmin(total, axis=0)
            val = total[c_best, np.arange(L)]
            better = val < best[j, 1:]
            best[j, 1:][better] = val[better]
            back[j, 1:][better] = np.stack((np.full(better.sum(), i), c_best[better] + 1), axis=1)
    coord = np.array([f.coord[p] if cap_ms is None or f.coord[p] <= cap_ms else math.inf for p in pcs])
    end = best[:, L] + coord
    j = int(np.argmin(end))
    if not math.isfinite(end[j]):
        return None
    out: list[Stage] = []
    c = L
    while j >= 0:
        i, c_prev = back[j, c]
        out.append((order[j], int(c_prev) if i >= 0 else 0, c - 1))
        j, c = int(i), int(c_prev)
    return out[::-1]


# --- throughput ------------------------------------------------------------------------------

def _direct_cycle(f: Fleet, s: Search) -> Timing | None:
    """Alike layers: the counts model minimises the cycle itself (its LP bound is not flat like
    the cuts model's), then the least latency at that cycle breaks ties - two solves instead of
    the bisection's five or more (measured at 30 × 128: ~2 s instead of ~18 s on a loaded box).
    None when the layers differ or either solve was not proven in time (the bisection goes on)."""
    sizes = layer_sizes(f) if s.formulation == "auto" else None
    if sizes is None or not sizes.uniform or _remaining(s) <= 0:
        return None
    twins = twin_pairs(f) if s.break_symmetry else []
    r = solve_counts(f, sizes, relax=True, time_limit_s=0.5 * _remaining(s), max_stages=s.max_stages,
                     min_stages=s.min_stages, twins=twins, cycle_streams=s.n_streams)
    if r.stages is None or not r.optimal:
        return None
    cycle = time_stages(f, r.stages, s.n_streams, True).cycle_ms
    tie = _TIE * cycle + 1e-12
    try:
        best = least_latency(f, s, cycle + tie, s.n_streams * (cycle + tie))
    except PlacementTimeout:
        return None
    if best.stages is None or not best.optimal:
        return None
    return time_stages(f, best.stages, s.n_streams, True)


def best_cycle(f: Fleet, s: Search, top: Timing, top_bound_ms: float) -> Timing:
    """Least cycle (then least latency) by bisection over the bottleneck cap τ (module doc).

    pred(k) := Lmin(τ_k) ≤ N·τ_k is monotone in k; with k the first index where it holds,
    T* = min(τ_k, Lmin(τ_{k-1})/N), reached by the least-latency plan at τ_k or at τ_{k-1}.
    Probes carry the bound latency ≤ N·τ_k, so a false predicate is a quick infeasibility proof.
    ``top`` is the unconstrained least-latency plan, ``top_bound_ms`` its proven bound.
    """
    n = s.n_streams
    direct = _direct_cycle(f, s)
    if direct is not None:
        return direct
    sizes = np.concatenate([stage_ms(f, d, *np.triu_indices(f.n_layers))
                            for d in range(len(f.device_ids))])
    taus = np.unique(np.concatenate((sizes, f.lat.ravel(), f.coord)))
    lo, hi, optimal = 0, len(taus) - 1, top.optimal
    lower = top_bound_ms / n  # a proven lower bound on the cycle
    found: list[tuple[int, int, Timing]] = []  # plan is least-latency for caps τ_from..τ_to

    def settle(k: int, plan: Timing) -> None:
        # The plan stays least-latency for every cap from its own bottleneck up to τ_k, and no
        # cap ≤ τ_k does better, so the predicate is false below i_n and true from max(k_b, i_n).
        nonlocal lo, hi
        k_b = int(np.searchsorted(taus, plan.bottleneck_ms))
        i_n = int(np.searchsorted(taus, plan.per_token_ms / n))
        found.append((k_b, k, plan))
        lo = max(lo, min(i_n, k + 1))
        if max(k_b, i_n) <= k:
            hi = min(hi, max(k_b, i_n))

    def probe(k: int, max_latency: float) -> Timing | None:
        nonlocal optimal, lower
        if time.monotonic() >= s.deadline:
            raise PlacementTimeout("time limit reached during the bottleneck search")
        r = least_latency(f, s, float(taus[k]), max_latency)
        optimal &= r.optimal
        if r.stages is None:  # proven: no plan has every stage and hop ≤ τ_k and cycle ≤ τ_k
            lower = max(lower, min(float(taus[k]), max_latency / n))
            return None
        return time_stages(f, r.stages, n, r.optimal)

    settle(hi, top)
    try:
        while lo < hi:
            k = (lo + hi) // 2
            plan = probe(k, n * float(taus[k]))
            if plan is None:
                lo = k + 1
            else:
                settle(k, plan)
        if hi > 0 and not any(a <= hi - 1 <= b for a, b, _ in found):
            # Lmin(τ_{k-1}) / N is the other candidate; only a plan beating the best counts.
            best_ms = min(p.cycle_ms for _, _, p in found)
            plan = probe(hi - 1, n * best_ms)
            if plan is not None:
                found.append((hi - 1, hi - 1, plan))
    except PlacementTimeout:
        optimal = False
    best = min((p for _, _, p in found), key=lambda p: (p.cycle_ms, p.per_token_ms))
    return replace(best, optimal=optimal, gap=0.0 if optimal else relative_gap(best.cycle_ms, lower))
