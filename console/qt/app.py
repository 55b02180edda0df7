"""``deskfleet console``: the QApplication, the console bridge and the main window.

The console is a client of the fleet service (`deskfleet fleet`): the one ``--service`` names, or
the local one over the state dir, started detached when none runs. Closing the window (or
SIGINT/SIGTERM) only detaches: the service keeps serving.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

from console.shared.qt_async import drop_pending_quit

log = logging.getLogger("deskfleet.console")


def settings_from_args(args: argparse.Namespace):
    """The console's settings for the parsed command line (defaults for what it does not name)."""
    from console.fleet_api.fleet_settings import (
        API_PORT,
        DEFAULT_DATA_PORT,
        ENROLLMENT_PORT,
        HUB_PORT,
        FleetSettings,
        default_state_dir,
    )
    from engine.machine.this_pc import primary_ipv4

    interface = getattr(args, "interface", None) or primary_ipv4()
    service_url = getattr(args, "service", None)
    admin_cert = getattr(args, "admin_cert", None)
    if admin_cert is not None and service_url is None:
        from engine.errors import DeskfleetError

        raise DeskfleetError("--admin-cert is for a service elsewhere: give its admin API with --service https://HOST:PORT")
    return FleetSettings(state_dir=getattr(args, "state_dir", None) or default_state_dir(), interface=interface,
                           api_port=_port(args, "api_port", API_PORT),
                           enrollment_port=_port(args, "enrollment_port", ENROLLMENT_PORT),
                           hub_port=_port(args, "hub_port", HUB_PORT),
                           runtime=getattr(args, "runtime", None) or "paged",
                           service_url=service_url, admin_cert=admin_cert,
                           service_node_id=getattr(args, "service_node_id", None),
                           admin_port=_admin_port(args), data_port=_data_port(args, DEFAULT_DATA_PORT))


def _admin_port(args: argparse.Namespace) -> int | None:
    port = getattr(args, "admin_port", 7222)
    if port is not None and not -1 <= port < 65536:
        from engine.errors import DeskfleetError

        raise DeskfleetError(f"--admin-port must be a TCP port (0-65535) or -1 for none, not {port}")
    return None if port == -1 else port


def _data_port(args: argparse.Namespace, default: int) -> int:
    port = getattr(args, "data_port", None)
    return default if port is None else _port(args, "data_port", port)


def _port(args: argparse.Namespace, name: str, default: int) -> int:
    from engine.errors import DeskfleetError

    value = getattr(args, name, None)
    value = default if value is None else value
    if not 0 <= value < 65536:
        raise DeskfleetError(f"--{name.replace('_', '-')} must be a TCP port (0-65535), not {value}")
    return value


def start_failure_box(parent, why: str, settings) -> QMessageBox:
    """The dialog a console that could not start shows: the reason, and where to look next."""
    from console.fleet_api.service_locator import LOG_FILE

    if settings.service_url:
        hint = (f"The console could not reach the fleet service at {settings.service_url}. Check the address, "
                "the admin certificate folder (--admin-cert) and that the service runs.")
    else:
        hint = (f"The console could not start or reach the fleet service over {settings.state_dir}. Its log is "
                f"{settings.state_dir / LOG_FILE}; `deskfleet doctor` checks this PC.")
    box = QMessageBox(QMessageBox.Icon.Critical, "Deskfleet console could not start", why,
                      QMessageBox.StandardButton.Close, parent)
    box.setInformativeText(hint)
    return box


def run_console(args: argparse.Namespace, *, until=None) -> int:
    """Run the console until its window closes; returns the exit code. ``until(window)`` (tests)
    is called once the console has started and quits the app when it returns."""
    from console.qt.main_window import QtConsoleWindow

    settings = settings_from_args(args)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Deskfleet console")
    from console.qt.service_bridge import ServiceBridge

    bridge = ServiceBridge(settings)
    window = QtConsoleWindow(bridge)
    code = {"exit": 0}

    def failed(why: str) -> None:
        print(f"deskfleet console: could not start: {why}", file=sys.stderr, flush=True)
        code["exit"] = 1
        # started from a desktop menu there is no terminal: say it in a window, then quit
        window.start_failure = start_failure_box(window, why, settings)
        window.start_failure.finished.connect(app.quit)
        window.start_failure.open()

    def started() -> None:
        if settings.service_url:
            where = f"attached to {settings.service_url}"
        else:
            where = (f"{'started' if bridge.started_service else 'attached to'} the fleet service over "
                     f"{settings.state_dir}")
        print(f"deskfleet console: fleet {bridge.fleet_id}; PCs join at {bridge.enrollment}; {where}", flush=True)
        if until is not None:
            until(window)
            app.quit()

    bridge.start_failed.connect(failed)
    bridge.started.connect(started)
    # SIGINT/SIGTERM quit the event loop; a timer lets Python run its signal handlers while Qt waits.
    previous = {sig: signal.signal(sig, lambda *_: app.quit()) for sig in (signal.SIGINT, signal.SIGTERM)}
    waker = QTimer()
    waker.timeout.connect(lambda: None)
    waker.start(250)
    window.show()
    bridge.start()
    try:
        app.exec()
    finally:
        waker.stop()
        window.shutdown()
        bridge.close()
        window.close()
        window.deleteLater()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        drop_pending_quit(app)
    return code["exit"]
