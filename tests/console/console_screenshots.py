"""Screenshots of every page of the admin console, from a real run: two agents on loopback found,
joined and approved, the tiny model placed over both and distributed, the chat answered, the
metrics counting. The same driver as tests/console/test_console_app.py, with a plain wait loop.

Run by tests/console/test_console_app.py under Xvfb in a subprocess when it can (real X11 rendering, and
a grab of the whole screen), else in-process offscreen. Standalone::

    xvfb-run -a env QT_QPA_PLATFORM=xcb \
        python -m tests.console.console_screenshots --out DIR --checkpoint CKPT --work TMP
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

PAGES = ("Dashboard", "Fleet", "Models", "Placement", "Distribution", "Chat", "Keys", "Metrics")
# the first hour, before anything is served: a fresh service and an empty library (issue 32)
FIRST_HOUR = ("console-dashboard-get-started.png", "console-models-on-arrival.png", "console-fleet-awaiting.png",
              "console-dashboard-approve.png")
QUESTION = "Tell me a long story."


def copy_caches(source: Path | None, into: Path) -> None:
    """Copy a console state dir's calibration and export directories (both keyed by content)."""
    for part in ("calibration", "exports"):
        if source is not None and (source / part).is_dir():
            shutil.copytree(source / part, into / part, dirs_exist_ok=True)


def settle(app, seconds: float = 0.3) -> None:
    """Let the page lay itself out and paint."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.02)


def take_console_screenshots(out: Path, checkpoint: Path, work: Path, cache: Path | None = None) -> list[Path]:
    """Write one PNG per page into ``out`` (and the whole screen under X11); return their paths."""
    from PySide6.QtWidgets import QApplication

    from tests.console.console_app_helpers import ConsoleDriver, local_agents, running_console
    from tests.support.xvfb import qt_wait

    out.mkdir(parents=True, exist_ok=True)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    written: list[Path] = []

    def wait(condition, timeout: float, what: str) -> None:
        qt_wait(app, condition, timeout, what)

    def save(window, name: str) -> None:
        path = out / name
        if not window.grab().save(str(path)):
            raise OSError(f"could not write {path}")
        written.append(path)

    copy_caches(cache, work / "console")
    with local_agents(work) as (agent_loop, agents), running_console(work / "console", wait) as window:
        drive = ConsoleDriver(window, wait)
        names = tuple(agents)
        window.move(40, 30)
        window.show()
        dialog = window.first_run_dialog  # this start created the fleet: the welcome with the token
        if dialog is None:
            raise RuntimeError("the first start of a console showed no first-run dialog")
        settle(app)
        save(dialog, "console-first-run.png")
        dialog.close()
        window.show_page("Dashboard")
        settle(app)
        save(window, "console-dashboard-get-started.png")
        window.show_page("Models")  # what a new admin finds there: the built-in model, chosen
        wait(lambda: window.models_page.model_list.count() > 0, 20, "the model library")
        settle(app)
        save(window, "console-models-on-arrival.png")
        drive.wait_rows(names, lambda row: row["State"] == "not joined", "the agents over mDNS")
        drive.join(agent_loop, agents)
        drive.wait_rows(names, lambda row: row["State"].startswith("awaiting approval"), "the joined agents")
        window.show_page("Fleet")
        wait(lambda: not window.approval_banner.isHidden(), 10, "the approval banner")
        settle(app)
        save(window, "console-fleet-awaiting.png")
        window.show_page("Dashboard")
        settle(app)
        save(window, "console-dashboard-approve.png")
        drive.approve(names)
        drive.measure_links(names)
        drive.add_model(checkpoint)
        window.show_page("Placement")
        drive.place(drive.two_agent_context())
        if window.bridge.session.plan is None:
            raise RuntimeError(f"no plan: {window.placement_page.explanation.text()}")
        window.show_page("Distribution")
        drive.distribute()
        window.chat_page.chat.options["max_tokens"] = 64  # long enough for the sparkline to show a rise
        answer = drive.chat(QUESTION)
        if not answer.strip():
            raise RuntimeError(f"the chat did not answer: {window.chat_page.chat.error_label.text()}")
        wait(lambda: float(drive.metric("tokens")) > 1, 10, "the metrics")
        wait(lambda: len(window.metrics_page.history.series("tokens_per_second")) >= 8, 10, "a few samples")
        window.models_page.exports_table.selectRow(0)  # its manifest beside it
        for page in PAGES:
            window.show_page(page)
            settle(app)
            save(window, f"console-{page.lower()}.png")
        if app.platformName() == "xcb":
            from PySide6.QtGui import QGuiApplication

            screen = QGuiApplication.primaryScreen()
            path = out / "console-screen.png"
            screen.grabWindow(0).save(str(path))
            written.append(path)
    (out / "CONSOLE-PLATFORM.txt").write_text(f"{app.platformName()}\n")
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--cache", type=Path, default=None, help="calibration/exports from an earlier run")
    args = parser.parse_args()
    for path in take_console_screenshots(args.out, args.checkpoint, args.work, args.cache):
        print(f"wrote {path}", flush=True)
    print(f"platform: {os.environ.get('QT_QPA_PLATFORM', '?')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
