"""``deskfleet agent`` with a tray icon: the QApplication, the agent bridge and the tray.

The agent keeps serving with no window open (``quitOnLastWindowClosed`` is off: closing the
chat must not stop the PC's part of the fleet). Where the desktop has no system tray (some
Wayland sessions, a bare X server), the agent still runs, as if headless, and says so on stderr
with the ways out: the headless mode, or Quit via SIGTERM/Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QSystemTrayIcon

from agent.service.idle import default_idle_source
from agent.service.join_file import default_path as join_file_path
from agent.service.service import AgentService
from agent.service.settings import default_state_dir, resolve_settings
from agent.tray.bridge import AgentBridge
from agent.tray.tray import QtAgentTray
from agent.tray.tray_model import login_command
from console.shared.qt_async import drop_pending_quit
from engine.control.tags import tags_from_text

log = logging.getLogger("deskfleet.agent")

NO_TRAY_WARNING = ("deskfleet agent: this desktop has no system tray, so no icon can be shown. The agent "
                   "keeps running and lends this PC as usual; stop it with Ctrl-C or SIGTERM, or run "
                   "`deskfleet agent --headless` on machines without a desktop.")


def run_tray(args: argparse.Namespace) -> int:
    """Run the tray agent until Quit (or SIGINT/SIGTERM); returns the exit code."""
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setQuitOnLastWindowClosed(False)
    app.setApplicationName("Deskfleet")

    tags = None if getattr(args, "tags", None) is None else tags_from_text(args.tags, "--tags")  # as agent.cli's
    state_dir, settings = resolve_settings(args.state_dir, interface=args.interface, control_port=args.control_port,
                                           data_port=args.data_port, seeds=args.seed, kv_pool_mb=args.kv_pool_mb,
                                           tags=tags)
    service = AgentService(state_dir, settings, idle_source=default_idle_source())
    bridge = AgentBridge(service)
    tray = QtAgentTray(bridge, login_command(state_dir, default_state_dir()), parent=app)
    tray.quit_requested.connect(app.quit)
    if QSystemTrayIcon.isSystemTrayAvailable():
        tray.show()
    else:
        print(NO_TRAY_WARNING, file=sys.stderr, flush=True)
        log.warning("no system tray available; running without an icon")

    def joined_from_file(outcome: str) -> None:
        if outcome != "joined":
            tray.open_join_dialog()  # the installer's token did not work (logged): ask the person

    def started() -> None:
        if getattr(args, "join", None) and not service.joined:
            bridge.join(args.console, args.join)
        elif not service.joined and join_file_path(state_dir).exists():  # a silent install's token
            bridge.join_from_file(join_file_path(state_dir), args.console, on_result=joined_from_file)
        elif not service.joined:
            tray.open_join_dialog()  # first run (or after leaving): the only question is the token

    # SIGINT/SIGTERM quit the event loop. Python runs signal handlers only between bytecodes, so a
    # timer wakes the interpreter while Qt waits for events.
    previous = {sig: signal.signal(sig, lambda *_: app.quit()) for sig in (signal.SIGINT, signal.SIGTERM)}
    waker = QTimer()
    waker.timeout.connect(lambda: None)
    waker.start(250)
    bridge.start(on_started=started)
    try:
        return app.exec()
    finally:
        waker.stop()
        tray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        tray.deleteLater()
        drop_pending_quit(app)
