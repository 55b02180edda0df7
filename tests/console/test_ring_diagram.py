"""The ring diagram: the pure `RingDiagram` built from a plan (names, devices, layers, hop round
trips, measured ms, the bottleneck), then the `QtRingDiagram` widget offscreen — the highlight
is painted where the model says the bottleneck is, and moves when live measurements move it."""

from __future__ import annotations

import math

import pytest

from console.qt.ring_diagram import (
    BOTTLENECK_FILL,
    COORDINATOR_FILL,
    PLANNED,
    RingDiagram,
    RingHop,
    RingStage,
    measured_from_metrics,
)
from engine.placement.types import Plan, PlannedStage

NAMES = {"node-a": "pc-a", "node-b": "pc-b", "node-c": "pc-c"}


def a_plan(compute=(3.0, 7.5, 4.0), hops=(0.4, 0.6, 0.5, 0.3)) -> Plan:
    devices = ("CPU", "GPU", "NPU")
    stages = tuple(PlannedStage(f"node-{c}/{devices[k]}", f"node-{c}", 10 * k, 10 * k + 9, ms, 2**30)
                   for k, (c, ms) in enumerate(zip("abc", compute, strict=True)))
    per_token = sum(compute) + sum(hops)
    return Plan(stages, hops, per_token, 1000 / per_token, max(*compute, *hops), 1, per_token, 1000 / per_token,
                "latency", True)


def test_a_plan_becomes_boxes_and_hops_with_round_trips():
    d = RingDiagram.from_plan(a_plan(), NAMES, states={"node-b": "serving"})
    assert [s.name for s in d.stages] == ["pc-a", "pc-b", "pc-c"]
    assert [s.device for s in d.stages] == ["CPU", "GPU", "NPU"]
    assert [(s.first_layer, s.last_layer) for s in d.stages] == [(0, 9), (10, 19), (20, 29)]
    assert [s.state for s in d.stages] == [PLANNED, "serving", PLANNED]
    assert [h.rtt_ms for h in d.hops] == pytest.approx([0.8, 1.2, 1.0, 0.6])  # twice the plan's one-way ms
    assert d.node_names() == ("console", "pc-a", "pc-b", "pc-c")
    assert d.hop_text(1) == "RTT 1.20 ms"
    assert d.stage_lines(1) == ("pc-b · GPU", "layers 10–19  (10)", "7.50 ms predicted")
    assert not d.measured


def test_an_unnamed_agent_shows_its_node_id_start():
    d = RingDiagram.from_plan(a_plan())
    assert d.stages[0].name == "node-a"


def test_the_bottleneck_is_the_slowest_stage_by_prediction():
    d = RingDiagram.from_plan(a_plan(), NAMES)
    assert (d.bottleneck.kind, d.bottleneck.index, d.bottleneck.ms) == ("stage", 1, 7.5)
    assert "bottleneck (predicted): stage 1 on pc-b, 7.50 ms" in d.summary()


def test_measured_ms_move_the_bottleneck():
    d = RingDiagram.from_plan(a_plan(), NAMES).with_live(measured_ms={2: 9.25, 1: 6.0}, states={2: "paused"})
    assert (d.bottleneck.kind, d.bottleneck.index) == ("stage", 2)
    assert d.stages[2].state == "paused" and d.stages[0].state == PLANNED
    assert d.stage_lines(2)[-1] == "9.25 ms measured"
    assert "bottleneck (measured): stage 2 on pc-c, 9.25 ms" in d.summary()
    again = d.with_live(measured_ms={0: 1.0})  # a later sample without stage 2 keeps its last figure
    assert again.stages[2].measured_ms == 9.25 and again.stages[0].measured_ms == 1.0


def test_a_slow_hop_is_the_bottleneck_and_a_tie_goes_to_the_stage():
    d = RingDiagram.from_plan(a_plan(hops=(0.4, 12.0, 0.5, 0.3)), NAMES)
    assert (d.bottleneck.kind, d.bottleneck.index, d.bottleneck.ms) == ("hop", 1, 12.0)
    assert "bottleneck (link probe): hop pc-a → pc-b, 12.00 ms" in d.summary()
    last = RingDiagram.from_plan(a_plan(hops=(0.4, 0.6, 0.5, 12.0)), NAMES)
    assert "hop pc-c → console" in last.summary()
    tie = RingDiagram.from_plan(a_plan(hops=(0.4, 7.5, 0.5, 0.3)), NAMES)
    assert tie.bottleneck.kind == "stage"


def test_a_diagram_needs_stages_and_one_hop_more():
    stage = RingStage("pc-a", "CPU", 0, 3, 1.0)
    with pytest.raises(ValueError, match="at least one stage"):
        RingDiagram((), (RingHop(1.0),))
    with pytest.raises(ValueError, match="has 2 hops, not 1"):
        RingDiagram((stage,), (RingHop(1.0),))


