"""Decode throughput of a batched, micro-batched ring: what S stages on P PCs serve to N users.

Pure arithmetic over frozen inputs (no sockets, no OpenVINO). The planner (`planner.py`) prices
one stream per weight pass, as the stateful stages run; paged stages run one infer per step for
every row the coordinator sends, and this module prices that.

The model, per decode step of one micro-batch of B rows (one row per user, one new token each)
whose users have c cached tokens on average:

    stage step  t_s(B) = fixed_s + streamed_s(B) / weight rate of its PC + B·row_s + B·c·context_s
    streamed    streamed_s(B) = weight_bytes_s + expert_bytes_s · D(B) / E   (a MoE stage: of its
                                E experts the D(B) = E·(1 − (1 − k/E)^B) that B rows of k picks touch
                                on average, `engine.placement.moe`; a dense stage: weight_bytes_s)
    hop         h_k(B) = latency_k + bytes_k(B) / bandwidth_k        (bytes: B rows of hidden states
                                                                      [B, H] plus per-row frame bytes)
    round trip  R(B)   = Σ_s t_s(B) + Σ_k h_k(B) + coordinator

N users are split into M micro-batches of ⌈N/M⌉ or ⌊N/M⌋ rows (M ≤ N; with M > N the empty
ones are not sent). The micro-batches circulate: one leaves the last stage, the coordinator plans
its next step, it enters stage 0 again. A *round* is every micro-batch stepping once, i.e. every
user getting one token. Its period is the larger of two lower bounds:

    round period = max( max_m R(B_m),                                 every micro-batch goes round once
                        max over resources of its busy time per round )  a PC, a link, the coordinator

where a PC's busy time is Σ_m Σ_{stages s on that PC} t_s(B_m) (stages sharing a PC share its
memory path: their times add, which is what one 2-core box shows), a link's is Σ_m bytes/bandwidth
(its latency is a delay, not a resource: frames overlap on the wire), the coordinator's M × its
per-step time. Then

    per-user tok/s = 1000 / period_ms        aggregate tok/s = N · 1000 / period_ms

With M equal micro-batches and one stage per PC this is min(M / R, 1 / max t_s) steps per second,
the cycle time of a closed line with deterministic times (exact in max-plus algebra: the slowest
of the loop, R/M, and of each station); with stages sharing a PC or uneven micro-batches it is a
lower bound on the period (an optimistic prediction).

Assumptions, stated once:
- Steady-state decode only: no prefill, no speculation (one token per row per step), the mean
  context held constant; TTFT is not predicted.
- The terms add. A step streams its stage's weights once whatever its rows, then pays per row;
  on a PC whose rows ride free on the weight stream (a roofline max instead of a sum) the model
  is pessimistic. The weight rate is a PC's memory bandwidth when it decodes with enough threads,
  or what one thread dequantises per second when that is slower (this box, one thread per stage).
- A MoE stage's rows pick their experts independently and uniformly; a trained router is skewed
  (its rows share experts more), so the expert bytes read are, if anything, over-counted.
- PCs are independent: each has its own memory bandwidth and cores; nothing else runs on them.
  Stages on one PC serialise (one memory path).
- Links are full duplex and switched: each hop is its own resource; the coordinator sits with
  stage 0 (its first hop is local) unless the hops say otherwise.
- Micro-batches never wait for anything but the resources above (no scheduler stalls, no jitter).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import PlacementInputError
from engine.placement.moe import ExpertRouting, streamed_bytes
from engine.shards.manifest import Manifest, ir_paths

__all__ = [
    "FleetPrediction", "LinkSpec", "ModelCost", "PcSpec", "RingPrediction", "RingSpec", "StageCost", "Workload",
    "export_stage_costs", "hop_ms", "predict", "predict_rings", "split_rows", "split_stages", "stage_step_ms",
    "step_weight_bytes", "uniform_ring",
]


@dataclass(frozen=True)
class StageCost:
    """One stage's cost of one decode step on the PC that runs it.

    ``weight_bytes`` are streamed once per step whatever its rows (its layers, and on the last
    stage the LM head; the embedding is gathered row by row, so it is not streamed). ``row_ms``
    is the work each row adds (matmuls that grow with rows, the head for an answered row),
    ``context_ms`` what each cached token costs a row (attention reading K/V), ``fixed_ms`` what
    a step costs whatever its size (dispatch, the step frame's decode and encode, copies).
    A mixture-of-experts stage's stacked expert weights are ``expert_bytes`` apart, read as far
    as ``routing`` sends the step's rows (`step_weight_bytes`); without ``routing`` they are read
    whole, as dense weights are.
    """

    weight_bytes: float
    row_ms: float
    context_ms: float = 0.0
    fixed_ms: float = 0.0
    expert_bytes: float = 0.0
    routing: ExpertRouting | None = None

    def __post_init__(self) -> None:
        _non_negative("stage cost", weight_bytes=self.weight_bytes, row_ms=self.row_ms,
                      context_ms=self.context_ms, fixed_ms=self.fixed_ms, expert_bytes=self.expert_bytes)


@dataclass(frozen=True)
class PcSpec:
    """A PC: the rate (GB/s, decimal) at which it streams a stage's weights through one step."""

    weight_gb_s: float

    def __post_init__(self) -> None:
        if not self.weight_gb_s > 0:
            raise PlacementInputError(f"a PC's weight rate must be positive GB/s, not {self.weight_gb_s}")


@dataclass(frozen=True)
class LinkSpec:
    """One hop: one-way latency (ms, the frame's software path included) and bandwidth (Gbit/s;
    infinite for a hop inside one process)."""

    latency_ms: float
    gbit_s: float = math.inf

    def __post_init__(self) -> None:
        _non_negative("link", latency_ms=self.latency_ms)
        if not self.gbit_s > 0:
            raise PlacementInputError(f"a link's bandwidth must be positive Gbit/s, not {self.gbit_s}")

    def serial_ms(self, nbytes: float) -> float:
        """Time the link is busy sending ``nbytes`` (the part frames cannot overlap)."""
        return nbytes * 8e-6 / self.gbit_s


@dataclass(frozen=True)
class RingSpec:
    """A ring: its stages in order, the PC each runs on, and its S + 1 hops.

    ``stage_pcs[s]`` indexes ``pcs``; two stages on one index share that PC's memory path.
    ``hops``: coordinator → stage 0, stage k → k+1, last stage → coordinator. A middle hop
    carries B rows of ``hidden_size`` values of ``hidden_bytes`` each; every hop carries
    ``row_frame_bytes`` per row besides (token id, plan row, block ids, the reply's id and
    probability). ``coordinator_ms`` is the coordinator's time per step (planning, the reply).
    """

    stages: tuple[StageCost, ...]
    stage_pcs: tuple[int, ...]
    pcs: tuple[PcSpec, ...]
    hops: tuple[LinkSpec, ...]
    hidden_size: int
    hidden_bytes: int = 4
    row_frame_bytes: int = 64
    coordinator_ms: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.stages)
        rules = [(n >= 1, "a ring needs at least one stage"),
                 (len(self.stage_pcs) == n, f"stage_pcs has {len(self.stage_pcs)} entries for {n} stage(s)"),
                 (all(0 <= p < len(self.pcs) for p in self.stage_pcs),
                  f"stage_pcs {self.stage_pcs} names a PC outside the {len(self.pcs)} given"),
                 (len(self.hops) == n + 1, f"a ring of {n} stage(s) has {n + 1} hops, not {len(self.hops)}"),
                 (self.hidden_size >= 1, f"hidden_size must be at least 1, not {self.hidden_size}"),
                 (self.hidden_bytes >= 1 and self.row_frame_bytes >= 0 and self.coordinator_ms >= 0,
                  "hidden_bytes must be at least 1, row_frame_bytes and coordinator_ms not negative")]
        if problems := [why for ok, why in rules if not ok]:
            raise PlacementInputError("invalid ring: " + "; ".join(problems))


