"""The Distribution page's controller over the fleet service, fed the event feed's items as the
service sends them (docs/ADMIN_API.md): only its own ring's news reaches the page, turned into the
objects the page draws; a failed ring can be re-run. Real Qt (offscreen), no network."""

from __future__ import annotations

from console.fleet_api.exports import ExportFailed, ExportFinished, ExportProgress
from console.fleet_api.feed import Event
from console.fleet_api.fleet_settings import FleetSettings
from console.fleet_api.ring_status import AgentProgress, RingHealth
from console.qt.service_bridge import ServiceBridge
from console.qt.service_serving import ServiceServing

PLAN = {"stages": [{"device_id": "a/CPU", "pc_id": "a" * 64, "first_layer": 0, "last_layer": 1},
                   {"device_id": "b/CPU", "pc_id": "b" * 64, "first_layer": 2, "last_layer": 3}]}


def _ring(phase: str, **extra) -> dict:
    return {"ring": "r1", "model": "llama", "phase": phase, "plan": PLAN, "export_id": "tiny-2",
            "agents": [{"agent": "desk-a", "stage": 0, "phase": "running", "done_bytes": 5, "total_bytes": 5}],
            "health": {"test_token": 42, "test_ms": 12.5, "error": None}, **extra}


def test_the_rings_news_becomes_what_the_distribution_page_draws(tmp_path, qtbot):
    bridge = ServiceBridge(FleetSettings(state_dir=tmp_path))
    bridge.service = {"api_url": "http://127.0.0.1:8000/v1"}
    serving = ServiceServing(bridge)
    seen: dict[str, list] = {k: [] for k in ("export", "progress", "health", "failed", "phase", "api", "metrics")}
    serving.export_event.connect(seen["export"].append)
    serving.progress.connect(seen["progress"].append)
    serving.health.connect(seen["health"].append)
    serving.failed.connect(seen["failed"].append)
    serving.phase_changed.connect(seen["phase"].append)
    serving.api_ready.connect(seen["api"].append)
    serving.metrics.connect(seen["metrics"].append)
    serving.ring = "r1"

    def feed(kind: str, **data) -> None:
        bridge.service_event.emit(Event(1, 0.0, kind, data))

    feed("export", ring="r2", state="progress", stage=0, step="convert", fraction=0.1)  # another ring's
    feed("export", ring="r1", state="progress", stage=1, step="compile", fraction=0.6)
    feed("export", ring="r1", state="finished", export_id="tiny-2", reused=True)
    feed("progress", ring="r1", agent="desk-b", stage=1, phase="fetching", done_bytes=1, total_bytes=4)
    feed("metrics", rings={"r1": {"tokens_generated_total": 3.0}})  # not serving yet: not shown
    feed("ring", ring=_ring("serving"))
    feed("metrics", rings={"r1": {"tokens_generated_total": 7.0}, "r2": {"tokens_generated_total": 1.0}})

    assert seen["export"][0] == ExportProgress(1, "compile", 0.6)
    assert isinstance(seen["export"][1], ExportFinished) and seen["export"][1].export.export_id == "tiny-2"
    assert seen["export"][1].reused and len(seen["export"]) == 2
    assert seen["progress"][0] == AgentProgress("desk-b", 1, "fetching", 1, 4)
    assert seen["health"] == [RingHealth((AgentProgress("desk-a", 0, "running", 5, 5),), False, 42, 12.5, None)]
    assert seen["phase"] == ["serving"] and seen["api"] == ["http://127.0.0.1:8000/v1"]
    assert seen["metrics"] == [{"tokens_generated_total": 7.0}]
    assert bridge.session.serving.export_id == "tiny-2" and bridge.session.serving.plan.stages[1].first_layer == 2

    feed("export", ring="r1", state="failed", message="the checkpoint vanished")
    assert seen["export"][-1] == ExportFailed("failed", "the checkpoint vanished")
    feed("ring", ring=_ring("failed", error="desk-b (stage 1): cannot reach the agent"))
    assert seen["failed"] == ["desk-b (stage 1): cannot reach the agent"] and serving.can_rerun
    feed("ring", ring=_ring("failed", error="desk-b (stage 1): cannot reach the agent"))  # the same news again
    assert len(seen["failed"]) == 1
    feed("ring_removed", ring="r2")
    assert serving.ring == "r1"
    feed("ring_removed", ring="r1")
    assert serving.ring is None and serving.phase == "idle" and bridge.session.serving is None
    bridge.close()
