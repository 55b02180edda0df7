"""First run, both sides. The agent's window (pytest-qt, offscreen, over the real AgentService):
it finds a real console advertising on loopback, asks only for the token, joins, says it waits for
approval, and turns to "approved" once work arrives. The console's view: the token from a real
token book, Copy, New token, and a QR code whose painted modules are the token's code. The texts
(pure) say what the app does with the PC."""

from __future__ import annotations

from dataclasses import replace

import pytest
from PySide6.QtGui import QGuiApplication

from agent.tray import first_run_model as model
from agent.tray.join_dialog import JoinDialog
from console.qt.first_run_model import NO_QR, first_run_text, qr_matrix
from console.qt.first_run_view import QtFirstRunView
from engine.control.fleet_services import is_first_run, load_or_create_authority
from engine.control.messages import AgentStatus, FetchProgress, WorkerStatus
from engine.discovery.join_service import console_advertisement
from engine.trust.join_token import TokenBook, parse_token
from tests.support.agent_helpers import console
from tests.support.asyncutil import held

FP = "ab" * 32


pytestmark = pytest.mark.usefixtures("private_dirs")


def _status(**over) -> AgentStatus:
    base = AgentStatus(node_id="n" * 64, fleet_id=FP[:16], name="desk-1", version="0", state="idle",
                       paused_reasons=(), inventory={}, export_id=None, stage=None, fetch=FetchProgress(),
                       worker=WorkerStatus(), api_url=None)
    return replace(base, **over)


def test_first_run_texts():
    for words in ("only while you are away", "stops the moment you come back", "pause it at any time"):
        assert words in model.WHAT_IT_DOES
    one = console_advertisement("Admin", FP, 7411, "127.0.0.1", "0.1.0")
    assert model.consoles_line(None) == model.SEARCHING
    assert model.consoles_line(()) == model.NONE_FOUND
    assert model.consoles_line((one,)) == f"Found the console of fleet {FP[:16]} at 127.0.0.1:7411."
    assert "2 consoles" in model.consoles_line((one, replace(one, instance="other")))
    assert not model.show_address_field(None, False) and not model.show_address_field((one,), False)
    assert model.show_address_field((), False) and model.show_address_field((one,), True)
    assert model.join_request("  ", "h:1") == model.NEED_TOKEN
    assert model.join_request(" DFJ1-x ", " ") == ("DFJ1-x", None)
    assert model.join_request("DFJ1-x", "h:1") == ("DFJ1-x", "h:1")
    waiting = model.waiting_page(_status())
    assert waiting.headline == "Joined — awaiting approval" and not waiting.approved
    assert FP[:16] in waiting.detail and "nothing runs on it" in waiting.detail
    approved = model.waiting_page(_status(export_id="smol-2", stage=1))
    assert approved.approved and "part 2 of a model" in approved.detail
    # approved before any work: the fleet gave it its chat address at the approval
    told = model.waiting_page(_status(api_url="http://10.0.0.9:8000/v1"))
    assert told.approved and "Open chat" in told.detail


@pytest.mark.slow
def test_agent_first_run_needs_only_the_token(qtbot, start_tray, tmp_path):
    with held(lambda: console(tmp_path / "console", advertise_on="127.0.0.1")) as con:
        tray = start_tray()
        dialog = tray.open_join_dialog()
        assert isinstance(dialog, JoinDialog) and dialog.page == "token"
        assert model.WHAT_IT_DOES in dialog.what_it_does.text()
        assert dialog.consoles_label.text() == model.SEARCHING
        qtbot.waitUntil(lambda: dialog.consoles is not None, timeout=20000)
        assert con.enrollment in [c.enrollment for c in dialog.consoles]
        assert dialog.consoles_label.text() == model.consoles_line(dialog.consoles)
        if len(dialog.consoles) == 1:  # (other consoles only when other tests share this loopback)
            assert dialog.consoles_label.text() == (f"Found the console of fleet {con.authority.fleet_id} at "
                                                    f"{con.enrollment}.")
        assert not dialog.console_edit.isVisible() and dialog.address_button.isVisible()

        dialog.join_button.click()
        assert dialog.error_text == model.NEED_TOKEN
        dialog.token_edit.setText(con.token())
        dialog.join_button.click()
        qtbot.waitUntil(lambda: dialog.page == "waiting", timeout=30000)
        assert tray.bridge.status.fleet_id == con.authority.fleet_id
        assert dialog.waiting_headline.text() == "Joined — awaiting approval"
        assert con.authority.fleet_id[:16] in dialog.waiting_detail.text()
        assert model.WHAT_IT_DOES in dialog.what_it_does.text() and dialog.what_it_does.isVisible()

        # the console gives the PC work: the window says it is approved
        tray.bridge.status_changed.emit(replace(tray.bridge.status, export_id="tiny-2", stage=0))
        assert dialog.waiting_headline.text() == "Approved: this PC is part of the fleet"
        dialog.close_button.click()
        qtbot.waitUntil(lambda: tray.join_dialog is None, timeout=5000)
        assert not tray.join_action.isVisible() and tray.leave_action.isVisible()


