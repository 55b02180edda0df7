"""The admin's first hour in the console (issue 32), against a real fleet service on loopback
(pytest-qt, offscreen): a console that starts from an empty library finds the built-in model on
the Models page and has it chosen; the pages follow the service (a lost service shows a banner,
and it goes once the service is back); agents that wait for approval are named so everywhere and
can be approved from a banner; the Dashboard's empty state is a checklist that ticks itself off.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

from console.fleet.key_usage import KeyUse, usage_of
from console.fleet_api.agent_record import UNVERIFIED_STATE, AgentRecord, AgentSource, Membership
from console.fleet_api.service_locator import pid_alive, read_service_file
from console.qt.api_snippets import mask_key
from console.qt.app import run_console
from console.qt.cli import COMMAND
from console.qt.first_steps import FleetNow, StepKey, checklist
from engine.trust.key_book import KEY_PREFIX
from export.sources import DEFAULT_MODEL_NAME, find_default_gguf
from tests.console.console_app_helpers import ConsoleDriver, fleet_service, item_texts, local_agents, running_console

pytestmark = pytest.mark.usefixtures("module_dirs")


@pytest.fixture(scope="module")
def service(module_dirs, tmp_path_factory):
    """The module's one fleet service, with an empty library (no model added)."""
    with fleet_service(tmp_path_factory.mktemp("fleet")) as running:
        yield running


@pytest.fixture
def wait(qtbot):
    def wait(condition, timeout: float, what: str) -> None:
        try:
            qtbot.waitUntil(condition, timeout=int(timeout * 1000))
        except AssertionError:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None
    return wait


@pytest.mark.skipif(find_default_gguf() is None, reason="the embedded default model's package is not installed")
def test_the_models_page_lists_the_library_on_arrival_and_chooses_the_default(tmp_path, wait, service):
    with running_console(tmp_path / "console", wait, service) as window:
        page = window.models_page
        wait(lambda: page.model_list.count() > 0, 10, "the model list")
        assert DEFAULT_MODEL_NAME in item_texts(page.model_list)[0]
        assert "built-in default" in item_texts(page.model_list)[0]
        session = window.bridge.session
        assert session.model is not None and session.model.name == DEFAULT_MODEL_NAME
        assert page.model_list.currentRow() == 0 and page.export_button.isEnabled()
        # the Placement page is no dead end: it names the model, not "choose one on the Models page"
        assert DEFAULT_MODEL_NAME in window.placement_page.model_label.text()
        # Refresh reads the library again without dropping the choice
        page.refresh_button.click()
        assert session.model is not None and session.model.name == DEFAULT_MODEL_NAME
        assert page.model_list.currentRow() == 0


def test_pcs_that_wait_for_approval_are_named_so_and_approved_from_the_banner(tmp_path, wait, service):
    with local_agents(tmp_path) as (agent_loop, agents), running_console(tmp_path / "console", wait,
                                                                         service) as window:
        drive, names = ConsoleDriver(window, wait), tuple(agents)
        banner = window.approval_banner
        assert banner.isHidden()
        drive.join(agent_loop, agents)
        # one name for it: the Fleet table, its count line, the Dashboard and the banner
        drive.wait_rows(names, lambda row: row["State"].startswith("awaiting approval") and row["Approved"] == "no",
                        "the joined agents")
        assert "2 awaiting approval" in window.fleet_page.count_label.text()
        assert [(c.state, c.count) for c in window.dashboard_page.state_bar.counts] == [("awaiting approval", 2)]
        wait(lambda: not banner.isHidden(), 5, "the approval banner")
        assert banner.text.text().startswith("2 PCs wait for approval")
        banner.buttons["Review"].click()
        assert window.tabs.currentWidget() is window.fleet_page
        assert {r.name for r in window.fleet_page.selected()} == set(names)
        window.show_page("Dashboard")
        banner.buttons["Approve all"].click()
        drive.wait_rows(names, lambda row: row["Approved"] == "yes", "the approvals")
        wait(banner.isHidden, 10, "the banner to go")
        # the approval gave each PC the fleet's chat address (its key came with its join): every
        # approved employee can chat before their PC is given any part of a model
        api_url = str(window.bridge.service["api_url"])
        wait(lambda: all(a.status().api_url == api_url for a in agents.values()), 20,
             "the PCs to learn the chat address")
        assert all(a.chat_key for a in agents.values())
        assert not any(row["State"].startswith("awaiting") for row in drive.fleet_rows().values())


