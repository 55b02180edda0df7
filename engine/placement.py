"""Stage placement: how many stages, which contiguous layers each holds, and on which device.

Pure decision code over frozen inputs (no sockets, no OpenVINO, no Qt): the console feeds it the
agents' calibrated device profiles and measured links and shows the returned `Plan`.

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
    Σ z ≤ max_stages (optional)

    minimise ms ≥ Σ z·(stage ms + coordinator hop if it holds layer 0 / L-1) + Σ h·lat[p][q]

Throughput for N interleaved streams: a token leaves the ring every
cycle = max(bottleneck, latency / N) ms, where the bottleneck is the slowest stage or hop. A
minimax MILP is slow to prove (flat LP bound), so the solver searches the bottleneck instead:
with Lmin(τ) = least latency when every stage and hop takes ≤ τ,
    T* = min over τ in {stage, hop and coordinator times} of max(τ, Lmin(τ) / N),
and max(increasing, non-increasing) is minimised where the two cross, found by bisection in
O(log #values) latency MILPs (most skipped: one solved plan settles a whole range of τ). The
plan found at T* also has the least latency among plans with cycle T* (exact tie-break).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from types import MappingProxyType
from typing import Literal

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from engine.errors import DeskfleetError

__all__ = [
    "DeviceProfile", "Exclusion", "Links", "ModelProfile", "PcInfo", "Plan", "PlacementInfeasible",
    "PlacementInputError", "PlacementRequest", "PlacementTimeout", "PlannedStage", "format_plan",
    "solve",
]

GB = 1e9  # decimal gigabytes in messages; the MILP works in GB so HiGHS sees O(1) numbers
_MIP_REL_GAP = 1e-9  # HiGHS's default 1e-4 would call a 0.01 %-worse plan "optimal"
# HiGHS presolve finds almost nothing to remove in these models but its probing cost 1-8 s per
# solve on 30- and 64-layer fleets (measured); without it the 30-layer, 12-device benchmark set
# took ~30 % less CPU.
_PRESOLVE = False

DeviceKind = Literal["CPU", "GPU", "NPU"]
Objective = Literal["latency", "throughput"]
Stage = tuple[int, int, int]  # (device index, first layer, last layer)


class PlacementInputError(DeskfleetError):
    """Raised when the profiles or request handed to the solver are inconsistent or incomplete."""


class PlacementInfeasible(DeskfleetError):
    """Raised when no plan exists: no agent is available, or the model does not fit in memory.

    ``shortfall_bytes`` is the least extra usable memory that would make a plan possible (None
    when no agent was available at all); ``excluded`` lists the agents left out and why.
    """

    def __init__(self, message: str, *, shortfall_bytes: float | None = None,
                 excluded: tuple[Exclusion, ...] = ()) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes
        self.excluded = excluded


class PlacementTimeout(DeskfleetError):
    """Raised when the time limit passed before HiGHS found any plan."""


@dataclass(frozen=True)
class DeviceProfile:
    """One candidate device of an agent, calibrated for the model being placed.

    ``layer_ms`` is t[d], decode time of one layer for one token; ``overhead_ms`` is o[d], the
    fixed cost of running a stage (dispatch, activation copies); ``memory_bytes`` is the memory
    the device can address now, of which the solver uses ``PlacementRequest.headroom``.
    """

    device_id: str  # "pc-a/GPU"
    pc_id: str
    kind: DeviceKind
    layer_ms: float
    overhead_ms: float
    memory_bytes: int


@dataclass(frozen=True)
class PcInfo:
    """One agent's PC: free memory shared by all its devices, and whether it may be used."""

    pc_id: str
    memory_bytes: int
    approved: bool
    paused: bool = False
    on_battery: bool = False


