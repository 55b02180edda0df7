"""Copies or a ring, chosen for the admin: the arrangement of a fleet's PCs into rings that serves the
users expected the most aggregate tok/s, by the decode model of `engine.placement.throughput`.

Every way of dealing the usable PCs into rings is a candidate (a ring of one PC is a *copy* of the
model; PCs may also stay unused): a ring must hold the model, each stage within its PC's memory
at the request's headroom. Its layers are cut where its slowest stage step at its share of the
users is least (a PC twice as fast takes about twice the layers). The users are dealt to the
rings as evenly as the service's router deals them, each ring running one micro-batch per stage
(the paged coordinator's default lanes). So

- where the model fits one PC, copies win (no hops, no bubbles; each PC batches its own users);
- where it fits no PC, the PCs form rings (the fewest stages that hold it, as many rings as fit);
- where PCs differ, the big ones hold copies and the small ones rings, if that serves more.

Nothing fits: :class:`LayoutChoice` ``refused`` names the memory the model needs and the most
the PCs offer. A calibrated device's one-row time per layer is split into what streams the
layer's weights (the PC's weight rate) and what each row adds (:data:`ROW_SHARE`), the only
assumption beyond the throughput model's own. Pure: no sockets, no OpenVINO.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from engine.placement.throughput import (
    LinkSpec,
    PcSpec,
    RingSpec,
    StageCost,
    Workload,
    predict,
    split_rows,
    stage_step_ms,
)
from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo

__all__ = ["DEFAULT_USERS", "ROW_SHARE", "Layout", "LayoutChoice", "LayoutKind", "LayoutPc", "choose_layout",
           "expected_users", "layout_pcs", "lan_of", "propose", "users_in_load"]

# Of one row's decode step through a layer, the share that grows with the rows of a batch (the
# matmul work per row, attention); the rest streams the layer's weights once a step. Fitted on this
# box's SmolLM2-135M steps (tests/benchmarks/ring_model.py: 0.24 ms of 0.66 ms per layer at 1 row).
ROW_SHARE = 0.35
DEFAULT_USERS = 8  # what the admin is offered when no setting and no load say otherwise
MAX_ENUMERATED_PCS = 8  # more PCs: the canonical layouts only (all copies, rings of k, mixed)
GB = 1e9
OFFICE_LAN = LinkSpec(latency_ms=1.0, gbit_s=1.0)  # a hop on gigabit Ethernet, where none was measured


class LayoutKind(StrEnum):
    COPIES = "copies"  # every ring one PC
    RINGS = "rings"  # every ring several PCs
    MIXED = "mixed"  # some of each


@dataclass(frozen=True)
class LayoutPc:
    """A usable PC as the chooser sees it: its memory and its calibrated one-row time per layer."""

    pc_id: str
    memory_bytes: int
    layer_ms: float
    overhead_ms: float = 0.0
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.pc_id[:12]


@dataclass(frozen=True)
class RingLayout:
    """One ring: its PCs in stage order and the layers each holds (first, last)."""

    pcs: tuple[str, ...]
    layers: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    """One arrangement with its predicted aggregate tok/s at 1 user and at ``users``."""

    kind: LayoutKind
    rings: tuple[RingLayout, ...]
    users: int
    tok_s_one: float
    tok_s_users: float
    unused: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        sizes = sorted((len(r.pcs) for r in self.rings), reverse=True)
        copies, rings = sizes.count(1), [s for s in sizes if s > 1]
        parts = []
        if copies:
            parts.append(f"{copies} cop{'y' if copies == 1 else 'ies'}")
        for size in sorted(set(rings), reverse=True):
            n = rings.count(size)
            parts.append(f"{n} ring{'s' if n > 1 else ''} of {size}")
        return " + ".join(parts)


@dataclass(frozen=True)
class LayoutChoice:
    """The alternatives, best first at ``users``; ``chosen`` the first (None: ``refused`` says why)."""

    users: int
    users_source: str
    alternatives: tuple[Layout, ...]
    refused: str | None = None

    @property
    def chosen(self) -> Layout | None:
        return self.alternatives[0] if self.alternatives else None

    def best_of(self, kind: LayoutKind) -> Layout | None:
        return next((a for a in self.alternatives if a.kind is kind), None)


def expected_users(setting: int | None, observed: int | None) -> tuple[int, str]:
    """(users, where the figure comes from): the admin's setting, else the most streams seen at
    once (the load observed), else :data:`DEFAULT_USERS`."""
    if setting is not None and setting >= 1:
        return setting, "the admin's setting"
    if observed is not None and observed >= 1:
        return observed, "the most users seen at once"
    return DEFAULT_USERS, f"no load seen yet: {DEFAULT_USERS} assumed"


def users_in_load(rings: Mapping[str, Mapping[str, float]]) -> int:
    """Users being served now over the fleet's rings (their coordinators' metrics by ring): the
    streams running and waiting."""
    return int(sum(m.get("active_streams", 0.0) + m.get("waiting_requests", 0.0) for m in rings.values()))


def lan_of(links: Links, pc_ids: Sequence[str], default_ms: float = 1.0, gbit_s: float = 1.0) -> LinkSpec:
    """One hop as the chooser prices every hop: the mean measured one-way latency between these PCs
    and between them and the coordinator (``default_ms`` where none was measured), at ``gbit_s``."""
    measured = [ms for (a, b), ms in links.pc_ms.items() if a in pc_ids and b in pc_ids]
    measured += [ms for pc, ms in links.coordinator_ms.items() if pc in pc_ids]
    return LinkSpec(sum(measured) / len(measured) if measured else default_ms, gbit_s)


def propose(model: ModelProfile, pcs: Sequence[PcInfo], devices: Sequence[DeviceProfile], links: Links, *,
            users: int, users_source: str = "", names: Mapping[str, str] | None = None, headroom: float = 0.8,
            allow_battery: bool = False) -> LayoutChoice:
    """The layouts of a placement's inputs (its model's memory profile, the PCs, their calibrated
    devices and measured links) for ``users``: `choose_layout` over `layout_pcs`."""
    usable = layout_pcs(pcs, devices, dict(names or {}), allow_battery=allow_battery)
    return choose_layout(model, usable, users, users_source=users_source, headroom=headroom,
                         lan=lan_of(links, [pc.pc_id for pc in usable]))


def layout_pcs(pcs: Sequence[PcInfo], devices: Sequence[DeviceProfile], names: dict[str, str] | None = None,
               *, allow_battery: bool = False) -> tuple[LayoutPc, ...]:
    """The usable PCs (approved, not paused, on mains unless allowed) with their fastest calibrated
    device, in the order given."""
    out = []
    for pc in pcs:
        if not pc.approved or pc.paused or (pc.on_battery and not allow_battery):
            continue
        mine = [d for d in devices if d.pc_id == pc.pc_id]
        if not mine:
            continue
        best = min(mine, key=lambda d: (d.layer_ms, d.overhead_ms))
        out.append(LayoutPc(pc.pc_id, min(pc.memory_bytes, best.memory_bytes), best.layer_ms, best.overhead_ms,
                            (names or {}).get(pc.pc_id, "")))
    return tuple(out)


def choose_layout(model: ModelProfile, pcs: Sequence[LayoutPc], users: int, *, users_source: str = "",
                  headroom: float = 0.8, lan: LinkSpec = OFFICE_LAN, coordinator_ms: float = 0.75,
                  hidden_size: int = 4096, context_tokens: float = 0.0) -> LayoutChoice:
    """Every arrangement of ``pcs`` into rings that holds ``model`` (memory per layer, with its KV at
    the placement's context), best first by predicted aggregate tok/s at ``users`` (module doc).
    ``lan``: every hop (the coordinator sits on the fleet service's PC, not with stage 0)."""
    users = max(1, users)
    cap = {pc.pc_id: headroom * pc.memory_bytes for pc in pcs}
    need = model.total_bytes
    if not pcs:
        return LayoutChoice(users, users_source, (), "no usable PC (approved, calibrated, not paused)")
    by_id = {pc.pc_id: pc for pc in pcs}
    kind_of = {pc.pc_id: (pc.memory_bytes, pc.layer_ms, pc.overhead_ms) for pc in pcs}  # alike PCs arrange alike
    layouts: dict[str, Layout] = {}
    seen: set[tuple] = set()
    fits: dict[tuple[tuple[str, ...], int], tuple[RingLayout, RingSpec] | None] = {}
    rates: dict[tuple[tuple[str, ...], int], float] = {}

    def fit(group: list[str], share: int) -> tuple[RingLayout, RingSpec] | None:
        key = (tuple(group), share)
        if key not in fits:
            fits[key] = _fit_ring(model, [by_id[p] for p in group], cap, share, lan, hidden_size, coordinator_ms,
                                  context_tokens)
        return fits[key]

    def rate(ring: RingLayout, spec: RingSpec, n: int) -> float:
        key = (ring.pcs, n)
        if key not in rates:
            rates[key] = predict(spec, Workload(n, len(spec.stages), context_tokens)).aggregate_tok_s if n else 0.0
        return rates[key]

    for groups in _arrangements(list(pcs)):
        signature = tuple(sorted(tuple(kind_of[p] for p in g) for g in groups))
        if signature in seen:
            continue
        seen.add(signature)
        rings = [fit(g, -(-users // len(groups))) for g in groups]
        fitted = [r for r in rings if r is not None]
        if len(fitted) < len(rings):
            continue
        one = max(rate(r, spec, 1) for r, spec in fitted)
        fastest_first = sorted(fitted, key=lambda rs: -rate(rs[0], rs[1], 1))
        many = sum(rate(r, spec, n) for (r, spec), n in zip(fastest_first, split_rows(users, len(fitted)),
                                                             strict=False))
        used = {p for g in groups for p in g}
        sizes = [len(g) for g in groups]
        kind = (LayoutKind.COPIES if max(sizes) == 1 else LayoutKind.RINGS if min(sizes) > 1 else LayoutKind.MIXED)
        layout = Layout(kind, tuple(r for r, _ in fastest_first), users, one, many,
                        tuple(pc.pc_id for pc in pcs if pc.pc_id not in used))
        best = layouts.get(layout.name)
        if best is None or (layout.tok_s_users, layout.tok_s_one) > (best.tok_s_users, best.tok_s_one):
            layouts[layout.name] = layout
    if not layouts:
        biggest = max(pcs, key=lambda pc: pc.memory_bytes)
        total = sum(cap.values())
        return LayoutChoice(users, users_source, (), (
            f"the model needs {need / GB:.2f} GB of memory; the largest PC ({biggest.label}) offers "
            f"{cap[biggest.pc_id] / GB:.2f} GB of its {biggest.memory_bytes / GB:.2f} GB at {headroom:.0%} headroom "
            f"and all {len(pcs)} together {total / GB:.2f} GB, with no layer split across PCs"))
    ordered = sorted(layouts.values(), key=lambda a: (-a.tok_s_users, -a.tok_s_one, len(a.rings)))
    return LayoutChoice(users, users_source, tuple(ordered))


# --- arrangements ------------------------------------------------------------------------------------

def _arrangements(pcs: list[LayoutPc]) -> Iterator[list[list[str]]]:
    """Ways to deal the PCs into rings (unused PCs allowed), biggest memory first within a ring."""
    order = sorted(pcs, key=lambda pc: (-pc.memory_bytes, pc.layer_ms, pc.pc_id))
    ids = [pc.pc_id for pc in order]
    if len(ids) <= MAX_ENUMERATED_PCS:
        for n in range(len(ids), 0, -1):
            for subset in _prefix_subsets(ids, n):
                yield from _partitions(subset)
        return
    for k in range(1, len(ids) + 1):  # rings of k over all PCs, the rest unused; and copies + one ring
        yield [ids[i:i + k] for i in range(0, len(ids) - len(ids) % k, k)]
    for c in range(1, len(ids)):
        yield [[p] for p in ids[:c]] + [ids[c:]]


def _prefix_subsets(ids: list[str], n: int) -> Iterator[list[str]]:
    """The subsets of ``n`` PCs worth trying: every subset when few, else the first ``n``."""
    if len(ids) <= 6:
        from itertools import combinations

        for combo in combinations(ids, n):
            yield list(combo)
    else:
        yield ids[:n]


def _partitions(items: list[str]) -> Iterator[list[list[str]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for k in range(len(part)):
            yield [*part[:k], [first, *part[k]], *part[k + 1:]]


# --- one ring -----------------------------------------------------------------------------------------

def _fit_ring(model: ModelProfile, pcs: Sequence[LayoutPc], cap: dict[str, float], users: int, lan: LinkSpec,
              hidden_size: int, coordinator_ms: float, context: float) -> tuple[RingLayout, RingSpec] | None:
    """The ring of ``pcs`` (stage order) with the cut whose slowest stage step at its rows is least,
    every stage within its PC's memory (``cap``); None when no cut fits."""
    n_layers, s = model.n_layers, len(pcs)
    if s > n_layers:
        return None
    rows = max(1, -(-users // s))
    mem = _prefix(model)
    # best[k][j]: least max step of stages 0..k-1 holding layers 0..j-1 (and the cut), DP over cuts
    inf = (math.inf, ())
    best: list[list[tuple[float, tuple[int, ...]]]] = [[inf] * (n_layers + 1) for _ in range(s + 1)]
    best[0][0] = (0.0, ())
    for k in range(s):
        pc = pcs[k]
        last_stage = k == s - 1
        for i in range(n_layers):
            if best[k][i][0] == math.inf:
                continue
            for j in ([n_layers] if last_stage else range(i + 1, n_layers - (s - k - 1) + 1)):
                nbytes = mem[j] - mem[i]
                if nbytes > cap[pc.pc_id]:
                    break
                step = _stage_cost(model, pc, i, j)
                t = max(best[k][i][0], _step_ms(model, step, pc, rows, context))
                if t < best[k + 1][j][0]:
                    best[k + 1][j] = (t, (*best[k][i][1], j))
    if best[s][n_layers][0] == math.inf:
        return None
    cut = best[s][n_layers][1]
    starts = (0, *cut[:-1])
    stages = tuple(_stage_cost(model, pcs[k], a, b) for k, (a, b) in enumerate(zip(starts, cut, strict=True)))
    spec = RingSpec(stages=stages, stage_pcs=tuple(range(s)), pcs=tuple(_pc_spec(model, pc) for pc in pcs),
                    hops=(lan,) * (s + 1), hidden_size=hidden_size, coordinator_ms=coordinator_ms)
    return RingLayout(tuple(pc.pc_id for pc in pcs), tuple((a, b - 1) for a, b in zip(starts, cut, strict=True))), spec


def _prefix(model: ModelProfile) -> list[float]:
    """Bytes of layers 0..j-1 (embedding with layer 0, head with the last), j = 0..L."""
    out, total = [0.0], 0.0
    for k, b in enumerate(model.layer_bytes):
        total += b + (model.embed_bytes if k == 0 else 0) + (model.head_bytes if k == model.n_layers - 1 else 0)
        out.append(total)
    return out


def _layer_stream_bytes(model: ModelProfile) -> float:
    return sum(model.layer_bytes) / model.n_layers


def _pc_spec(model: ModelProfile, pc: LayoutPc) -> PcSpec:
    """The PC's weight rate: a layer's bytes over the weight-streaming part of its one-row time."""
    return PcSpec(weight_gb_s=_layer_stream_bytes(model) / ((1 - ROW_SHARE) * pc.layer_ms * 1e6))


def _stage_cost(model: ModelProfile, pc: LayoutPc, first: int, end: int) -> StageCost:
    """Layers first..end-1 on ``pc``: streamed weights, the per-row share, the head on the last stage."""
    n = end - first
    last = end == model.n_layers
    head_gb_s = _pc_spec(model, pc).weight_gb_s
    head_bytes = model.head_bytes if last else 0.0
    # the calibrated head time covers streaming the head; what is left of it is per row
    head_row = max(0.0, model.head_ms - head_bytes / (head_gb_s * 1e6)) if last else 0.0
    return StageCost(weight_bytes=n * _layer_stream_bytes(model) + head_bytes, row_ms=n * ROW_SHARE * pc.layer_ms
                     + head_row + (model.embed_ms if first == 0 else 0.0), fixed_ms=pc.overhead_ms)


def _step_ms(model: ModelProfile, stage: StageCost, pc: LayoutPc, rows: int, context: float) -> float:
    return stage_step_ms(stage, _pc_spec(model, pc), rows, context)
