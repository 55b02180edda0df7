"""The fleet's figures on the service's ``/metrics``: each ring's coordinator and stages, each agent,
and the service's own counts, as ``prometheus_client`` metric families in the API's registry.

Where the figures come from (nothing new listens on a PC):

- a ring's coordinator runs in the service: its ``metrics()`` (queue, slots, KV blocks in use and
  free, prefix-cache hits, rows per step, failovers, the step-time histograms of every stage as the
  frames report them) is read at each scrape and labelled ``ring`` and ``model``; a stage's series
  also carry ``agent``, the name of the PC serving that stage (``service`` for a stage 0 run in the
  service itself);
- an agent's status comes from the service's status polls (``AgentRecord.status``: worker state,
  restarts, steps/s, streams, bytes its stage sent to the next hop, CPU and memory), its pauses
  from the hub's ``paused`` events the agents send (:class:`PauseCounter`);
- re-plans: the stages failover moved to another PC (``RingRecovery.moves``) and the rebuilds the
  service started (:meth:`FleetFigures.note_rebuild`).

The console's Metrics page and Dashboard read the rings' samples from :meth:`FleetFigures.rings`
(``GET /admin/v1/metrics``), the same call this collector renders: one source for both.

Label cardinality is bounded: ``ring`` and ``model`` by the rings the admin serves, ``stage`` by a
ring's stages, ``agent`` by the approved members of the fleet, at most :data:`MAX_AGENT_LABELS`
of them (the rest are counted in ``deskfleet_fleet_agents`` only); pause reasons are not labels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from prometheus_client.metrics_core import Metric

from console.fleet.service_ring import ServiceRing
from console.fleet_api.agent_record import AgentRecord, Membership
from console.fleet_api.errors import FleetServiceError
from engine.api.api_metrics import PREFIX, families, merge, split_key
from engine.control.hub_events import AgentEvent

MAX_AGENT_LABELS = 1000  # agents named in labels: an office's fleet, with room
LOCAL_STAGE_AGENT = "service"  # the agent label of a stage the service runs itself

# what the main generator figures mean (HELP lines); the rest say "reported by the ring's coordinator"
HELP = {
    "active_streams": "streams the ring is generating now",
    "waiting_requests": "requests queued for a slot of the ring",
    "slots": "streams the ring can generate at once",
    "kv_blocks_used": "KV-cache blocks in use",
    "kv_blocks_free": "KV-cache blocks free",
    "kv_blocks_total": "KV-cache blocks in the ring's pool",
    "prefix_hits_total": "requests that reused cached prefix blocks",
    "prefix_tokens_reused_total": "prompt tokens served from the prefix cache",
    "failovers_total": "failovers of the ring (a stage stopped answering and was brought back or moved)",
    "step_answered_rows_avg": "rows answered per step, over the latest steps",
    "tokens_per_second": "tokens generated per second, over the latest seconds",
    "stage_step_seconds": "each stage's compute time per step, as the stage reports it",
    "ring_step_seconds": "one step's round trip through the whole ring",
    "first_hop_sent_bytes_total": "bytes the coordinator sent to the ring's first stage",
    "stage_compute_seconds_per_step": "each stage's median compute time per step, over the latest steps",
}
COORDINATOR_HELP = "reported by the ring's coordinator"


@dataclass(frozen=True)
class RingFigures:
    """One serving ring at a scrape: its coordinator's ``metrics`` and who serves each stage."""

    ring: str
    model: str
    metrics: Mapping[str, float]
    stage_agents: Mapping[int, str] = field(default_factory=dict)  # stage -> agent name
    stage_moves: int = 0  # stages failover moved to another PC since the ring was built
    rebuilds: int = 0  # times the service rebuilt the ring


def serving_figures(rings: Mapping[str, ServiceRing]) -> list[RingFigures]:
    """The figures of every ring of ``rings`` that serves now."""
    return [f for f in map(ring_figures, rings.values()) if f is not None]