@dataclass(frozen=True)
class ModelProfile:
    """Memory per decoder layer (weights + KV cache at the configured context and slot count).

    The embedding lives with layer 0 and the final norm + LM head with the last layer; their
    bytes and per-token milliseconds are added to whichever stage holds those layers.
    """

    layer_bytes: tuple[int, ...]
    embed_bytes: int = 0
    embed_ms: float = 0.0
    head_bytes: int = 0
    head_ms: float = 0.0

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes


@dataclass(frozen=True)
class Links:
    """Measured one-way latencies in ms: ``pc_ms[(src, dst)]`` between PCs (the reverse pair is
    used when only one direction was measured), ``coordinator_ms[pc]`` each way between the
    coordinator and a PC. ``default_ms`` stands in for pairs never measured; without it a missing
    pair is an error, because guessing 0 would favour unmeasured PCs."""

    pc_ms: Mapping[tuple[str, str], float] = field(default_factory=dict)
    coordinator_ms: Mapping[str, float] = field(default_factory=dict)
    default_ms: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pc_ms", MappingProxyType(dict(self.pc_ms)))
        object.__setattr__(self, "coordinator_ms", MappingProxyType(dict(self.coordinator_ms)))

    def between(self, src: str, dst: str) -> float:
        """One-way latency from PC ``src`` to PC ``dst`` (0 on the same PC)."""
        if src == dst:
            return 0.0
        for key in ((src, dst), (dst, src)):
            if key in self.pc_ms:
                return float(self.pc_ms[key])
        return self._default(f"between {src} and {dst}")

    def coordinator(self, pc_id: str) -> float:
        """One-way latency between the coordinator and ``pc_id``."""
        if pc_id in self.coordinator_ms:
            return float(self.coordinator_ms[pc_id])
        return self._default(f"between the coordinator and {pc_id}")

    def _default(self, what: str) -> float:
        if self.default_ms is None:
            raise PlacementInputError(f"no latency measured {what}; run the link probe from "
                                      "the console or set Links.default_ms")
        return float(self.default_ms)


@dataclass(frozen=True)
class PlacementRequest:
    """What to optimise and under which limits.

    ``objective`` "latency" minimises one stream's ms/token; "throughput" maximises the aggregate
    tok/s of ``n_streams`` interleaved streams. ``headroom`` is the fraction of free memory the
    plan may fill. ``time_limit_s`` bounds the whole solve.
    """

    objective: Objective = "latency"
    n_streams: int = 1
    headroom: float = 0.8
    allow_battery: bool = False
    time_limit_s: float = 10.0
    max_stages: int | None = None

    def __post_init__(self) -> None:
        rules = [(self.objective in ("latency", "throughput"), "objective must be 'latency' or "
                  f"'throughput', not {self.objective!r}"),
                 (self.n_streams >= 1, f"n_streams must be at least 1, not {self.n_streams}"),
                 (0.0 < self.headroom <= 1.0, f"headroom must be in (0, 1], not {self.headroom}"),
                 (self.time_limit_s > 0, f"time_limit_s must be positive, not {self.time_limit_s}"),
                 (self.max_stages is None or self.max_stages >= 1,
                  f"max_stages must be at least 1 or None, not {self.max_stages}")]
        if problems := [why for ok, why in rules if not ok]:
            raise PlacementInputError("invalid placement request: " + "; ".join(problems))


@dataclass(frozen=True)
class Exclusion:
    """An agent left out of the placement, and why ("not approved", "paused", "on battery",
    "no device profile")."""

    pc_id: str
    reason: str


@dataclass(frozen=True)
class PlannedStage:
    """One pipeline stage: layers ``first_layer..last_layer`` (inclusive) on one device."""

    device_id: str
    pc_id: str
    first_layer: int
    last_layer: int
    compute_ms: float  # per token, including overhead and any embedding/head work
    memory_bytes: int  # including the embedding/head bytes it carries

    @property
    def n_layers(self) -> int:
        return self.last_layer - self.first_layer + 1


