"""The console's admin client on real sockets: the local unix socket and mutual TLS with an admin
certificate (the service must answer with the fleet's console-role certificate), errors and jobs
as the admin API's doc shapes them, the service's JSON read back into the pages' objects, and a
detached service start that outlives the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from console.fleet_api.admin_client import AdminApiError, AdminClient, AdminJobError, ServiceUnreachableError
from console.fleet_api.admin_decode import agent_from_json, inputs_from_json
from console.fleet_api.admin_shapes import agent_json, inputs_json
from console.fleet_api.agent_record import AgentRecord, AgentSource, Membership
from console.fleet_api.link_report import LinkReport
from console.fleet_api.placement import PlacementInputs
from console.fleet_api.service_locator import SERVICE_FILE, pid_alive, read_service_file
from engine.control.links import LinkMeasurement
from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo
from engine.trust.fleet_ca import ADMIN_ROLES, FleetAuthority, Role
from tests.support.asyncutil import run

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="unix sockets")


def _app(calls: list[str]) -> web.Application:
    """The few routes the transport tests need, shaped as docs/ADMIN_API.md says."""
    jobs = {"j1": ["running", "running", "done"], "j2": ["running", "failed"]}

    async def service(request):
        calls.append("service")
        return web.json_response({"fleet_id": "abc", "api_url": "http://127.0.0.1:1/v1"})

    async def missing(request):
        calls.append("missing")
        return web.json_response({"error": {"code": "not_found", "message": "no agent named pc-9"}}, status=404)

    async def job(request):
        states = jobs[request.match_info["id"]]
        state = states.pop(0) if len(states) > 1 else states[0]
        return web.json_response({"job": {"id": request.match_info["id"], "kind": "links", "state": state,
                                          "result": {"measured": []} if state == "done" else None,
                                          "error": "pc-2 did not answer" if state == "failed" else None}})

    app = web.Application()
    app.router.add_get("/admin/v1/service", service)
    app.router.add_post("/admin/v1/agents/pc-9/approve", missing)
    app.router.add_get("/admin/v1/jobs/{id}", job)
    return app


async def _site(app, **where):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.UnixSite(runner, where["path"]) if "path" in where else \
        web.TCPSite(runner, "127.0.0.1", 0, ssl_context=where["ssl"])
    await site.start()
    return runner


def test_the_socket_transport_answers_errors_with_the_services_words_and_follows_jobs(tmp_path):
    sock = tmp_path / "admin.sock"
    calls: list[str] = []

    async def main():
        runner = await _site(_app(calls), path=str(sock))
        try:
            async with AdminClient.over_socket(sock) as client:
                service = await client.async_service()
                with pytest.raises(AdminApiError) as refused:
                    await client.async_approve("pc-9")
                result = await client.async_wait_job("j1", timeout=10)
                with pytest.raises(AdminJobError, match="pc-2 did not answer"):
                    await client.async_wait_job("j2", timeout=10)
                return service, refused.value, result
        finally:
            await runner.cleanup()

    service, refused, result = run(main(), 30)
    assert service["fleet_id"] == "abc" and calls == ["service", "missing"]
    assert (refused.status, refused.code, str(refused)) == (404, "not_found", "no agent named pc-9")
    assert result == {"measured": []}

    async def gone():
        async with AdminClient.over_socket(sock) as client:
            await client.async_service()

    with pytest.raises(ServiceUnreachableError, match="is `deskfleet fleet` running"):
        run(gone(), 10)
    assert AdminClient.over_socket(sock).ca_pem is None  # no fleet CA in that folder
    (tmp_path / "fleet-ca.crt").write_bytes(b"the CA's PEM")
    assert AdminClient.over_socket(sock).ca_pem == b"the CA's PEM"  # the local service's state dir holds it


def test_mutual_tls_takes_an_admin_and_talks_only_to_the_fleets_service():
    fleet = FleetAuthority.create("Acme")
    service = fleet.issue_credentials("office", role=Role.CONSOLE)
    impostor = fleet.issue_credentials("pc", role=Role.AGENT)
    admin, agent = fleet.issue_admin("alice"), fleet.issue_credentials("desk", role=Role.AGENT)
    calls: list[str] = []

    async def main():
        real = await _site(_app(calls), ssl=service.server_context(admit=ADMIN_ROLES))
        fake = await _site(_app(calls), ssl=impostor.server_context(admit=ADMIN_ROLES))
        real_url = f"https://127.0.0.1:{real.addresses[0][1]}"
        fake_url = f"https://127.0.0.1:{fake.addresses[0][1]}"
        try:
            async with AdminClient.over_tls(real_url, admin, service_node_id=service.node_id) as client:
                answered = await client.async_service()
            with pytest.raises(ServiceUnreachableError, match="is not the fleet service") as posing:
                async with AdminClient.over_tls(fake_url, admin) as client:
                    await client.async_service()
            with pytest.raises(ServiceUnreachableError, match="is not the fleet service"):  # pinned: another id
                async with AdminClient.over_tls(real_url, admin, service_node_id=impostor.node_id) as client:
                    await client.async_service()
            return answered, str(posing.value)
        finally:
            await real.cleanup()
            await fake.cleanup()

    answered, posing = run(main(), 30)
    assert answered["fleet_id"] == "abc" and calls == ["service"]  # the impostor heard nothing
    assert "agent" in posing
    # the console's chat trusts the fleet's https API by the CA the admin credentials carry
    assert AdminClient.over_tls("https://127.0.0.1:1", admin).ca_pem == fleet.ca_pem
    with pytest.raises(AdminApiError, match="takes admin certificates"):
        AdminClient.over_tls("https://127.0.0.1:1", agent)
    with pytest.raises(AdminApiError, match="not an https:// address"):
        AdminClient.over_tls("http://127.0.0.1:1", admin)


def test_the_services_json_reads_back_into_the_pages_objects():
    record = AgentRecord(node_id="a" * 64, name="pc-1", address="10.0.0.3", control_port=7230, state="idle",
                         devices=("CPU", "GPU"), memory_bytes=8 << 30, fleet_id="f" * 16,
                         membership=Membership.MEMBER, last_seen=100.0,
                         sources=frozenset({AgentSource.HUB, AgentSource.PROBE}), approved=True, reachable=True,
                         paused_reasons=("user active",), version="1.0", instance="pc-1", verified=True)
    back = agent_from_json(agent_json(record, now=102.5), now=50.0)
    assert back == AgentRecord(**{**record.__dict__, "last_seen": 47.5})
    inputs = PlacementInputs(
        model=ModelProfile(layer_bytes=(100,) * 4),
        pcs=(PcInfo("a" * 64, 8 << 30, True),), devices=(DeviceProfile("a/CPU", "a" * 64, "CPU", 1.5, 0.2, 4 << 30),),
        links=LinkReport(Links(pc_ms={("a", "b"): 0.4}, coordinator_ms={"a": 0.3}),
                         {("console", "a"): LinkMeasurement(0.6, 900.0)}, {("a", "b"): "timed out"}),
        unreachable=("b" * 64,), names={"a" * 64: "pc-1"}, failures={("b" * 64, "b/GPU"): "no driver"})
    read = inputs_from_json(inputs_json(inputs))
    assert read.model.n_layers == 4 and sum(read.model.layer_bytes) == 400
    assert (read.pcs, read.devices, read.unreachable, dict(read.names), dict(read.failures)) == \
        (inputs.pcs, inputs.devices, inputs.unreachable, dict(inputs.names), dict(inputs.failures))
    assert dict(read.links.measured) == dict(inputs.links.measured)
    assert dict(read.links.failures) == {("a", "b"): "timed out"}


def test_a_detached_service_outlives_the_process_that_started_it(tmp_path):
    """What `deskfleet console` does when no service runs: the child gets its own session, so the
    console's death (SIGKILL, a closed terminal) does not reach it."""
    pid_file = tmp_path / "pid"
    starter = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from console.fleet_api.service_locator import start_detached; "
        "p = start_detached([sys.executable, '-c', 'import time; time.sleep(60)'], "
        f"Path({str(tmp_path)!r}) / 'x.log'); "
        f"Path({str(pid_file)!r}).write_text(str(p.pid)); time.sleep(60)")], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert os.getsid(child) == child != os.getsid(starter.pid)  # a session of its own
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        time.sleep(0.3)
        assert pid_alive(child), "the detached service died with the console"
    finally:
        if starter.poll() is None:
            starter.kill()
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    (tmp_path / SERVICE_FILE).write_text('{"pid": 1, "admin_socket": "/nonexistent"}')
    assert read_service_file(tmp_path).pid == 1
    (tmp_path / SERVICE_FILE).write_text('{"pid": ')
    assert read_service_file(tmp_path) is None
