"""Screenshots of the chat window (tests/console/chat_screenshots.py: a Markdown answer with a code
block and a table, the saved chats listed, the paused line, the unreachable line), written to
``$DESKFLEET_SCREENSHOTS`` (default: a temporary folder). Under Xvfb when it is installed and Qt's
xcb plugin loads, else offscreen in this process (the test says which)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

from tests.console.chat_screenshots import NAMES
from tests.support.xvfb import XVFB, xvfb_works

pytestmark = pytest.mark.slow


def colours(image: QImage, x0: int, y0: int, x1: int, y1: int) -> set[int]:
    return {image.pixel(x, y) for x in range(x0, x1, 3) for y in range(y0, y1, 3)}


def test_screenshots_of_the_chat(tmp_path, qtbot, monkeypatch):
    out = Path(os.environ.get("DESKFLEET_SCREENSHOTS") or tmp_path / "screenshots")
    monkeypatch.setenv("DESKFLEET_CHATS_DIR", str(tmp_path / "default-chats"))
    env = {**os.environ, "QT_QPA_PLATFORM": "xcb"}
    if xvfb_works(env):
        run = subprocess.run([*XVFB, sys.executable, "-m", "tests.console.chat_screenshots", "--out", str(out),
                              "--work", str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
    else:
        from tests.console.chat_screenshots import take_chat_screenshots

        take_chat_screenshots(out, tmp_path / "work")
    print(f"chat screenshots ({(out / 'CHAT-PLATFORM.txt').read_text().strip()}) in {out}")
    images = {name: QImage(str(out / name)) for name in NAMES}
    for name, image in images.items():
        assert not image.isNull() and image.width() >= 1000 and image.height() >= 700, name
        assert len(colours(image, 0, 0, image.width(), image.height())) > 8, f"{name} is blank"
    # the code block's grey box and the table's header cells are drawn in the Markdown answer
    markdown = images["chat-markdown.png"]
    assert markdown.pixelColor(markdown.width() // 2, 200).name() == "#f3f4f6", \
        "no code block background in the middle of the answer"
    # the paused and unreachable lines are coloured bands above the input
    for name, background in (("chat-paused.png", "#fff3d6"), ("chat-unreachable.png", "#fde7e5")):
        image = images[name]
        band = {image.pixelColor(x, y).name() for x in range(300, 1000, 50) for y in range(540, 700, 4)}
        assert background in band, (name, sorted(band))