@dataclass(frozen=True)
class Plan:
    """A placement and what it predicts.

    ``hop_ms`` has one entry more than ``stages``: coordinator → stage 0, stage k → k+1, and
    last stage → coordinator. ``cycle_ms`` = max(bottleneck_ms, per_token_ms / n_streams) is the
    time between tokens leaving the ring when ``n_streams`` streams are interleaved.
    """

    stages: tuple[PlannedStage, ...]
    hop_ms: tuple[float, ...]
    per_token_ms: float
    tok_s: float  # one stream: 1000 / per_token_ms
    bottleneck_ms: float  # slowest stage or hop
    n_streams: int
    cycle_ms: float
    aggregate_tok_s: float  # n_streams interleaved: 1000 / cycle_ms
    objective: Objective
    optimal: bool  # HiGHS proved optimality of every solve within the time limit
    excluded: tuple[Exclusion, ...] = ()

    @property
    def objective_ms(self) -> float:
        """The value the solver minimised: per-token ms, or the ring's cycle ms."""
        return self.per_token_ms if self.objective == "latency" else self.cycle_ms


def solve(request: PlacementRequest, *, model: ModelProfile, pcs: Sequence[PcInfo],
          devices: Sequence[DeviceProfile], links: Links, break_symmetry: bool = False) -> Plan:
    """Choose the number of stages, their layer ranges and devices; return the optimal `Plan`.

    ``break_symmetry`` adds explicit order constraints between interchangeable devices and PCs.
    It is off by default because HiGHS detects these symmetries itself: on a benchmark set of
    30-layer fleets of 6-12 devices (half of them clones) the extra rows tripled the CPU time.

    Raises `PlacementInfeasible` (with the memory shortfall or the exclusion counts),
    `PlacementTimeout` if no plan was found in time, `PlacementInputError` for bad profiles.
    """
    fleet = _prepare(request, model, pcs, devices, links)
    deadline = time.monotonic() + request.time_limit_s
    stages, optimal = _least_latency(fleet, request, deadline, break_symmetry)
    if stages is None:
        raise _explain_infeasible(fleet, request, deadline)
    plan = _evaluate(fleet, request, stages, optimal)
    if request.objective == "throughput":
        plan = _best_cycle(fleet, request, deadline, plan, break_symmetry)
    return plan


def format_plan(plan: Plan) -> str:
    """Render a plan for the CLI and logs: one line per stage and hop, then the predictions."""
    lines = [f"{len(plan.stages)} stage(s), {plan.per_token_ms:.2f} ms/token = "
             f"{plan.tok_s:.1f} tok/s for one stream ({'optimal' if plan.optimal else 'best found'})",
             f"  coordinator -> {plan.stages[0].pc_id}: {plan.hop_ms[0]:.2f} ms"]
    for k, st in enumerate(plan.stages):
        lines.append(f"  stage {k}: {st.device_id:<16} layers {st.first_layer}-{st.last_layer} "
                     f"({st.n_layers})  {st.compute_ms:.2f} ms  {st.memory_bytes / GB:.2f} GB")
        dst = plan.stages[k + 1].pc_id if k + 1 < len(plan.stages) else "coordinator"
        lines.append(f"  {st.pc_id} -> {dst}: {plan.hop_ms[k + 1]:.2f} ms")
    lines.append(f"  bottleneck {plan.bottleneck_ms:.2f} ms; {plan.n_streams} stream(s): "
                 f"{plan.aggregate_tok_s:.1f} tok/s aggregate")
    lines += [f"  excluded {ex.pc_id}: {ex.reason}" for ex in plan.excluded]
    return "\n".join(lines)


