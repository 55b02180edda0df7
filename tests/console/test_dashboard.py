"""The Dashboard: the Qt-free overview (agents by state, rings and figures, the per-agent load
history, the failover tally of the day), then the page itself in the console window against a
real fleet service, four real agents on loopback (two serving a real ring, one paused, one
awaiting approval) and chats through the API: the counts, the CPU/memory sparklines from the
agents' own status and the figures from the service's metrics are checked by
tests/console/picture_screenshots.py as it takes its screenshots, under Xvfb when it can."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest

from console.fleet.failover_tally import FailoverTally
from console.fleet_api.agent_record import AgentRecord, AgentSource, Membership
from console.qt.fleet_overview import (
    AWAITING,
    COLOURS,
    UNREACHABLE,
    LoadHistory,
    dashboard_state,
    figures,
    members,
    ring_lines,
    state_counts,
)
from engine.control.messages import AgentStatus, FetchProgress, WorkerStatus
from engine.state.db import DB_FILE, StateDB

GB = 1 << 30


def record(name: str, state: str = "idle", *, approved: bool = True, reachable: bool | None = True,
           cpu: float | None = 10.0, used: int | None = 4 * GB, membership=Membership.MEMBER) -> AgentRecord:
    status = AgentStatus(f"n-{name}", "fleet", name, "1", state, (), {"ram_total": 16 * GB}, None, None,
                         FetchProgress(), WorkerStatus(), None, cpu_percent=cpu, memory_used_bytes=used)
    return AgentRecord(node_id=f"n-{name}", name=name, address="127.0.0.1", control_port=1, state=state,
                       devices=("CPU",), memory_bytes=16 * GB, fleet_id="fleet", membership=membership,
                       last_seen=1.0, sources=frozenset({AgentSource.HUB}), approved=approved, status=status,
                       reachable=reachable, verified=True)


def test_members_are_counted_by_state_in_a_fixed_order_with_their_colours():
    records = [record("a", "serving"), record("b", "paused"), record("c", "serving"), record("d", approved=False),
               record("e", reachable=False), record("f", "weird"),
               record("x", membership=Membership.OTHER_FLEET), record("y", membership=Membership.NOT_JOINED)]
    counts = state_counts(records)
    assert [(c.state, c.count) for c in counts] == [("serving", 2), ("paused", 1), (AWAITING, 1), (UNREACHABLE, 1),
                                                    ("other", 1)]
    assert all(c.colour == COLOURS[c.state] for c in counts)
    assert dashboard_state(record("z", "paused", reachable=False)) == UNREACHABLE  # its last word is stale
    assert [r.name for r in members(records)] == ["a", "b", "c", "d", "e", "f"]
    assert state_counts([]) == ()


def test_rings_and_the_figures_of_the_moment():
    rings = {"r2": {"ring": "r2", "model": "tiny", "phase": "failed", "plan": {"stages": [{}]}},
             "r1": {"ring": "r1", "model": "llama", "phase": "serving", "plan": {"stages": [{}, {}]}},
             "r3": {"ring": "r3", "model": "qwen", "phase": "serving", "plan": None}}
    metrics = {"r1": {"tokens_per_second": 30.5, "active_streams": 2.0},
               "r3": {"tokens_per_second": 4.5, "active_streams": 1.0}}
    lines = ring_lines(rings, metrics)
    assert [(r.ring, r.model, r.phase, r.stages, r.tok_s, r.active_streams) for r in lines] == [
        ("r1", "llama", "serving", 2, 30.5, 2), ("r2", "tiny", "failed", 1, None, None),
        ("r3", "qwen", "serving", 0, 4.5, 1)]
    f = figures(lines, 3)
    assert (f.models, f.rings_serving, f.requests_now, f.tok_s, f.failovers_today) == (("llama", "qwen"), 2, 3, 35.0,
                                                                                       3)
    none = figures(ring_lines({}, {}), None)
    assert (none.models, none.requests_now, none.tok_s) == ((), None, None)


def test_the_load_history_samples_members_within_its_window():
    history = LoadHistory(window_s=10.0, sample_s=2.0)
    history.add([record("a", cpu=10.0), record("b", cpu=50.0, used=8 * GB)], now=0.0)
    history.add([record("a", cpu=99.0)], now=1.0)  # too soon: not sampled (b is gone: forgotten)
    assert history.cpu("n-a") == [10.0] and history.cpu("n-b") == []
    history.add([record("a", cpu=30.0, used=12 * GB), record("b", cpu=70.0, used=8 * GB)], now=2.5)
    assert history.cpu("n-a") == [10.0, 30.0] and history.memory("n-a") == [0.25, 0.75]
    history.add([record("a", cpu=None, used=None), record("b", cpu=5.0, reachable=False)], now=5.0)
    assert history.cpu("n-a") == [10.0, 30.0]  # nothing known: no point; an unreachable agent's is stale
    history.add([record("a", cpu=20.0), record("b", cpu=80.0)], now=13.0)
    assert history.cpu("n-a") == [20.0]  # the window moved past the first points
    assert history.busiest(1) == ["n-b"] and history.busiest(5) == ["n-b", "n-a"]
    assert history.latest("n-b").cpu_percent == 80.0 and history.latest("n-zz") is None


class Day:
    def __init__(self) -> None:
        self.day = dt.date(2026, 3, 1)

    def __call__(self) -> dt.date:
        return self.day


def test_the_failover_tally_counts_what_each_coordinator_added_today_and_keeps_it(tmp_path):
    day, path = Day(), tmp_path
    tally = FailoverTally(path, clock=day)
    assert tally.observe({"r1": {"failovers_total": 0.0}}) == 0
    assert tally.observe({"r1": {"failovers_total": 2.0}, "r2": {"failovers_total": 1.0}}) == 3
    assert tally.observe({"r1": {"failovers_total": 2.0}}) == 3  # no change; r2 not sampled
    assert tally.observe({"r2": {"failovers_total": 1.0}}) == 3  # r2 back with the same coordinator
    assert tally.observe({"r1": {"failovers_total": 1.0}}) == 4  # a new coordinator for r1: its 1 is new
    assert FailoverTally(path, clock=day).today() == 4  # a restarted service keeps the day's count
    day.day = dt.date(2026, 3, 2)
    assert tally.today() == 0 and FailoverTally(path, clock=day).today() == 0
    assert tally.observe({"r1": {"failovers_total": 3.0}}) == 2
    StateDB.forget(path)
    damaged = b"not a database" * 400
    (path / DB_FILE).write_bytes(damaged)
    assert FailoverTally(path, clock=day).today() == 0  # a damaged database: counted from 0, left in place
    assert (path / DB_FILE).read_bytes() == damaged


# -- the page against a real fleet service -----------------------------------------------------------------

@pytest.mark.slow
def test_screenshots_of_the_dashboard_and_the_live_ring(tmp_path, module_dirs, tiny_checkpoint, qtbot):
    """The Dashboard and the Distribution page's ring diagram of a real serving ring, as PNGs in
    ``$DESKFLEET_SCREENSHOTS`` (default: a temporary folder), under Xvfb when it works here, else
    offscreen in this process; the state colours and the bottleneck's red are in the pictures."""
    from PySide6.QtGui import QColor, QImage

    from console.qt.ring_diagram import BOTTLENECK
    from tests.console.picture_screenshots import SHOTS, STATES_SHOWN, take_picture_screenshots
    from tests.support.xvfb import XVFB, xvfb_works

    out = Path(os.environ.get("DESKFLEET_SCREENSHOTS") or tmp_path / "screenshots")
    checkpoint = tiny_checkpoint("llama")
    env = {**os.environ, "QT_QPA_PLATFORM": "xcb"}
    if xvfb_works(env):
        run = subprocess.run([*XVFB, sys.executable, "-m", "tests.console.picture_screenshots", "--out", str(out),
                              "--checkpoint", str(checkpoint), "--work", str(tmp_path / "work")],
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    else:
        take_picture_screenshots(out, checkpoint, tmp_path / "work")
    print(f"picture screenshots ({(out / 'PICTURES-PLATFORM.txt').read_text().strip()}) in {out}")

    def colours(name: str, top: float = 0.0, bottom: float = 1.0) -> set[str]:
        image = QImage(str(out / name))
        assert not image.isNull() and image.width() >= 800 and image.height() >= 500, name
        rows = range(int(top * image.height()), int(bottom * image.height()), 3)
        return {QColor(image.pixel(x, y)).name() for x in range(0, image.width(), 3) for y in rows}

    dashboard = colours(SHOTS[0], 0.0, 0.2)  # the state bar and its legend
    assert {COLOURS[s] for s in STATES_SHOWN} <= dashboard
    assert BOTTLENECK.name() in colours(SHOTS[1], 0.25, 1.0)  # the ring's slowest stage or hop


def test_a_sparkline_draws_on_its_fixed_scale(qtbot):
    from console.qt.sparkline import QtSparkline

    spark = QtSparkline(ceiling=100.0)
    qtbot.addWidget(spark)
    spark.resize(200, 30)
    assert spark.points() == []
    spark.set_values([0.0, 50.0, 100.0, 140.0, -5.0])  # out of scale: clamped
    area, points = spark.line_area(), spark.points()
    assert spark.values == [0.0, 50.0, 100.0, 100.0, 0.0]
    assert [round(p.y(), 3) for p in points] == [round(area.bottom(), 3), round(area.center().y(), 3),
                                                 round(area.top(), 3), round(area.top(), 3), round(area.bottom(), 3)]
    assert points[0].x() == area.left() and points[-1].x() == area.right()
    image = spark.grab().toImage()
    assert not image.isNull()
