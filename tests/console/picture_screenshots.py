"""Screenshots of the console's pictures from a real run: the Dashboard with three real agents
(one serving a stage, one paused, one awaiting approval) and their CPU/memory sparklines, and
the Distribution page's live ring diagram of a real two-agent paged ring (the service's default
runtime) generating tokens (measured ms per stage beside the prediction). A real fleet service
on a loop thread, real agents on loopback, the real console window.

Run by tests/console/test_dashboard.py under Xvfb in a subprocess when it can (real X11
rendering), else offscreen in-process. Standalone::

    xvfb-run -a env QT_QPA_PLATFORM=xcb \
        python -m tests.console.picture_screenshots --out DIR --checkpoint CKPT --work TMP
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import ssl
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

SHOTS = ("picture-dashboard.png", "picture-distribution.png")
STATES_SHOWN = {"serving": 2, "paused": 1, "awaiting approval": 1}  # the Dashboard's counts in the shot
GB = 1 << 30



@contextlib.contextmanager
def chatting(url: str, key: str, ca_pem: bytes | None, stop: threading.Event) -> Iterator[list[str]]:
    """Chat completions (of the first model the API lists) one after another in a thread until
    ``stop``, so the ring's metrics move; yields the list the thread appends its errors to."""
    errors: list[str] = []
    context = ssl.create_default_context(cadata=ca_pem.decode()) if ca_pem and url.startswith("https") else None
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    listing = urllib.request.Request(f"{url.rstrip('/')}/models", headers=headers)
    with urllib.request.urlopen(listing, timeout=30, context=context) as answer:
        model = json.loads(answer.read())["data"][0]["id"]

    def run() -> None:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
                           "max_tokens": 48, "temperature": 0}).encode()
        while not stop.is_set():
            request = urllib.request.Request(f"{url.rstrip('/')}/chat/completions", body, headers)
            try:
                with urllib.request.urlopen(request, timeout=60, context=context) as answer:
                    answer.read()
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.5)

    thread = threading.Thread(target=run, name="picture-chat", daemon=True)
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join(70)


def check_dashboard(dashboard, bridge, names: tuple[str, ...], failovers_today: int) -> None:
    """What the Dashboard shows against what the service and the agents said (AssertionError)."""
    from console.qt.fleet_overview import dashboard_state, members

    records = {r.name: r for r in members(bridge.records) if r.name in names}
    dashboard.sample()
    table = dashboard.load_table
    rows = {table.item(r, 0).text(): r for r in range(table.rowCount())}
    assert set(rows) == set(names), rows
    for name, row in rows.items():
        record = records[name]
        assert table.item(row, 1).text() == dashboard_state(record)
        used, total = record.status.memory_used_bytes, record.status.inventory["ram_total"]
        assert table.item(row, 4).text() == f"{used / GB:.1f} of {total / GB:.1f} GB"
        cpu, memory = table.cellWidget(row, 2), table.cellWidget(row, 3)
        assert cpu.values == dashboard.history.cpu(record.key) and len(cpu.values) >= 4, (name, cpu.values)
        assert all(0.0 <= v <= 100.0 for v in cpu.values)
        assert memory.values == dashboard.history.memory(record.key) and all(0 < v <= 1 for v in memory.values)
    f = dashboard.figures
    assert f.models == (bridge.session.model.name,) and f.rings_serving == 1 and f.tok_s > 0, f
    assert dashboard.models_tile.value.text() == "1" and dashboard.rate_tile.value.text() == f"{f.tok_s:.1f}"
    assert dashboard.agents_title.text() == f"Agents: {len(names)} in this fleet"
    assert f.failovers_today == failovers_today and dashboard.failovers_tile.value.text() == str(failovers_today)


