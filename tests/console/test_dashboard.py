"""The Dashboard: the Qt-free overview (agents by state, rings and figures, the per-agent load
history, the failover tally of the day), then the page itself against a real fleet service with
two real agents joined over loopback, one paused: the counts, the CPU/memory sparklines from
the agents' own status, the figures read from the service's metrics."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from console.service.agent_record import AgentRecord, AgentSource, Membership
from console.service.failover_tally import FailoverTally
from console.service.fleet_overview import (
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
    day, path = Day(), tmp_path / "failovers.json"
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
    path.write_text("{not json")
    assert FailoverTally(path, clock=day).today() == 0  # a damaged file: counted from 0, the file left in place
    assert path.read_text() == "{not json"


# -- the page against a real fleet service -----------------------------------------------------------------

@pytest.fixture(scope="module")
def module_dirs(tmp_path_factory):
    from engine.envvars import KEYRING_DIR

    root = tmp_path_factory.mktemp("dirs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEYRING_DIR, str(root / "keyring"))
        patch.setenv("XDG_CONFIG_HOME", str(root / "config"))
        patch.setenv("XDG_DATA_HOME", str(root / "data"))
        yield


def join_and_approve(window, loop, agents, wait) -> None:
    """Each agent joins with a join token of its own and the admin approves it (through the bridge:
    the Fleet page is not under test here)."""
    bridge = window.bridge
    for name, agent in agents.items():
        loop.run(agent.async_join(bridge.enrollment, bridge.issue_token_now()), 30, f"{name} joining")
    wait(lambda: {r.name for r in members(bridge.records) if r.verified} >= set(agents), 30, "the joined agents")
    for r in members(bridge.records):
        if r.name in agents:
            bridge.approve(r.key)
    wait(lambda: all(r.approved for r in members(bridge.records) if r.name in agents), 30, "the approvals")


@pytest.fixture
def wait(qtbot):
    def wait(condition, timeout: float, what: str) -> None:
        try:
            qtbot.waitUntil(condition, timeout=int(timeout * 1000))
        except AssertionError:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None
    return wait


@pytest.mark.slow
def test_the_dashboard_shows_real_agents_by_state_and_their_cpu_and_memory(tmp_path, module_dirs, qtbot, wait):
    from console.dashboard_page import QtDashboardPage
    from tests.console.console_app_helpers import NAMES, local_agents, running_console

    with local_agents(tmp_path) as (loop, agents), running_console(tmp_path / "console", wait) as window:
        bridge = window.bridge
        assert window.tabs.tabText(0) == "Dashboard" and window.tabs.widget(0) is window.dashboard_page
        join_and_approve(window, loop, agents, wait)
        paused = next(r for r in bridge.records if r.name == NAMES[1])
        bridge.pause(paused.key)
        page = QtDashboardPage(bridge, sample_s=0.25)  # the window's samples every 2 s
        qtbot.addWidget(page)

        def counts(p) -> dict[str, int]:
            return {c.state: c.count for c in p.state_bar.counts}
        wait(lambda: counts(page) == {"idle": 1, "paused": 1}, 30, "one idle and one paused agent")
        assert counts(window.dashboard_page) == {"idle": 1, "paused": 1}
        assert page.agents_title.text() == "Agents: 2 in this fleet"
        keys = [r.key for r in members(bridge.records)]
        wait(lambda: all(len(page.history.cpu(k)) >= 3 for k in keys), 30, "three CPU samples of each agent")
        table = page.load_table
        page.sample()
        rows = {table.item(r, 0).text(): r for r in range(table.rowCount())}
        assert set(rows) == set(NAMES)
        for name, row in rows.items():
            key = next(r.key for r in bridge.records if r.name == name)
            assert table.item(row, 1).text() == ("paused" if name == NAMES[1] else "idle")
            assert re.fullmatch(r"\d+ %", table.item(row, 3).text())
            assert re.fullmatch(r"\d+\.\d of \d+\.\d GB", table.item(row, 5).text())
            cpu, memory = table.cellWidget(row, 2), table.cellWidget(row, 4)
            assert cpu.values == page.history.cpu(key) and len(cpu.values) >= 3
            assert memory.values == page.history.memory(key) and all(0 < v <= 1 for v in memory.values)
        assert (page.models_tile.value.text(), page.requests_tile.value.text()) == ("0", "—")
        bridge.resume(paused.key)
        wait(lambda: counts(page) == {"idle": 2}, 30, "the resumed agent")
