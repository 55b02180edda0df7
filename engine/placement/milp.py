"""The cuts model: the placement MILP with candidate stages (device, layer range) as columns.

Pure numbers over a prepared `Fleet` (no profiles, no names the solver does not need);
`engine.placement.planner` validates the inputs, builds the fleet, and turns the stages found here into
a `Plan`.

Formulation - a path through layer cuts instead of PLACEMENT.md's slots, because layers are
contiguous: a stage is fully described by (device, first layer, last layer), so slots need no
variables and the slot symmetry disappears. D devices, L layers, P PCs, cut c = after layer c.

    z[k] ∈ {0,1}        candidate stage k = (device d, layers i..j); only ranges that fit d's
                        memory (and its PC's) are generated, so the device limit is exact
    h[c,p,q] ∈ [0,1]    cut c hands over from PC p to PC q                (only when P > 1)

    Σ_{k starts at 0} z = 1;  Σ_{k ends at c} z = Σ_{k starts at c+1} z    (one chain of stages)
    Σ_{k on d} z ≤ 1                       each device at most one stage
    Σ_{k on PC p} bytes·z ≤ C[p]           devices of a PC share its memory
    Σ_q h[c,p,q] = Σ_{k on p ends at c} z;  Σ_p h[c,p,q] = Σ_{k on q starts at c+1} z
        -- a transportation polytope with 0/1 unit-vector margins once z is integral, so h is
           forced to the one hand-over pair without being declared integer
    h[c,p,p] ≤ Σ_{e on p, e ≠ d} (e ends at c + e starts at c+1)   for each d on p
    Σ_c h[c,p,p] ≤ Σ_{e on p, e ≠ d} (e used)                         for each d on p
        -- valid cuts: a same-PC hand-over needs a second device, and a PC whose stages run
           back to back hands over (used - 1) times. Without them the LP relaxation splits one
           device into two half stages around another and skips hop costs (2-100x slower).
    min_stages ≤ Σ z ≤ max_stages (both optional)

    minimise ms ≥ Σ z·(stage ms + coordinator hop if it holds layer 0 / L-1) + Σ h·lat[p][q]

It solves any layer sizes, but has D·L(L+1)/2 range columns (~250,000 at 30 devices and 128
layers); `engine.placement.counts` is exact with far fewer when the interior layers are alike, and
`engine.placement.search` chooses between them and searches the bottleneck for throughput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from engine.errors import DeskfleetError
from engine.placement.fleet import GB, Fleet, Stage, stage_ms

__all__ = ["Milp", "build_milp", "extract_stages", "run_milp", "twin_pairs"]

_MIP_REL_GAP = 1e-9  # HiGHS's default 1e-4 would call a 0.01 %-worse plan "optimal"
# HiGHS presolve finds almost nothing to remove in these models but its probing cost 1-8 s per
# solve on 30- and 64-layer fleets (measured); without it the 30-layer, 12-device benchmark set
# took ~30 % less CPU.
_PRESOLVE = False

# --- the MILP -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Columns:
    """Candidate stages z[k] = (device, first..last), as parallel (K,) arrays."""

    dev: np.ndarray
    first: np.ndarray
    last: np.ndarray
    mem: np.ndarray  # bytes
    ms: np.ndarray  # compute per token


def _columns(f: Fleet, cap_ms: float | None, keep_oversized: bool) -> _Columns:
    """Every (device, layer range) stage that fits the device and its PC (all of them when
    ``keep_oversized``, for the shortfall re-solve) and, under ``cap_ms``, whose own time and
    coordinator hops stay within the cap."""
    L = f.n_layers
    first, last = np.triu_indices(L)
    parts = []
    for d in range(len(f.device_ids)):
        span = f.stage_bytes(d, first, last)
        ms = stage_ms(f, d, first, last)
        ok = np.ones(len(first), bool)
        if not keep_oversized:
            ok &= span <= min(f.dev_cap[d], f.pc_cap[f.dev_pc[d]])
        if cap_ms is not None:
            hop = f.coord[f.dev_pc[d]]
            ok &= (ms <= cap_ms) & ((first > 0) | (hop <= cap_ms)) & ((last < L - 1) | (hop <= cap_ms))
        parts.append((np.full(ok.sum(), d), first[ok], last[ok], span[ok], ms[ok]))
    return _Columns(*(np.concatenate(x) for x in zip(*parts, strict=True)))


class _Rows:
    """Sparse constraint rows lo ≤ Σ coef·x ≤ hi, added in blocks of COO triplets."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.lo: list[np.ndarray] = []
        self.hi: list[np.ndarray] = []
        self.n = 0

    def block(self, n_rows: int, row, col, val, lo, hi) -> None:
        """Rows ``0..n_rows-1`` of a new block; entry e sits in row ``row[e]``, column ``col[e]``."""
        row = np.asarray(row, int)
        self.parts.append((self.n + row, np.asarray(col, int),
                           np.broadcast_to(np.asarray(val, float), row.shape)))
        self.lo.append(np.broadcast_to(np.asarray(lo, float), (n_rows,)))
        self.hi.append(np.broadcast_to(np.asarray(hi, float), (n_rows,)))
        self.n += n_rows

    def row(self, col, val, lo: float, hi: float) -> None:
        self.block(1, np.zeros(len(col), int), col, val, lo, hi)

    def constraint(self, n_cols: int) -> LinearConstraint:
        r, c, v = (np.concatenate(x) for x in zip(*self.parts, strict=True))
        A = coo_array((v, (r, c)), shape=(self.n, n_cols)).tocsr()
        return LinearConstraint(A, np.concatenate(self.lo), np.concatenate(self.hi))