# --- fleet preparation ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Fleet:
    """The candidates after exclusions, as numbers: devices grouped by PC in canonical order."""

    devices: tuple[DeviceProfile, ...]
    dev_pc: np.ndarray  # (D,) index into pc_ids
    dev_cap: np.ndarray  # (D,) usable bytes (headroom applied)
    pc_ids: tuple[str, ...]
    pc_cap: np.ndarray  # (P,) usable bytes
    lat: np.ndarray  # (P, P) one-way ms
    coord: np.ndarray  # (P,) coordinator <-> PC, each way
    mem_pre: np.ndarray  # (L+1,) prefix sums of bytes per layer, embedding/head folded in
    ms_pre: np.ndarray  # (L+1,) prefix sums of embedding/head ms per layer
    excluded: tuple[Exclusion, ...]

    @property
    def n_layers(self) -> int:
        return len(self.mem_pre) - 1


def _stage_ms(f: _Fleet, d, first, last):
    """Compute ms of device d on layers first..last; one expression for arrays and scalars so
    the MILP's columns and the reported plan agree to the last bit."""
    t = np.asarray([x.layer_ms for x in f.devices])[d]
    o = np.asarray([x.overhead_ms for x in f.devices])[d]
    return t * (last - first + 1) + o + (f.ms_pre[last + 1] - f.ms_pre[first])


def _exclusion_reason(pc: PcInfo, allow_battery: bool) -> str | None:
    if not pc.approved:
        return "not approved"
    if pc.paused:
        return "paused"
    if pc.on_battery and not allow_battery:
        return "on battery"
    return None


def _prepare(request: PlacementRequest, model: ModelProfile, pcs: Sequence[PcInfo],
             devices: Sequence[DeviceProfile], links: Links) -> _Fleet:
    if model.n_layers == 0 or min(model.layer_bytes) < 0 or min(model.embed_bytes,
                                                                 model.head_bytes) < 0:
        raise PlacementInputError("the model profile needs at least one layer and no negative "
                                  "sizes; re-run the model's memory profiling")
    pc_by_id = {pc.pc_id: pc for pc in pcs}
    if len(pc_by_id) != len(pcs):
        raise PlacementInputError("two agents report the same pc_id; remove the stale entry")
    if len({d.device_id for d in devices}) != len(devices):
        raise PlacementInputError("two device profiles share a device_id; recalibrate the agent")
    for d in devices:
        if d.pc_id not in pc_by_id:
            raise PlacementInputError(f"device {d.device_id} names unknown PC {d.pc_id}; "
                                      "refresh the agent list")
        if not (d.layer_ms > 0 and d.overhead_ms >= 0 and d.memory_bytes >= 0):
            raise PlacementInputError(f"device {d.device_id} has an invalid profile (layer_ms "
                                      "must be > 0, overhead and memory >= 0); recalibrate it")

    excluded = [Exclusion(pc.pc_id, r) for pc in pcs
                if (r := _exclusion_reason(pc, request.allow_battery))]
    out = {e.pc_id for e in excluded}
    with_devices = {d.pc_id for d in devices}
    excluded += [Exclusion(pc.pc_id, "no device profile") for pc in pcs
                 if pc.pc_id not in out and pc.pc_id not in with_devices]
    pc_ids = tuple(pc.pc_id for pc in pcs if pc.pc_id not in out and pc.pc_id in with_devices)
    if not pc_ids:
        raise PlacementInfeasible(_no_agent_message(excluded), excluded=tuple(excluded))

    index = {p: k for k, p in enumerate(pc_ids)}
    # Canonical order (PC, then profile) puts identical devices next to each other.
    chosen = tuple(sorted((d for d in devices if d.pc_id in index),
                          key=lambda d: (index[d.pc_id], d.layer_ms, d.overhead_ms,
                                         d.memory_bytes, d.device_id)))
    mem = np.array(model.layer_bytes, dtype=np.int64)
    extra = np.zeros(model.n_layers)
    mem[0] += model.embed_bytes
    mem[-1] += model.head_bytes
    extra[0] += model.embed_ms
    extra[-1] += model.head_ms
    lat = np.array([[links.between(p, q) for q in pc_ids] for p in pc_ids])
    coord = np.array([links.coordinator(p) for p in pc_ids])
    if lat.min() < 0 or coord.min() < 0:
        raise PlacementInputError("a measured latency is negative; re-run the link probe")
    return _Fleet(
        devices=chosen, dev_pc=np.array([index[d.pc_id] for d in chosen]),
        dev_cap=np.array([request.headroom * d.memory_bytes for d in chosen]), pc_ids=pc_ids,
        pc_cap=np.array([request.headroom * pc_by_id[p].memory_bytes for p in pc_ids]),
        lat=lat, coord=coord, mem_pre=np.concatenate(([0], np.cumsum(mem))),
        ms_pre=np.concatenate(([0.0], np.cumsum(extra))), excluded=tuple(excluded))