def test_a_lost_service_shows_a_banner_and_retry_starts_it_again(tmp_path, wait):
    state = tmp_path / "state"
    service_cm = fleet_service(state)
    running, stopped = service_cm.__enter__(), False
    try:
        with running_console(state, wait, running) as window:
            banner = window.service_banner
            assert banner.isHidden()
            service_cm.__exit__(None, None, None)  # the service stops under the open console
            stopped = True
            wait(lambda: not banner.isHidden(), 30, "the lost-service banner")
            assert "Lost contact with the fleet service on this PC" in banner.text.text()
            banner.buttons["Retry"].click()  # starts the service again, detached, over the same state dir
            wait(banner.isHidden, 90, "the banner to go once the service is back")
            assert read_service_file(state) is not None
            token = window.fleet_page.token_edit.text()
            window.fleet_page.new_token_button.click()  # the console works again
            wait(lambda: window.fleet_page.token_edit.text() not in ("", token), 20, "a new join token")
    finally:
        if not stopped:
            service_cm.__exit__(None, None, None)
        info = read_service_file(state)
        if info is not None and pid_alive(info.pid):
            os.kill(info.pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while pid_alive(info.pid) and time.monotonic() < deadline:
                time.sleep(0.1)


def test_a_console_that_cannot_start_says_why_in_a_dialog(tmp_path, qtbot):
    parser = argparse.ArgumentParser()
    COMMAND.configure(parser)
    args = parser.parse_args(["--service", "https://127.0.0.1:9", "--admin-cert", str(tmp_path / "no-such-folder"),
                              "--interface", "127.0.0.1"])
    seen: list[tuple[str, str]] = []

    def answer() -> None:  # the dialog is up while the event loop runs: read it and close it as a person would
        for widget in QApplication.topLevelWidgets():
            if isinstance(widget, QMessageBox) and widget.isVisible():
                seen.append((widget.text(), widget.informativeText()))
                widget.button(QMessageBox.StandardButton.Close).click()
                return
        QTimer.singleShot(50, answer)

    QTimer.singleShot(50, answer)
    assert run_console(args) == 1
    assert len(seen) == 1
    why, hint = seen[0]
    assert "no-such-folder" in why and "https://127.0.0.1:9" in hint


@pytest.mark.slow
def test_the_dashboard_checklist_walks_an_empty_fleet_to_a_chat_and_ticks_itself_off(tmp_path, wait,
                                                                                       tiny_checkpoint):
    with fleet_service(tmp_path / "fleet") as running, local_agents(tmp_path) as (agent_loop, agents), \
            running_console(tmp_path / "console", wait, running) as window:
        drive, names, steps = ConsoleDriver(window, wait), tuple(agents), window.first_steps

        def done() -> dict[StepKey, bool]:
            return {s.key: s.done for s in steps.steps}

        assert not steps.isHidden() and not any(done().values())
        join = steps.details[StepKey.JOIN].text()
        assert f"echo {window.bridge.token} | deskfleet agent --headless --join -" in join and "Join a fleet…" in join
        assert not steps.buttons[StepKey.SERVE].isEnabled()  # nothing approved to serve on
        steps.links[StepKey.JOIN].click()
        assert window.tabs.currentWidget() is window.fleet_page
        window.show_page("Dashboard")
        drive.join(agent_loop, agents)
        wait(lambda: done()[StepKey.JOIN] and "2 PCs wait for approval" in steps.details[StepKey.APPROVE].text(),
             30, "the join step ticked and two PCs waiting")
        steps.buttons[StepKey.APPROVE].click()
        wait(lambda: done()[StepKey.APPROVE], 30, "the approve step ticked")
        wait(lambda: steps.buttons[StepKey.SERVE].isEnabled(), 10, "Serve to be offered")
        # Serve brings up the model chosen on the Models page (the built-in default unless the admin chose
        # another): here the tiny test model, which a loaded 2-core test machine answers within the step timeout
        drive.add_model(tiny_checkpoint("llama"))
        model = window.bridge.session.model.name
        window.show_page("Dashboard")
        assert model in steps.details[StepKey.SERVE].text()
        steps.buttons[StepKey.SERVE].click()  # one press: place with the defaults, then distribute
        assert not steps.buttons[StepKey.SERVE].isEnabled()  # no second press while it runs
        wait(lambda: done()[StepKey.SERVE] or window.quick_serve.error, 900, "the default model to be served")
        assert done()[StepKey.SERVE], steps.details[StepKey.SERVE].text()
        plan = window.bridge.session.plan
        assert plan is not None and window.bridge.session.model.name == model
        assert {window.bridge.session.name(s.pc_id) for s in plan.stages} <= set(names)
        steps.buttons[StepKey.CHAT].click()
        assert window.tabs.currentWidget() is window.chat_page
        assert drive.chat("What is the capital of France?").strip()
        window.show_page("Dashboard")
        wait(lambda: done()[StepKey.CHAT], 30, "the chat step ticked by the service's metrics")
        assert steps.isHidden()  # every step done: the Dashboard is the fleet at a glance again

        # Stop serving asks first (it cuts off every chat); Cancel keeps the ring
        dist = window.distribution_page
        dist.stop_button.click()
        assert dist.confirmation is not None and "chat" in dist.confirmation.informativeText()
        dist.confirmation.button(QMessageBox.StandardButton.Cancel).click()
        assert window.serving.phase == "serving" and dist.confirmation is None
        dist.stop_button.click()
        dist.confirmation.button(QMessageBox.StandardButton.Yes).click()
        wait(lambda: window.serving.phase == "idle", 120, "the ring to stop")
        # nothing stale: no "Serving at", no running rows; the checklist follows the service again
        assert not window.statusBar().currentMessage().startswith("Serving at")
        assert dist.table.rowCount() == 0 and "not running" in dist.health_label.text()
        wait(lambda: not done()[StepKey.SERVE] and not steps.isHidden(), 30, "Serve to be offered again")


def _member(i: int, **kw) -> AgentRecord:
    fields = dict(node_id=f"n{i:04d}", name=f"pc-{i}", address="10.0.0.1", control_port=7000 + i, state="idle",
                  devices=("CPU",), memory_bytes=8 * 10**9, fleet_id="F", membership=Membership.MEMBER,
                  last_seen=100.0, sources=frozenset({AgentSource.HUB}), approved=True, verified=True)
    fields.update(kw)
    return AgentRecord(**fields)


def test_the_checklist_is_decided_from_the_services_state_alone():
    def steps(records=(), rings=None, metrics=None, model="SmolLM2-135M-Instruct", busy=False):
        now = FleetNow(tuple(records), rings or {}, metrics or {}, "TOKEN-1", "10.0.0.9:7220", model, busy)
        return {s.key: s for s in checklist(now)}

    empty = steps()
    assert not any(s.done for s in empty.values()) and not empty[StepKey.SERVE].can_act
    assert "echo TOKEN-1 | deskfleet agent --headless --join -" in empty[StepKey.JOIN].detail
    assert [s.page for s in empty.values()] == ["Fleet", "Fleet", "Distribution", "Chat"]
    waiting = steps([_member(1, approved=False), _member(2, approved=False), _member(3, approved=False,
                                                                                      state=UNVERIFIED_STATE)])
    assert waiting[StepKey.JOIN].done and not waiting[StepKey.APPROVE].done and waiting[StepKey.APPROVE].can_act
    assert waiting[StepKey.APPROVE].detail.startswith("2 PCs wait for approval: pc-1, pc-2")  # a claim is no PC yet
    approved = steps([_member(1)])
    assert approved[StepKey.APPROVE].done and approved[StepKey.SERVE].can_act
    assert not steps([_member(1)], busy=True)[StepKey.SERVE].can_act  # no second press while it runs
    assert "add one on the Models page" in steps([_member(1)], model="")[StepKey.SERVE].detail
    ring = {"r1": {"ring": "r1", "phase": "serving", "model": "m"}}
    serving = steps([_member(1)], ring)
    assert serving[StepKey.SERVE].done and not serving[StepKey.CHAT].done and serving[StepKey.CHAT].can_act
    assert steps([_member(1)], ring, {"r1": {"requests_finished_total": 1.0}})[StepKey.CHAT].done
    # a ring that stopped serving un-ticks Serve: the list follows the service, it does not remember
    assert not steps([_member(1)], {"r1": {**ring["r1"], "phase": "failed"}})[StepKey.SERVE].done


def test_the_keys_page_masks_the_consoles_key_issues_shows_once_tracks_use_and_revokes(tmp_path, wait, service):
    with running_console(tmp_path / "console", wait, service) as window:
        page, serving = window.keys_page, window.serving
        wait(lambda: bool(serving.api_key) and page.copy_key_button.isEnabled(), 20, "the console's key")
        key, url = serving.api_key, str(window.bridge.service["api_url"])
        assert key not in page.key_label.text() and page.key_label.text().endswith(key[-4:])
        page.copy_key_button.click()
        assert QApplication.clipboard().text() == key
        page.show_key_button.click()
        assert page.key_label.text() == key
        page.show_key_button.click()
        model = window.bridge.session.model.name if window.bridge.session.model else "MODEL"
        for snippet in (page.curl_view.toPlainText(), page.python_view.toPlainText()):
            assert url in snippet and key in snippet and model in snippet
        # the Chat page masks it too
        window.chat_page.show_api(url)
        assert key not in window.chat_page.url_label.text() and not window.chat_page.copy_key_button.isHidden()

        page.name_edit.setText("alice")
        page.rpm.setValue(5)
        page.issue_button.click()
        wait(lambda: not page.secret_box.isHidden(), 20, "the new key's secret")
        secret = page.secret_edit.text()
        assert secret and "only this once" in page.secret_note.text()
        assert secret in page.curl_view.toPlainText()  # the snippets now use alice's key
        wait(lambda: "alice" in _column(page, 0), 20, "alice in the list (from the service's keys event)")
        row = _column(page, 0).index("alice")
        assert page.table.item(row, 1).text() == "5" and page.table.item(row, 5).text().startswith("never")
        # a real request with it: the audit logs who asked
        assert _get(url + "/models", secret) == 200
        page.refresh_button.click()
        wait(lambda: _column(page, 6)[_column(page, 0).index("alice")] == "1", 20, "alice's use")
        assert not _column(page, 5)[_column(page, 0).index("alice")].startswith("never")
        page.table.selectRow(_column(page, 0).index("alice"))
        page.revoke_button.click()
        box = page.confirmation
        assert box is not None and "alice" in box.text()
        box.button(QMessageBox.StandardButton.Yes).click()
        wait(lambda: "alice" not in _column(page, 0), 20, "alice to be revoked")
        assert _get(url + "/models", secret) == 401
        assert page.secret_box.isHidden() and secret not in page.curl_view.toPlainText()


def _column(page, col: int) -> list[str]:
    return [page.table.item(r, col).text() for r in range(page.table.rowCount())]


def _get(url: str, key: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=20) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_key_use_is_read_from_the_audit_lines_and_a_key_is_masked_to_its_end():
    lines = ['{"time": "t1", "key": "alice", "prompt_tokens": 3, "completion_tokens": 4}',
             '{"time": "t0", "kind": "strangers", "key": null}', 'cut-off line"}',
             '{"time": "t2", "key": "alice", "prompt_tokens": 1, "completion_tokens": 0}',
             '{"time": "t3", "key": "bob"}']
    used = usage_of(lines)
    assert used == {"alice": KeyUse("t2", 2, 8), "bob": KeyUse("t3", 1, 0)}
    masked = mask_key(KEY_PREFIX + "x" * 36 + "9abc")
    assert masked.startswith(KEY_PREFIX) and masked.endswith("9abc") and "x" not in masked
