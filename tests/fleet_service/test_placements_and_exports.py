"""Placements persisted (the state database) and the export route, on a real fleet service on loopback.

A placement made in one run of the service answers by its id after a real restart (the service
object closed and a new one started on the same state dir), a re-solve is kept too, and new ids go
on after the kept ones; a damaged file stops the start with an error naming it and is left in
place. ``POST /admin/v1/exports`` exports the tiny random model with a plan's split as a job over
the real admin socket: progress on the feed under the job's id, the export in the library, an
identical request reused; bad requests are named."""

from __future__ import annotations

import pytest

from console.fleet.errors import FleetStateError
from console.fleet.placement_store import Placement, PlacementStore
from console.fleet_api.admin_client import AdminClient
from console.fleet_api.exports import ExportSpec
from engine.placement.types import Plan, PlannedStage
from engine.state.db import StateDB
from engine.state.legacy import PLACEMENTS_FILE
from tests.fleet_service.admin import Admin
from tests.fleet_service.conftest import service_in_process
from tests.support.asyncutil import run

pytestmark = pytest.mark.usefixtures("private_keyring")

SPEC = ExportSpec(weights="fp32", kv_cache_precision="f32")


def _inputs():
    """Measured inputs as a finished placement job leaves them: three PCs, one CPU each."""
    from console.fleet_api.link_report import LinkReport
    from console.fleet_api.placement import PlacementInputs
    from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo

    pcs = tuple(PcInfo(f"pc-{c}", (4 + i) << 30, True) for i, c in enumerate("abc"))
    devices = tuple(DeviceProfile(f"{pc.pc_id}/CPU", pc.pc_id, "CPU", 2.0, 1.0, pc.memory_bytes) for pc in pcs)
    return PlacementInputs(ModelProfile((256 << 20,) * 8), pcs, devices, LinkReport(Links(default_ms=0.3), {}, {}),
                           (), {pc.pc_id: pc.pc_id.upper() for pc in pcs}, {})


def _store_placement(service) -> Placement:
    from console.fleet.placement_inputs import solve_inputs
    from engine.placement.types import PlacementRequest

    inputs = _inputs()
    placement = Placement(service.placements.new_id(), "tiny", 2048, SPEC, inputs,
                          solve_inputs(inputs, PlacementRequest()))
    return service.placements.put(placement)


def test_a_placement_id_survives_a_restart_of_the_service(tmp_path):
    state = tmp_path / "fleet"

    async def main():
        async with service_in_process(state) as service:
            made = _store_placement(service)
            assert made.id == "p1"
            before = made.to_json()
        assert [p["id"] for p in StateDB.for_dir(state).placements()] == ["p1"]  # kept in the state database

        async with service_in_process(state) as service, Admin.unix(state / "admin.sock") as a:
            got = (await a.ok("GET", "/placements/p1"))["placement"]
            assert got == before  # model, context, spec, inputs and plan, as they were
            plan = (await a.ok("POST", "/placements/p1/solve", {"leave_out": ["pc-c"]}))["plan"]
            assert all(st["pc_id"] != "pc-c" for st in plan["stages"])
            assert _store_placement(service).id == "p2"  # ids go on after the kept ones
            status, body = await a.call("GET", "/placements/p9")
            assert status == 404 and "p9" in body["error"]["message"]

        async with service_in_process(state) as service, Admin.unix(state / "admin.sock") as a:
            kept = (await a.ok("GET", "/placements/p1"))["placement"]
            assert kept["plan"]["stages"] == plan["stages"]  # the re-solve was kept, not the first plan
            assert "p2" in service.placements

    run(main(), 120)


@pytest.mark.parametrize("text", ["{not json", '{"format": 1, "placements": [{"id": "p1"}]}', '{"format": 7}'])
def test_a_damaged_placements_file_from_before_the_database_stops_the_start_and_is_left_in_place(tmp_path, text):
    state = tmp_path / "fleet"
    state.mkdir()
    (state / PLACEMENTS_FILE).write_text(text)
    with pytest.raises(FleetStateError, match=PLACEMENTS_FILE):
        PlacementStore(state)

    async def main():
        with pytest.raises(FleetStateError, match="placements"):
            async with service_in_process(state):
                raise AssertionError("the service started over a damaged placements file")

    run(main(), 60)
    assert (state / PLACEMENTS_FILE).read_text() == text


def _plan(*ranges: tuple[int, int]) -> Plan:
    stages = tuple(PlannedStage(f"pc-{i}/CPU", f"pc-{i}", a, b, 1.0, 1 << 20) for i, (a, b) in enumerate(ranges))
    return Plan(stages=stages, hop_ms=(0.0,) * (len(stages) + 1), per_token_ms=1.0, tok_s=1000.0, bottleneck_ms=1.0,
                n_streams=1, cycle_ms=1.0, aggregate_tok_s=1000.0, objective="latency", optimal=True)