def test_measured_ms_come_from_the_coordinators_metrics():
    metrics = {'stage_compute_ms_per_step{stage="0"}': 2.5, 'stage_compute_ms_per_step{stage="2"}': 4.0,
               'stage_compute_ms_per_step{stage="1"}': math.nan, 'stage_compute_ms_per_step{stage="3"}': 9.0,
               "tokens_per_second": 30.0}
    assert measured_from_metrics(metrics, 3) == {0: 2.5, 2: 4.0}  # NaN left out; stage 3 is not in the ring
    assert measured_from_metrics({'stage_compute_ms_per_step{stage="0"}': 0.0}, 1) == {}


# -- the widget (offscreen) -------------------------------------------------------------------------

def painted(widget):
    widget.resize(1000, 600)
    return widget.grab().toImage()


def fill_at(image, centre, w, h):
    """The colours inside a box, off its text (a band just above the bottom edge)."""
    y = int(centre.y() + h / 2 - 5)
    return {image.pixelColor(int(centre.x() + dx), y).name() for dx in range(int(-w / 3), int(w / 3), 4)}


def test_the_widget_highlights_the_bottleneck_box_and_follows_live_measurements(qtbot):
    from console.qt.ring_diagram import QtRingDiagram

    widget = QtRingDiagram()
    qtbot.addWidget(widget)
    assert not painted(widget).isNull()  # "No plan." before a diagram
    d = RingDiagram.from_plan(a_plan(), NAMES)
    widget.set_diagram(d)
    image = painted(widget)
    centres, w, h = widget.layout_nodes()
    assert len(centres) == 4
    assert fill_at(image, centres[0], w, h) == {COORDINATOR_FILL.name()}
    assert fill_at(image, centres[2], w, h) == {BOTTLENECK_FILL.name()}  # stage 1: node 2 (after the console)
    assert BOTTLENECK_FILL.name() not in fill_at(image, centres[3], w, h)
    widget.set_diagram(d.with_live(measured_ms={2: 20.0}))
    image = painted(widget)
    assert fill_at(image, centres[3], w, h) == {BOTTLENECK_FILL.name()}
    assert BOTTLENECK_FILL.name() not in fill_at(image, centres[2], w, h)


def test_the_widget_keeps_boxes_apart_for_a_large_ring(qtbot):
    from console.qt.ring_diagram import QtRingDiagram

    widget = QtRingDiagram()
    qtbot.addWidget(widget)
    n = 24
    plan = Plan(tuple(PlannedStage(f"n{k}/CPU", f"n{k}", k, k, 1.0 + k / 10, 1) for k in range(n)),
                (0.2,) * (n + 1), 50.0, 20.0, 3.3, 1, 50.0, 20.0, "latency", True)
    widget.set_diagram(RingDiagram.from_plan(plan))
    widget.resize(1100, 560)
    assert widget.compact
    centres, w, h = widget.layout_nodes()
    for i, a in enumerate(centres):
        for b in centres[i + 1:]:
            assert abs(a.x() - b.x()) >= w - 1 or abs(a.y() - b.y()) >= h - 1, "two boxes overlap"
    assert not widget.grab().toImage().isNull()


# -- the Distribution page's diagram, driven by the serving's signals (no service attached) ------------

def test_the_distribution_page_draws_the_plan_and_follows_the_rings_metrics_and_records(qtbot, tmp_path):
    import dataclasses

    from console.fleet_api.fleet_settings import FleetSettings
    from console.qt.distribution_page import QtDistributionPage, stage_state
    from console.qt.service_bridge import ServiceBridge
    from console.qt.service_serving import ServiceServing
    from tests.console.test_dashboard import record

    bridge = ServiceBridge(FleetSettings(state_dir=tmp_path))
    try:
        serving = ServiceServing(bridge)
        page = QtDistributionPage(serving, bridge.session)
        qtbot.addWidget(page)
        assert page.ring.diagram is None and "Placement page" in page.ring.empty_text
        bridge.session.set_plan(a_plan())
        d = page.ring.diagram
        assert [s.name for s in d.stages] == ["node-a", "node-b", "node-c"] and d.bottleneck.index == 1
        serving.metrics.emit({'stage_compute_ms_per_step{stage="2"}': 11.0, "tokens_per_second": 3.0})
        assert page.ring.diagram.stages[2].measured_ms == 11.0 and page.ring.diagram.bottleneck.index == 2
        named = [dataclasses.replace(record(n, "paused" if n == "pc-b" else "idle"), node_id=f"node-{n[-1]}")
                 for n in ("pc-a", "pc-b")]
        bridge.records = tuple(named)
        bridge.records_changed.emit(bridge.records)
        d = page.ring.diagram
        assert [s.name for s in d.stages] == ["pc-a", "pc-b", "node-c"]
        assert [s.state for s in d.stages] == ["planned", "paused", "planned"]  # idle, not up: planned
        assert d.stages[2].measured_ms == 11.0  # the last measurement stays until a new ring comes up
        serving.phase_changed.emit("distributing")
        assert page.ring.diagram.stages[2].measured_ms is None
    finally:
        bridge.close()
    assert stage_state(None, "serving") == "unreachable" and stage_state(None, "idle") == "planned"
    unreachable = record("x", "serving", reachable=False)
    assert stage_state(unreachable, "serving") == "unreachable"
    assert stage_state(record("x", "serving"), "serving") == "serving"