def _no_agent_message(excluded: Sequence[Exclusion]) -> str:
    counts: dict[str, int] = {}
    for e in excluded:
        counts[e.reason] = counts.get(e.reason, 0) + 1
    why = ", ".join(f"{n} {reason}" for reason, n in counts.items()) or "no agents known"
    return (f"no approved agent is available ({why}); approve agents in the console, resume "
            "paused ones, calibrate their devices, or allow agents on battery")


# --- the MILP -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Columns:
    """Candidate stages z[k] = (device, first..last), as parallel (K,) arrays."""

    dev: np.ndarray
    first: np.ndarray
    last: np.ndarray
    mem: np.ndarray  # bytes
    ms: np.ndarray  # compute per token


def _columns(f: _Fleet, cap_ms: float | None, keep_oversized: bool) -> _Columns:
    """Every (device, layer range) stage that fits the device and its PC (all of them when
    ``keep_oversized``, for the shortfall re-solve) and, under ``cap_ms``, whose own time and
    coordinator hops stay within the cap."""
    L = f.n_layers
    first, last = np.triu_indices(L)
    span = f.mem_pre[last + 1] - f.mem_pre[first]
    parts = []
    for d in range(len(f.devices)):
        ms = _stage_ms(f, d, first, last)
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
class _Milp:
    c: np.ndarray
    integrality: np.ndarray
    bounds: Bounds
    constraints: LinearConstraint
    cols: _Columns
    n_layers: int


def _build(f: _Fleet, req: PlacementRequest, *, slack: bool = False, cap_ms: float | None = None,
           max_latency: float | None = None, break_symmetry: bool = False) -> _Milp:
    """The latency MILP (every stage and hop ≤ ``cap_ms`` and latency ≤ ``max_latency`` if
    given), or with ``slack`` the least extra memory Σσ[p] that would make the model fit.
    Columns: z, then h (P > 1), then σ (slack) or the latency ms (otherwise)."""
    D, L, P = len(f.devices), f.n_layers, len(f.pc_ids)
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
        for d in np.flatnonzero(~alone[f.dev_pc]):
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
    if req.max_stages is not None:
        rows.row(zk, 1.0, 0.0, req.max_stages)
    for d, e in _twin_pairs(f) if break_symmetry else ():
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
    return _Milp(c, integrality, Bounds(np.zeros(n), ub), rows.constraint(n), cols, L)


def _twin_pairs(f: _Fleet) -> list[tuple[int, int]]:
    """Pairs (d, e) of devices that a symmetry of the problem swaps; d is ordered before e.

    Identical devices of one PC pair up directly. Identical PCs (same memory, coordinator hop,
    latencies to every other PC, and device list) pair through their first devices; this is
    compatible with the per-PC pairs because swapping two PCs maps k-th device to k-th device.
    """
    D, P = len(f.devices), len(f.pc_ids)
    sig = [(x.layer_ms, x.overhead_ms, f.dev_cap[d]) for d, x in enumerate(f.devices)]
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


def _run(m: _Milp, deadline: float):
    remaining = max(deadline - time.monotonic(), 0.05)
    return milp(m.c, integrality=m.integrality, bounds=m.bounds, constraints=[m.constraints],
                options={"time_limit": remaining, "mip_rel_gap": _MIP_REL_GAP,
                         "presolve": _PRESOLVE})


