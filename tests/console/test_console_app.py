"""The admin console end to end (pytest-qt, offscreen), against a real local fleet: a real
`FleetService` (one for the module, on a loop thread of its own), the console's `ServiceBridge`
over its admin socket and the window, two headless `AgentService`s on 127.0.0.1 with their own
state dirs, real mDNS, TLS, calibration, export process, stage workers and OpenAI API. Only the
idle clock is fake.

From an empty network to a chat answered by a 2-agent fleet through the pages' widgets: agents
discovered on the Fleet page, joined with the token shown there, approved, links measured; the
tiny model added on the Models page and placed (a plan over both agents, a split moved by hand
and re-timed, an impossible context explained); distributed with per-agent progress; the Chat
page answers; the Metrics page counts the tokens and logs an agent's pause; closing the console
stops nothing, and the next console shows the ring and stops it. Also: an export from the Models
page runs in the service with its progress shown, and one cancelled there leaves nothing behind;
the Qt-free pieces without a QApplication.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PySide6.QtWidgets import QMessageBox

from console.fleet.ring_endpoints import ring_endpoints
from console.fleet_api.placement import retime, stage_firsts
from console.qt.fleet_metrics import PauseLog, stage_breakdown
from engine.control.hub import AgentEvent
from engine.placement.types import Plan, PlannedStage
from export.sources import find_default_gguf
from tests.console.console_app_helpers import (
    ConsoleDriver,
    fleet_service,
    item_texts,
    local_agents,
    running_console,
)
from tests.console.console_screenshots import FIRST_HOUR, PAGES, copy_caches, take_console_screenshots

pytestmark = pytest.mark.usefixtures("module_dirs")


@pytest.fixture(scope="module")
def service(module_dirs, tmp_path_factory):
    """The module's one fleet service: every console test attaches to it (its start, the CA and
    the listeners, is paid once)."""
    with fleet_service(tmp_path_factory.mktemp("fleet")) as running:
        yield running


@pytest.fixture(scope="module")
def console_cache(tmp_path_factory):
    """Calibration exports and shard exports of the first console run, for the screenshots' run
    (both are keyed by content, so reusing them changes no outcome, only the time taken)."""
    return tmp_path_factory.mktemp("console-cache")


@pytest.fixture
def wait(qtbot):
    def wait(condition, timeout: float, what: str) -> None:
        try:
            qtbot.waitUntil(condition, timeout=int(timeout * 1000))
        except AssertionError:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None
    return wait


@pytest.mark.slow
def test_from_an_empty_network_to_a_chat_answered_by_two_agents(tmp_path, tiny_checkpoint, wait, console_cache,
                                                                service):
    hub = service.service.host.hub
    with local_agents(tmp_path) as (agent_loop, agents):
        _from_an_empty_network_to_a_chat(tmp_path, tiny_checkpoint, wait, console_cache, service, agent_loop, agents)
        # closing the console stopped nothing: the service still serves the ring on both agents (the
        # one paused last comes back once resumed)
        wait(lambda: all(a.status().worker.state == "running" for a in agents.values()), 60,
             "both workers to run with no console attached")
        with running_console(tmp_path / "console-2", wait, service) as window:
            serving = window.serving
            wait(lambda: serving.phase == "serving", 30, "the next console to show the ring serving")
            assert hub.bytes_served > 0 and window.bridge.session.serving is not None
            window.distribution_page.stop_button.click()
            window.distribution_page.confirmation.button(QMessageBox.StandardButton.Yes).click()  # it cuts chats off
            wait(lambda: serving.phase == "idle" and serving.ring is None, 120, "the ring to stop")
        assert all(a.status().worker.state == "stopped" for a in agents.values())  # stopping it stopped them


def _from_an_empty_network_to_a_chat(tmp_path, tiny_checkpoint, wait, console_cache, service, agent_loop, agents):
    hub = service.service.host.hub
    with running_console(tmp_path / "console", wait, service) as window:
        drive = ConsoleDriver(window, wait)
        names = tuple(agents)
        # Fleet: both agents are found over mDNS before they join, then join with the page's token
        drive.wait_rows(names, lambda row: row["State"] == "not joined", "the agents over mDNS")
        assert window.fleet_page.enrollment_label.text() == window.bridge.enrollment
        drive.join(agent_loop, agents)
        drive.wait_rows(names, lambda row: row["State"].startswith("awaiting approval") and row["Approved"] == "no",
                        "the joined agents")
        # the built-in default is chosen on arrival (when installed): Placement is no dead end
        assert window.placement_page.place_button.isEnabled() == (find_default_gguf() is not None)
        drive.approve(names)
        drive.measure_links(names)
        rows = drive.fleet_rows()
        assert all(0 < float(rows[n]["RTT ms"]) < 500 and float(rows[n]["Mbit/s"]) > 0 for n in names)
        assert f"{names[0]} ↔ {names[1]}" in window.fleet_page.links_label.text()

        # Models + Placement: the context makes a layer ~1/3 of an agent: two stages, one per agent
        drive.add_model(tiny_checkpoint("llama"))
        window.show_page("Placement")
        context = drive.two_agent_context()
        drive.place(context)
        page, session = window.placement_page, window.bridge.session
        plan = session.plan
        assert plan is not None, page.explanation.text()
        assert {session.name(s.pc_id) for s in plan.stages} == set(names) and stage_firsts(plan) == (2,)
        assert page.table.rowCount() == 2 and page.table.item(0, 3).text() == "0-1 (2)"
        assert f"{plan.tok_s:.1f} tok/s" in page.summary.text() and not page.explanation.text()
        # moving the split re-times the plan at once, and says that three layers do not fit one agent
        page.split_boxes[0].setValue(3)
        moved = session.plan
        assert stage_firsts(moved) == (3,) and not moved.optimal
        assert moved.stages[0].compute_ms > plan.stages[0].compute_ms
        assert page.table.item(0, 3).text() == "0-2 (3)" and "does not fit" in page.explanation.text()
        page.split_boxes[0].setValue(2)
        assert session.plan.per_token_ms == pytest.approx(plan.per_token_ms) and not page.explanation.text()
        # an impossible context: the solver's explanation is shown, and no plan is kept
        drive.place(context * 4)
        assert session.plan is None and "GB more memory than the approved agents offer" in page.explanation.text()
        drive.place(context)
        assert session.plan is not None and stage_firsts(session.plan) == (2,)

        # Distribution: the admin paused desk-b meanwhile: the run fails naming it; resumed, Re-run
        # finishes it (desk-b's verified shard is not sent again) with a progress bar per agent
        window.show_page("Fleet")
        drive.select(names[1:])
        window.fleet_page.pause_button.click()
        drive.wait_rows(names[1:], lambda row: row["State"].startswith("paused"), "the pause in the table")
        window.show_page("Distribution")
        dist, serving = window.distribution_page, window.serving
        dist.distribute_button.click()
        assert dist.confirmation is None  # nothing served yet: nothing to ask
        wait(lambda: serving.phase == "failed", 600, "the distribution to fail on the paused agent")
        assert f"{names[1]} (stage" in dist.error_label.text()
        assert "run the distribution again" in dist.error_label.text()
        assert "it is paused" in dist.error_label.text()  # the reason, not just "worker stopped"
        assert dist.rerun_button.isEnabled() and dist.distribute_button.isEnabled()
        served = hub.bytes_served
        window.show_page("Fleet")
        window.fleet_page.resume_button.click()
        drive.wait_rows(names[1:], lambda row: not row["State"].startswith("paused"), "the resume")
        window.show_page("Distribution")
        dist.rerun_button.click()
        wait(lambda: serving.phase in ("serving", "failed"), 300, "the re-run")
        assert serving.phase == "serving", dist.error_label.text()
        assert hub.bytes_served == served  # resumed: nothing fetched twice
        assert sorted(stage for _, stage in dist.rows) == [0, 1] and {a for a, _ in dist.rows} == set(names)
        bars = [dist.table.cellWidget(r, 3) for r in dist.rows.values()]
        assert all(b.value() == 1000 for b in bars) and "Ring: healthy" in dist.health_label.text()
        assert [a.status().stage for a in agents.values()] in ([0, 1], [1, 0])
        assert all(a.status().worker.state == "running" for a in agents.values())
        exported = window.bridge.library.exports()
        assert [e.split for e in exported] == [(2,)] and exported[0].weights == "fp32"
        copy_caches(service.state_dir, console_cache)

        # Chat answers through the console's API; Metrics count the tokens (1 of them the health check)
        answer = drive.chat("What is the capital of France?")
        assert answer.strip(), window.chat_page.chat.error_label.text()
        streamed = window.chat_page.chat.model.current.messages[-1].throughput.tokens
        window.show_page("Metrics")
        wait(lambda: float(drive.metric("tokens")) >= 1 + streamed, 10, "the metrics")
        metrics = window.metrics_page
        assert len(metrics.history.series("tokens_per_second")) >= 1
        assert metrics.breakdown.rowCount() == 2 * 2 + 1 + 1  # two stages, three hops, the ring step
        assert metrics.breakdown.item(metrics.breakdown.rowCount() - 1, 3).text() != "—"
        # every stage reports its own compute per step (the frames' stage times): measured, not "—"
        table = metrics.breakdown
        computes = [r for r in range(table.rowCount()) if table.item(r, 1).text() == "compute"]
        assert len(computes) == 2 and all(float(table.item(r, 3).text()) > 0 for r in computes)

        # an agent with an assignment reports its pauses to the hub: the Metrics page logs them
        assert any(f"{names[1]} resumed" in t for t in item_texts(metrics.pause_list))
        window.show_page("Fleet")
        drive.select(names[:1])
        window.fleet_page.pause_button.click()
        wait(lambda: any(f"{names[0]} paused" in t for t in item_texts(metrics.pause_list)), 20, "the pause event")
        # the hub's event can come before the Fleet page's record: Resume acts on what the table shows
        drive.wait_rows(names[:1], lambda row: row["State"].startswith("paused"), "the pause in the table")
        window.fleet_page.resume_button.click()
        drive.wait_rows(names[:1], lambda row: not row["State"].startswith("paused"), "the resume")


def test_an_export_from_the_models_page_runs_in_the_service_and_a_cancelled_one_leaves_nothing(
        tmp_path, tiny_checkpoint, wait, service):
    exports_dir = service.state_dir / "exports"
    with running_console(tmp_path / "console", wait, service) as window:
        drive = ConsoleDriver(window, wait)
        page, library = window.models_page, window.bridge.library
        drive.add_model(tiny_checkpoint("llama"))
        before = library.exports()
        feed = []  # the service's export events, as the console's feed hears them
        window.bridge.service_event.connect(lambda e: feed.append(e.data) if e.kind == "export" else None)
        labels = []  # what the page showed after each event (connected after the job's own handler)

        # a 2-stage export, to its end (or reused, when the module's other test made it first)
        page.stages.setValue(2)
        page.export_button.click()
        job = page.job
        window.bridge.service_event.connect(lambda _: labels.append((page.progress_label.text(),
                                                                     page.progress.value())))
        assert not page.export_button.isEnabled() and page.cancel_button.isEnabled()
        wait(lambda: job.done, 300, "the export")
        assert job.state == "finished", page.progress_label.text()
        assert (job.result.split, job.result.weights) == ((2,), "fp32") and job.result in library.exports()
        assert page.progress.value() == 1000 and f" {job.result.export_id} in " in page.progress_label.text()
        steps = [(d["stage"], d["step"]) for d in feed if d.get("job") == job.job_id and d["state"] == "progress"]
        if not job.reused:
            assert steps[:2] == [(None, "resolve"), (None, "fingerprint")] and (1, "save") in steps
            shown = [value for text, value in labels if text.startswith("Exporting: stage 1,")]
            assert shown and shown == sorted(shown) and 0 < shown[0] < 1000  # the page showed it, rising
        assert page.exports_table.rowCount() == len(library.exports()) and page.export_button.isEnabled()
        row = next(r for r in range(page.exports_table.rowCount())
                   if page.exports_table.item(r, 0).text() == job.result.export_id)
        page.exports_table.selectRow(row)  # the service is this PC's: its manifest is shown beside it
        assert job.result.fingerprint in page.manifest_view.toPlainText()

        # a 4-stage export, cancelled mid-stage from the page: the service stops it, nothing is left
        kept = library.exports()
        page.stages.setValue(4)
        page.export_button.click()
        job = page.job
        wait(lambda: any(d.get("job") == job.job_id and d.get("stage") is not None for d in feed), 120,
             "the export to begin its first stage")
        wait(lambda: page.progress_label.text().startswith("Exporting: stage"), 10, "the page to show the stage")
        assert page.cancel_button.isEnabled() and not job.done
        page.cancel_button.click()
        wait(lambda: job.done, 60, "the cancelled export to end")
        assert job.state == "cancelled" and "cancelled" in page.progress_label.text()
        assert page.progress.value() == 0 and page.export_button.isEnabled()
        assert library.exports() == kept and kept[:len(before)] == before
        assert not [p for p in exports_dir.iterdir() if p.name.startswith(".")]  # no partial directory
        assert page.exports_table.rowCount() == len(kept)


def test_the_console_command_starts_a_service_and_attaches_to_it_again(tmp_path, qtbot):
    """`deskfleet console` with no service running starts one (detached: it creates the fleet CA and
    outlives the console); the next `deskfleet console` attaches to that same service."""
    from console.fleet_api.service_locator import pid_alive, read_service_file
    from console.qt.app import run_console
    from console.qt.cli import COMMAND

    parser = argparse.ArgumentParser()
    COMMAND.configure(parser)
    state = tmp_path / "state"
    args = parser.parse_args(["--state-dir", str(state), "--interface", "127.0.0.1", "--api-port", "0",
                              "--enrollment-port", "0", "--hub-port", "0", "--data-port", "0", "--admin-port", "-1"])
    seen = []

    def look(window) -> None:
        dialog = window.first_run_dialog  # the first start says the fleet is ready, with the token
        seen.append((window.bridge.fleet_id, window.bridge.token, dialog and dialog.view.token,
                     window.bridge.started_service))
        assert window.fleet_page.token_edit.text() == window.bridge.token

    try:
        assert run_console(args, until=look) == 0
        first = read_service_file(state)
        assert first is not None and pid_alive(first.pid), "closing the console stopped the service"
        assert run_console(args, until=look) == 0
        assert read_service_file(state).pid == first.pid
    finally:
        info = read_service_file(state)
        if info is not None and pid_alive(info.pid):
            os.kill(info.pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while pid_alive(info.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
    (fleet_a, token_a, welcome_a, started_a), (fleet_b, token_b, welcome_b, started_b) = seen
    assert fleet_a == fleet_b and token_a and token_b and token_a != token_b
    assert welcome_a == token_a and welcome_b is None
    assert (started_a, started_b) == (True, False)
    assert (state / "fleet-ca.key").stat().st_mode & 0o777 == 0o600
    assert not pid_alive(info.pid), "the service did not stop on SIGTERM"


# -- the Qt-free decisions behind the pages ----------------------------------------------------------

def _plan(*stages: tuple[str, int, int, float]) -> Plan:
    planned = tuple(PlannedStage(f"{pc}/CPU", pc, a, b, ms, 1 << 20) for pc, a, b, ms in stages)
    hops = (0.5,) * (len(planned) + 1)
    per_token = sum(s.compute_ms for s in planned) + sum(hops)
    return Plan(stages=planned, hop_ms=hops, per_token_ms=per_token, tok_s=1000 / per_token,
                bottleneck_ms=max(s.compute_ms for s in planned), n_streams=1, cycle_ms=per_token,
                aggregate_tok_s=1000 / per_token, objective="latency", optimal=True)


def test_ring_endpoints_give_agents_on_one_address_their_own_data_ports():
    from console.fleet_api.agent_record import AgentRecord, Membership

    def record(node: str, address: str) -> AgentRecord:
        return AgentRecord(node, f"desk-{node}", address, 7210, "idle", ("CPU",), 1, "f", Membership.MEMBER,
                           None, frozenset(), True)

    plan = _plan(("a", 0, 1, 1.0), ("b", 2, 3, 1.0), ("c", 4, 5, 1.0))
    records = {"a": record("a", "10.0.0.5"), "b": record("b", "10.0.0.6"), "c": record("c", "10.0.0.5")}
    ports = {n: e.data_port for n, e in ring_endpoints(plan, records, 7211).items()}
    assert ports == {"a": 7211, "b": 7211, "c": 7212}
    assert ring_endpoints(plan, records, 7211)["c"].control == "10.0.0.5:7210"
    with pytest.raises(Exception, match="no longer lists"):
        ring_endpoints(plan, {"a": records["a"]}, 7211)


def test_the_metrics_breakdown_and_the_pause_log():
    plan = _plan(("a", 0, 1, 2.0), ("b", 2, 3, 3.0))
    rows = stage_breakdown(plan, {"ring_step_ms_avg": 9.0}, {"a": "desk-a", "b": "desk-b"}, local_stage0=False)
    assert [r.what for r in rows][:2] == ["hop console → desk-a", "stage 0 on desk-a (layers 0-1)"]
    assert rows[-1].predicted_ms == pytest.approx(2.0 + 3.0 + 3 * 0.5) and rows[-1].measured_ms == 9.0
    local = stage_breakdown(plan, {"ring_step_ms_avg": 9.0, 'stage_compute_ms_per_step{stage="0"}': 2.5}, {}, True)
    assert local[1].measured_ms == 2.5 and local[-1].measured_ms == pytest.approx(6.5)
    paged = stage_breakdown(plan, {"ring_step_ms_avg": 9.0, 'stage_compute_ms_per_step{stage="0"}': 2.5,
                                   'stage_compute_ms_per_step{stage="1"}': 3.5}, {}, False)  # each stage's stage_ms
    assert [r.measured_ms for r in paged if r.kind == "compute"] == [2.5, 3.5]
    assert (paged[-1].predicted_ms, paged[-1].measured_ms) == (pytest.approx(1.5), pytest.approx(3.0))  # network
    log = PauseLog()
    assert log.take(AgentEvent("n", "registered", {}, 0.0), "desk-a") is None
    entry = log.take(AgentEvent("n", "paused", {"reasons": ["in-use", 3]}, 0.0), "desk-a")
    assert entry.text.endswith("desk-a paused (in-use)") and len(log.entries) == 1


def _inputs():
    from console.fleet_api.link_report import LinkReport
    from console.fleet_api.placement import PlacementInputs
    from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo

    model = ModelProfile(layer_bytes=(600,) * 4, embed_bytes=100, head_bytes=150, head_ms=0.3)
    devices = tuple(DeviceProfile(f"{pc}/CPU", pc, "CPU", layer_ms, 0.2, 2000, dataclasses.replace(model, head_ms=head))
                    for pc, layer_ms, head in (("a", 1.0, 0.3), ("b", 1.5, 1.0)))
    links = LinkReport(Links(pc_ms={("a", "b"): 0.25}, coordinator_ms={"a": 0.1, "b": 0.4}), {}, {})
    pcs = (PcInfo("a", 2000, True), PcInfo("b", 2000, True))
    return PlacementInputs(model, pcs, devices, links, ("c",), {"a": "desk-a", "b": "desk-b"}, {})


def test_a_plan_is_retimed_exactly_and_re_solved_without_an_agent():
    from console.fleet.placement_inputs import LEFT_OUT, solve_inputs
    from console.fleet_api.placement import memory_warnings
    from engine.errors import Exclusion, PlacementInfeasible
    from engine.placement.types import PlacementRequest

    inputs = _inputs()
    plan = solve_inputs(inputs, PlacementRequest())  # 80 % of 2000 bytes: two layers per agent at most
    # desk-b's head is slow: it takes the first half
    assert [(s.pc_id, s.first_layer, s.last_layer) for s in plan.stages] == [("b", 0, 1), ("a", 2, 3)]
    assert Exclusion("c", "unreachable") in plan.excluded
    same = retime(inputs, plan, stage_firsts(plan))  # the solver's own numbers, recomputed
    for mine, solver in zip(same.stages, plan.stages, strict=True):
        assert mine.compute_ms == pytest.approx(solver.compute_ms) and mine.memory_bytes == solver.memory_bytes
    assert same.per_token_ms == pytest.approx(plan.per_token_ms) and same.hop_ms == pytest.approx(plan.hop_ms)
    moved = retime(inputs, plan, (1,))
    assert moved.stages[0].compute_ms == pytest.approx(1 * 1.5 + 0.2)
    assert moved.stages[1].compute_ms == pytest.approx(3 * 1.0 + 0.2 + 0.3) and not moved.optimal
    assert moved.stages[1].memory_bytes == 3 * 600 + 150
    assert moved.per_token_ms == pytest.approx(1.7 + 3.5 + 0.4 + 0.25 + 0.1)
    warnings = memory_warnings(inputs, moved, 0.8)
    assert len(warnings) == 2 and warnings[0].startswith("stage 1 needs") and "desk-a" in warnings[1]
    assert memory_warnings(inputs, same, 0.8) == []
    for firsts in ((0,), (4,), (1, 2), (3, 2)):
        with pytest.raises(Exception, match="non-empty"):
            retime(inputs, plan, firsts)
    roomy = dataclasses.replace(inputs, pcs=tuple(dataclasses.replace(p, memory_bytes=10_000) for p in inputs.pcs),
                                devices=tuple(dataclasses.replace(d, memory_bytes=10_000) for d in inputs.devices))
    alone = solve_inputs(roomy, PlacementRequest(), leave_out={"a"})
    assert {s.pc_id for s in alone.stages} == {"b"} and Exclusion("a", LEFT_OUT) in alone.excluded
    with pytest.raises(PlacementInfeasible):
        solve_inputs(inputs, PlacementRequest(), leave_out={"a"})  # four layers do not fit desk-b alone


# -- screenshots ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_screenshots_of_every_page(tmp_path, tiny_checkpoint, console_cache, qtbot):
    """One PNG per page into ``$DESKFLEET_SCREENSHOTS`` (default: a temporary folder), under Xvfb
    when it is installed and Qt's xcb plugin loads, else offscreen in this process."""
    from PySide6.QtGui import QImage

    from tests.support.xvfb import XVFB, xvfb_works

    out = Path(os.environ.get("DESKFLEET_SCREENSHOTS") or tmp_path / "screenshots")
    checkpoint = tiny_checkpoint("llama")
    env = {**os.environ, "QT_QPA_PLATFORM": "xcb"}
    expected = [f"console-{p.lower()}.png" for p in PAGES] + ["console-first-run.png", *FIRST_HOUR]
    if xvfb_works(env):
        run = subprocess.run([*XVFB, sys.executable, "-m", "tests.console.console_screenshots", "--out", str(out),
                              "--checkpoint", str(checkpoint), "--work", str(tmp_path / "work"),
                              "--cache", str(console_cache)], env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        expected.append("console-screen.png")
    else:
        take_console_screenshots(out, checkpoint, tmp_path / "work", console_cache)
    print(f"console screenshots ({(out / 'CONSOLE-PLATFORM.txt').read_text().strip()}) in {out}")
    for name in expected:
        image = QImage(str(out / name))
        assert not image.isNull() and image.width() >= 300 and image.height() >= 200, name
        colours = {image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)}
        assert len(colours) > 8, f"{name} is blank"
