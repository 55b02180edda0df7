"""Placement inputs measured over real agents on loopback, and placement itself: links into
`engine.placement.planner.Links`, calibration of the real CPU (OpenVINO, in the agents' subprocesses)
cached per (model, node, device), the model's memory profile read from its calibration export,
and `async_place` over two agents: a valid plan, an infeasible request explained, a paused agent
left out with the reason, an unreachable one too.

(ILP against brute force on small fleets is tests/placement/test_placement.py's job.)"""

from __future__ import annotations

import json
import shutil

import pytest

from console.fleet.calibration_export import (
    build_calibration_set,
    layer_weight_bytes,
    model_profile,
)
from console.fleet.errors import CalibrationError
from console.fleet.links import async_measure_links
from console.fleet.placement_inputs import async_place
from console.fleet.profiling import (
    PROFILES_SETTING,
    ProfileCache,
    async_calibrate_devices,
)
from console.fleet_api.link_report import SERVICE
from engine.control.client import ControlClient
from engine.errors import Exclusion, PlacementInfeasible
from engine.placement.types import Plan
from engine.shards.kv_precision import KV_BYTES_PER_VALUE
from engine.state.db import StateDB
from tests.support.asyncutil import run
from tests.support.console_fleet_helpers import joined_fleet

pytestmark = pytest.mark.usefixtures("private_keyring")


@pytest.fixture(scope="module")
def fp32():
    from export.exporter import ExportOptions

    return ExportOptions(weights="fp32")


@pytest.fixture(scope="module")
def template(tiny_calibration):
    """A console state dir holding the tiny model's calibration exports (built once a session)."""
    return tiny_calibration


def _seeded(tmp_path, template):
    """``tmp_path``, whose console state dir already holds the calibration exports."""
    shutil.copytree(template / "calibration", tmp_path / "console" / "calibration")
    return tmp_path


@pytest.fixture
def calibrate_calls(monkeypatch):
    """Every calibration request sent to an agent, as (node port, export id)."""
    calls: list[tuple[str, str]] = []
    original = ControlClient.async_calibrate

    async def counting(self, body):
        calls.append((self.base, body["export_id"]))
        return await original(self, body)

    monkeypatch.setattr(ControlClient, "async_calibrate", counting)
    return calls


async def _approve_all(f) -> list[str]:
    for name, a in f.agents.items():
        await f.fleet.async_add_address("127.0.0.1", a.control_port)
        f.fleet.approve(f.node(name))
    await f.fleet.async_refresh()
    return [f.node(n) for n in f.agents]


# -- pure: the model's memory profile from its calibration exports ---------------------------------

@pytest.mark.slow
def test_model_profile_reads_layer_embedding_and_head_bytes_from_the_exports(template, tiny_checkpoint, fp32):
    calibration = build_calibration_set(tiny_checkpoint("llama"), template, fp32)  # reused, not rebuilt
    assert [p.stages for p in calibration.parts] == [(1,), (1,)]
    assert [p.manifest.splits for p in calibration.parts] == [(1, 2), (1, 3)]
    info = calibration.parts[0].manifest.model
    hidden, kv_heads, head_dim, vocab = info.hidden_size, info.num_kv_heads, info.head_dim, info.vocab_size
    params = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * 128 + 2 * hidden
    weights = layer_weight_bytes(calibration)
    assert params * 4 <= weights <= params * 4 * 2  # fp32 weights plus the graph's XML
    one = model_profile(calibration, context=100, streams=1, kv_precision="f16")
    three = model_profile(calibration, context=100, streams=3, kv_precision="f32")
    kv_one = 2 * kv_heads * head_dim * KV_BYTES_PER_VALUE["f16"] * 100
    assert one.layer_bytes == (int(weights) + kv_one,) * info.num_layers
    assert three.layer_bytes[0] - int(weights) == 2 * kv_heads * head_dim * 4 * 100 * 3
    assert vocab * hidden * 4 <= one.embed_bytes < vocab * hidden * 4 * 1.2  # the fp32 embedding table
    assert vocab * hidden * 4 <= one.head_bytes < vocab * hidden * 4 * 1.3  # the (tied) head + final norm


def test_a_model_too_small_to_calibrate_is_refused(tmp_path, tiny_checkpoint, fp32):
    tiny3 = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "ckpt")
    config = json.loads((tiny3 / "config.json").read_text())
    (tiny3 / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CalibrationError, match="at least 4"):
        build_calibration_set(tiny3, tmp_path / "state", fp32)


# -- live: agents on loopback ----------------------------------------------------------------------

@pytest.mark.slow
def test_links_are_measured_into_placement_links(tmp_path):
    async def main():
        async with joined_fleet(tmp_path) as f:
            a, b = await _approve_all(f)
            report = await async_measure_links(f.fleet, [a, b], samples=3)
            await f.agents["beta"].async_close()
            gone = await async_measure_links(f.fleet, [a, b], samples=2, timeout=5)
            return a, b, report, gone

    a, b, report, gone = run(main())
    links = report.links
    assert set(report.measured) == {(SERVICE, a), (SERVICE, b), (a, b)} and not report.failures
    for n in (a, b):
        assert links.coordinator(n) == pytest.approx(report.measured[(SERVICE, n)].rtt_ms / 2)
        assert 0 < links.coordinator(n) < 500 and report.mbit_s(SERVICE, n) > 1
    assert links.between(a, b) == links.between(b, a) == pytest.approx(report.measured[(a, b)].rtt_ms / 2)
    assert report.mbit_s(b, a) > 1 and links.between(a, a) == 0
    assert gone.unreachable == {b} and b not in gone.links.coordinator_ms and a in gone.links.coordinator_ms