def test_an_export_with_a_plans_split_runs_as_a_job_over_the_admin_socket(tmp_path, tiny_checkpoint):
    state = tmp_path / "fleet"
    checkpoint = tiny_checkpoint("llama")  # 4 layers

    async def main():
        async with service_in_process(state) as service, Admin.unix(state / "admin.sock") as a:
            model = (await a.ok("POST", "/models", {"path": str(checkpoint)}))["model"]["name"]
            after = (await a.ok("GET", "/events?after=0&timeout=0"))["next"]
            async with AdminClient.over_socket(state / "admin.sock") as client:
                job = await client.async_start_export(model, _plan((0, 0), (1, 3)), spec=SPEC)
                assert job["kind"] == "export"
                result = await client.async_wait_job(job["id"], timeout=300)
            export = result["export"]
            assert result["reused"] is False and export["stages"] == 2 and export["layers"] == [[0, 0], [1, 3]]
            assert export["export_id"] in {e["export_id"] for e in (await a.ok("GET", "/exports"))["exports"]}

            mine = []
            while not any(e["data"].get("state") == "finished" for e in mine):
                poll = await a.ok("GET", f"/events?after={after}&timeout=2")
                assert poll["events"], "the export's events did not reach the feed"
                after = poll["next"]
                mine += [e for e in poll["events"] if e["kind"] == "export" and e["data"].get("job") == job["id"]]
            steps = [e["data"]["step"] for e in mine if e["data"]["state"] == "progress"]
            assert steps[:2] == ["resolve", "fingerprint"] and "save" in steps
            assert mine[-1]["data"]["export_id"] == export["export_id"]

            # the same split, given as the plan's stages only: the export is reused
            stages = [{"device_id": "x/CPU", "pc_id": "x", "first_layer": 0, "last_layer": 0},
                      {"device_id": "y/CPU", "pc_id": "y", "first_layer": 1, "last_layer": 3}]
            again = (await a.ok("POST", "/exports", {"model": model, "stages": stages,
                                                     "spec": {"weights": "fp32", "kv_cache_precision": "f32"}}))
            done = await a.job(again["job"]["id"], 300)
            assert done["state"] == "done" and done["result"]["reused"] is True
            assert done["result"]["export"]["export_id"] == export["export_id"]

            status, body = await a.call("POST", "/exports", {"model": "no-such-model", "stages": stages})
            assert status == 404 and "no-such-model" in body["error"]["message"]
            status, body = await a.call("POST", "/exports", {"model": model})
            assert status == 400 and "'plan'" in body["error"]["message"]
            status, body = await a.call("POST", "/exports", {"model": model, "stages": stages[1:] + stages[:1]})
            assert status == 400 and "follow each other" in body["error"]["message"]
            assert len(service.library.exports()) == 1

    run(main(), 400)


def test_cancelling_an_export_job_stops_it_and_leaves_nothing(tmp_path, tiny_checkpoint):
    state = tmp_path / "fleet"
    checkpoint = tiny_checkpoint("llama")

    async def main():
        async with service_in_process(state) as service, Admin.unix(state / "admin.sock") as a:
            model = (await a.ok("POST", "/models", {"path": str(checkpoint)}))["model"]["name"]
            after = (await a.ok("GET", "/events?after=0&timeout=0"))["next"]
            plan = {"stages": [{"device_id": f"pc-{i}/CPU", "pc_id": f"pc-{i}", "first_layer": i, "last_layer": i}
                               for i in range(4)]}
            job = (await a.ok("POST", "/exports", {"model": model, "plan": plan,
                                                   "spec": {"weights": "fp32", "kv_cache_precision": "f32"}}))["job"]
            started = False
            while not started:  # the process is exporting a stage: a partial directory exists
                poll = await a.ok("GET", f"/events?after={after}&timeout=5")
                assert poll["events"], "no export progress reached the feed"
                after = poll["next"]
                started = any(e["kind"] == "export" and e["data"].get("job") == job["id"]
                              and e["data"].get("stage") is not None for e in poll["events"])
            cancelled = (await a.ok("DELETE", f"/jobs/{job['id']}"))["job"]
            assert cancelled["state"] in ("running", "cancelled")
            done = await a.job(job["id"], 60)
            assert done["state"] == "cancelled"
            assert service.library.exports() == []
            left = list(service.library.exports_dir.iterdir()) if service.library.exports_dir.exists() else []
            assert left == [], f"the cancelled export left {left}"

    run(main(), 300)


def test_placement_inputs_round_trip_through_json_unchanged():
    """What placements.json keeps is what was measured: layer sizes, embedding and head, links'
    default (an older service's JSON without them still reads, spread evenly)."""
    import dataclasses

    from console.fleet_api.admin_decode import inputs_from_json
    from console.fleet_api.admin_shapes import inputs_json

    inputs = _inputs()
    model = dataclasses.replace(inputs.model, layer_bytes=(1 << 20, 3 << 20, 2 << 20), embed_bytes=7, embed_ms=0.5,
                                head_bytes=9, head_ms=1.5)
    inputs = dataclasses.replace(inputs, model=model)
    back = inputs_from_json(inputs_json(inputs))
    assert back.model == inputs.model and back.links.links.default_ms == 0.3
    assert back.pcs == inputs.pcs and back.devices == inputs.devices
    old = inputs_json(inputs)
    old["model"] = {"n_layers": 3, "total_bytes": 6 << 20}
    assert inputs_from_json(old).model.layer_bytes == (2 << 20,) * 3
