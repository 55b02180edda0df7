"""The admin role: issued by the fleet CA, admitted only by the service's admin API, refused by an
agent's control API and a stage's data port on real loopback sockets, and carried in one file."""

from __future__ import annotations

import logging
import stat
import sys

import aiohttp
import pytest
from aiohttp import web

from agent.service.control_api import build_app
from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from engine.paged.stage import PagedStage
from engine.paged.worker import PagedStageWorker
from engine.shards.manifest import load_manifest
from engine.trust.admin_bundle import (
    CA_FILE,
    CERT_FILE,
    KEY_FILE,
    AdminCredentialsError,
    read_admin_credentials,
    write_admin_credentials,
)
from engine.trust.fleet_ca import ADMIN_ROLES, MEMBER_ROLES, FleetAuthority, Role, peer_node_id, refuse_role
from engine.trust.peer_policy import PeerPolicy
from engine.wire.address import Address
from engine.wire.format import Role as WireRole
from engine.wire.messages import Hello
from engine.wire.transport import async_connect
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import run


@pytest.fixture(scope="module")
def fleet():
    return FleetAuthority.create("Acme")


def test_the_role_decision_admits_only_the_listed_roles_and_names_the_admin():
    assert refuse_role(Role.AGENT, MEMBER_ROLES) is None and refuse_role(Role.CONSOLE, MEMBER_ROLES) is None
    assert "admin certificate" in refuse_role(Role.ADMIN, MEMBER_ROLES)
    assert refuse_role(Role.ADMIN, ADMIN_ROLES) is None
    for role in (Role.AGENT, Role.CONSOLE, None):
        assert "this port takes admin certificates" in refuse_role(role, ADMIN_ROLES)


def test_an_admin_certificate_is_issued_with_the_admin_role(fleet):
    admin = fleet.issue_admin("alice")
    assert admin.role is Role.ADMIN and admin.name == "alice"
    assert admin.ca_fingerprint == fleet.fingerprint


async def _serve(ctx):
    """An HTTPS server recording the node id of every caller it answers."""
    seen: list[str] = []

    async def hello(request):
        seen.append(peer_node_id(request.transport.get_extra_info("ssl_object").getpeercert(binary_form=True)))
        return web.Response(text="in")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
    return runner, runner.addresses[0][1], seen


async def _get(port, ctx, path="/"):
    """(status, body) of a GET, or the exception's class name when the connection was refused."""
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                session.get(f"https://127.0.0.1:{port}{path}", ssl=ctx, timeout=aiohttp.ClientTimeout(total=10)) as r:
            return r.status, await r.text()
    except aiohttp.ClientError as exc:
        return type(exc).__name__


def test_member_ports_refuse_an_admin_and_the_admin_port_takes_only_admins(fleet, caplog):
    caplog.set_level(logging.DEBUG, logger="engine.trust.fleet_ca")
    service = fleet.issue_credentials("office", role=Role.CONSOLE)
    agent = fleet.issue_credentials("desk-1", role=Role.AGENT)
    admin = fleet.issue_admin("alice")

    async def main():
        outcomes = {}
        for port_name, admit in (("member port", MEMBER_ROLES), ("admin port", ADMIN_ROLES)):
            runner, port, seen = await _serve(service.server_context(admit=admit))
            try:
                for who, creds in (("agent", agent), ("service", service), ("admin", admin), ("admin", admin)):
                    outcomes.setdefault((port_name, who), []).append(await _get(port, creds.client_context()))
                outcomes[(port_name, "seen")] = seen
            finally:
                await runner.cleanup()
        return outcomes

    out = run(main(), 60)
    assert out[("member port", "agent")] == [(200, "in")] and out[("member port", "service")] == [(200, "in")]
    assert all(isinstance(o, str) for o in out[("member port", "admin")]), out  # cut before any request
    assert out[("member port", "seen")] == [agent.node_id, service.node_id]
    assert out[("admin port", "admin")] == [(200, "in")] * 2
    assert isinstance(out[("admin port", "agent")][0], str) and isinstance(out[("admin port", "service")][0], str)
    assert out[("admin port", "seen")] == [admin.node_id] * 2
    refusals = [r for r in caplog.records if "admin certificate, which only the fleet service's admin API" in
                r.getMessage()]
    levels = [r.levelno for r in refusals]  # each refused connect (aiohttp may retry one): warned once, then debug
    assert levels[0] == logging.WARNING and set(levels[1:]) == {logging.DEBUG}, levels


class _Agent:
    """The least a control API serves: reads answer, orders are recorded (never reached here)."""

    service_node_id = None
    deny: frozenset[str] = frozenset()
    orders: list[str] = []

    def status(self):
        raise AssertionError("an admin's read reached the agent")

    def probe(self):
        return {"name": "desk"}

    async def async_set_remote_pause(self, paused):
        self.orders.append(f"pause={paused}")


