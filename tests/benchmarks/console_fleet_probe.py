"""The console side of the console-fleet benchmark (run by tests/benchmarks/console_fleet.py, under
Xvfb): the real console window (`QtConsoleWindow` over a `ServiceBridge`) attached to a running
fleet service over its admin socket, on the Fleet page, while the service's agents change state.

A heartbeat `QTimer` (precise, every ``--beat-ms``) stamps the GUI thread's event loop; the
bridge's GUI-thread receipt of each records snapshot and each refresh of the Fleet page are
timed. After ``--seconds`` it writes one JSON object (raw stamps and spans, in seconds from the
start) to ``--out``; the parent turns them into blocks per refresh. ``--variant old`` puts the
pre-model page and feed (tests/benchmarks/console_fleet_old.py) in place of the new ones.

    xvfb-run -a env QT_QPA_PLATFORM=xcb python -m tests.benchmarks.console_fleet_probe \\
        --state-dir STATE --agents 100 --variant new --seconds 20 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import QApplication

SETTLE_S = 2.0


class Clock:
    """The measurement's end: a refresh that finds it passed quits the event loop and the ones
    queued behind it are dropped (a page slower than the news it gets builds a backlog that
    would starve any quit timer)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.end: float | None = None  # perf_counter() deadline, once measuring
        self.over = False

    def timed(self, spans: list[tuple[float, float]], fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            if self.over:
                return None
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                now = time.perf_counter()
                spans.append((start - self.t0, now - self.t0))
                if self.end is not None and now > self.end:
                    self.over = True
                    QApplication.instance().quit()
        return run


def probe(state_dir: Path, agents: int, variant: str, seconds: float, beat_ms: int,
          screenshot: Path | None = None) -> dict[str, Any]:
    import PySide6
    from PySide6.QtCore import Qt, QTimer

    from console.fleet_api.fleet_settings import FleetSettings
    from console.qt.main_window import QtConsoleWindow
    from console.qt.service_bridge import ServiceBridge
    from tests.benchmarks.console_fleet_old import OldBridge, OldFleetPage
    from tests.support.xvfb import qt_wait

    app = QApplication.instance() or QApplication(sys.argv[:1])
    t0 = time.perf_counter()
    clock = Clock(t0)
    receive: list[tuple[float, float]] = []  # the GUI thread taking a snapshot from the feed
    refresh: list[tuple[float, float]] = []  # the Fleet page applying one
    settings = FleetSettings(state_dir=state_dir, interface="127.0.0.1")
    bridge = (OldBridge if variant == "old" else ServiceBridge)(settings)
    window = QtConsoleWindow(bridge)
    if variant == "old":  # the old page in the new one's tab; the old feed decodes and fills in one slot
        new_page = window.fleet_page
        bridge.records_changed.disconnect(new_page.updates.offer)
        window.tabs.removeTab(0)
        new_page.deleteLater()
        page = OldFleetPage(bridge)
        window.tabs.insertTab(0, page, "Fleet")
        bridge._on_event = clock.timed(receive, bridge._on_event)
        refresh = receive

        def rows() -> int:
            return page.table.rowCount()
    else:
        page = window.fleet_page
        bridge._on_records = clock.timed(receive, bridge._on_records)
        page.updates._apply = clock.timed(refresh, page.updates._apply)

        def rows() -> int:
            return page.model.rowCount()
    window.show_page("Fleet")
    window.resize(1200, 760)
    window.show()
    try:
        bridge.start()
        qt_wait(app, lambda: bridge.running and rows() >= agents, 300, f"the console to list {agents} agents")
        settled = time.perf_counter() + SETTLE_S  # the first fill's paint and sizing are not measured
        qt_wait(app, lambda: time.perf_counter() > settled, SETTLE_S + 5, "the window to settle")
        beats: list[float] = []
        heartbeat = QTimer()
        heartbeat.setTimerType(Qt.TimerType.PreciseTimer)
        heartbeat.setInterval(beat_ms)
        heartbeat.timeout.connect(lambda: beats.append(time.perf_counter() - t0))
        receive.clear()
        refresh.clear()
        nones = sys.getrefcount(None)  # PySide6 6.12.0 on CPython 3.11 drops one per void Qt call
        start, cpu = time.perf_counter() - t0, time.process_time()
        heartbeat.start()
        clock.end = time.perf_counter() + seconds
        QTimer.singleShot(int(seconds * 1000), app.quit)
        app.exec()
        clock.over = True
        heartbeat.stop()
        end, cpu = time.perf_counter() - t0, time.process_time() - cpu
        nones = (nones, sys.getrefcount(None))
        if screenshot is not None:
            if variant != "old":  # a few agents selected: the buttons that act on all of them enabled
                page.select({page.model.record(r).key for r in range(min(4, page.model.rowCount()))})
                settled = time.perf_counter() + 0.5
                qt_wait(app, lambda: time.perf_counter() > settled, 5, "the selection to paint")
            window.grab().save(str(screenshot))
        return {"variant": variant, "agents": agents, "rows": rows(), "start": start, "end": end,
                "beat_s": beat_ms / 1000, "beats": beats, "receive": receive if variant != "old" else list(refresh),
                "refresh": list(refresh), "cpu_s": cpu, "platform": app.platformName(),
                "none_refs": nones, "pyside": PySide6.__version__}
    finally:
        window.shutdown()
        bridge.close()
        window.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.console_fleet_probe",
                                description="One console-fleet measurement: the console attached to a running "
                                            "fleet service; writes the heartbeat and refresh timings as JSON.")
    p.add_argument("--state-dir", type=Path, required=True, help="the running fleet service's state dir")
    p.add_argument("--agents", type=int, required=True, help="measure once the Fleet page lists this many")
    p.add_argument("--variant", choices=("old", "new"), default="new", help="which Fleet page and feed (default new)")
    p.add_argument("--seconds", type=float, default=20.0, help="how long to measure (default 20)")
    p.add_argument("--beat-ms", type=int, default=5, help="the heartbeat timer's interval (default 5 ms)")
    p.add_argument("--screenshot", type=Path, help="also save the window as this PNG at the end")
    p.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    args = p.parse_args(argv)
    result = probe(args.state_dir, args.agents, args.variant, args.seconds, args.beat_ms, args.screenshot)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
