"""The console's Join tokens dialog against a real fleet service and agent (tests/console/tokens_screenshot.py
drives it): issuing a reusable auto-approving token, the PC it admitted listed, the form refusing
a never-expiring auto-approving token before anything is sent, revoking, copying; its rows are
pure (console.fleet_api.token_rows); the screenshot is taken under Xvfb when it works here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from console.fleet_api.token_rows import EXPIRY_CHOICES, TokenFormError, expiry_text, issue_options, token_rows
from tests.console.tokens_screenshot import LABEL, drive_tokens_dialog, to_json

pytestmark = pytest.mark.usefixtures("private_dirs")


def test_rows_say_uses_expiry_state_and_whom_a_token_admitted():
    now = 1_000_000.0
    tokens = [{"id": "aa11", "label": "floor 3", "uses": 40, "used": 8, "uses_left": 32, "expires_at": now + 7200,
               "auto_approve": True, "state": "active", "admitted": [{"name": f"pc-{i}"} for i in range(8)]},
              {"id": "bb22", "label": "", "uses": 1, "used": 1, "uses_left": 0, "expires_at": None,
               "auto_approve": False, "state": "used_up", "admitted": [{"name": "pc-x"}]}]
    first, second = token_rows(tokens, now)
    assert first.cells[:5] == ("floor 3", "aa11", "40", "8", "32") and first.active
    assert first.cells[5].endswith("(in 2 h)") and first.cells[6] == "yes"
    assert first.cells[8] == "pc-0, pc-1, pc-2, pc-3, pc-4, pc-5 and 2 more"
    evented = {**tokens[0], "admitted_count": 30}  # an event carries the newest admissions only
    assert token_rows([evented], now)[0].cells[8].endswith("and 24 more")
    assert second.cells[0] == "—" and second.cells[5] == "never" and second.cells[7] == "used up"
    assert not second.active
    assert expiry_text(now - 1, now).endswith("(past)")


def test_the_form_refuses_what_the_service_would():
    never = [text for text, _ in EXPIRY_CHOICES].index("never")
    with pytest.raises(TokenFormError, match="must expire"):
        issue_options(5, never, True, "x")
    assert issue_options(5, never, False, " lab ") == {"uses": 5, "ttl_s": None, "auto_approve": False, "label": "lab"}
    assert issue_options(1, 0, True, "")["ttl_s"] == EXPIRY_CHOICES[0][1]


@pytest.mark.slow
def test_the_dialog_issues_lists_revokes_and_copies_over_a_real_service(tmp_path, qtbot):
    """Under Xvfb (a subprocess, real X11 rendering) when it works here, else offscreen in this
    process; either way the same story, checked the same way, and a screenshot to look at."""
    from PySide6.QtGui import QImage

    from tests.support.xvfb import XVFB, xvfb_works

    out = Path(os.environ.get("DESKFLEET_SCREENSHOTS") or tmp_path / "screenshots")
    env = {**os.environ, "QT_QPA_PLATFORM": "xcb"}
    if xvfb_works(env):
        run = subprocess.run([*XVFB, sys.executable, "-m", "tests.console.tokens_screenshot", "--out", str(out),
                              "--work", str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
    else:
        result = to_json(drive_tokens_dialog(tmp_path / "work", lambda c, t, w: qtbot.waitUntil(
            c, timeout=int(t * 1000)), out))
    rows = {r["token_id"]: r for r in result["rows"]}
    issued = next(r for r in rows.values() if r["cells"][0] == LABEL)
    assert issued["cells"][2:5] == ["40", "1", "39"] and issued["cells"][6] == "yes" and issued["active"]
    assert issued["cells"][8] == result["name"] and "(in 6 d)" in issued["cells"][5]
    assert rows[result["first_id"]]["cells"][7] == "revoked" and not rows[result["first_id"]]["active"]
    assert "must expire" in result["refused"]
    assert result["copied"] == result["token"] and not result["revoke_enabled"]
    image = QImage(result["png"])
    assert not image.isNull() and image.width() >= 900 and image.height() >= 400
    colours = {image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)}
    assert len(colours) > 8, "the screenshot is blank"