def _least_latency(f: _Fleet, req: PlacementRequest, deadline: float, break_symmetry: bool,
                   cap_ms: float | None = None, max_latency: float | None = None,
                   ) -> tuple[list[Stage] | None, bool]:
    """Least-latency stages with every stage and hop ≤ ``cap_ms`` and latency ≤ ``max_latency``;
    None if proven impossible. The flag says whether HiGHS proved optimality."""
    m = _build(f, req, cap_ms=cap_ms, max_latency=max_latency, break_symmetry=break_symmetry)
    if len(m.cols.dev) == 0:
        return None, True
    res = _run(m, deadline)
    if res.status == 2:
        return None, True
    if res.x is None:
        raise PlacementTimeout(
            f"no placement found within {req.time_limit_s:g} s ({res.message}); raise the time "
            "limit or set max_stages to shrink the search")
    return _extract(m, res.x), res.status == 0


def _best_cycle(f: _Fleet, req: PlacementRequest, deadline: float, top: Plan,
                break_symmetry: bool) -> Plan:
    """Least cycle (then least latency) by bisection over the bottleneck cap τ (module doc).

    pred(k) := Lmin(τ_k) ≤ N·τ_k is monotone in k; with k the first index where it holds,
    T* = min(τ_k, Lmin(τ_{k-1})/N), reached by the least-latency plan at τ_k or at τ_{k-1}.
    Probes carry the bound latency ≤ N·τ_k, so a false predicate is a quick infeasibility proof.
    """
    n = req.n_streams
    sizes = np.concatenate([_stage_ms(f, d, *np.triu_indices(f.n_layers))
                            for d in range(len(f.devices))])
    taus = np.unique(np.concatenate((sizes, f.lat.ravel(), f.coord)))
    lo, hi, optimal = 0, len(taus) - 1, top.optimal
    found: list[tuple[int, int, Plan]] = []  # plan is least-latency for caps τ_from..τ_to

    def settle(k: int, plan: Plan) -> None:
        # The plan stays least-latency for every cap from its own bottleneck up to τ_k, and no
        # cap ≤ τ_k does better, so the predicate is false below i_n and true from max(k_b, i_n).
        nonlocal lo, hi
        k_b = int(np.searchsorted(taus, plan.bottleneck_ms))
        i_n = int(np.searchsorted(taus, plan.per_token_ms / n))
        found.append((k_b, k, plan))
        lo = max(lo, min(i_n, k + 1))
        if max(k_b, i_n) <= k:
            hi = min(hi, max(k_b, i_n))

    def probe(k: int, max_latency: float) -> Plan | None:
        nonlocal optimal
        if time.monotonic() >= deadline:
            raise PlacementTimeout("time limit reached during the bottleneck search")
        stages, ok = _least_latency(f, req, deadline, break_symmetry, float(taus[k]), max_latency)
        optimal &= ok
        return None if stages is None else _evaluate(f, req, stages, ok)

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
            best = min(p.cycle_ms for _, _, p in found)
            plan = probe(hi - 1, n * best)
            if plan is not None:
                found.append((hi - 1, hi - 1, plan))
    except PlacementTimeout:
        optimal = False
    best = min((p for _, _, p in found), key=lambda p: (p.cycle_ms, p.per_token_ms))
    return replace(best, optimal=optimal)


# --- reading a solution -------------------------------------------------------------------

def _extract(m: _Milp, x: np.ndarray) -> list[Stage]:
    """(device, first, last) per chosen stage, in layer order."""
    chosen = np.flatnonzero(x[: len(m.cols.dev)] > 0.5)
    stages = sorted(((int(m.cols.dev[k]), int(m.cols.first[k]), int(m.cols.last[k]))
                     for k in chosen), key=lambda s: s[1])
    edges = [-1] + [b for s in stages for b in (s[1] - 1, s[2])] + [m.n_layers - 1]
    if not stages or edges[0::2] != edges[1::2]:
        raise DeskfleetError("the placement solver returned stages that do not chain; this is "
                             "a bug - please report it with the fleet profiles")
    return stages


