"""The Placement page over a real fleet service and two real tagged agents
(tests/console/placement_screenshot.py drives it): the context left to the service is the model's
maximum with the reason beside the field, an excluded tag keeps its agent out and says so, the
plan is drawn as a ring (two stages when the context forces a split), a bad tag is refused in
the page before anything is sent. Under Xvfb in a subprocess when it works here (with a
screenshot of each plan), else offscreen in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from console.fleet_api.agent_record import AgentRecord, Membership
from console.qt.placement_page import fleet_tags_text

pytestmark = pytest.mark.usefixtures("private_dirs")


def _record(name: str, tags: tuple[str, ...], approved: bool = True) -> AgentRecord:
    return AgentRecord(name, name, "127.0.0.1", 1, "idle", (), 0, "f", Membership.MEMBER, None, frozenset(),
                       approved, tags=tags)


def test_the_fleet_tags_line_counts_the_approved_agents_tags():
    records = (_record("a", ("finance", "floor-2")), _record("b", ("floor-2",)), _record("c", ("lab",), False))
    assert fleet_tags_text(records) == "Tags in the fleet: finance (1), floor-2 (2)"
    assert fleet_tags_text(()).startswith("No approved agent has tags yet")


def test_a_moe_model_is_placed_with_its_experts_said_on_the_page(qtbot, tmp_path, tiny_checkpoint):
    """The tiny qwen3_moe's calibration exports give a profile with its experts (memory: all of
    them; a token's layer step reads 2 of 8), which reaches the console through the admin API's
    JSON and is said under the plan, offscreen; a dense model's plan says nothing of experts."""
    import dataclasses

    from console.fleet.calibration_export import build_calibration_set, layer_weight_bytes
    from console.fleet.placement_inputs import layer_read_bytes, placement_model, solve_inputs
    from console.fleet_api.admin_decode import inputs_from_json
    from console.fleet_api.admin_shapes import inputs_json
    from console.fleet_api.fleet_settings import FleetSettings
    from console.fleet_api.link_report import LinkReport
    from console.fleet_api.placement import PlacementInputs
    from console.qt.placement_page import QtPlacementPage
    from console.qt.service_bridge import ServiceBridge
    from engine.placement.types import DeviceProfile, Links, PcInfo, PlacementRequest
    from export.exporter import ExportOptions

    calibration = build_calibration_set(tiny_checkpoint("qwen3_moe"), tmp_path / "state", ExportOptions(weights="fp32"))
    model = placement_model(calibration, context=64)
    moe = model.moe
    assert moe is not None and (moe.routing.experts, moe.routing.per_token) == (8, 2)
    assert moe.expert_bytes == 3 * 8 * 3 * 32 * 64 * 4  # layers 0, 1 and 3: E x (gate, up, down) x I x H x f32
    assert model.total_bytes >= moe.expert_bytes + moe.dense_bytes  # memory holds every expert (and KV)
    # a middle stage of layer 1 (MoE) and one of layers 1-2: a token reads 2 of the 8 experts' bytes
    read = layer_weight_bytes(calibration) - 2 * (8 * 3 * 32 * 64 * 4) * (1 - 2 / 8) / 3
    assert layer_read_bytes(calibration) == pytest.approx(read)
    inputs = PlacementInputs(model, (PcInfo("pc-a", 8 * 2**30, True),),
                             (DeviceProfile("pc-a/CPU", "pc-a", "CPU", 1.0, 0.5, 8 * 2**30),),
                             LinkReport(Links(default_ms=0.5), {}, {}), (), {"pc-a": "desk-a"}, {})
    received = inputs_from_json(inputs_json(inputs))  # as the console reads the service's placement
    assert received.model.moe == moe
    plan = solve_inputs(received, PlacementRequest())
    bridge = ServiceBridge(FleetSettings(state_dir=tmp_path / "console"))
    try:
        page = QtPlacementPage(bridge)
        qtbot.addWidget(page)
        assert page.moe.isHidden()
        bridge.session.set_plan(plan, received)
        text = page.moe.text()
        assert not page.moe.isHidden() and text.startswith("MoE: 8 experts, 2 active per token")
        assert "memory counts all experts" in text and "each step reads the active ones" in text
        assert "tok/s" in page.summary.text()
        dense = dataclasses.replace(received, model=dataclasses.replace(received.model, moe=None))
        bridge.session.set_plan(plan, dense)
        assert page.moe.isHidden() and page.moe.text() == ""
    finally:
        bridge.close()


@pytest.mark.slow
def test_the_placement_page_places_by_tags_with_the_context_default_and_draws_the_ring(tmp_path, tiny_checkpoint,
                                                                                        tiny_calibration, qapp):
    from tests.support.xvfb import XVFB, qt_wait, xvfb_works

    checkpoint = tiny_checkpoint("llama")
    out = Path(os.environ["DESKFLEET_SCREENSHOTS"]) if os.environ.get("DESKFLEET_SCREENSHOTS") else \
        tmp_path / "screenshots"
    env = {**os.environ, "QT_QPA_PLATFORM": "xcb"}
    if xvfb_works(env):
        run = subprocess.run([*XVFB, sys.executable, "-m", "tests.console.placement_screenshot", "--out", str(out),
                              "--work", str(tmp_path / "work"), "--checkpoint", str(checkpoint),
                              "--cache", str(tiny_calibration)],
                             env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        result = json.loads((out / "result.json").read_text())
        assert result["platform"] == "xcb"
        _check_screenshots(out)
    else:
        from tests.console.placement_screenshot import drive_placement_page

        result = drive_placement_page(tmp_path / "work", checkpoint, lambda c, t, w: qt_wait(qapp, c, t, w),
                                      cache=tiny_calibration)
    desk_a, desk_b = result["names"]
    assert result["fleet_tags"] == "Tags in the fleet: finance (1), floor-2 (2)"
    assert result["context_field"] == "auto"
    first = result["first"]
    assert first is not None, result["explanation"]
    assert first["names"] == [desk_b]  # finance excluded: desk-a takes no stage
    assert f"{desk_a} (tagged finance (excluded))" in first["summary"]
    assert first["context_reason"].startswith("512 tokens: model maximum (512 tokens)")  # the tiny model's
    assert first["ring_stages"] >= 1
    assert any(t.startswith(desk_a) and "[finance, floor-2]" in t for t in first["agents_list"])
    second = result["second"]
    assert second is not None, result["explanation_2"]
    assert second["names"] == sorted([desk_a, desk_b]) and second["stages"] == second["ring_stages"] == 2
    assert ": as given; auto would be 512 tokens (model maximum" in second["context_reason"]
    assert "bottleneck" in second["ring_summary"]
    assert "only agents tagged: 'fl@or-3' is not a tag" in result["bad_tag"] and not result["busy_after_bad_tag"]


def _check_screenshots(out: Path) -> None:
    from PySide6.QtGui import QImage

    for name in ("console-placement-tags.png", "console-placement-ring.png"):
        image = QImage(str(out / name))
        assert not image.isNull() and image.width() >= 1000 and image.height() >= 600, name
        colours = {image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)}
        assert len(colours) > 8, f"{name} is blank"