def test_the_control_api_refuses_an_admin_even_when_tls_would_admit_it(fleet):
    """Two checks, each enough: the TLS layer (above), and the control API's own (here, behind a
    context that admits every role)."""
    agent_creds = fleet.issue_credentials("desk", role=Role.AGENT)
    admin, service = fleet.issue_admin("alice"), fleet.issue_credentials("office", role=Role.CONSOLE)
    target = _Agent()

    async def main():
        runner = web.AppRunner(build_app(target))
        await runner.setup()
        ctx = agent_creds.server_context(admit=MEMBER_ROLES | ADMIN_ROLES)
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
        port = runner.addresses[0][1]
        try:
            probe_by_service = await _get(port, service.client_context(), "/v1/probe")
            probe = await _get(port, admin.client_context(), "/v1/probe")
            status = await _get(port, admin.client_context(), "/v1/status")
            async with aiohttp.ClientSession() as s, s.post(f"https://127.0.0.1:{port}/v1/pause", json={},
                                                            ssl=admin.client_context()) as r:
                pause = r.status, await r.text()
            return probe_by_service, probe, status, pause
        finally:
            await runner.cleanup()

    probe_by_service, probe, status, pause = run(main(), 60)
    assert probe_by_service[0] == 200
    for status_code, body in (probe, status, pause):
        assert status_code == 403 and "admin certificate is for the fleet service's admin API" in body
    assert target.orders == []


@pytest.mark.slow
def test_a_real_agent_and_a_real_stage_refuse_an_admin_certificate(tmp_path, tiny_export, private_keyring):
    """The agent's control API and a stage worker's data port, as they run: an admin certificate of
    the same fleet is cut at the handshake, even when the stage's peer policy names its node id."""
    export = tiny_export("llama", 2)

    async def main():
        async with console(tmp_path / "console", {"tiny-2": export}) as con:
            agent = AgentService(tmp_path / "desk", AgentSettings(name="desk", interface="127.0.0.1", control_port=0,
                                                                  data_port=0),
                                 idle_source=FakeIdle(1e6), power=lambda: None)
            await agent.async_start()
            admin = con.authority.issue_admin("alice")
            desk = con.authority.issue_credentials("desk-2", role=Role.AGENT)
            worker = PagedStageWorker(PagedStage(export, 1, exact=True), Address("127.0.0.1", 0),
                                      Address("127.0.0.1", 9), kv_pool_bytes=16 << 20,
                                      server_ssl=desk.server_context(), client_ssl=desk.client_context(),
                                      peers=PeerPolicy.of([admin.node_id, desk.node_id]))
            try:
                await agent.async_join(con.enrollment, con.token())
                data = await worker.async_start()
                fingerprint = load_manifest(export).model.fingerprint
                results = {}
                for who, creds in (("admin", admin), ("member", desk)):
                    results[("control", who)] = await _get(agent.control_port, creds.client_context(), "/v1/probe")
                    try:
                        conn = await async_connect("127.0.0.1", data.port, Hello(fingerprint, 1, WireRole.STAGE),
                                                   ssl=creds.client_context(), attempts=1)
                        await conn.async_close()
                        results[("data", who)] = "in"
                    except Exception as exc:  # the handshake, or the first read after it, failed
                        results[("data", who)] = type(exc).__name__
                return results, worker.listener.stats
            finally:
                await worker.async_close()
                await agent.async_close()

    results, stats = run(main(), 120)
    assert results[("control", "member")][0] == 200 and results[("data", "member")] == "in"
    assert isinstance(results[("control", "admin")], str), results
    assert results[("data", "admin")] != "in", results


def test_the_admin_folder_round_trips_private_and_refuses_what_is_not_an_admins(fleet, tmp_path):
    admin = fleet.issue_admin("alice")
    folder = write_admin_credentials(admin, tmp_path / "alice")
    if sys.platform != "win32":
        assert stat.S_IMODE((folder / KEY_FILE).stat().st_mode) == 0o600
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert read_admin_credentials(folder) == admin
    with pytest.raises(AdminCredentialsError, match="refusing to write a certificate of the agent role"):
        write_admin_credentials(fleet.issue_credentials("desk", role=Role.AGENT), tmp_path / "desk")
    agent = fleet.issue_credentials("desk", role=Role.AGENT)
    cases = {"missing": lambda d: (d / CA_FILE).unlink(),
             "not PEM": lambda d: (d / CERT_FILE).write_text("hello"),
             "an agent's certificate": lambda d: ((d / CERT_FILE).write_bytes(agent.cert_pem),
                                                  (d / KEY_FILE).write_bytes(agent.key_pem)),
             "a foreign key": lambda d: (d / KEY_FILE).write_bytes(fleet.issue_admin("bob").key_pem)}
    says = {"missing": "cannot read", "not PEM": "not a PEM certificate", "an agent's certificate": "role, not admin",
            "a foreign key": "does not belong to the certificate"}
    for what, damage in cases.items():
        bad = write_admin_credentials(admin, tmp_path / what.replace(" ", "-").replace("'", ""))
        damage(bad)
        with pytest.raises(AdminCredentialsError, match=says[what]) as err:
            read_admin_credentials(bad)
        assert str(bad) in str(err.value), what
