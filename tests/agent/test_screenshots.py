"""Screenshots of the tray menu, the join dialog and the chat window (see tests/agent/screenshots.py),
written to ``$DESKFLEET_SCREENSHOTS`` (default: a temporary folder). Under Xvfb when it is
installed and Qt's xcb plugin loads, else offscreen in this process (the test says which)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

from tests.support.xvfb import XVFB, xvfb_works

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_dirs")]

EXPECTED = ("tray-icons.png", "tray-menu-not-joined.png", "join-dialog.png", "tray-menu-paused.png",
            "chat-window.png")


def test_screenshots_of_the_tray_menu_and_the_chat(tiny_export, tmp_path, qtbot):
    out = Path(os.environ.get("DESKFLEET_SCREENSHOTS") or tmp_path / "screenshots")
    export = tiny_export("llama", 2)
    env = {**os.environ, "QT_QPA_PLATFORM": "xcb"}
    if xvfb_works(env):
        run = subprocess.run([*XVFB, sys.executable, "-m", "tests.agent.screenshots", "--out", str(out),
                              "--export", str(export), "--work", str(tmp_path / "work")],
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        expected = (*EXPECTED, "screen.png")
    else:
        from tests.agent.screenshots import take_screenshots

        take_screenshots(out, export, tmp_path / "work")
        expected = EXPECTED
    platform = (out / "PLATFORM.txt").read_text().strip()
    print(f"screenshots ({platform}) in {out}")
    for name in expected:
        image = QImage(str(out / name))
        assert not image.isNull() and image.width() >= 64 and image.height() >= 64, name
        colours = {image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)}
        assert len(colours) > 3, f"{name} is blank"