@pytest.mark.slow
def test_agent_first_run_without_a_console_on_the_network_asks_for_its_address(qtbot, start_tray, tmp_path):
    with held(lambda: console(tmp_path / "console")) as con:  # not advertised: another network
        tray = start_tray()
        dialog = tray.open_join_dialog()
        qtbot.waitUntil(lambda: dialog.consoles is not None, timeout=20000)
        assert dialog.consoles == () and dialog.consoles_label.text() == model.NONE_FOUND
        assert dialog.console_edit.isVisible() and not dialog.address_button.isVisible()
        dialog.token_edit.setText(con.token())
        dialog.join_button.click()  # no address: searched again, nothing found, explained
        qtbot.waitUntil(lambda: not dialog.busy and bool(dialog.error_text), timeout=30000)
        assert "no console of fleet" in dialog.error_text and dialog.page == "token"
        dialog.console_edit.setText(con.enrollment)
        dialog.join_button.click()
        qtbot.waitUntil(lambda: dialog.page == "waiting", timeout=30000)
        assert tray.bridge.status.fleet_id == con.authority.fleet_id


def test_console_first_run_view_shows_a_working_token_copy_and_qr(qtbot, tmp_path):
    state = tmp_path / "console"
    assert is_first_run(state)
    authority = load_or_create_authority(state)
    assert not is_first_run(state)
    book = TokenBook(state / "join-tokens.json", authority.fingerprint)
    view = QtFirstRunView(authority.fleet_id, "127.0.0.1:7411", book.issue)
    qtbot.addWidget(view)
    issued = []
    view.token_issued.connect(issued.append)
    view.show()
    qtbot.waitExposed(view)
    first = view.token
    assert parse_token(first).pins(authority.fingerprint)
    text = first_run_text(authority.fleet_id, "127.0.0.1:7411")
    assert "127.0.0.1:7411" in view.address_label.text() == text.address
    assert "pause the moment someone does" in text.steps

    view.copy_button.click()
    assert QGuiApplication.clipboard().text() == first
    assert "Copied" in view.copied_label.text()

    view.new_button.click()
    assert issued == [view.token] and view.token != first and view.copied_label.text() == ""
    book.redeem(first)  # both tokens are real, single-use tokens of this fleet
    book.redeem(view.token)

    matrix = qr_matrix(view.token)
    assert matrix is not None and view.qr.isVisible() and not view.qr_note.isVisible()
    assert view.qr.matrix == matrix and len(matrix) >= 21
    image = view.qr.grab().toImage()
    for r in range(len(matrix)):
        for c in range(len(matrix)):
            x, y = view.qr.module_rect_center(r, c)
            dark = image.pixelColor(x, y).lightness() < 128
            assert dark == matrix[r][c], (r, c)
    assert image.pixelColor(1, 1).lightness() > 200  # the quiet zone is white


def test_console_view_without_segno_shows_the_token_and_says_why_no_qr(qtbot, tmp_path, monkeypatch):
    import console.qt.first_run_view as view_module

    monkeypatch.setattr(view_module, "qr_matrix", lambda text: None)
    view = QtFirstRunView("f" * 16, "h:1", lambda: "DFJ1-token")
    qtbot.addWidget(view)
    view.show()
    assert view.token == "DFJ1-token" and not view.qr.isVisible() and view.qr_note.isVisible()
    assert view.qr_note.text() == NO_QR
