"""What the Metrics page shows, decided without Qt: a bounded history of the coordinator's
metrics, where each token's time goes (compute vs network, per stage) and the pause log from
the agents' hub events.

The coordinator measures one ring round trip per step (``ring_step_ms_avg``), and every stage
reports its own compute time per step on the frames it passes on (docs/PROTOCOL.md, stage
times): the coordinator keeps each stage's moving median (``stage_compute_ms_per_step{stage="k"}``,
engine.ring.stage_times). So the per-stage rows pair the plan's prediction for every stage
and hop with what is measured, and the last row shows the network's share of a ring step (the
round trip minus every stage's compute) against the plan's hops; with a coordinator whose stages
do not report (an older ring), the remainder of a ring step is shown as one figure instead.
"""

from __future__ import annotations

import datetime as dt
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.control.hub import AgentEvent
from engine.placement.types import Plan

LOCAL_COMPUTE = 'stage_compute_ms_per_step{stage="0"}'
HISTORY = 120  # samples kept for the sparkline (two minutes at one a second)


class MetricsHistory:
    """The last ``capacity`` metric samples (dicts as `Coordinator.metrics()` returns them)."""

    def __init__(self, capacity: int = HISTORY) -> None:
        self._samples: deque[Mapping[str, float]] = deque(maxlen=capacity)

    def add(self, metrics: Mapping[str, float]) -> None:
        self._samples.append(dict(metrics))

    def clear(self) -> None:
        self._samples.clear()

    def series(self, key: str) -> list[float]:
        return [s.get(key, 0.0) for s in self._samples]

    @property
    def latest(self) -> Mapping[str, float]:
        return self._samples[-1] if self._samples else {}


@dataclass(frozen=True)
class StageTime:
    """One row of the breakdown: a stage's compute or a hop, predicted and (if known) measured."""

    what: str
    kind: str  # "compute" | "network"
    predicted_ms: float
    measured_ms: float | None = None


def stage_breakdown(plan: Plan | None, metrics: Mapping[str, float], names: Mapping[str, str],
                    local_stage0: bool) -> list[StageTime]:
    """Per stage and hop of ``plan``: predicted ms, and measured ms where the coordinator
    measures it (every stage of a ring whose workers report their stage times); a final row for the
    network's share of a ring step, or for the rest of it (network + remote compute) when some stage
    is not measured."""
    if plan is None:
        return []
    local = metrics.get(LOCAL_COMPUTE)
    rows = []
    hop_names = ["console", *(names.get(s.pc_id, s.pc_id[:12]) for s in plan.stages), "console"]
    for k, stage in enumerate(plan.stages):
        rows.append(StageTime(f"hop {hop_names[k]} → {hop_names[k + 1]}", "network", plan.hop_ms[k]))
        # measured where the coordinator hears it: stage 0 in this process, every stage of a paged ring
        measured = metrics.get(f'stage_compute_ms_per_step{{stage="{k}"}}')
        rows.append(StageTime(f"stage {k} on {hop_names[k + 1]} (layers {stage.first_layer}-{stage.last_layer})",
                              "compute", stage.compute_ms, measured))
    rows.append(StageTime(f"hop {hop_names[-2]} → console", "network", plan.hop_ms[-1]))
    ring = metrics.get("ring_step_ms_avg")
    computes = [r.measured_ms for r in rows if r.kind == "compute"]
    if ring is not None and computes and None not in computes:
        rows.append(StageTime("ring step minus every stage's compute: network", "network", sum(plan.hop_ms),
                              max(0.0, ring - sum(ms for ms in computes if ms is not None))))
    elif ring is not None:
        remote = sum(r.predicted_ms for r in rows) - (plan.stages[0].compute_ms if local_stage0 else 0.0)
        rows.append(StageTime("ring step: network + remote compute", "network", remote,
                              ring - (local or 0.0) if local_stage0 else ring))
    return rows


def speculation_text(metrics: Mapping[str, float]) -> str:
    if "speculation_acceptance_rate" not in metrics:
        return "off"
    return (f"{metrics['speculation_acceptance_rate']:.0%} of "
            f"{metrics.get('speculation_proposed_total', 0):.0f} drafted tokens accepted")


@dataclass(frozen=True)
class PauseEntry:
    at: dt.datetime
    agent: str
    event: str  # "paused" | "resumed"
    reasons: tuple[str, ...]

    @property
    def text(self) -> str:
        why = f" ({', '.join(self.reasons)})" if self.reasons else ""
        return f"{self.at:%H:%M:%S}  {self.agent} {self.event}{why}"


class PauseLog:
    """Who paused and why, newest last, from the hub's paused/resumed events."""

    def __init__(self, capacity: int = 200, clock: Callable[[], dt.datetime] = dt.datetime.now) -> None:
        self.entries: deque[PauseEntry] = deque(maxlen=capacity)
        self._clock = clock

    def take(self, event: AgentEvent, name: str) -> PauseEntry | None:
        """Record ``event`` if it is a pause or resume; the entry, else None."""
        if event.event not in ("paused", "resumed"):
            return None
        reasons = event.body.get("reasons")
        reasons = tuple(r for r in reasons if isinstance(r, str)) if isinstance(reasons, list) else ()
        entry = PauseEntry(self._clock(), name, event.event, reasons if event.event == "paused" else ())
        self.entries.append(entry)
        return entry
