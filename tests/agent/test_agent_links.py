"""Link probes and calibration through the agents' control API: console -> agent and
agent -> agent round trips and bandwidth, and decode-step timing of calibration stages on the
agent's device, fitted into placement's per-layer time and overhead."""

from __future__ import annotations

import pytest

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from engine.control.client import ControlClient, ControlError
from engine.control.links import async_measure_link
from engine.control.messages import Assignment
from engine.shards.calibration import StageTiming, fit_layer_time
from engine.trust.fleet_ca import Role
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import run

pytestmark = pytest.mark.usefixtures("private_keyring")


@pytest.fixture(scope="module")
def calibration_export(tmp_path_factory, tiny_checkpoint):
    from export.exporter import ExportOptions, export_model

    root = tmp_path_factory.mktemp("calib")
    made = {}
    for name, split in (("one", [1, 2]), ("two", [1, 3])):  # stage 1 holds 1 or 2 middle layers
        export_model(tiny_checkpoint("llama"), root / name, split=split, options=ExportOptions(weights="fp32"))
        made[name] = root / name
    return made


def _agent(tmp_path, name: str) -> AgentService:
    settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0)
    return AgentService(tmp_path / name, settings, idle_source=FakeIdle(1e6), power=lambda: None)


@pytest.mark.slow
def test_links_measured_console_to_agent_and_agent_to_agent(tmp_path):
    async def main():
        async with console(tmp_path) as con:
            a, b = _agent(tmp_path, "a"), _agent(tmp_path, "b")
            await a.async_start()
            await b.async_start()
            try:
                for agent in (a, b):
                    await agent.async_join(con.enrollment, con.token())
                direct = await async_measure_link(f"https://127.0.0.1:{a.control_port}",
                                                  con.credentials.client_context(), samples=3, nbytes=4 << 20)
                client_a = ControlClient(con.credentials, "127.0.0.1", a.control_port)
                client_b = ControlClient(con.credentials, "127.0.0.1", b.control_port)
                with pytest.raises(ControlError) as not_expected:  # b's echo is not open to a yet
                    await client_a.async_measure_link(f"127.0.0.1:{b.control_port}", samples=3)
                await client_b.async_expect_link(a.status().node_id)
                a_to_b = await client_a.async_measure_link(f"127.0.0.1:{b.control_port}", samples=3,
                                                           target_node_id=b.status().node_id)
                peer = ControlClient(con.authority.issue_credentials("c", role=Role.AGENT), "127.0.0.1", a.control_port)
                with pytest.raises(ControlError) as forbidden:
                    await peer.async_measure_link(f"127.0.0.1:{b.control_port}")
                with pytest.raises(ControlError) as bad:
                    await client_a._call("GET", "/v1/link/echo?bytes=-5")
                with pytest.raises(ControlError) as unreachable:
                    await client_a.async_measure_link("127.0.0.1:9")
                assert "403" in str(not_expected.value)
                return direct, a_to_b, forbidden.value.status, bad.value.status, unreachable.value.status
            finally:
                await a.async_close()
                await b.async_close()

    direct, a_to_b, forbidden, bad, unreachable = run(main())
    assert 0 < direct.rtt_ms < 1000 and direct.mbit_s > 1
    assert 0 < a_to_b["rtt_ms"] < 1000 and a_to_b["mbit_s"] > 1
    assert (forbidden, bad) == (403, 400)
    assert unreachable >= 400


@pytest.mark.slow
def test_calibration_times_stages_of_two_sizes_on_the_agent(tmp_path, calibration_export):
    async def main():
        async with console(tmp_path, calibration_export) as con:
            agent = _agent(tmp_path, "a")
            await agent.async_start()
            try:
                await agent.async_join(con.enrollment, con.token())
                client = ControlClient(con.credentials, "127.0.0.1", agent.control_port)
                timings = []
                for export_id, export in calibration_export.items():
                    base = Assignment.create((export / "manifest.json").read_text(), export_id=export_id,
                                             stage=1, source=con.hub.shard_url(export_id), listen_port=0,
                                             next_hop="127.0.0.1:1").to_dict()
                    body = {k: base[k] for k in ("export_id", "manifest_json", "manifest_sha256", "source")}
                    con.hub.grant(agent.status().node_id, export_id, [0, 1])  # the stages calibrated below
                    timings += await client.async_calibrate({**body, "stages": [1], "device": "CPU", "steps": 8})
                one = await client.async_calibrate({**body, "stages": [1], "device": "CPU", "steps": 2,
                                                    "threads": 1})  # the workers' setting
                for threads in (0, True, "2"):
                    with pytest.raises(ControlError) as refused:
                        await client.async_calibrate({**body, "stages": [1], "threads": threads})
                    assert refused.value.status == 400 and "threads" in str(refused.value)
                with pytest.raises(ControlError) as bad:
                    await client.async_calibrate({**body, "stages": [0], "device": "CPU"})  # has the embedding
                with pytest.raises(ControlError) as bad_stage:
                    await client.async_calibrate({**body, "stages": "1,2"})
                return timings, one, bad.value.status, bad_stage.value.status
            finally:
                await agent.async_close()

    timings, one, bad, bad_stage = run(main())
    assert [t["threads"] for t in one] == [1]
    assert all(t["threads"] >= 1 for t in timings)
    assert [t["layers"] for t in timings] == [1, 2]
    assert all(t["step_ms"] > 0 for t in timings)
    layer_ms, overhead_ms = fit_layer_time([StageTiming(**t) for t in timings])
    assert layer_ms > 0 and overhead_ms >= 0
    assert bad == 500 and bad_stage == 400


def test_layer_time_fit():
    t = [StageTiming(1, 1, 3.0, 0), StageTiming(2, 2, 5.0, 0), StageTiming(3, 4, 9.0, 0)]
    assert fit_layer_time(t) == pytest.approx((2.0, 1.0))
    with pytest.raises(ValueError):
        fit_layer_time(t[:1])
    noisy = [StageTiming(1, 1, 5.0, 0), StageTiming(2, 2, 4.0, 0)]
    assert fit_layer_time(noisy)[0] > 0
