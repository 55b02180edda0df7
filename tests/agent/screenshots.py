"""Screenshots of the tray menu, the state icons and the chat window, from a real run: a console
half and the OpenAI API (the paged coordinator over a tiny export) on loopback, the real agent
service joined to that console, and the chat streaming a real answer.

Run by tests/agent/test_screenshots.py, under Xvfb in a subprocess when it can (real X11 rendering,
plus a grab of the whole screen), else in-process offscreen. Standalone::

    xvfb-run -a env QT_QPA_PLATFORM=xcb python -m tests.agent.screenshots --out DIR --export EXPORT --work TMP
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from tests.support.asyncutil import held_on
from tests.support.xvfb import qt_wait

QUESTION = "Tell me a long story."
POOL_BYTES = 16 << 20  # the paged coordinator's KV pool per stage: the tiny export's blocks are small


@contextlib.asynccontextmanager
async def _api(export: Path):
    from engine.api.server import ApiSettings, async_run_api
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator

    async with BatchCoordinator.local(export, slots=2, kv_pool_bytes=POOL_BYTES) as coordinator:
        running = await async_run_api(coordinator, ChatTokenizer(export / "tokenizer"),
                                      ApiSettings(max_tokens_limit=400, default_max_tokens=48))
        try:
            yield running.url
        finally:
            await running.async_stop()


def take_screenshots(out: Path, export: Path, work: Path) -> list[Path]:
    """Write the PNGs into ``out``; return their paths."""
    from PySide6.QtCore import QPoint, QRect
    from PySide6.QtGui import QGuiApplication, QPainter, QPixmap
    from PySide6.QtWidgets import QApplication

    from agent.service.service import AgentService
    from agent.service.settings import AgentSettings, AgentState, save_settings, save_state
    from agent.tray.bridge import AgentBridge
    from agent.tray.icons import STATE_STYLES, state_pixmap
    from agent.tray.tray import QtAgentTray
    from console.shared.loop_thread import LoopThread
    from tests.support.agent_helpers import FakeIdle, console

    out.mkdir(parents=True, exist_ok=True)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    written: list[Path] = []

    def save(pixmap: QPixmap, name: str) -> None:
        path = out / name
        if not pixmap.save(str(path)):
            raise OSError(f"could not write {path}")
        written.append(path)

    strip = QPixmap(64 * len(STATE_STYLES) + 8 * (len(STATE_STYLES) + 1), 80)
    strip.fill(app.palette().window().color())
    painter = QPainter(strip)
    for i, state in enumerate(STATE_STYLES):
        painter.drawPixmap(8 + i * 72, 8, state_pixmap(state, 64))
    painter.end()
    save(strip, "tray-icons.png")

    with LoopThread("screenshots-servers") as servers, \
            held_on(servers, lambda: console(work / "console"), 300) as con, \
            held_on(servers, lambda: _api(export), 300) as url:
        state_dir = work / "agent"
        settings = AgentSettings(name="desk-7", interface="127.0.0.1", control_port=0, data_port=0)
        save_settings(state_dir, settings)
        save_state(state_dir, AgentState(api_url=url))  # learnt from an earlier assignment
        service = AgentService(state_dir, settings, idle_source=FakeIdle(), power=lambda: None)
        bridge = AgentBridge(service, poll_interval_ms=200)
        tray = QtAgentTray(bridge, [sys.executable, "-m", "engine.cli.main", "agent"], confirm_leave=lambda: True)
        try:
            bridge.start()
            qt_wait(app, lambda: bridge.running and bridge.status is not None, 120, "the agent to start")

            def grab_menu(name: str) -> None:
                tray.menu.popup(QPoint(24, 24))
                qt_wait(app, tray.menu.isVisible, 10, "the menu")
                save(tray.menu.grab(), name)
                tray.menu.hide()

            grab_menu("tray-menu-not-joined.png")
            dialog = tray.open_join_dialog()
            dialog.token_edit.setText(con.token())
            dialog.console_edit.setText(con.enrollment)
            qt_wait(app, dialog.isVisible, 10, "the join dialog")
            save(dialog.grab(), "join-dialog.png")
            dialog.join_button.click()
            qt_wait(app, lambda: bridge.status.state == "idle", 60, "the join")
            bridge.set_manual_pause(True)
            qt_wait(app, lambda: bridge.status.state == "paused", 30, "the pause")
            grab_menu("tray-menu-paused.png")
            bridge.set_manual_pause(False)
            qt_wait(app, lambda: bridge.status.state == "idle", 30, "the resume")

            window = tray.open_chat()
            window.options = {"temperature": 0, "max_tokens": 48}
            window.move(120, 60)
            qt_wait(app, lambda: window.model_choice.count() > 0, 30, "the model list")
            window.input.setText(QUESTION)
            window.send()
            qt_wait(app, lambda: not window.streaming, 60, "the answer")
            if window.model.current.messages[-1].state != "done":
                raise RuntimeError(f"the chat answer failed: {window.error_label.text()}")
            save(window.grab(), "chat-window.png")
            if app.platformName() == "xcb":  # the real screen: the window as the X server shows it
                tray.menu.popup(QPoint(window.x() + window.width() + 20, 60))
                qt_wait(app, tray.menu.isVisible, 10, "the menu")
                screen = QGuiApplication.primaryScreen()
                save(screen.grabWindow(0).copy(QRect(0, 0, screen.size().width(), screen.size().height())),
                     "screen.png")
                tray.menu.hide()
        finally:
            tray.shutdown()
    (out / "PLATFORM.txt").write_text(f"{app.platformName()}\n")
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()
    for path in take_screenshots(args.out, args.export, args.work):
        print(f"wrote {path}", flush=True)
    print(f"platform: {os.environ.get('QT_QPA_PLATFORM', '?')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
