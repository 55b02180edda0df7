"""The value types of placement: what the fleet service hands the solver and what it gets back.

Frozen dataclasses, shared by the solver (`engine.placement.planner`, `engine.placement.rings`),
the fleet service that builds requests and stores plans, its admin API and the console's pages;
they hold validation of their own fields and nothing of the solving.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from engine.errors import Exclusion, PlacementInputError
from engine.placement.moe import MoeWeights

DeviceKind = Literal["CPU", "GPU", "NPU"]
Objective = Literal["latency", "throughput"]


@dataclass(frozen=True)
class DeviceProfile:
    """One candidate device of an agent, calibrated for the model being placed.

    ``layer_ms`` is t[d], decode time of one layer for one token; ``overhead_ms`` is o[d], the
    fixed cost of running a stage (dispatch, activation copies); ``memory_bytes`` is the memory
    the device can address now, of which the solver uses ``PlacementRequest.headroom``.

    ``model`` is the model as this device would run it, when that differs from the request's
    profile: an NPU runs static, stateless shards whose host KV ring is allocated for the whole
    fixed context (and whose graphs differ), a CPU may hold another weight format. Its layer
    bytes and embedding/head costs then replace the shared ones for this device only. For a
    packed NPU stage, calibrate ``layer_ms`` per token at the slot count it will serve.
    """

    device_id: str  # "pc-a/GPU"
    pc_id: str
    kind: DeviceKind
    layer_ms: float
    overhead_ms: float
    memory_bytes: int
    model: ModelProfile | None = None


@dataclass(frozen=True)
class Calibration:
    """What a short calibration run measured for one device and the model being placed.

    ``model`` is the form the device runs (see `DeviceProfile.model`): for an NPU, the static
    export's profile; None for the request's (stateful) one.
    """

    layer_ms: float
    overhead_ms: float
    model: ModelProfile | None = None


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

    ``moe`` (a mixture-of-experts model): its experts and how many a token uses. Memory counts
    every expert (they are in ``layer_bytes``); a step reads only the routed ones, which the
    calibrated times already show for one stream and `engine.placement.throughput` prices for
    a batch of rows.
    """

    layer_bytes: tuple[int, ...]
    embed_bytes: int = 0
    embed_ms: float = 0.0
    head_bytes: int = 0
    head_ms: float = 0.0
    moe: MoeWeights | None = None

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
    plan may fill. ``time_limit_s`` bounds the whole solve. ``min_stages``/``max_stages`` bound
    the number of stages (at least N spreads the model over N devices even where fewer would be
    faster, e.g. to measure a split, or to keep each PC's share small).
    """

    objective: Objective = "latency"
    n_streams: int = 1
    headroom: float = 0.8
    allow_battery: bool = False
    time_limit_s: float = 10.0
    max_stages: int | None = None
    min_stages: int = 1

    def __post_init__(self) -> None:
        rules = [(self.objective in ("latency", "throughput"), "objective must be 'latency' or "
                  f"'throughput', not {self.objective!r}"),
                 (self.n_streams >= 1, f"n_streams must be at least 1, not {self.n_streams}"),
                 (0.0 < self.headroom <= 1.0, f"headroom must be in (0, 1], not {self.headroom}"),
                 (self.time_limit_s > 0, f"time_limit_s must be positive, not {self.time_limit_s}"),
                 (self.max_stages is None or self.max_stages >= 1,
                  f"max_stages must be at least 1 or None, not {self.max_stages}"),
                 (self.min_stages >= 1, f"min_stages must be at least 1, not {self.min_stages}"),
                 (self.max_stages is None or self.min_stages <= self.max_stages,
                  f"min_stages ({self.min_stages}) exceeds max_stages ({self.max_stages})")]
        if problems := [why for ok, why in rules if not ok]:
            raise PlacementInputError("invalid placement request: " + "; ".join(problems))


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
    # Proven relative gap of the minimised value (objective_ms): the optimum is at least
    # objective_ms * (1 - gap). 0.0 when optimal; None when no solver stands behind the plan
    # (a split adjusted by hand, or a plan from a service that did not report it).
    gap: float | None = None

    @property
    def objective_ms(self) -> float:
        """The value the solver minimised: per-token ms, or the ring's cycle ms."""
        return self.per_token_ms if self.objective == "latency" else self.cycle_ms


DEFAULT_REQUEST = PlacementRequest()


@dataclass(frozen=True)
class RingsRequest:
    """How many rings to propose (None: as many as fit), PCs kept aside as standbys, the
    placement options every ring is solved with, and the rings already serving (kept as they are)."""

    rings: int | None = None
    standbys: int = 1
    placement: PlacementRequest = DEFAULT_REQUEST
    existing: tuple[Plan, ...] = ()

    def __post_init__(self) -> None:
        if self.rings is not None and self.rings < 1:
            raise PlacementInputError(f"rings must be at least 1 or None (as many as fit), not {self.rings}")
        if self.standbys < 0:
            raise PlacementInputError(f"standbys must be 0 or more, not {self.standbys}")


@dataclass(frozen=True)
class RingsPlan:
    """The proposal: the new rings (in the order solved), the standbys, and what was left over.

    ``limit`` says why no further ring was proposed ("asked for 2", or the solver's reason);
    ``standby_gaps`` names every stage (of a new or an existing ring) that no standby can hold, so
    the admin knows which failures would have to wait for the PC to come back."""

    rings: tuple[Plan, ...]
    standbys: tuple[str, ...]
    unused: tuple[str, ...]  # usable PCs in no ring and not a standby
    limit: str
    excluded: tuple[Exclusion, ...] = ()
    standby_gaps: tuple[str, ...] = ()

    @property
    def aggregate_tok_s(self) -> float:
        """The new rings' predicted aggregate: rings on separate PCs do not share compute."""
        return sum(p.aggregate_tok_s for p in self.rings)