def _evaluate(f: _Fleet, req: PlacementRequest, stages: Sequence[Stage], optimal: bool) -> Plan:
    """Predictions for a chain of stages, recomputed exactly from the profiles."""
    planned = tuple(
        PlannedStage(f.devices[d].device_id, f.devices[d].pc_id, first, last,
                     float(_stage_ms(f, d, first, last)),
                     int(f.mem_pre[last + 1] - f.mem_pre[first]))
        for d, first, last in stages)
    pcs = [int(f.dev_pc[d]) for d, _, _ in stages]
    hops = ((float(f.coord[pcs[0]]),) + tuple(float(f.lat[p, q]) for p, q in pairwise(pcs))
            + (float(f.coord[pcs[-1]]),))
    per_token = sum(s.compute_ms for s in planned) + sum(hops)
    bottleneck = max(max(s.compute_ms for s in planned), max(hops))
    cycle = max(bottleneck, per_token / req.n_streams)
    return Plan(stages=planned, hop_ms=hops, per_token_ms=per_token, tok_s=1000.0 / per_token,
                bottleneck_ms=bottleneck, n_streams=req.n_streams, cycle_ms=cycle,
                aggregate_tok_s=1000.0 / cycle, objective=req.objective, optimal=optimal,
                excluded=f.excluded)


def _explain_infeasible(f: _Fleet, req: PlacementRequest, deadline: float) -> PlacementInfeasible:
    """Re-solve with memory slack per PC; the least total slack is the shortfall to report."""
    need = int(f.mem_pre[-1])
    offer = float(sum(min(f.pc_cap[p], f.dev_cap[f.dev_pc == p].sum())
                      for p in range(len(f.pc_ids))))
    m = _build(f, req, slack=True)
    res = _run(m, max(deadline, time.monotonic() + 1.0))  # an explanation is worth a second
    shortfall = _shortfall(f, _extract(m, res.x)) if res.x is not None else max(need - offer, 0)
    limits = f"{req.headroom:.0%} headroom"
    if req.max_stages is not None:
        limits += f", at most {req.max_stages} stage(s)"
    why = (f"the model needs {_gb_up(shortfall)} GB more memory than the approved agents offer "
           f"(model {need / GB:.1f} GB; {offer / GB:.1f} GB usable on {len(f.devices)} "
           f"device(s) of {len(f.pc_ids)} agent(s) at {limits}")
    if offer >= need:
        why += "; a layer cannot be split across devices"
    why += ")"
    if f.excluded:
        why += f"; {len(f.excluded)} more agent(s) left out (" + ", ".join(
            f"{e.pc_id}: {e.reason}" for e in f.excluded) + ")"
    why += (". Free memory on the agents, approve or resume more agents, lower the context "
            "length or slot count, or use a more compressed model.")
    return PlacementInfeasible(why, shortfall_bytes=shortfall, excluded=f.excluded)


def _shortfall(f: _Fleet, stages: Sequence[Stage]) -> float:
    """Extra bytes a plan's PCs would need: per PC, its worst device or its shared limit."""
    need = np.zeros(len(f.pc_ids))
    used = np.zeros(len(f.pc_ids))
    for d, first, last in stages:
        p, m = f.dev_pc[d], float(f.mem_pre[last + 1] - f.mem_pre[first])
        used[p] += m
        need[p] = max(need[p], m - f.dev_cap[d])
    return float(np.maximum(np.maximum(need, used - f.pc_cap), 0.0).sum())


def _gb_up(nbytes: float) -> str:
    """Round up to 0.1 GB, so that adding the reported amount is always enough."""
    return f"{max(math.ceil(nbytes / 1e8 - 1e-6), 1) / 10:.1f}"