@pytest.mark.slow
def test_calibration_on_the_cpu_is_cached_per_model_node_and_device(tmp_path, template, tiny_checkpoint,
                                                                    fp32, calibrate_calls):
    root = _seeded(tmp_path, template)

    async def main():
        async with joined_fleet(root) as f:
            a, b = await _approve_all(f)
            calibration = build_calibration_set(tiny_checkpoint("llama"), f.fleet.state_dir, fp32)
            first = await async_calibrate_devices(f.fleet, f.host.hub, calibration, [a, b],
                                                  ProfileCache(f.fleet.state_dir), steps=4)
            after_first = len(calibrate_calls)
            # a fresh cache object: the numbers come from the file, not from memory
            second = await async_calibrate_devices(f.fleet, f.host.hub, calibration, [a, b],
                                                   ProfileCache(f.fleet.state_dir), steps=4)
            # workers set to one thread: timed again (as they will run), then cached on their own
            one = [await async_calibrate_devices(f.fleet, f.host.hub, calibration, [a],
                                                 ProfileCache(f.fleet.state_dir), steps=4, threads=1)
                   for _ in range(2)]
            return a, b, calibration, first, second, after_first, f.fleet.state_dir, one

    a, b, calibration, first, second, after_first, state_dir, one = run(main())
    assert [c.cached for c in one[0].done] == [False] and [c.cached for c in one[1].done] == [True]
    assert not first.failures and {(c.node_id, c.device) for c in first.done} >= {(a, "CPU"), (b, "CPU")}
    assert after_first == len(first.done) * len(calibration.parts) and after_first >= 4
    assert len(calibrate_calls) == after_first + len(calibration.parts)  # the second round asked no agent
    assert not any(c.cached for c in first.done) and all(c.cached for c in second.done)
    for c in first.done:
        assert 0 < c.layer_ms < 1000 and c.overhead_ms >= 0
    assert [(c.layer_ms, c.overhead_ms) for c in second.done] == [(c.layer_ms, c.overhead_ms) for c in first.done]
    stored = StateDB.for_dir(state_dir).setting(PROFILES_SETTING)
    assert f"{calibration.key}|{a}|CPU" in stored and len(stored[f"{calibration.key}|{a}|CPU"]["timings"]) == 2
    one_thread = stored[f"{calibration.key}|{a}|CPU@1t"]["timings"]
    assert [t["threads"] for t in one_thread] == [1] * len(calibration.parts)


@pytest.mark.slow
def test_placement_over_two_agents(tmp_path, template, tiny_checkpoint, fp32, calibrate_calls):
    root = _seeded(tmp_path, template)
    checkpoint = tiny_checkpoint("llama")

    async def main():
        async with joined_fleet(root) as f:
            a, b = await _approve_all(f)
            # a context whose KV cache makes a layer ~1/3 of one agent's usable memory: the four
            # layers fit on two agents, not on one
            free = min(r.status.inventory["ram_available"] for r in f.fleet.approved())
            per_token = 2 * 2 * 16 * KV_BYTES_PER_VALUE[fp32.kv_cache_precision]  # tiny: 2 KV heads of 16
            context = int(0.34 * 0.8 * free / per_token)
            place = dict(options=fp32, steps=4)
            split = await async_place(f.fleet, f.host.hub, checkpoint, context=context, **place)
            with pytest.raises(PlacementInfeasible) as infeasible:
                await async_place(f.fleet, f.host.hub, checkpoint, context=context * 4, **place)
            await f.fleet.async_pause(b)
            without_paused = await async_place(f.fleet, f.host.hub, checkpoint, context=1024, **place)
            await f.fleet.async_resume(b)
            await f.agents["alpha"].async_close()
            without_dead = await async_place(f.fleet, f.host.hub, checkpoint, context=1024, **place)
            return a, b, split, infeasible.value, without_paused, without_dead

    a, b, split, infeasible, without_paused, without_dead = run(main())
    _check_plan(split, {a, b})
    assert {s.pc_id for s in split.stages} == {a, b} and split.per_token_ms > 0
    assert "GB more memory than the approved agents offer" in str(infeasible) and infeasible.shortfall_bytes > 0
    _check_plan(without_paused, {a})
    assert Exclusion(b, "paused") in without_paused.excluded
    _check_plan(without_dead, {b})
    assert Exclusion(a, "unreachable") in without_dead.excluded
    assert len(calibrate_calls) == 4  # two agents, two calibration exports, once: then the cache


def _check_plan(plan: Plan, allowed: set[str]) -> None:
    """Stages cover every layer once, in order, each on one of ``allowed``."""
    assert isinstance(plan, Plan) and plan.stages
    assert plan.stages[0].first_layer == 0 and plan.stages[-1].last_layer == 3
    for prev, nxt in zip(plan.stages, plan.stages[1:], strict=False):
        assert nxt.first_layer == prev.last_layer + 1
    assert {s.pc_id for s in plan.stages} <= allowed
    assert all(s.device_id == f"{s.pc_id}/CPU" for s in plan.stages)
