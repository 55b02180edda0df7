"""The counts model: placement as layer counts and a device order, exact when layers are alike.

A model's decoder layers are usually all the same size; only layer 0 (with the embedding) and the
last layer (with the final norm and head) differ. Then a stage's bytes and milliseconds depend
only on its device, how many layers it holds and whether it holds the first and/or the last
layer - not on where its layers sit. The plan is then an ordered list of devices with a layer
count each, and the MILP needs a handful of variables per device instead of one column per
(device, layer range) - 150 integer columns and ~900 arcs at 30 devices instead of ~250,000
range columns for 128 layers (`engine.placement.milp`'s cuts model, which solves any sizes).

    u[d], f[d], g[d] ∈ {0,1}   device d holds a stage / the first / the last layer
    n[d] ∈ {0..n_max[d]}       its layer count;  s[d] ∈ [0, L] its first layer
    a[d,e] ∈ {0,1}             d hands over to e (d ≠ e; same-PC pairs cost no latency)

    Σ n = L;  u ≤ n ≤ n_max·u;  Σ f = Σ g = 1;  f, g ≤ u
    Σ_e a[d,e] + g[d] = u[d];   Σ_d a[d,e] + f[e] = u[e]           (one path, first to last)
    a[d,e] = 1  ⇒  s[e] ≥ s[d] + n[d];  f ⇒ s = 0;  g ⇒ s + n = L;  s + n ≤ L   (no detached cycles)
    m[d] ≥ bytes of d's stage;  m[d] ≤ min(C[d], C[pc]);  Σ_{d on pc} m[d] ≤ C[pc]
    minimise Σ t·n + o·u + (first_ms + coord)·f + (last_ms + coord)·g + Σ lat[pc d, pc e]·a

With equal interior layers of b bytes, a stage's bytes are b·n + (first_bytes − b)·f +
(last_bytes − b)·g and the model is exact. When they differ (mixed quantisation, alternating
attention windows) the same model is solved twice: as a relaxation, with the bytes bounded
below by the lower convex hull of the least sums of n consecutive interior layers (its optimum
is a proven lower bound, and the optimal plan if its split happens to fit), and as a
restriction, with every interior layer as large as the largest (every plan it finds fits).
`engine.placement.search.least_latency` puts the two together with the cuts model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from engine.errors import DeskfleetError
from engine.placement.fleet import GB, Fleet, Stage

__all__ = ["CountsResult", "LayerSizes", "layer_sizes", "solve_counts"]

_MIP_REL_GAP = 1e-9
# Presolve off: at 30 devices × 128 layers the solves took ~40 % less time without it (measured,
# the unconstrained solve and two bottleneck probes, interleaved).
_PRESOLVE = False


@dataclass(frozen=True)
class LayerSizes:
    """Per device d, what the counts model knows of its layers' bytes and ms.

    ``lines_a[d, k] · n + lines_c[d, k]`` ≤ the bytes of any n consecutive interior layers, for
    every k: the lower convex hull of the least window sums (n = 0..L-2), exact (one line through
    0) when the interior layers are alike. ``inner_hi`` is the largest interior layer, ``n_fit``
    the most layers any stage on d can hold (its least window sum fits d and its PC).
    """

    lines_a: np.ndarray  # (D, K) slope, bytes per layer
    lines_c: np.ndarray  # (D, K) intercept, bytes (≤ 0)
    inner_hi: np.ndarray  # (D,)
    first_bytes: np.ndarray  # (D,) layer 0 with the embedding
    last_bytes: np.ndarray  # (D,) the last layer with the head
    first_ms: np.ndarray  # (D,) extra ms of layer 0 (embedding)
    last_ms: np.ndarray  # (D,) extra ms of the last layer (head)
    n_fit: np.ndarray  # (D,) int
    uniform: bool  # every interior layer of every device alike: the model is exact


def layer_sizes(f: Fleet) -> LayerSizes | None:
    """The fleet's layers as the counts model sees them; None when it cannot describe them
    (under 3 layers, or extra milliseconds on an interior layer)."""
    D, L = len(f.device_ids), f.n_layers
    if L < 3:
        return None
    mem, ms = np.diff(f.mem_pre, axis=1), np.diff(f.ms_pre, axis=1)
    if np.any(ms[:, 1:-1] != 0):
        return None
    inner = mem[:, 1:-1]
    uniform = bool(np.all(inner == inner[:, :1]))
    cap = np.minimum(f.dev_cap, f.pc_cap[f.dev_pc])
    hulls, n_fit, memo = [], np.zeros(D, int), {}
    for d in range(D):
        key = f.mem_pre[d].tobytes()
        if key not in memo:
            inner_pre = f.mem_pre[d, 1:-1] - f.mem_pre[d, 1]
            memo[key] = (_least_windows(f.mem_pre[d]), _lower_hull(_least_windows(inner_pre)))
        least, hull = memo[key]
        n_fit[d] = int(np.searchsorted(least, cap[d], side="right")) - 1
        hulls.append(hull if not uniform else [(float(inner[d, 0]), 0.0)])
    K = max(len(h) for h in hulls)
    lines = np.array([h + [h[-1]] * (K - len(h)) for h in hulls])  # (D, K, 2)
    return LayerSizes(lines[:, :, 0], lines[:, :, 1], inner.max(axis=1), mem[:, 0], mem[:, -1],
                      ms[:, 0], ms[:, -1], np.minimum(n_fit, L), uniform)


def _least_windows(pre: np.ndarray) -> np.ndarray:
    """least[n] = the least sum of n consecutive layers (n = 0..len), from prefix sums."""
    n_layers = len(pre) - 1
    return np.array([float((pre[n:] - pre[:n_layers + 1 - n]).min()) for n in range(n_layers + 1)])


def _lower_hull(y: np.ndarray) -> list[tuple[float, float]]:
    """The lines (slope, intercept) of the lower convex hull of the points (n, y[n])."""
    pts: list[int] = []
    for n in range(len(y)):
        while len(pts) >= 2:
            a, b = pts[-2], pts[-1]
            if (y[b] - y[a]) * (n - a) >= (y[n] - y[a]) * (b - a):  # b on or above a-n: drop it
                pts.pop()
            else:
                break
        pts.append(n)
    if len(pts) == 1:
        return [(0.0, float(y[0]))]
    return [((y[b] - y[a]) / (b - a), y[a] - (y[b] - y[a]) / (b - a) * a) for a, b in zip(pts, pts[1:], strict=False)]


@dataclass(frozen=True)
class CountsResult:
    """One solve: stages in layer order (None: proven infeasible, or none found in time),
    whether HiGHS proved optimality, and its proven lower bound on the latency (ms)."""

    stages: list[Stage] | None
    optimal: bool
    bound_ms: float
    timed_out: bool = False


def solve_counts(f: Fleet, sizes: LayerSizes, *, relax: bool, time_limit_s: float,
                 max_stages: int | None = None, min_stages: int = 1, cap_ms: float | None = None,
                 max_latency: float | None = None, twins: Sequence[tuple[int, int]] = (),
                 cycle_streams: int | None = None) -> CountsResult:
    """Least-latency counts and order (module doc); each stage and hop ≤ ``cap_ms``, latency ≤
    ``max_latency``. A stage's bytes are bounded below by the hull lines (``relax``: a
    relaxation, exact when the layers are alike) or above by its count times the largest
    interior layer (a restriction). ``twins`` (d, e) are interchangeable: d takes the larger count.
    With ``cycle_streams`` N it minimises the cycle instead: T ≥ every stage, hop and coordinator
    time and T ≥ latency / N (``bound_ms`` is then a bound on the cycle)."""
    D, L = len(f.device_ids), f.n_layers
    pc = f.dev_pc
    cap_gb = np.minimum(f.dev_cap, f.pc_cap[pc]) / GB
    if relax:
        line_a, line_c = sizes.lines_a / GB, sizes.lines_c / GB
    else:
        line_a, line_c = sizes.inner_hi[:, None] / GB, np.zeros((D, 1))
    n_max = sizes.n_fit.copy()
    coord = f.coord[pc]
    first_ok = last_ok = np.ones(D, bool)
    if cap_ms is not None:
        spare = cap_ms - f.overhead_ms
        n_max = np.minimum(n_max, np.floor(np.maximum(spare, -1) / f.layer_ms + 1e-9)).astype(int)
        first_ok, last_ok = coord <= cap_ms, coord <= cap_ms
    n_max = np.maximum(n_max, 0)
    src, dst = (a.ravel() for a in np.indices((D, D)))
    keep = src != dst
    if cap_ms is not None:
        keep &= f.lat[pc[src], pc[dst]] <= cap_ms
    src, dst = src[keep], dst[keep]
    A = len(src)
    U, F, G, N, S, M, AR = (k * D for k in range(7))  # column blocks; arcs from AR
    n_cols = AR + A
    d_idx = np.arange(D)
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def add(n_rows, r, c, v, lo, hi) -> None:
        r = np.asarray(r, int)
        rows.append((r, np.asarray(c, int), np.broadcast_to(np.asarray(v, float), r.shape),
                     np.broadcast_to(np.asarray(lo, float), (n_rows,)),
                     np.broadcast_to(np.asarray(hi, float), (n_rows,))))

    z, o1 = np.zeros(D, int), np.ones(D)
    add(1, z, N + d_idx, 1.0, L, L)                                        # Σ n = L
    add(D, np.r_[d_idx, d_idx], np.r_[N + d_idx, U + d_idx], np.r_[o1, -o1], 0, np.inf)  # n ≥ u
    add(D, np.r_[d_idx, d_idx], np.r_[N + d_idx, U + d_idx], np.r_[o1, -n_max], -np.inf, 0)
    add(1, z, F + d_idx, 1.0, 1, 1)
    add(1, z, G + d_idx, 1.0, 1, 1)
    for blk in (F, G):                                                     # f, g ≤ u
        add(D, np.r_[d_idx, d_idx], np.r_[blk + d_idx, U + d_idx], np.r_[o1, -o1], -np.inf, 0)
    arc = AR + np.arange(A)
    ones_a = np.ones(A)
    add(D, np.r_[src, d_idx, d_idx], np.r_[arc, G + d_idx, U + d_idx], np.r_[ones_a, o1, -o1], 0, 0)
    add(D, np.r_[dst, d_idx, d_idx], np.r_[arc, F + d_idx, U + d_idx], np.r_[ones_a, o1, -o1], 0, 0)
    # Positions: a[d,e] = 1 ⇒ s[e] ≥ s[d] + n[d], which no cycle can keep. (The other direction
    # of the big-M, for s[e] = s[d] + n[d], doubled the solve time: measured at 30 × 128.)
    a_rows = np.arange(A)
    add(A, np.tile(a_rows, 4), np.r_[S + dst, S + src, N + src, arc],
        np.r_[ones_a, -ones_a, -ones_a, -L * ones_a], -L, np.inf)
    add(D, np.r_[d_idx, d_idx], np.r_[S + d_idx, N + d_idx], 1.0, -np.inf, L)         # s + n ≤ L
    add(D, np.r_[d_idx, d_idx], np.r_[S + d_idx, F + d_idx], np.r_[o1, L * o1], -np.inf, L)
    add(D, np.r_[d_idx, d_idx, d_idx], np.r_[S + d_idx, N + d_idx, G + d_idx],
        np.r_[o1, o1, -L * o1], 0, np.inf)                                 # g ⇒ s + n = L
    # m[d] ≥ each line's bytes for d's stage (module doc), m[d] ≤ its limit, Σ_pc m ≤ the PC's.
    K = line_a.shape[1]
    fb, lb = sizes.first_bytes / GB, sizes.last_bytes / GB
    for k in range(K):
        a_k, c_k = line_a[:, k], line_c[:, k]
        add(D, np.tile(d_idx, 5), np.r_[M + d_idx, N + d_idx, U + d_idx, F + d_idx, G + d_idx],
            np.r_[o1, -a_k, -c_k, -(fb - a_k), -(lb - a_k)], 0, np.inf)
    shared = [p for p in range(len(f.pc_ids)) if np.count_nonzero(pc == p) > 1]
    for p in shared:
        on = np.flatnonzero(pc == p)
        add(1, np.zeros(len(on), int), M + on, 1.0, -np.inf, f.pc_cap[p] / GB)
    if max_stages is not None or min_stages > 1:
        add(1, z, U + d_idx, 1.0, min_stages, np.inf if max_stages is None else max_stages)
    if cap_ms is not None:
        add(D, np.tile(d_idx, 4), np.r_[N + d_idx, U + d_idx, F + d_idx, G + d_idx],
            np.r_[f.layer_ms, f.overhead_ms, sizes.first_ms, sizes.last_ms], -np.inf, cap_ms)
    for d, e in twins:
        add(1, [0, 0], [N + d, N + e], [1.0, -1.0], 0, np.inf)

    c = np.zeros(n_cols)
    c[N:N + D] = f.layer_ms
    c[U:U + D] = f.overhead_ms
    c[F:F + D] = sizes.first_ms + coord
    c[G:G + D] = sizes.last_ms + coord
    c[arc] = f.lat[pc[src], pc[dst]]
    if max_latency is not None:
        nz = np.flatnonzero(c)
        add(1, np.zeros(len(nz), int), nz, c[nz], -np.inf, max_latency)
    if cycle_streams is not None:  # one more column, T, and it alone is minimised
        T = n_cols
        n_cols += 1
        t_col = np.full(D, T)
        add(D, np.r_[np.tile(d_idx, 4), d_idx], np.r_[N + d_idx, U + d_idx, F + d_idx, G + d_idx, t_col],
            np.r_[f.layer_ms, f.overhead_ms, sizes.first_ms, sizes.last_ms, -o1], -np.inf, 0)
        for blk in (F, G):
            add(D, np.r_[d_idx, d_idx], np.r_[blk + d_idx, t_col], np.r_[coord, -o1], -np.inf, 0)
        hop = np.flatnonzero(c[arc] > 0)
        add(len(hop), np.tile(np.arange(len(hop)), 2), np.r_[arc[hop], np.full(len(hop), T)],
            np.r_[c[arc][hop], -np.ones(len(hop))], -np.inf, 0)
        nz = np.flatnonzero(c)
        add(1, np.zeros(len(nz) + 1, int), np.r_[nz, T], np.r_[c[nz] / cycle_streams, -1.0], -np.inf, 0)
        c = np.zeros(n_cols)
        c[T] = 1.0
    offset = 0
    row_parts, col_parts, val_parts, lo, hi = [], [], [], [], []
    for r, cc, v, rl, rh in rows:
        row_parts.append(r + offset)
        col_parts.append(cc)
        val_parts.append(v)
        lo.append(rl)
        hi.append(rh)
        offset += len(rl)
    A_mat = coo_array((np.concatenate(val_parts), (np.concatenate(row_parts), np.concatenate(col_parts))),
                      shape=(offset, n_cols)).tocsr()
    ub = np.concatenate((np.minimum(n_max, 1), (n_max > 0) & first_ok, (n_max > 0) & last_ok, n_max,
                         np.full(D, float(L)), cap_gb, np.ones(A), np.full(n_cols - AR - A, np.inf))).astype(float)
    lb_cols = np.zeros(n_cols)
    lb_cols[M:M + D] = -np.inf  # a hull line may dip below 0 for an unused device
    integrality: np.ndarray = np.ones(n_cols)
    integrality[S:M + D] = 0
    integrality[AR + A:] = 0  # T
    res = milp(c, integrality=integrality, bounds=Bounds(lb_cols, ub),
               constraints=[LinearConstraint(A_mat, np.concatenate(lo), np.concatenate(hi))],
               options={"time_limit": max(time_limit_s, 0.05), "mip_rel_gap": _MIP_REL_GAP,
                        "presolve": _PRESOLVE})
    if res.status == 2:
        return CountsResult(None, True, math.inf)
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(bound) if bound is not None and np.isfinite(bound) else 0.0
    if res.x is None:
        return CountsResult(None, False, bound, timed_out=True)
    return CountsResult(_stages(res.x, D, src, dst, L), res.status == 0,
                        float(res.fun) if res.status == 0 else bound)


def _stages(x: np.ndarray, D: int, src: np.ndarray, dst: np.ndarray, L: int) -> list[Stage]:
    """Follow the hand-overs from the first device; (device, first, last) in layer order."""
    used = x[:D] > 0.5
    counts = np.rint(x[3 * D:4 * D]).astype(int)
    chosen = np.flatnonzero(x[6 * D:6 * D + len(src)] > 0.5)
    nxt = dict(zip(src[chosen].tolist(), dst[chosen].tolist(), strict=True))
    d = int(np.argmax(x[D:2 * D]))
    stages: list[Stage] = []
    start = 0
    while True:
        stages.append((d, start, start + int(counts[d]) - 1))
        start += int(counts[d])
        if d not in nxt or len(stages) > D:
            break
        d = nxt[d]
    if start != L or len(stages) != int(used.sum()) or any(n < 1 for n in counts[used]):
        raise DeskfleetError("the placement solver's counts model returned a chain that does not "
                             "cover the layers; this is a bug - please report it with the fleet profiles")
    return stages
