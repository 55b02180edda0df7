"""The fleet's figures without a ring: bounded agent labels, pauses from hub events, the bytes a
worker sends to its next hop as its agent counts them, and ring figures labelled per stage."""

from __future__ import annotations

import json
import types

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.service.supervisor import WorkerSupervisor
from console.fleet import fleet_prometheus
from console.fleet.fleet_prometheus import FleetFigures, PauseCounter, RingFigures, with_labels
from engine.control.hub_events import AgentEvent
from engine.control.messages import AgentStatus
from engine.worker.status_lines import STATS_PREFIX
from tests.metrics.test_prometheus_export import _record


def _scrape(figures: FleetFigures) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(figures)
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_agents_beyond_the_bound_are_counted_by_state_but_not_labelled(monkeypatch):
    monkeypatch.setattr(fleet_prometheus, "MAX_AGENT_LABELS", 3)
    records = [_record(f"desk-{i}") for i in range(5)]
    samples = _scrape(FleetFigures(list, lambda: records))
    assert len(samples["deskfleet_agent_up"]) == 3
    assert [(s.labels, s.value) for s in samples["deskfleet_fleet_agents"]] == [({"state": "serving"}, 5.0)]


def test_pauses_are_counted_per_agent_and_bounded(monkeypatch):
    monkeypatch.setattr(fleet_prometheus, "MAX_AGENT_LABELS", 2)
    counter = PauseCounter()
    for node, event in (("a", "paused"), ("a", "resumed"), ("a", "paused"), ("b", "paused"), ("c", "paused")):
        counter.on_event(AgentEvent(node, event, {}, 0.0))
    assert counter.pauses == {"a": 2, "b": 1}


def test_stage_series_name_their_agent_and_quotes_are_escaped():
    metrics = {'stage_compute_ms_per_step{stage="1"}': 4.0, "kv_blocks_used": 3.0,
               'stage_step_seconds_bucket{stage="1",le="+Inf"}': 2.0, 'stage_step_seconds_sum{stage="1"}': 0.01,
               'stage_step_seconds_count{stage="1"}': 2.0}
    figures = FleetFigures(lambda: [RingFigures("r1", "m", metrics, {1: 'desk "b"'})], list)
    samples = _scrape(figures)
    (median,) = samples["deskfleet_stage_compute_seconds_per_step"]
    assert median.labels == {"stage": "1", "agent": 'desk "b"', "ring": "r1", "model": "m"} and median.value == 0.004
    assert samples["deskfleet_stage_step_seconds_count"][0].labels["agent"] == 'desk "b"'
    assert samples["deskfleet_kv_blocks_used"][0].labels == {"ring": "r1", "model": "m"}
    assert with_labels('x{a="1"}', {"b": 'q"'}) == 'x{a="1",b="q\\""}'


def test_the_agent_counts_what_its_workers_send_to_the_next_hop_across_a_restart():
    supervisor = WorkerSupervisor()
    first, second = (types.SimpleNamespace(last_stats=None, tail=[], pid=1) for _ in range(2))

    def line(proc, sent):
        supervisor._proc = proc
        supervisor._on_line(proc, STATS_PREFIX + json.dumps({"steps": 1, "streams": 0, "bytes_out": sent}))

    line(first, 100)
    line(first, 250)
    line(second, 40)  # a restarted worker counts from zero
    line(second, 30)  # never backwards
    assert supervisor.hop_bytes_sent == 290
    status = _record("desk-a").status
    assert isinstance(status, AgentStatus)
    reported = AgentStatus.from_dict({**status.to_dict(), "hop_bytes_sent": supervisor.hop_bytes_sent})
    assert reported.hop_bytes_sent == 290
    assert AgentStatus.from_dict({**status.to_dict(), "hop_bytes_sent": -1}).hop_bytes_sent is None