def ring_figures(ring: ServiceRing, rebuilds: int = 0) -> RingFigures | None:
    """A serving ring's figures now (None while it is not in the router: nothing to scrape)."""
    dist = ring.dist
    if not ring.in_router or dist is None:
        return None
    try:
        metrics = dist.coordinator.metrics()
    except FleetServiceError:  # the ring stopped between the check and the read
        return None
    agents = {t.stage: t.name or t.control for t in dist.layout.targets}
    if dist.layout.local_stage0:
        agents[0] = LOCAL_STAGE_AGENT
    return RingFigures(ring.ring_id, ring.served.model, metrics, agents, len(dist.recovery.moves), rebuilds)


class PauseCounter:
    """Pauses per agent (node id), from the hub's ``paused`` events; bounded to
    :data:`MAX_AGENT_LABELS` nodes (a node beyond is not counted: it is not labelled either)."""

    def __init__(self) -> None:
        self.pauses: dict[str, int] = {}

    def on_event(self, event: AgentEvent) -> None:
        if event.event != "paused":
            return
        if event.node_id in self.pauses or len(self.pauses) < MAX_AGENT_LABELS:
            self.pauses[event.node_id] = self.pauses.get(event.node_id, 0) + 1


def with_labels(key: str, labels: Mapping[str, str]) -> str:
    """A metric key with ``labels`` added to its own (``'x{stage="1"}'`` + agent -> ``'x{stage="1",agent="a"}'``)."""
    base, own = split_key(key)
    merged = {**own, **labels}
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in merged.items())
    return f"{base}{{{inner}}}" if inner else base


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _stage_labelled(metrics: Mapping[str, float], stage_agents: Mapping[int, str]) -> dict[str, float]:
    """``metrics`` with an ``agent`` label on every series of a stage ``stage_agents`` names."""
    out = {}
    for key, value in metrics.items():
        _, own = split_key(key)
        stage = own.get("stage")
        agent = stage_agents.get(int(stage)) if stage is not None and stage.isdigit() else None
        out[with_labels(key, {"agent": agent}) if agent is not None else key] = value
    return out


def ring_families(rings: Sequence[RingFigures]) -> list[Metric]:
    """Every ring's coordinator figures under ``ring`` and ``model`` (and ``agent`` on stage series),
    plus its re-plans; one family per name."""
    groups = []
    for r in rings:
        metrics = _stage_labelled(r.metrics, r.stage_agents)
        metrics["ring_stage_moves_total"] = float(r.stage_moves)
        metrics["ring_rebuilds_total"] = float(r.rebuilds)
        groups.append(families(metrics, {"ring": r.ring, "model": r.model},
                               help_text=lambda n: HELP.get(n.removesuffix("_bucket"), HELP.get(n, COORDINATOR_HELP))))
    return list(merge(groups))


def is_labelled(record: AgentRecord) -> bool:
    """Whether an agent gets its own series: an approved member of this fleet."""
    return record.approved and record.membership is Membership.MEMBER and bool(record.node_id)


def _gauge(name: str, doc: str, samples: Sequence[tuple[Mapping[str, str], float]]) -> Metric:
    family = Metric(PREFIX + name, doc, "gauge")
    for labels, value in samples:
        family.add_sample(PREFIX + name, dict(labels), value)
    return family