@dataclass(frozen=True)
class Workload:
    """N users decoding at once, split into M micro-batches, with c cached tokens each on average."""

    users: int
    micro_batches: int
    context_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.users < 1 or self.micro_batches < 1 or self.context_tokens < 0:
            raise PlacementInputError(f"a workload needs at least one user and one micro-batch and a context "
                                      f"not negative (users {self.users}, micro-batches {self.micro_batches}, "
                                      f"context {self.context_tokens})")


@dataclass(frozen=True)
class RingPrediction:
    """What one ring serves. Times in ms, of the largest micro-batch where per micro-batch.

    ``bound`` names what sets the period: "round trip" (add micro-batches), "PC p" (that PC's
    memory path or cores), "hop k" (that link's bandwidth) or "coordinator".
    """

    users: int
    rows: tuple[int, ...]  # per micro-batch sent (len = the effective M)
    stage_ms: tuple[float, ...]
    hop_ms: tuple[float, ...]
    round_trip_ms: float
    period_ms: float  # one round: every micro-batch steps once, every user gets one token
    bound: str
    per_user_tok_s: float
    aggregate_tok_s: float

    @property
    def micro_batches(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class FleetPrediction:
    """Independent rings with the users split between them (each ring its own PCs and coordinator)."""

    rings: tuple[RingPrediction, ...]
    users: int
    aggregate_tok_s: float
    per_user_tok_s: float  # the slowest ring's


def split_rows(users: int, micro_batches: int) -> tuple[int, ...]:
    """Rows per micro-batch: ``users`` as evenly as possible over min(M, users) micro-batches."""
    m = min(users, micro_batches)
    q, r = divmod(users, m)
    return tuple(q + 1 if k < r else q for k in range(m))


def step_weight_bytes(stage: StageCost, rows: int) -> float:
    """streamed_s(B): the weight bytes one step of ``rows`` rows reads (module doc)."""
    return streamed_bytes(stage.weight_bytes, stage.expert_bytes, stage.routing, rows)


def stage_step_ms(stage: StageCost, pc: PcSpec, rows: int, context_tokens: float) -> float:
    """t_s(B): one step of ``rows`` rows on ``pc`` (module doc)."""
    weight_ms = step_weight_bytes(stage, rows) / (pc.weight_gb_s * 1e6)
    return stage.fixed_ms + weight_ms + rows * (stage.row_ms + context_tokens * stage.context_ms)


def _hop_bytes(spec: RingSpec, hop: int, rows: int) -> float:
    middle = 0 < hop < len(spec.stages)
    return rows * (spec.row_frame_bytes + (spec.hidden_size * spec.hidden_bytes if middle else 0))


def hop_ms(spec: RingSpec, hop: int, rows: int) -> float:
    """h_k(B): latency plus sending the hop's bytes for ``rows`` rows."""
    link = spec.hops[hop]
    return link.latency_ms + link.serial_ms(_hop_bytes(spec, hop, rows))


def predict(spec: RingSpec, work: Workload) -> RingPrediction:
    """The ring's steady decode rate for ``work`` (module doc: the round period and its bound)."""
    rows = split_rows(work.users, work.micro_batches)
    busy: dict[str, float] = {f"PC {p}": 0.0 for p in sorted(set(spec.stage_pcs))}
    busy |= {f"hop {k}": 0.0 for k in range(len(spec.hops))}
    busy["coordinator"] = spec.coordinator_ms * len(rows)
    trips: list[tuple[float, tuple[float, ...], tuple[float, ...]]] = []
    for b in rows:
        stage = tuple(stage_step_ms(st, spec.pcs[p], b, work.context_tokens)
                      for st, p in zip(spec.stages, spec.stage_pcs, strict=True))
        hops = tuple(hop_ms(spec, k, b) for k in range(len(spec.hops)))
        for t, p in zip(stage, spec.stage_pcs, strict=True):
            busy[f"PC {p}"] += t
        for k, link in enumerate(spec.hops):
            busy[f"hop {k}"] += link.serial_ms(_hop_bytes(spec, k, b))
        trips.append((sum(stage) + sum(hops) + spec.coordinator_ms, stage, hops))
    round_trip, stage_ms, hops_ms = max(trips, key=lambda t: t[0])
    bound, period = "round trip", round_trip
    for name, t in busy.items():
        if t > period:
            bound, period = name, t
    return RingPrediction(users=work.users, rows=rows, stage_ms=stage_ms, hop_ms=hops_ms,
                          round_trip_ms=round_trip, period_ms=period, bound=bound,
                          per_user_tok_s=1000.0 / period, aggregate_tok_s=work.users * 1000.0 / period)


def predict_rings(spec: RingSpec, work: Workload, rings: int) -> FleetPrediction:
    """``rings`` copies of ``spec`` on their own PCs, the users split as evenly as possible
    (a ring left without users is not counted); each ring splits its users into
    ``work.micro_batches`` micro-batches."""
    if rings < 1:
        raise PlacementInputError(f"rings must be at least 1, not {rings}")
    shares = split_rows(work.users, rings)
    out = tuple(predict(spec, Workload(n, work.micro_batches, work.context_tokens)) for n in shares)
    return FleetPrediction(rings=out, users=work.users, aggregate_tok_s=sum(p.aggregate_tok_s for p in out),
                           per_user_tok_s=min(p.per_user_tok_s for p in out))


@dataclass(frozen=True)
class ModelCost:
    """A model of uniform decoder layers as one PC kind runs it, to be cut into stages.

    Per layer: bytes streamed per step, ms per row, ms per row per cached token. The LM head
    (``head_bytes`` streamed, ``head_row_ms`` per answered row) goes with the last stage; the
    embedding is a gather (nothing streamed). ``fixed_ms`` is what every stage's step costs.
    A mixture-of-experts model's layers also hold ``layer_expert_bytes`` of experts, routed by
    ``routing`` (`StageCost`); ``layer_bytes`` is then the rest of a layer.
    """

    layers: int
    layer_bytes: float
    layer_row_ms: float
    layer_context_ms: float
    head_bytes: float
    head_row_ms: float
    hidden_size: int
    fixed_ms: float = 0.0
    layer_expert_bytes: float = 0.0
    routing: ExpertRouting | None = None

    def __post_init__(self) -> None:
        if self.layers < 1 or self.hidden_size < 1:
            raise PlacementInputError(f"a model needs at least one layer and a hidden size (layers {self.layers}, "
                                      f"hidden_size {self.hidden_size})")
        _non_negative("model cost", layer_bytes=self.layer_bytes, layer_row_ms=self.layer_row_ms,
                      layer_context_ms=self.layer_context_ms, head_bytes=self.head_bytes,
                      head_row_ms=self.head_row_ms, fixed_ms=self.fixed_ms,
                      layer_expert_bytes=self.layer_expert_bytes)

    def stage(self, n_layers: int, last: bool) -> StageCost:
        """The cost of a stage of ``n_layers`` layers (with the head when ``last``)."""
        return StageCost(weight_bytes=n_layers * self.layer_bytes + (self.head_bytes if last else 0.0),
                         row_ms=n_layers * self.layer_row_ms + (self.head_row_ms if last else 0.0),
                         context_ms=n_layers * self.layer_context_ms, fixed_ms=self.fixed_ms,
                         expert_bytes=n_layers * self.layer_expert_bytes, routing=self.routing)


def split_stages(model: ModelCost, stages: int, pc: PcSpec, rows: int,
                 context_tokens: float) -> tuple[StageCost, ...]:
    """Contiguous layers over ``stages`` stages on PCs like ``pc`` whose slowest step of ``rows``
    rows is the least (what the planner would choose for that load); earlier stages get the
    extra layer when the counts cannot be equal."""
    if not 1 <= stages <= model.layers:
        raise PlacementInputError(f"{stages} stage(s) cannot split {model.layers} layer(s); "
                                  f"use 1 to {model.layers}")

    def cut(tail: int) -> tuple[StageCost, ...]:
        rest = split_rows(model.layers - tail, stages - 1) if stages > 1 else ()
        return tuple([model.stage(n, last=False) for n in rest] + [model.stage(tail, last=True)])

    tails = range(1, model.layers - stages + 2) if stages > 1 else (model.layers,)
    return min((cut(tail) for tail in tails),
               key=lambda costs: max(stage_step_ms(c, pc, rows, context_tokens) for c in costs))


def uniform_ring(stages: Sequence[StageCost], *, pc: PcSpec, own_pcs: bool, local: LinkSpec, lan: LinkSpec,
                 hidden_size: int, coordinator_ms: float, hidden_bytes: int = 4,
                 row_frame_bytes: int = 64) -> RingSpec:
    """A ring of identical PCs: one PC per stage (``own_pcs``) or every stage on one PC.

    The coordinator runs on stage 0's PC, so its first hop is ``local``; the others cross the
    ``lan`` between PCs, or stay ``local`` when every stage shares one PC.
    """
    n = len(stages)
    between = lan if own_pcs else local
    hops = (local,) + (between,) * (n - 1) + ((between,) if n > 1 else (local,))
    return RingSpec(stages=tuple(stages), stage_pcs=tuple(range(n)) if own_pcs else (0,) * n,
                    pcs=(pc,) * (n if own_pcs else 1), hops=hops, hidden_size=hidden_size,
                    hidden_bytes=hidden_bytes, row_frame_bytes=row_frame_bytes, coordinator_ms=coordinator_ms)


def export_stage_costs(manifest: Manifest, *, row_ms: float, context_ms: float = 0.0,
                       fixed_ms: float = 0.0) -> tuple[StageCost, ...]:
    """The stages of an export as this model prices them: each stage's weight file, of a MoE
    model split into its dense and expert bytes with the model's routing (the manifest's
    `StageMoe`; a manifest without one, older or dense, is priced dense). The per-row and
    per-step times are the caller's (measured), the same for every stage. The embedding is
    counted with the dense bytes (a little pessimistic: a step only gathers its rows)."""
    costs = []
    for stage in manifest.stages:
        weights = sum(f.size for f in stage.files if f.path == ir_paths(stage.xml)[1])
        moe = stage.moe
        routing = None if moe is None else ExpertRouting(moe.experts, moe.per_token)
        costs.append(StageCost(weight_bytes=weights if moe is None else moe.dense_bytes, row_ms=row_ms,
                               context_ms=context_ms, fixed_ms=fixed_ms,
                               expert_bytes=0.0 if moe is None else moe.expert_bytes, routing=routing))
    return tuple(costs)


def _non_negative(what: str, **values: float) -> None:
    bad = [f"{k} {v}" for k, v in values.items() if not (v >= 0 and math.isfinite(v))]
    if bad:
        raise PlacementInputError(f"invalid {what}: " + ", ".join(bad) + " (each must be finite and not negative)")