def take_picture_screenshots(out: Path, checkpoint: Path, work: Path) -> list[Path]:
    from PySide6.QtWidgets import QApplication

    from console.qt.fleet_overview import members
    from tests.console.console_app_helpers import ConsoleDriver, fleet_service, local_agents, running_console
    from tests.support.xvfb import qt_wait

    out.mkdir(parents=True, exist_ok=True)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    suffix = uuid.uuid4().hex[:4]
    names = (f"desk-a-{suffix}", f"desk-b-{suffix}", f"desk-c-{suffix}", f"desk-d-{suffix}")
    written: list[Path] = []

    began = time.monotonic()

    def wait(condition, timeout: float, what: str) -> None:
        qt_wait(app, condition, timeout, what)
        print(f"{time.monotonic() - began:6.1f} s: {what}", flush=True)

    def settle(seconds: float = 0.4) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.02)

    def save(window, name: str) -> None:
        path = out / name
        if not window.grab().save(str(path)):
            raise OSError(f"could not write {path}")
        written.append(path)

    with fleet_service(work / "console") as service, local_agents(work, names) as (loop, agents), \
            running_console(work / "console", wait, service) as window:
        bridge, drive = window.bridge, ConsoleDriver(window, wait)
        window.move(40, 30)
        window.show()
        if window.first_run_dialog is not None:
            window.first_run_dialog.close()
        for name, agent in agents.items():
            loop.run(agent.async_join(bridge.enrollment, bridge.issue_token_now()), 30, f"{name} joining")
        wait(lambda: {r.name for r in members(bridge.records) if r.verified} >= set(names), 30, "the joined agents")
        serving_pair = [r for r in members(bridge.records) if r.name in names[:2]]
        for r in serving_pair:
            bridge.approve(r.key)
        wait(lambda: sum(r.approved for r in members(bridge.records)) == 2, 30, "the approvals")
        links = []
        bridge.measure_links([r.node_id for r in serving_pair], links.append, lambda exc: links.append(exc))
        wait(lambda: bool(links), 180, "the links")
        if isinstance(links[0], BaseException):
            raise links[0]
        drive.add_model(checkpoint)
        window.show_page("Placement")
        drive.place(drive.two_agent_context())
        if bridge.session.plan is None:
            raise RuntimeError(f"no plan: {window.placement_page.explanation.text()}")
        window.show_page("Distribution")
        drive.distribute()
        stop = threading.Event()
        with chatting(window.serving.api_url, window.serving.api_key, window.serving.ca_pem, stop) as errors:
            page, rates = window.distribution_page, []
            window.serving.metrics.connect(lambda m: rates.append(m.get("tokens_per_second", 0.0)))
            wait(lambda: any(rates) and page.ring.diagram is not None
                 and all(s.state == "serving" for s in page.ring.diagram.stages), 60,
                 f"tokens and the serving ring on the diagram (chat errors: {errors[-1:]})")
            settle(1.0)
            save(window, SHOTS[1])
            # the third agent approved now and paused (the ring has its two); the fourth stays unapproved
            third = next(r for r in members(bridge.records) if r.name == names[2])
            bridge.approve(third.key, on_result=lambda _: bridge.pause(third.key))
            dashboard = window.dashboard_page
            dashboard.set_sample_s(0.5)  # the console's is 2 s: four samples sooner
            window.show_page("Dashboard")
            wait(lambda: {c.state: c.count for c in dashboard.state_bar.counts} == STATES_SHOWN, 30,
                 f"the agents' states {STATES_SHOWN}")
            wait(lambda: dashboard.figures is not None and dashboard.figures.tok_s, 30, "the tokens per second")
            wait(lambda: all(len(dashboard.history.cpu(r.key)) >= 4 for r in members(bridge.records)), 60,
                 "four load samples of every agent")
            settle(1.0)

            async def tally() -> int:
                return service.service.failovers.today()
            check_dashboard(dashboard, bridge, names, service.loop.run(tally(), 10, "the service's failover tally"))
            save(window, SHOTS[0])
            print(f"chat requests failed: {len(errors)} {errors[-1:]}", flush=True)
    (out / "PICTURES-PLATFORM.txt").write_text(f"{app.platformName()}\n")
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    parser.add_argument("--checkpoint", type=Path, required=True, help="a tiny HF checkpoint to serve")
    parser.add_argument("--work", type=Path, required=True, help="a scratch folder (state dirs)")
    args = parser.parse_args()
    for path in take_picture_screenshots(args.out, args.checkpoint, args.work):
        print(f"wrote {path}", flush=True)
    print(f"platform: {os.environ.get('QT_QPA_PLATFORM', '?')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