def agent_families(records: Sequence[AgentRecord], pauses: Mapping[str, int]) -> list[Metric]:
    """Every approved member's figures under ``agent`` (its name), and the fleet's agents by state."""
    by_state: dict[str, int] = {}
    for r in records:
        by_state[r.state] = by_state.get(r.state, 0) + 1
    labelled = [r for r in records if is_labelled(r)][:MAX_AGENT_LABELS]
    up, paused, restarts, steps, streams, cpu, memory, count, sent = [], [], [], [], [], [], [], [], []
    for r in labelled:
        who = {"agent": r.name or r.node_id[:12]}
        up.append((who, 1.0 if r.reachable else 0.0))
        paused.append((who, 1.0 if r.paused_reasons else 0.0))
        count.append((who, float(pauses.get(r.node_id, 0))))
        s = r.status
        if s is None:
            continue
        restarts.append((who, float(s.worker.restarts)))
        steps.append((who, s.worker.steps_per_s))
        streams.append((who, float(s.worker.streams)))
        if s.cpu_percent is not None:
            cpu.append((who, s.cpu_percent))
        if s.memory_used_bytes is not None:
            memory.append((who, float(s.memory_used_bytes)))
        if s.hop_bytes_sent is not None:
            sent.append(({**who, "stage": "" if s.stage is None else str(s.stage)}, float(s.hop_bytes_sent)))
    pause_family = Metric(PREFIX + "agent_pauses", "times the agent paused (its person came back, battery, ...), "
                                                   "from the agents' hub events", "counter")
    for labels, value in count:
        pause_family.add_sample(PREFIX + "agent_pauses_total", dict(labels), value)
    hop_family = Metric(PREFIX + "agent_hop_sent_bytes", "bytes the agent's stage workers sent to the next hop "
                                                         "(stage: the one it serves now)", "counter")
    for labels, value in sent:
        hop_family.add_sample(PREFIX + "agent_hop_sent_bytes_total", dict(labels), value)
    return [
        _gauge("fleet_agents", "agents the service knows, by state", [({"state": k}, float(v))
                                                                      for k, v in sorted(by_state.items())]),
        _gauge("agent_up", "1 while the service's last status poll reached the agent", up),
        _gauge("agent_paused", "1 while the agent is paused", paused),
        pause_family,
        hop_family,
        _gauge("agent_worker_restarts", "restarts of the agent's stage worker since it was started", restarts),
        _gauge("agent_worker_steps_per_second", "steps the agent's stage worker computes per second", steps),
        _gauge("agent_worker_streams", "streams the agent's stage worker holds", streams),
        _gauge("agent_cpu_percent", "the PC's CPU use, all cores together (0-100)", cpu),
        _gauge("agent_memory_used_bytes", "the PC's RAM in use", memory),
    ]


class FleetFigures:
    """The fleet's figures, read at each scrape: ``rings()`` (ring figures of the rings serving)
    and ``records()`` (the agents). A ``prometheus_client`` collector (:meth:`collect`); also the
    source of the admin API's ``GET /admin/v1/metrics``."""

    def __init__(self, rings: Callable[[], Iterable[RingFigures]], records: Callable[[], Sequence[AgentRecord]],
                 phases: Callable[[], Iterable[str]] = tuple) -> None:
        self._rings = rings
        self._records = records
        self._phases = phases
        self.pauses = PauseCounter()
        self.rebuilds: dict[str, int] = {}
        self.started_at = time.time()

    def note_rebuild(self, ring: str) -> None:
        """The service started rebuilding ``ring`` (a re-run or an automatic restore)."""
        self.rebuilds[ring] = self.rebuilds.get(ring, 0) + 1

    def rings(self) -> tuple[RingFigures, ...]:
        """Every serving ring's figures now."""
        return tuple(replace(f, rebuilds=self.rebuilds.get(f.ring, 0)) for f in self._rings())

    def collect(self) -> Iterator[Metric]:
        phases: dict[str, int] = {}
        for phase in self._phases():
            phases[str(phase)] = phases.get(str(phase), 0) + 1
        yield _gauge("fleet_service_start_time_seconds", "when the fleet service started (Unix time)",
                     [({}, self.started_at)])
        yield _gauge("fleet_rings", "the rings the service holds, by phase",
                     [({"phase": k}, float(v)) for k, v in sorted(phases.items())])
        yield from ring_families(self.rings())
        yield from agent_families(tuple(self._records()), self.pauses.pauses)

    def describe(self) -> list[Metric]:
        return []  # names vary with the rings: not checked at registration
