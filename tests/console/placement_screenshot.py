"""The Placement page driven as an admin does, against a real fleet service and two real agents
with tags (desk-a: finance, floor-2; desk-b: floor-2): place the tiny model with the context left
to the service ("auto": the model's maximum, the reason beside the field) and finance excluded,
so only desk-b is used and desk-a is listed as left out by its tag; then over both agents with a
context so large that the layers must be split, the plan drawn as a two-stage ring. A screenshot
of each. Shared by tests/console/test_placement_page.py (under Xvfb in a subprocess when it can,
else offscreen in-process)::

    xvfb-run -a env QT_QPA_PLATFORM=xcb \\
        python -m tests.console.placement_screenshot --out DIR --work TMP --checkpoint CKPT [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

Wait = Callable[[Callable[[], bool], float, str], None]
SUFFIX = uuid.uuid4().hex[:4]  # mDNS on loopback is shared with other runs
TAGS = {f"desk-a-{SUFFIX}": ("finance", "floor-2"), f"desk-b-{SUFFIX}": ("floor-2",)}


@contextlib.contextmanager
def tagged_agents(root: Path) -> Iterator[tuple]:
    """Started, not yet joined agents with TAGS on a loop thread of their own (as if other PCs)."""
    from agent.service.service import AgentService
    from agent.service.settings import AgentSettings
    from console.shared.loop_thread import LoopThread
    from tests.support.agent_helpers import FakeIdle

    with LoopThread("test-tagged-agents") as loop:
        agents = {}
        try:
            for name, tags in TAGS.items():
                settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0, tags=tags)
                agents[name] = AgentService(root / name, settings, idle_source=FakeIdle(1e6), power=lambda: None)
                loop.run(agents[name].async_start(), 120, f"starting {name}")
            yield loop, agents
        finally:
            for a in agents.values():
                loop.run(a.async_close(), 60, "stopping an agent")


def drive_placement_page(work: Path, checkpoint: Path, wait: Wait, out: Path | None = None,
                         cache: Path | None = None) -> dict:
    """Run the story (see the module docstring); what the test checks, and the PNGs when ``out``.
    ``cache``: a state dir whose ``calibration`` exports of the checkpoint the service may reuse."""
    from PySide6.QtWidgets import QApplication

    from console.fleet_api.exports import ExportSpec
    from console.qt.placement_page import QtPlacementPage
    from console.qt.service_bridge import ServiceBridge, ServiceLibrary
    from engine.shards.kv_precision import KV_BYTES_PER_VALUE
    from tests.console.console_app_helpers import console_settings, fleet_service

    app = QApplication.instance()
    result: dict = {}

    def shot(page, name: str) -> None:
        for _ in range(20):
            app.processEvents()
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            if not page.grab().save(str(out / name)):
                raise OSError(f"could not write {out / name}")

    if cache is not None and (cache / "calibration").is_dir():  # keyed by content: only time is saved
        shutil.copytree(cache / "calibration", work / "service" / "calibration")
    with fleet_service(work / "service") as running, tagged_agents(work / "agents") as (loop, agents):
        bridge = ServiceBridge(console_settings(running.state_dir))
        bridge.start()
        page = None
        try:
            wait(lambda: bridge.running, 60, "the console to attach")
            for name, a in agents.items():
                loop.run(a.async_join(running.service.host.enrollment, bridge.issue_token_now()), 60, f"{name} joining")
            wait(lambda: {r.name for r in bridge.records if r.verified} >= set(agents), 30, "the joined agents")
            for r in bridge.records:
                bridge.approve(r.key)
            wait(lambda: sum(r.approved and r.status is not None for r in bridge.records) == 2, 30,
                 "the approved agents' status")
            page = QtPlacementPage(bridge)
            page.resize(1100, 720)
            page.show()
            wait(lambda: "finance (1), floor-2 (2)" in page.fleet_tags.text(), 20, "the fleet's tags on the page")
            result["fleet_tags"] = page.fleet_tags.text()
            model = ServiceLibrary(bridge).add_model(str(checkpoint))
            bridge.session.choose_model(model, ExportSpec(weights="fp32"))
            result["context_field"] = page.context.text()

            page.exclude_tags.setText("finance")
            page.place_button.click()
            wait(lambda: not page.busy, 600, "the placement")
            plan = bridge.session.plan
            result["explanation"] = page.explanation.text()
            result["first"] = None if plan is None else {
                "names": sorted({bridge.session.name(s.pc_id) for s in plan.stages}),
                "summary": page.summary.text(), "context_reason": page.context_reason.text(),
                "ring_stages": len(page.ring.diagram.stages) if page.ring.diagram else 0,
                "agents_list": [page.agents.item(i).text() for i in range(page.agents.count())]}
            shot(page, "console-placement-tags.png")

            page.exclude_tags.clear()
            free = min(r.status.inventory["ram_available"] for r in bridge.records if r.approved)
            per_token = 2 * 2 * 16 * KV_BYTES_PER_VALUE[bridge.session.spec.kv_cache_precision]  # 2 KV heads of 16
            page.context.setValue(int(0.4 * 0.8 * free / per_token))  # a layer is 0.4 of an agent: two stages
            page.place_button.click()
            wait(lambda: not page.busy, 600, "the second placement")
            plan = bridge.session.plan
            result["second"] = None if plan is None else {
                "names": sorted({bridge.session.name(s.pc_id) for s in plan.stages}),
                "stages": len(plan.stages), "context_reason": page.context_reason.text(),
                "ring_stages": len(page.ring.diagram.stages) if page.ring.diagram else 0,
                "ring_summary": page.ring.diagram.summary() if page.ring.diagram else ""}
            result["explanation_2"] = page.explanation.text()
            shot(page, "console-placement-ring.png")

            page.include_tags.setText("floor-2, fl@or-3")
            page.place_button.click()
            result["bad_tag"] = page.explanation.text()
            result["busy_after_bad_tag"] = page.busy
        finally:
            if page is not None:
                page.close()
            bridge.close()
    result["names"] = list(TAGS)
    return result


def main() -> int:
    from PySide6.QtWidgets import QApplication

    from tests.support.xvfb import qt_wait

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the PNGs and result.json go")
    parser.add_argument("--work", type=Path, required=True, help="a scratch directory")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the tiny model's HF checkpoint")
    parser.add_argument("--cache", type=Path, default=None, help="a state dir with its calibration exports")
    args = parser.parse_args()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    result = drive_placement_page(args.work, args.checkpoint, lambda c, t, w: qt_wait(app, c, t, w), args.out,
                                  args.cache)
    result["platform"] = app.platformName()
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
