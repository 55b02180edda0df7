"""The tray agent (Qt offscreen, pytest-qt) over the real AgentService: the menu follows the
state, the icon changes with it, Pause and "Pause while I use this PC" reach the service and
settings.json, the join dialog joins a real console half over TLS on loopback (and explains a
bad token without changing anything), Start at login writes and removes the XDG entry, and
Quit stops everything without leaking a thread. Only the idle clock is fake."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication

from agent.service import pause
from agent.service.settings import (
    AgentSettings,
    AgentState,
    load_settings,
    save_state,
)
from agent.tray.icons import STATE_STYLES, state_pixmap
from agent.tray.tray import QtAgentTray
from agent.tray.tray_model import (
    NOT_JOINED_CHAT,
    PauseFor,
    TrayContext,
    login_command,
    menu_state,
    notices_between,
    pause_until,
    status_line,
)
from engine.control.messages import AgentStatus, FetchProgress, WorkerStatus
from engine.trust.join_token import JoinToken
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import held

pytestmark = pytest.mark.usefixtures("private_dirs")



@pytest.fixture
def fleet_console(tmp_path):
    with held(lambda: console(tmp_path / "console")) as con:
        yield con


def _status(state: str, **over) -> AgentStatus:
    base = AgentStatus(node_id="n" * 64, fleet_id="f" * 32, name="desk-1", version="0", state=state,
                       paused_reasons=(), inventory={}, export_id="tiny-2", stage=1,
                       fetch=FetchProgress(done_bytes=42, total_bytes=100), worker=WorkerStatus(), api_url=None)
    return replace(base, **over)


def test_status_lines_and_notices_are_decided_without_qt():
    now = dt.datetime(2026, 12, 7, 14, 31)
    two = TrayContext(now, parts=2)
    serving = _status("serving", worker=WorkerStatus(state="running", steps_per_s=12.4))
    # people's words: no export ids, stages counted from 1 as parts of the model
    assert status_line(serving, two) == "Helping the fleet (part 2 of 2)"
    assert status_line(serving) == "Helping the fleet (part 2)"  # the part count unknown
    assert status_line(_status("fetching"), two) == "Getting its share of the model (part 2 of 2) · 42%"
    assert status_line(_status("paused", paused_reasons=(pause.IN_USE, pause.BATTERY))) == \
        "Paused: the PC is in use, on battery"
    in_use_line = status_line(_status("paused", paused_reasons=(pause.IN_USE,)),
                              TrayContext(now, resume_after_idle_s=300))
    assert in_use_line == "Paused while you use this PC — resumes at 14:36 if idle"
    assert status_line(_status("paused", paused_reasons=(pause.MANUAL,)),
                       TrayContext(now, paused_until=pause_until(PauseFor.HOUR, now))) == "Paused by you until 15:31"
    assert status_line(_status("paused", paused_reasons=(pause.MANUAL,)),
                       TrayContext(now, paused_until=pause_until(PauseFor.TOMORROW, now))) == \
        "Paused by you until tomorrow 08:00"
    assert "ask them" in status_line(_status("paused", paused_reasons=(pause.REMOTE,)))
    assert status_line(_status("error", worker=WorkerStatus(last_error="x" * 200))).endswith("…")
    assert status_line(_status("idle"), two) == "Ready to help the fleet (part 2 of 2)"
    unassigned = _status("idle", export_id=None, stage=None)
    assert status_line(unassigned) == "Joined — awaiting approval by the fleet's admin"
    assert status_line(replace(unassigned, api_url="http://h:8000/v1")) == "Approved — no work for this PC right now"
    assert status_line(None) == "Starting…"

    idle = _status("idle", export_id=None, stage=None)
    not_joined = _status("not-joined", fleet_id="", node_id="")
    in_use = _status("paused", paused_reasons=(pause.IN_USE,))
    assert notices_between(None, serving) == []  # start-up is not news
    assert [n.title for n in notices_between(not_joined, idle)] == ["Joined the fleet"]
    assert [n.title for n in notices_between(idle, not_joined)] == ["Left the fleet"]
    assert notices_between(idle, in_use) == []  # the person touched their own PC: no noise
    assert [n.message for n in notices_between(serving, in_use)] == [
        "Paused while you use this PC: the fleet carries on without it, and it helps again once the PC is idle."]
    office = notices_between(idle, _status("paused", paused_reasons=(pause.OFFICE_HOURS,)))
    assert [n.message for n in office] == ["Paused: office hours."]
    failed = notices_between(serving, _status("error", worker=WorkerStatus(last_error="worker exited 9")))
    assert [(n.level, n.message) for n in failed] == [("error", "worker exited 9")]
    assert notices_between(in_use, in_use) == []

    assert menu_state(None, AgentSettings(), False).pause_enabled is False
    manual = menu_state(_status("paused", paused_reasons=(pause.MANUAL,)), AgentSettings(), True)
    assert (manual.pause_text, manual.joined, manual.start_at_login) == ("Resume", True, True)
    assert login_command(Path("/a"), Path("/a"))[-1] == "agent"
    assert login_command(Path("/b"), Path("/a"))[-2:] == ["--state-dir", "/b"]


def _icon_image(tray: QtAgentTray):
    return tray.icon.icon().pixmap(64, 64).toImage()


def test_each_state_has_its_own_icon(qtbot):
    images = {state: state_pixmap(state, 64).toImage() for state in STATE_STYLES}
    states = list(images)
    for i, a in enumerate(states):
        assert images[a].pixelColor(32, 32).alpha() > 0 or a == "not-joined"
        for b in states[i + 1:]:
            assert images[a] != images[b], f"{a} and {b} draw the same icon"
    assert state_pixmap("no-such-state").toImage() == state_pixmap("error").toImage()
    assert state_pixmap("serving", 16).size().width() == 16


def test_menu_follows_join_pause_resume_and_leave(qtbot, start_tray, fleet_console, tmp_path):
    tray = start_tray()
    bridge = tray.bridge
    assert bridge.status.state == "not-joined"
    assert tray.status_action.text() == "Not in a fleet: join one to lend this PC"
    assert not tray.status_action.isEnabled()
    assert tray.join_action.isVisible() and tray.join_action.isEnabled()
    assert not tray.leave_action.isVisible()
    assert not tray.pause_action.isEnabled()
    assert tray.pause_in_use_action.isChecked() and not tray.login_action.isChecked()
    assert _icon_image(tray) == state_pixmap("not-joined").toImage()
    icons = {"not-joined": _icon_image(tray)}

    tray.join_action.trigger()
    dialog = tray.join_dialog
    assert dialog is not None and dialog.isVisible()
    dialog.token_edit.setText(fleet_console.token())
    dialog.console_edit.setText(fleet_console.enrollment)
    dialog.join_button.click()
    qtbot.waitUntil(lambda: dialog.page == "waiting" and bridge.status.state == "idle", timeout=30000)
    assert dialog.waiting_headline.text() == "Joined — awaiting approval"
    dialog.close_button.click()
    qtbot.waitUntil(lambda: tray.join_dialog is None, timeout=5000)
    assert bridge.status.fleet_id == fleet_console.authority.fleet_id
    assert [n.title for n in tray.notices] == ["Joined the fleet"]
    assert fleet_console.authority.fleet_id[:16] in tray.notices[0].message
    assert not tray.join_action.isVisible() and tray.leave_action.isVisible() and tray.leave_action.isEnabled()
    assert tray.pause_action.isEnabled() and tray.pause_action.text() == "Pause"
    assert tray.status_action.text() == "Joined — awaiting approval by the fleet's admin"
    icons["idle"] = _icon_image(tray)

    tray.pause_action.trigger()
    qtbot.waitUntil(lambda: bridge.status.state == "paused", timeout=10000)
    assert bridge.status.paused_reasons == (pause.MANUAL,)
    assert tray.status_action.text().startswith("Paused by you")
    assert tray.pause_action.text() == "Resume"
    assert json.loads((tmp_path / "agent" / "state.json").read_text())["manually_paused"] is True
    assert tray.notices[-1].title == "Deskfleet paused" and pause.MANUAL in tray.notices[-1].message
    icons["paused"] = _icon_image(tray)

    tray.pause_action.trigger()
    qtbot.waitUntil(lambda: bridge.status.state == "idle", timeout=10000)
    assert tray.pause_action.text() == "Pause" and bridge.status.paused_reasons == ()
    assert _icon_image(tray) == icons["idle"]

    # "Pause for 1 hour": paused now, with its end in the menu, and resumed by itself at that time
    start = dt.datetime.now()
    tray.pause_for(PauseFor.HOUR, now=start)
    qtbot.waitUntil(lambda: bridge.status.state == "paused", timeout=10000)
    ends = (start + dt.timedelta(hours=1)).strftime("%H:%M")
    qtbot.waitUntil(lambda: tray.status_action.text().startswith("Paused by you until"), timeout=5000)
    assert ends in tray.status_action.text()
    assert not any(a.isEnabled() for a in tray.timed_pause_actions.values())  # one timed pause at a time
    tray.end_timed_pause_if_due(now=start + dt.timedelta(minutes=59))
    assert tray.paused_until is not None  # not yet
    tray.end_timed_pause_if_due(now=start + dt.timedelta(hours=1))
    qtbot.waitUntil(lambda: bridge.status.state == "idle", timeout=10000)
    assert tray.paused_until is None and all(a.isEnabled() for a in tray.timed_pause_actions.values())

    assert len({img.cacheKey() for img in icons.values()}) == 3
    assert icons["not-joined"] != icons["idle"] != icons["paused"] != icons["not-joined"]

    tray.leave_action.trigger()
    qtbot.waitUntil(lambda: bridge.status.state == "not-joined", timeout=10000)
    assert tray.notices[-1].title == "Left the fleet"
    assert tray.join_action.isVisible() and not tray.leave_action.isVisible()
    assert _icon_image(tray) == icons["not-joined"]


@pytest.mark.slow
def test_a_bad_token_is_explained_in_the_dialog_and_changes_nothing(qtbot, start_tray, fleet_console, tmp_path):
    tray = start_tray()
    settings_before = (tmp_path / "agent" / "settings.json").read_text()
    dialog = tray.open_join_dialog()
    unknown = JoinToken.new(fleet_console.authority.fingerprint).text  # well-formed, never issued
    cases = [
        ("not a token at all", fleet_console.enrollment, "this is not a Deskfleet join token"),
        (unknown, fleet_console.enrollment, "does not know this join token"),
        (fleet_console.token(), "127.0.0.1:9", "cannot connect to the console at 127.0.0.1:9"),
    ]
    for token, address, expected in cases:
        dialog.token_edit.setText(token)
        dialog.console_edit.setText(address)
        dialog.join_button.click()
        qtbot.waitUntil(lambda: not dialog.busy and bool(dialog.error_text), timeout=30000)
        assert expected in dialog.error_text
        assert dialog.isVisible() and tray.join_dialog is dialog
    assert bridge_state(tray) == "not-joined" and tray.join_action.isVisible()
    assert tray.notices == []
    ring = tmp_path / "keyring" / "keyring.json"  # the console's own secrets may be there, no agent's
    assert not ring.exists() or not [u for u in json.loads(ring.read_text())["deskfleet"] if u.startswith("agent-")]
    assert (tmp_path / "agent" / "settings.json").read_text() == settings_before
    assert not (tmp_path / "agent" / "state.json").exists() or \
        json.loads((tmp_path / "agent" / "state.json").read_text()) == AgentState().to_dict()
    dialog.token_edit.setText("")
    dialog.join_button.click()
    assert "Enter the join token" in dialog.error_text


def bridge_state(tray: QtAgentTray) -> str:
    return tray.bridge.status.state


@pytest.mark.slow
def test_pause_while_in_use_is_saved_and_applied(qtbot, start_tray, tmp_path):
    idle = FakeIdle(0.0)  # someone is typing
    tray = start_tray(idle)
    bridge = tray.bridge
    qtbot.waitUntil(lambda: pause.IN_USE in bridge.status.paused_reasons, timeout=5000)
    assert tray.pause_in_use_action.isChecked()

    tray.pause_in_use_action.trigger()  # untick
    qtbot.waitUntil(lambda: pause.IN_USE not in bridge.status.paused_reasons, timeout=5000)
    assert not tray.pause_in_use_action.isChecked()
    assert load_settings(tmp_path / "agent").pause_while_in_use is False
    assert bridge.settings.pause_while_in_use is False

    tray.pause_in_use_action.trigger()  # tick again
    qtbot.waitUntil(lambda: pause.IN_USE in bridge.status.paused_reasons, timeout=5000)
    assert tray.pause_in_use_action.isChecked()
    assert load_settings(tmp_path / "agent").pause_while_in_use is True


@pytest.mark.slow
def test_start_at_login_writes_and_removes_the_xdg_entry(qtbot, start_tray, tmp_path):
    tray = start_tray()
    entry = tmp_path / "config" / "autostart" / "deskfleet-agent.desktop"
    assert not entry.exists() and not tray.login_action.isChecked()

    tray.login_action.trigger()
    assert entry.is_file() and tray.login_action.isChecked()
    assert 'Exec=/usr/bin/deskfleet agent --state-dir "/tmp/a dir"' in entry.read_text()
    qtbot.waitUntil(lambda: load_settings(tmp_path / "agent").start_at_login, timeout=5000)

    tray.login_action.trigger()
    assert not entry.exists() and not tray.login_action.isChecked()
    qtbot.waitUntil(lambda: not load_settings(tmp_path / "agent").start_at_login, timeout=5000)


@pytest.mark.slow
def test_open_chat_needs_the_fleets_address(qtbot, start_tray, tmp_path):
    tray = start_tray()
    assert tray.open_chat() is None
    assert tray.notices[-1].message == NOT_JOINED_CHAT  # says why: this PC is in no fleet
    assert tray.chat_action.text() == "Open chat… (not available yet)"
    tray.shutdown()

    # the agent learnt an address from an earlier assignment (kept in state.json)
    state_dir = tmp_path / "agent-2"
    state_dir.mkdir()
    save_state(state_dir, AgentState(api_url="http://127.0.0.1:9/v1"))
    tray = start_tray(state_dir=state_dir)
    assert tray.bridge.status.api_url == "http://127.0.0.1:9/v1"
    tray.chat_action.trigger()
    window = tray.chat_window
    assert window is not None and window.isVisible()
    assert window.client.base_url == "http://127.0.0.1:9/v1" and window.loop is tray.bridge.loop
    assert window.client.ca_pem is None  # not joined: no fleet CA to trust an https API by
    # the chat's fleet line says why it cannot answer
    qtbot.waitUntil(lambda: "cannot reach the fleet's API" in window.fleet_label.text(), timeout=15000)
    assert window.fleet.level == "unreachable" and window.fleet_label.isVisible()


@pytest.mark.slow
def test_the_trays_chat_sends_the_api_key_its_assignment_brought(qtbot, start_tray, tmp_path, tiny_export):
    from engine.control.messages import Assignment

    manifest_json = (tiny_export("llama", 1) / "manifest.json").read_text()
    assignment = Assignment.create(manifest_json, export_id="e1", stage=0, source="https://127.0.0.1:9/shards/e1/",
                                   listen_port=0, next_hop="127.0.0.1:9", api_url="http://127.0.0.1:9/v1",
                                   api_key="sk-deskfleet-tray")
    state_dir = tmp_path / "agent-3"
    state_dir.mkdir()
    save_state(state_dir, AgentState(api_url=assignment.api_url, assignment=assignment.to_dict()))
    tray = start_tray(state_dir=state_dir)
    qtbot.waitUntil(lambda: tray.bridge.api_key == "sk-deskfleet-tray", timeout=10000)
    window = tray.open_chat()
    assert window.client.base_url == "http://127.0.0.1:9/v1"
    assert window.client._headers() == {"Authorization": "Bearer sk-deskfleet-tray"}
    assert "sk-deskfleet-tray" not in repr(tray.bridge.status)  # the status other members may read has no key


@pytest.mark.slow
def test_run_tray_quits_cleanly_and_warns_without_a_system_tray(qtbot, tmp_path, capsys):
    from agent.cli import configure
    from agent.tray.app import NO_TRAY_WARNING, run_tray

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--state-dir", str(tmp_path / "agent"), "--interface", "127.0.0.1",
                              "--control-port", "0", "--data-port", "0"])
    app = QApplication.instance()
    seen = {}

    def quit_when_running():
        tray = app.findChild(QObject, "deskfleet-tray")
        if tray is None or not tray.bridge.running or tray.bridge.status is None:
            QTimer.singleShot(100, quit_when_running)
            return
        seen["state"], seen["loop"] = tray.bridge.status.state, tray.bridge.loop
        seen["first run"] = tray.join_dialog is not None and tray.join_dialog.isVisible()
        tray.quit_action.trigger()

    QTimer.singleShot(100, quit_when_running)
    watchdog = QTimer()
    watchdog.setSingleShot(True)
    watchdog.timeout.connect(lambda: app.exit(99))  # fail rather than hang
    watchdog.start(90000)
    try:
        assert run_tray(args) == 0
    finally:
        watchdog.stop()
    assert seen["state"] == "not-joined"
    assert seen["first run"]  # not in a fleet: the first-run window opened by itself
    assert not seen["loop"].running
    assert NO_TRAY_WARNING in capsys.readouterr().err
    assert (tmp_path / "agent" / "settings.json").is_file()
