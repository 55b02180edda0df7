"""Agent tags end to end on loopback: real agents whose settings carry tags join a real fleet
service; the service shows them (status poll, admin API), the admin sets others over the admin
API and ``deskfleet fleet tag`` (which win, and survive a restart of the service), takes them
away again, and a placement keeps to or avoids agents by their tags, naming the reason."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from console.fleet.agent_tags import TagBook
from console.fleet.errors import FleetStateError
from console.fleet.fleet_state import fleet_db
from console.fleet.placement_store import Placement
from console.fleet_api.exports import ExportSpec
from engine.control.hub import AgentEvent
from engine.errors import DeskfleetError
from engine.state.legacy import BACKUP_DIR, TAGS_FILE
from tests.fleet_service.admin import Admin
from tests.fleet_service.conftest import service_in_process
from tests.support.asyncutil import run
from tests.support.console_fleet_helpers import agent

pytestmark = pytest.mark.usefixtures("private_keyring")

TAGS = {"desk-a": ("finance", "floor-2"), "desk-b": ("floor-2",), "desk-c": ("floor-3",)}


def _placement_over(service, nodes: dict[str, str]) -> Placement:
    """A placement whose measured inputs are the joined agents' (node ids), each able to hold the
    whole model; solving it needs no calibration."""
    from console.fleet.placement_inputs import solve_inputs
    from console.fleet_api.link_report import LinkReport
    from console.fleet_api.placement import PlacementInputs
    from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo, PlacementRequest

    pcs = tuple(PcInfo(node, 8 << 30, True) for node in nodes.values())
    devices = tuple(DeviceProfile(f"{pc.pc_id}/CPU", pc.pc_id, "CPU", 1.0 + k, 0.2, pc.memory_bytes)
                    for k, pc in enumerate(pcs))
    inputs = PlacementInputs(ModelProfile((64 << 20,) * 4), pcs, devices, LinkReport(Links(default_ms=0.3), {}, {}),
                             (), {node: name for name, node in nodes.items()}, {})
    return service.placements.put(Placement(service.placements.new_id(), "tiny", 2048, ExportSpec(), inputs,
                                            solve_inputs(inputs, PlacementRequest())))


async def _joined(service, root, a: Admin) -> tuple[list, dict[str, str]]:
    pcs = []
    for name, tags in TAGS.items():
        pc = agent(root, name, tags=tags)
        await pc.async_start()
        pcs.append(pc)
        token = (await a.ok("POST", "/tokens", {}))["token"]
        await pc.async_join(service.host.enrollment, token)
        added = (await a.ok("POST", "/agents", {"host": "127.0.0.1", "port": pc.control_port}))["agent"]
        await a.ok("POST", f"/agents/{added['key']}/approve")
    await a.ok("POST", "/agents/refresh")
    return pcs, {pc.settings.name: pc.status().node_id for pc in pcs}


def _cli(state_dir, name=None, tags=None, reset=False) -> int:
    """``deskfleet fleet tag [name] [--tags tags] [--reset]`` through the real parser."""
    from console.fleet import cli as fleet_cli

    parser = argparse.ArgumentParser()
    fleet_cli.configure(parser)
    argv = ["tag", *([name] if name else []), "--state-dir", str(state_dir)]
    argv += ["--tags", tags] if tags is not None else []
    argv += ["--reset"] if reset else []
    return fleet_cli.run(parser.parse_args(argv))


@pytest.mark.slow
def test_tags_from_the_agents_and_the_admin_and_placement_by_tags(tmp_path, capsys):
    state = tmp_path / "fleet"

    async def main():
        async with service_in_process(state) as service, Admin.unix(state / "admin.sock") as a:
            pcs, nodes = await _joined(service, tmp_path, a)
            try:
                agents = {x["name"]: x for x in (await a.ok("GET", "/agents"))["agents"]}
                assert {n: tuple(agents[n]["tags"]) for n in TAGS} == TAGS  # from each agent's status
                assert {agents[n]["tags_set_by"] for n in TAGS} == {"agent"}
                key_c = agents["desk-c"]["key"]

                # the admin's tags win over the agent's own; bad ones are refused, naming the tag
                changed = (await a.ok("PUT", f"/agents/{key_c}/tags", {"tags": ["Floor-2", "lab"]}))["agent"]
                assert changed["tags"] == ["floor-2", "lab"] and changed["tags_set_by"] == "admin"
                status, body = await a.call("PUT", f"/agents/{key_c}/tags", {"tags": ["two words"]})
                assert status == 400 and "'two words' is not a tag" in body["error"]["message"]
                status, body = await a.call("PUT", f"/agents/{key_c}/tags", {"labels": []})
                assert status == 400 and "'tags'" in body["error"]["message"]
                await a.ok("POST", "/agents/refresh")  # a poll (the agent still says floor-3) changes nothing
                again = {x["name"]: x for x in (await a.ok("GET", "/agents"))["agents"]}["desk-c"]
                assert again["tags"] == ["floor-2", "lab"]

                # a hub registration carries the agent's tags too (before any poll); the next poll is its word
                a_node, a_port = nodes["desk-a"], agents["desk-a"]["control_port"]
                service.fleet.on_hub_event(AgentEvent(a_node, "registered", {
                    "advertisement": {}, "control_port": a_port, "address": "127.0.0.1", "tags": ["floor-9"]}, 0.0))
                assert service.fleet.get(a_node).tags == ("floor-9",)
                await a.ok("POST", "/agents/refresh")
                assert service.fleet.get(a_node).tags == ("finance", "floor-2")

                # the CLI, over the same admin socket
                assert await asyncio.to_thread(_cli, state, "desk-b", "floor-2, printer") == 0
                assert await asyncio.to_thread(_cli, state) == 0
                with pytest.raises(DeskfleetError, match="no member agent is called"):
                    await asyncio.to_thread(_cli, state, "desk-z", "x")
                with pytest.raises(DeskfleetError, match="--tags floor-2,finance to set them"):
                    await asyncio.to_thread(_cli, state, "desk-b")

                # placement: only floor-2, never finance -> desk-b and desk-c (admin's tags) remain
                made = _placement_over(service, nodes)
                solve = f"/placements/{made.id}/solve"
                plan = (await a.ok("POST", solve, {"include_tags": ["floor-2"], "exclude_tags": ["finance"]}))["plan"]
                used = {st["pc_id"] for st in plan["stages"]}
                assert used <= {nodes["desk-b"], nodes["desk-c"]} and used
                assert {"pc_id": nodes["desk-a"], "reason": "tagged finance (excluded)"} in plan["excluded"]
                kept = (await a.ok("GET", f"/placements/{made.id}"))["placement"]
                assert kept["include_tags"] == ["floor-2"] and kept["exclude_tags"] == ["finance"]
                only_printer = (await a.ok("POST", solve, {"include_tags": ["printer"]}))["plan"]
                assert {st["pc_id"] for st in only_printer["stages"]} == {nodes["desk-b"]}
                assert {"pc_id": nodes["desk-c"], "reason": "not tagged printer"} in only_printer["excluded"]
                same = (await a.ok("POST", solve, {}))["plan"]  # no tags given: the placement's own (printer)
                assert {st["pc_id"] for st in same["stages"]} == {nodes["desk-b"]}
                # rings proposed over the placement keep to its tags (printer, not finance: both kept)
                proposal = await a.ok("POST", f"/placements/{made.id}/rings", {"standbys": 0})
                assert {st["pc_id"] for ring in proposal["rings"] for st in ring["stages"]} == {nodes["desk-b"]}
                assert {"pc_id": nodes["desk-c"], "reason": "not tagged printer"} in proposal["excluded"]
                assert {"pc_id": nodes["desk-a"], "reason": "tagged finance (excluded)"} in proposal["excluded"]
                status, body = await a.call("POST", solve, {"include_tags": ["-bad"]})
                assert status == 400 and "include_tags" in body["error"]["message"]
                status, body = await a.call("POST", solve, {"include_tags": ["nobody-has-this"]})
                assert status == 409 and "no approved agent" in body["error"]["message"]
                status, body = await a.call("POST", "/placements", {"model": "nope", "exclude_tags": ["a b"]})
                assert status == 400 and "exclude_tags: 'a b' is not a tag" in body["error"]["message"]
            finally:
                for pc in pcs:
                    await pc.async_close()
        # after a restart of the service: the admin's tags are kept, the agents' own too
        async with service_in_process(state) as service:
            records = {r.name: r for r in service.fleet.records()}
            assert records["desk-c"].tags == ("floor-2", "lab") and records["desk-c"].tags_set_by == "admin"
            assert records["desk-b"].tags == ("floor-2", "printer")
            assert records["desk-a"].tags == ("finance", "floor-2") and records["desk-a"].tags_set_by == "agent"
            service.fleet.set_tags(records["desk-c"].node_id, None)  # the admin's taken away: its own again
            assert service.fleet.get(records["desk-c"].node_id).tags == ("floor-3",)
            service.fleet.remove(records["desk-a"].node_id)  # a removed agent's tags go with it
        return nodes

    nodes = run(main(), timeout=240)
    out = capsys.readouterr().out
    assert "desk-b" in out and "floor-2, printer (set by the admin)" in out and "finance, floor-2" in out
    kept = fleet_db(state).agent_tags()
    assert nodes["desk-a"] not in kept and kept[nodes["desk-c"]] == (["floor-3"], None)


def test_a_damaged_tags_file_from_before_the_database_is_named_and_left_in_place(tmp_path):
    (tmp_path / TAGS_FILE).write_text("{")
    with pytest.raises(FleetStateError, match=f"{TAGS_FILE}.*cannot be read"):
        TagBook(tmp_path)
    assert (tmp_path / TAGS_FILE).read_text() == "{"
    (tmp_path / TAGS_FILE).write_text(json.dumps({"format": 1, "agents": {"n1": {"reported": ["not a tag"]}}}))
    with pytest.raises(FleetStateError, match="malformed entry for 'n1'"):  # imported, then refused by name
        TagBook(tmp_path)
    assert (tmp_path / BACKUP_DIR / TAGS_FILE).is_file()
    book = TagBook(tmp_path / "fresh")
    book.note_reported("n1", ("a",))
    book.set_admin("n1", ("B",))
    assert TagBook(tmp_path / "fresh").get("n1").effective == ("b",)
