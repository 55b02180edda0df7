"""The fleet service's admin API on loopback: a real service (fleet host, hub, API) and a real
agent in this process (the tests that need no settings of their own share one service). Two admin
clients on the local socket see the same state — an agent one of them adds and approves reaches
the other through the event feed; over mutual TLS the API takes an admin certificate and refuses
an agent's, the service's own and none at all; errors name what is wrong."""

from __future__ import annotations

import asyncio
import os
import ssl
import stat

import aiohttp
import pytest

from engine.trust.fleet_ca import Role
from tests.fleet_service.admin import Admin
from tests.fleet_service.conftest import service_in_process
from tests.support.asyncutil import run
from tests.support.console_fleet_helpers import agent

pytestmark = pytest.mark.usefixtures("private_keyring")


async def _records_until(admin: Admin, after: int, predicate, timeout: float = 20.0):
    """Follow the event feed until a ``records`` event satisfies ``predicate``; its agents."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        poll = await admin.ok("GET", f"/events?after={after}&timeout=2")
        after = poll["next"]
        for event in poll["events"]:
            if event["kind"] == "records" and predicate(event["data"]["agents"]):
                return event["data"]["agents"]
    raise AssertionError("no records event showed the change")


def test_two_admin_clients_see_the_same_fleet(tmp_path, shared_service):
    async def main():
        service = shared_service.service
        sock = service.settings.state_dir / "admin.sock"
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        async with Admin.unix(sock) as a, Admin.unix(sock) as b:
            start_b = await b.ok("GET", "/events?after=0")
            kinds = {e["kind"] for e in start_b["events"]}
            assert {"records", "token", "health"} <= kinds  # a client starting out gets a snapshot
            token = (await a.ok("POST", "/tokens", {}))["token"]
            pc = agent(tmp_path, "desk-a")
            await pc.async_start()
            try:
                await pc.async_join(service.host.enrollment, token)
                added = (await a.ok("POST", "/agents", {"host": "127.0.0.1", "port": pc.control_port}))["agent"]
                assert added["name"] == "desk-a" and added["verified"] and not added["approved"]
                approved = (await a.ok("POST", f"/agents/{added['key']}/approve"))["agent"]
                assert approved["approved"]

                seen = await _records_until(b, start_b["next"],
                                            lambda agents: any(x["approved"] for x in agents))
                assert [(x["name"], x["approved"]) for x in seen] == [("desk-a", True)]
                assert (await b.ok("GET", "/agents"))["agents"][0]["approved"]
                status, err = await b.call("POST", f"/agents/{added['key']}/approve")
                assert status == 200  # approving twice is harmless
                service_a, service_b = await a.ok("GET", "/service"), await b.ok("GET", "/service")
                assert service_a == service_b and service_a["fleet_id"] == service.fleet.fleet_id

                node = added["node_id"]
                trays = [k for k in (await b.ok("GET", "/keys"))["keys"] if k["node_id"] == node]
                assert trays, "the joined agent's tray has a key of its own"
                assert (await a.ok("DELETE", f"/agents/{added['key']}")) == {"removed": added["key"]}
                assert not [k for k in (await b.ok("GET", "/keys"))["keys"] if k["node_id"] == node]
                assert (await b.ok("GET", "/agents"))["agents"] == []
                status, _ = await b.call("POST", "/agents", {"host": "127.0.0.1", "port": pc.control_port})
                assert status == 409  # revoked: it comes back only by joining again
            finally:
                await pc.async_close()

    shared_service.run(main(), 120)


def test_only_an_admin_certificate_is_let_in_over_tls(shared_service):
    async def main():
        service = shared_service.service
        url = service.admin_url
        assert url is not None and url.startswith("https://127.0.0.1:")
        authority = service.host.authority
        admin = authority.issue_admin("alice")
        async with Admin.tls(url, admin.client_context()) as alice:
            assert (await alice.ok("GET", "/service"))["fleet_id"] == service.fleet.fleet_id
            assert (await alice.ok("GET", "/health"))["status"] == "down"  # no ring yet

        for who, creds in (("an agent", authority.issue_credentials("desk-x", role=Role.AGENT)),
                           ("the service itself", service.host.credentials)):
            async with Admin.tls(url, creds.client_context()) as intruder:
                with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
                    status, body = await intruder.call("GET", "/agents", timeout=10)
                    pytest.fail(f"{who}'s certificate was let in: {status} {body}")

        bare = ssl.create_default_context(cadata=service.host.credentials.ca_pem.decode())
        bare.check_hostname = False
        async with Admin.tls(url, bare) as stranger:  # no certificate at all
            with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
                await stranger.call("GET", "/agents", timeout=10)

    shared_service.run(main(), 120)


def test_errors_name_what_is_wrong(shared_service):
    async def main():
        service = shared_service.service
        async with Admin.unix(service.settings.state_dir / "admin.sock") as a:
            status, body = await a.call("GET", "/rings/r9")
            assert status == 404 and body["error"]["code"] == "not_found" and "r9" in body["error"]["message"]
            status, body = await a.call("POST", "/rings", {"model": "x"})
            assert status == 400 and "'plan'" in body["error"]["message"]
            plan = {"stages": [{"device_id": "pc/CPU", "pc_id": "pc", "first_layer": 0, "last_layer": 3}]}
            status, body = await a.call("POST", "/rings", {"plan": plan, "model": "no-such-model"})
            assert status == 404 and "no-such-model" in body["error"]["message"]
            status, body = await a.call("POST", "/rings", {"plan": plan, "model": "m", "ring": "bad id"})
            assert status == 400 and "ring id" in body["error"]["message"]
            status, body = await a.call("POST", "/agents", {"host": 7})
            assert status == 400 and "'host'" in body["error"]["message"]
            status, body = await a.call("POST", "/agents/nobody/approve")
            assert status == 404
            status, body = await a.call("GET", "/jobs/j77")
            assert status == 404
            status, body = await a.call("GET", "/events?after=x")
            assert status == 400
            status, body = await a.call("GET", "/nothing-here")
            assert status == 404 and body["error"]["code"] == "not_found"
            assert (await a.ok("GET", "/rings")) == {"rings": []}

            issued = await a.ok("POST", "/keys", {"name": "wiki-bot", "rpm": 30})
            assert issued["secret"].startswith("sk-deskfleet-") and issued["rpm"] == 30 and not issued["metrics"]
            monitor = await a.ok("POST", "/keys", {"name": "grafana", "metrics": True})  # may read /metrics
            assert monitor["metrics"] and service.host.keys.identify(monitor["secret"]).metrics
            status, body = await a.call("POST", "/keys", {"name": "grafana-2", "metrics": "yes"})
            assert status == 400 and "metrics" in body["error"]["message"]
            listed = (await a.ok("GET", "/keys"))["keys"]
            assert {k["name"] for k in listed} >= {"wiki-bot"} and all("secret" not in k for k in listed)
            status, body = await a.call("POST", "/keys", {"name": "wiki-bot"})
            assert status == 409
            assert (await a.ok("DELETE", "/keys/wiki-bot")) == {"revoked": "wiki-bot"}
            status, body = await a.call("DELETE", "/keys/wiki-bot")
            assert status == 404
            status, body = await a.call("POST", "/keys/wiki-bot/secret")
            assert status == 403
            assert (await a.ok("POST", "/keys/console/secret"))["secret"] == service.host.api_key

    shared_service.run(main(), 120)


def _placement(service):
    """A placement over synthetic measured inputs (three PCs, one CPU each), as a finished
    POST /placements would leave it: the solve and rings routes work from the kept inputs."""
    from console.fleet.fleet_service import Placement
    from console.fleet.placement_inputs import solve_inputs
    from console.fleet_api.exports import ExportSpec
    from console.fleet_api.link_report import LinkReport
    from console.fleet_api.placement import PlacementInputs
    from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo, PlacementRequest

    pcs = tuple(PcInfo(f"pc-{c}", (4 + i) << 30, True) for i, c in enumerate("abc"))
    devices = tuple(DeviceProfile(f"{pc.pc_id}/CPU", pc.pc_id, "CPU", 2.0, 1.0, pc.memory_bytes) for pc in pcs)
    inputs = PlacementInputs(ModelProfile((256 << 20,) * 8), pcs, devices, LinkReport(Links(default_ms=0.3), {}, {}),
                             (), {pc.pc_id: pc.pc_id.upper() for pc in pcs}, {})
    placement = Placement("p1", "tiny", 4096, ExportSpec(), inputs, solve_inputs(inputs, PlacementRequest()))
    service.placements["p1"] = placement
    return placement


def test_solve_and_propose_rings_over_a_placements_inputs(shared_service):
    async def main():
        service = shared_service.service
        async with Admin.unix(service.settings.state_dir / "admin.sock") as a:
            _placement(service)
            got = (await a.ok("GET", "/placements/p1"))["placement"]
            assert got["inputs"]["names"]["pc-a"] == "PC-A" and len(got["inputs"]["devices"]) == 3
            plan = (await a.ok("POST", "/placements/p1/solve", {"leave_out": ["pc-c"]}))["plan"]
            assert plan["stages"] and all(st["pc_id"] != "pc-c" for st in plan["stages"])
            assert {"pc_id": "pc-c", "reason": "left out by the admin"} in plan["excluded"]

            proposal = await a.ok("POST", "/placements/p1/rings", {"standbys": 1})
            assert proposal["standby"] == ["pc-c"]  # the most memory is kept aside
            used = [st["pc_id"] for ring in proposal["rings"] for st in ring["stages"]]
            assert proposal["rings"] and "pc-c" not in used and len(used) == len(set(used))  # no PC in two rings
            status, body = await a.call("POST", "/placements/p1/rings", {"standbys": 3})
            assert status == 409 and "no new ring fits" in body["error"]["message"]
            status, body = await a.call("POST", "/placements/p7/solve", {})
            assert status == 404 and "p7" in body["error"]["message"]

    shared_service.run(main(), 120)


def test_a_listed_ring_that_cannot_form_is_retried_until_stopped(tmp_path):
    """A ring in served-rings.json whose agents are gone: at start the service tries to re-form it,
    says why it failed, keeps trying with its back-off, and forgets it once an admin stops it."""
    from console.fleet.served_rings import ServedRing, ServedRings
    from engine.placement.types import Plan, PlannedStage

    state = tmp_path / "fleet"
    plan = Plan((PlannedStage("pc-gone/CPU", "pc-gone", 0, 3, 1.0, 1 << 20),), (0.0, 0.0), 1.0, 1000.0, 1.0, 1,
                1.0, 1000.0, "latency", True)
    ServedRings(state).put(ServedRing("r1", "gone-model", plan, export_id="gone-export"))

    async def main():
        async with service_in_process(state, retry_s=(0.2,), watch_s=0.1) as service, \
                Admin.unix(state / "admin.sock") as a:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while sum(1 for e in service.feed.since(1).events
                      if e.kind == "job" and e.data["job"]["kind"] == "restore"
                      and e.data["job"]["state"] == "failed") < 2:
                assert loop.time() < deadline, "the ring was not retried"
                await asyncio.sleep(0.1)
            ring = (await a.ok("GET", "/rings/r1"))["ring"]
            assert ring["phase"] in ("failed", "pending")
            failed = [e.data["job"] for e in service.feed.since(1).events if e.kind == "job"
                      and e.data["job"]["state"] == "failed"]
            assert "gone-model" in failed[0]["error"] and failed[0]["ring"] == "r1"
            health = await a.ok("GET", "/health")
            assert health["status"] == "down" and health["rings"][0]["ring"] == "r1"
            status, body = await a.call("POST", "/rings/r1/rerun")
            assert status in (202, 409)  # a retry may be under way
            assert (await a.ok("DELETE", "/rings/r1")) == {"stopped": "r1"}
            assert ServedRings(state).state.rings == ()
            assert (await a.ok("GET", "/rings")) == {"rings": []}

    run(main(), 120)


def test_a_state_dir_too_deep_for_the_socket_is_a_clear_error(tmp_path):
    from console.fleet_api.errors import FleetServiceError

    deep = tmp_path / ("d" * 60) / ("e" * 60)

    async def main():
        with pytest.raises(FleetServiceError, match="shorter"):
            async with service_in_process(deep):
                pass

    run(main(), 60)


class _DeadRing:
    """A ring whose stage died for good: what a coordinator reports once its failover gave up."""

    from engine.generation.generator import ModelCard as _Card

    model = _Card("gone-model", 2048, (2,), 2)

    def ring_reports(self):
        from engine.generation.ring_report import RingReport, RingStatus

        return (RingReport("default", "gone-model", RingStatus.DOWN, "stage 1 (desk-b): worker exited 137", 1),)

    def metrics(self):
        return {}

    async def stream(self, request):  # pragma: no cover - never routed to: it is down
        raise AssertionError("a down ring was given a request")
        yield


def test_a_serving_ring_that_stays_down_is_rebuilt(tmp_path):
    """The watch sees a serving ring report down beyond the grace time and rebuilds it (a restore
    job), its stage named in /health meanwhile."""
    from console.fleet.served_rings import ServedRing
    from console.fleet.service_ring import ServiceRing
    from console.fleet_api.ring_status import RingPhase
    from engine.placement.types import Plan, PlannedStage

    plan = Plan((PlannedStage("pc/CPU", "pc", 0, 3, 1.0, 1 << 20),), (0.0, 0.0), 1.0, 1000.0, 1.0, 1, 1.0, 1000.0,
                "latency", True)

    async def main():
        async with service_in_process(tmp_path / "fleet", down_grace_s=0.5, watch_s=0.1,
                                      retry_s=(30.0,)) as service, \
                Admin.unix(tmp_path / "fleet" / "admin.sock") as a:
            ring = ServiceRing(service._context(), ServedRing("r1", "gone-model", plan))
            service.router.add_ring("r1", _DeadRing(), model_name="gone-model")
            ring.phase, ring.in_router = RingPhase.SERVING, True
            service.rings["r1"] = ring
            health = await a.ok("GET", "/health")
            assert health["status"] == "down" and "worker exited 137" in health["rings"][0]["detail"]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while not [e for e in service.feed.since(1).events if e.kind == "job"
                       and e.data["job"]["kind"] == "restore"]:
                assert loop.time() < deadline, "the down ring was not rebuilt"
                await asyncio.sleep(0.1)
            restores = [e for e in service.feed.since(1).events if e.kind == "job"]
            assert restores[0].data["job"]["ring"] == "r1"
            await asyncio.sleep(0.5)
            jobs = {e.data["job"]["id"] for e in service.feed.since(1).events if e.kind == "job"}
            assert len(jobs) == 1  # the back-off (30 s here) holds the next try

    run(main(), 60)