@dataclass(frozen=True)
class Milp:
    """One model for `scipy.optimize.milp`; ``cols`` maps its first columns back to stages."""

    c: np.ndarray
    integrality: np.ndarray
    bounds: Bounds
    constraints: LinearConstraint
    cols: _Columns
    n_layers: int


def build_milp(f: Fleet, max_stages: int | None, *, min_stages: int = 1, slack: bool = False,
               cap_ms: float | None = None, max_latency: float | None = None,
               break_symmetry: bool = False) -> Milp:
    """The latency MILP (every stage and hop ≤ ``cap_ms`` and latency ≤ ``max_latency`` if
    given), or with ``slack`` the least extra memory Σσ[p] that would make the model fit.
    Columns: z, then h (P > 1), then σ (slack) or the latency ms (otherwise)."""
    D, L, P = len(f.device_ids), f.n_layers, len(f.pc_ids)
    cols = _columns(f, cap_ms, keep_oversized=slack)
    K = len(cols.dev)
    n_h = (L - 1) * P * P if P > 1 else 0
    n = K + n_h + (P if slack else 0)
    zk = np.arange(K)
    pc = f.dev_pc[cols.dev]
    at_start, at_end = cols.first == 0, cols.last == L - 1
    inner, later = ~at_end, cols.first > 0
    ones = np.ones
    rows = _Rows()

    rows.row(zk[at_start], 1.0, 1.0, 1.0)
    rows.block(L - 1, np.concatenate((cols.last[inner], cols.first[later] - 1)),
               np.concatenate((zk[inner], zk[later])),
               np.concatenate((ones(inner.sum()), -ones(later.sum()))), 0.0, 0.0)
    rows.block(D, cols.dev, zk, 1.0, 0.0, 1.0)
    gb = cols.mem / GB
    if slack:  # σ[p] is extra memory on PC p: it lifts the PC's limit and each of its devices'
        s0 = K + n_h
        rows.block(D, np.concatenate((cols.dev, np.arange(D))),
                   np.concatenate((zk, s0 + f.dev_pc)), np.concatenate((gb, -ones(D))),
                   -np.inf, f.dev_cap / GB)
        rows.block(P, np.concatenate((pc, np.arange(P))), np.concatenate((zk, s0 + np.arange(P))),
                   np.concatenate((gb, -ones(P))), -np.inf, f.pc_cap / GB)
    else:
        # Only PCs whose devices could together exceed the shared limit get a row.
        biggest = np.zeros(D)
        np.maximum.at(biggest, cols.dev, cols.mem)
        shared = np.flatnonzero(np.bincount(f.dev_pc, weights=biggest, minlength=P) > f.pc_cap)
        row_of = np.full(P, -1)
        row_of[shared] = np.arange(len(shared))
        on = row_of[pc] >= 0
        rows.block(len(shared), row_of[pc[on]], zk[on], gb[on], -np.inf, f.pc_cap[shared] / GB)

    hk, hop_ms = K + np.arange(n_h), np.zeros(n_h)
    if P > 1:
        c_idx, p_idx, q_idx = (a.ravel() for a in np.indices((L - 1, P, P)))
        hop_ms = f.lat[p_idx, q_idx]
        rows.block((L - 1) * P, np.concatenate((c_idx * P + p_idx, cols.last[inner] * P + pc[inner])),
                   np.concatenate((hk, zk[inner])), np.concatenate((ones(n_h), -ones(inner.sum()))),
                   0.0, 0.0)
        rows.block((L - 1) * P,
                   np.concatenate((c_idx * P + q_idx, (cols.first[later] - 1) * P + pc[later])),
                   np.concatenate((hk, zk[later])), np.concatenate((ones(n_h), -ones(later.sum()))),
                   0.0, 0.0)
        cuts = np.arange(L - 1)
        alone = np.bincount(f.dev_pc, minlength=P) == 1
        same_pc = (p_idx == q_idx) & alone[p_idx]  # one device cannot hand over to itself
        for d in map(int, np.flatnonzero(~alone[f.dev_pc])):
            # A same-PC hand-over needs another device e of that PC to end or start there...
            p = f.dev_pc[d]
            h_pp = K + (cuts * P + p) * P + p
            other = (pc == p) & (cols.dev != d)
            ends, starts = other & inner, other & later
            rows.block(L - 1, np.concatenate((cuts, cols.last[ends], cols.first[starts] - 1)),
                       np.concatenate((h_pp, zk[ends], zk[starts])),
                       np.concatenate((ones(L - 1), -ones(ends.sum() + starts.sum()))),
                       -np.inf, 0.0)
            # ...and a PC whose used devices run back to back hands over (used - 1) times:
            # Σ_c h[c,p,p] ≤ Σ_{e on p, e ≠ d} used(e), which cuts "d, e, d again" sandwiches.
            rows.row(np.concatenate((h_pp, zk[other])),
                     np.concatenate((ones(L - 1), -ones(other.sum()))), -np.inf, 0.0)
    if max_stages is not None or min_stages > 1:
        rows.row(zk, 1.0, float(min_stages), np.inf if max_stages is None else float(max_stages))
    for d, e in twin_pairs(f) if break_symmetry else ():
        # Interchangeable d, e: keep only solutions where d is used if e is, and starts first.
        on_d, on_e = cols.dev == d, cols.dev == e
        rows.row(np.concatenate((zk[on_e], zk[on_d])),
                 np.concatenate((ones(on_e.sum()), -ones(on_d.sum()))), -np.inf, 0.0)
        rows.row(np.concatenate((zk[on_d], zk[on_e])),
                 np.concatenate((cols.first[on_d], L - cols.first[on_e])), -np.inf, float(L))

    c = np.zeros(n)
    if slack:
        c[K + n_h:] = 1.0
    else:
        # The latency goes into one continuous column, ms ≥ Σ cost·x, which is minimised.
        # With the costs on the binaries themselves, HiGHS extracts "objective cliques" from
        # every incumbent, quadratic in the columns: 30 of 33 s CPU on a 64-layer, 30-device
        # fleet went there (2.3 s this way). ``max_latency`` bounds that column and is also
        # stated on the binaries, where HiGHS turns it into cliques that prove "nothing that
        # good" quickly (measured: half the CPU of the bound alone on 30-layer probes).
        cost = np.concatenate((cols.ms + np.where(at_start, f.coord[pc], 0.0)
                               + np.where(at_end, f.coord[pc], 0.0), hop_ms))
        nz = np.flatnonzero(cost)
        rows.row(np.append(nz, n), np.append(cost[nz], -1.0), -np.inf, 0.0)
        if max_latency is not None:
            rows.row(nz, cost[nz], -np.inf, max_latency)
        c = np.zeros(n + 1)
        c[n] = 1.0
        n += 1
    integrality = np.zeros(n)
    integrality[:K] = 1  # h follows z (transportation margins); σ and ms are continuous
    ub = np.full(n, np.inf)
    ub[:K + n_h] = 1.0
    if P > 1:
        ub[K:K + n_h] = ~same_pc & (hop_ms <= (np.inf if cap_ms is None else cap_ms))
    if max_latency is not None:
        ub[-1] = max_latency
    return Milp(c, integrality, Bounds(np.zeros(n), ub), rows.constraint(n), cols, L)


def twin_pairs(f: Fleet) -> list[tuple[int, int]]:
    """Pairs (d, e) of devices that a symmetry of the problem swaps; d is ordered before e.

    Identical devices of one PC pair up directly. Identical PCs (same memory, coordinator hop,
    latencies to every other PC, and device list) pair through their first devices; this is
    compatible with the per-PC pairs because swapping two PCs maps k-th device to k-th device.
    """
    D, P = len(f.device_ids), len(f.pc_ids)
    sig = [(f.layer_ms[d], f.overhead_ms[d], f.dev_cap[d], f.mem_pre[d].tobytes(), f.ms_pre[d].tobytes())
           for d in range(D)]
    pairs = [(d, d + 1) for d in range(D - 1)
             if f.dev_pc[d] == f.dev_pc[d + 1] and sig[d] == sig[d + 1]]
    members = [[d for d in range(D) if f.dev_pc[d] == p] for p in range(P)]

    def twins(p: int, q: int) -> bool:
        others = [r for r in range(P) if r not in (p, q)]
        return bool(f.pc_cap[p] == f.pc_cap[q] and f.coord[p] == f.coord[q]
                    and f.lat[p, q] == f.lat[q, p]
                    and [sig[d] for d in members[p]] == [sig[d] for d in members[q]]
                    and (f.lat[p, others] == f.lat[q, others]).all()
                    and (f.lat[others, p] == f.lat[others, q]).all())

    classes: list[list[int]] = []
    for p in range(P):
        home = next((cl for cl in classes if all(twins(p, q) for q in cl)), None)
        if home is None:
            classes.append([p])
        else:
            home.append(p)
    for cl in classes:
        pairs += [(members[p][0], members[q][0]) for p, q in pairwise(cl)]
    return pairs


def run_milp(m: Milp, deadline: float):
    """HiGHS on ``m`` until ``deadline`` (at least 50 ms); the `scipy.optimize.milp` result."""
    remaining = max(deadline - time.monotonic(), 0.05)
    return milp(m.c, integrality=m.integrality, bounds=m.bounds, constraints=[m.constraints],
                options={"time_limit": remaining, "mip_rel_gap": _MIP_REL_GAP,
                         "presolve": _PRESOLVE})


# --- reading a solution -------------------------------------------------------------------

def extract_stages(m: Milp, x: np.ndarray) -> list[Stage]:
    """(device, first, last) per chosen stage, in layer order."""
    chosen = np.flatnonzero(x[: len(m.cols.dev)] > 0.5)
    stages = sorted(((int(m.cols.dev[k]), int(m.cols.first[k]), int(m.cols.last[k]))
                     for k in chosen), key=lambda s: s[1])
    edges = [-1] + [b for s in stages for b in (s[1] - 1, s[2])] + [m.n_layers - 1]
    if not stages or edges[0::2] != edges[1::2]:
        raise DeskfleetError("the placement solver returned stages that do not chain; this is "
                             "a bug - please report it with the fleet profiles")
    return stages
