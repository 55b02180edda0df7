"""A fleet member is not the console: the control plane played by an insider.

Each test holds a fellow member's real certificate (Role.AGENT, signed by the fleet's own CA,
so every TLS handshake passes) and tries one thing a member must not be able to do: stand in
for the console at a join, move or pause an approved agent with an mDNS record, answer a status
poll for another agent, make up node ids for approval, keep using the fleet after the admin
removed it, or download shards it was not assigned. Each is refused, logged, and changes
nothing. Real TLS, real aiohttp, real zeroconf on 127.0.0.1, real agents in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets

import aiohttp
import pytest
from aiohttp import web

from console.fleet.errors import ForeignAgentError
from console.fleet.fleet import FleetModel
from engine.control.client import ControlClient, ControlError, WrongAgentError
from engine.control.enrollment import NotTheConsoleError
from engine.control.fleet_services import API_KEY_SECRET
from engine.control.messages import Assignment
from engine.discovery.join_service import ConsoleAdvertiser, console_advertisement
from engine.discovery.mdns import Advertisement, Advertiser, Browser
from engine.trust.fleet_ca import Credentials, Role
from engine.trust.keystore import ConsoleSecrets
from tests.security.served_api import SETTINGS, served
from tests.support.agent_helpers import console
from tests.support.asyncutil import run, until
from tests.support.console_fleet_helpers import agent, joined_fleet

pytestmark = pytest.mark.usefixtures("private_keyring")


@contextlib.asynccontextmanager
async def fake_server(creds: Credentials, routes, *, port: int = 0, verify_clients: bool = True):
    """An aiohttp server on 127.0.0.1 presenting ``creds`` (an insider's certificate); ``routes``
    is [(method, path, handler)]. Yields its port."""
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    context = creds.server_context(verify_clients=verify_clients)
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.mark.slow
def test_a_member_posing_as_the_console_at_enrolment_never_sees_the_token(tmp_path, caplog):
    """The review's reproduction: an enrolled PC advertises ``_deskfleet-join`` with the fleet's
    (public) pin and serves the real CA, with its own agent certificate. Alone on the network it
    gets a refusal before the token is sent (not a final "used"); beside the real console, the
    agent joins the real one with the same token, whichever record it tries first."""
    caplog.set_level(logging.WARNING)

    async def main():
        async with console(tmp_path / "console") as con:
            mallory = con.authority.issue_credentials("mallory", role=Role.AGENT)
            posted = []

            async def ca(request):
                return web.Response(body=con.authority.ca_pem, content_type="application/x-pem-file")

            async def join(request):
                posted.append(await request.read())
                return web.json_response({"error": "used", "reason": "used"}, status=403)

            victim = agent(tmp_path, "victim")
            await victim.async_start()
            fake, real = ConsoleAdvertiser("127.0.0.1"), ConsoleAdvertiser("127.0.0.1")
            try:
                token = con.token()
                async with fake_server(mallory, [("GET", "/v1/ca", ca), ("POST", "/v1/join", join)],
                                       verify_clients=False) as port:
                    pin = con.authority.fingerprint
                    await fake.async_start(console_advertisement("Acme console", pin, port, "127.0.0.1", "0.1.0"))
                    with pytest.raises(NotTheConsoleError, match="not sent and is still good"):
                        await victim.async_join(None, token, timeout=8)
                    assert posted == [] and not victim.joined and con.tokens.outstanding() == 1
                    enrollment_port = int(con.enrollment.rsplit(":", 1)[1])
                    await real.async_start(console_advertisement("Acme", pin, enrollment_port, "127.0.0.1", "0.1.0"))
                    creds = await victim.async_join(None, token, timeout=15)
                assert posted == [] and creds.fleet_id == con.authority.fleet_id
                assert victim.service_node_id == con.credentials.node_id
            finally:
                await fake.async_close()
                await real.async_close()
                await victim.async_close()

    run(main(), 120)
    assert "refused before sending the token" in caplog.text and "agent certificate" in caplog.text


@pytest.mark.slow
def test_only_the_pinned_console_commands_and_a_revoked_member_is_refused_everywhere(tmp_path, tiny_export, caplog):
    export = tiny_export("llama", 2)
    caplog.set_level(logging.WARNING)

    async def main():
        async with joined_fleet(tmp_path, ("alpha", "beta"), exports={"tiny-2": export}) as f:
            alpha, beta = f.agents["alpha"], f.agents["beta"]
            for a in (alpha, beta):
                await f.fleet.async_add_address("127.0.0.1", a.control_port)
                f.fleet.approve(a.status().node_id)
            # Another console-role certificate of the same CA is not the console alpha joined through.
            other_console = f.host.authority.issue_credentials("second console", role=Role.CONSOLE)
            with pytest.raises(ControlError) as refused:
                await ControlClient(other_console, "127.0.0.1", alpha.control_port).async_pause()
            assert refused.value.status == 403 and "join again to change services" in str(refused.value)
            assert alpha.status().state == "idle"

            beta_creds = beta.keystore.load()
            beta_id = beta_creds.node_id
            f.fleet.remove(beta_id)
            assert beta_id in f.fleet.deny and beta_id in f.host.hub.deny
            assert await f.fleet.async_push_deny() == {}  # every member was told
            assert alpha.deny == {beta_id}
            # beta's certificate still chains to the CA, but alpha's control API and the hub refuse it
            with pytest.raises(ControlError) as denied:
                await ControlClient(beta_creds, "127.0.0.1", alpha.control_port).async_status()
            assert denied.value.status == 403
            async with aiohttp.ClientSession() as session:
                for method, url in (("POST", f"https://127.0.0.1:{f.host.hub.port}/v1/register"),
                                    ("GET", f.host.hub.shard_url("tiny-2") + "manifest.json")):
                    async with session.request(method, url, json={}, ssl=beta_creds.client_context()) as resp:
                        assert resp.status == 403, url
            assert beta_id not in {r.key for r in f.fleet.records()}
            reloaded = FleetModel(tmp_path / "console", f.host.credentials)
            assert reloaded.deny == (beta_id,)  # kept in the console's state dir

    run(main(), 120)
    assert "revoked" in caplog.text and "for the fleet service only" in caplog.text


def test_shards_only_for_the_stage_the_console_assigned(tmp_path, tiny_export, caplog):
    export = tiny_export("llama", 2)
    caplog.set_level(logging.WARNING)

    async def main():
        async with console(tmp_path / "console", {"tiny-2": export}) as con:
            mallory = con.authority.issue_credentials("mallory", role=Role.AGENT)
            manifest = Assignment.create((export / "manifest.json").read_text(), export_id="tiny-2", stage=1,
                                         source=con.hub.shard_url("tiny-2"), listen_port=0, next_hop="127.0.0.1:1")
            stage1 = manifest.files()[0].path
            stage0 = manifest.manifest.stages[0].files[0].path

            async def get(rel):
                async with aiohttp.ClientSession() as session:
                    async with session.get(con.hub.shard_url("tiny-2") + rel, ssl=mallory.client_context()) as r:
                        await r.read()
                        return r.status

            assert await get(stage1) == 403  # a member with no assignment
            con.hub.grant(mallory.node_id, "tiny-2", [1])
            assert await get(stage1) == 200
            assert await get(stage0) == 403  # another stage's files stay closed
            con.hub.revoke_grants(mallory.node_id)
            assert await get(stage1) == 403

    run(main(), 120)
    assert "no current assignment names it" in caplog.text


def test_a_poll_answered_by_another_member_echoing_the_victims_id_gets_nothing(tmp_path, caplog):
    caplog.set_level(logging.WARNING)

    async def main():
        async with joined_fleet(tmp_path, ("alpha",)) as f:
            alpha = f.agents["alpha"]
            alpha_id, port = f.node("alpha"), alpha.control_port
            await f.fleet.async_add_address("127.0.0.1", port)
            f.fleet.approve(alpha_id)
            before = f.fleet.get(alpha_id)
            mallory = f.host.authority.issue_credentials("mallory", role=Role.AGENT)
            status_body = alpha.status().to_dict()  # the victim's own words, node id included
            asked = []

            async def status(request):
                asked.append(request.path)
                return web.json_response(status_body)

            async def assign(request):
                asked.append(request.path)
                return web.json_response({"ok": True})

            await alpha.async_close()  # the victim is off; the insider takes its address and port
            async with fake_server(mallory, [("GET", "/v1/status", status), ("GET", "/v1/probe", status),
                                             ("POST", "/v1/assign", assign)], port=port):
                record = await f.fleet.async_refresh_one(alpha_id)
                assert record.status is None and "answers as another agent" in record.error
                assert (record.address, record.control_port, record.approved) == \
                    (before.address, before.control_port, True)
                with pytest.raises(WrongAgentError):
                    await f.fleet.client(alpha_id).async_assign(Assignment.create(
                        "{}", export_id="x", stage=0, source="https://127.0.0.1:1/", listen_port=0,
                        next_hop="127.0.0.1:1"))
                # added by address, the insider is listed under its own certificate's id, not the victim's
                lone = FleetModel(tmp_path / "lone", f.host.credentials)
                added = await lone.async_add_address("127.0.0.1", port)
                assert added.node_id == mallory.node_id and alpha_id not in {r.key for r in lone.records()}
            assert asked == ["/v1/probe"]  # the pinned calls were refused before a request went out

    run(main(), 120)
    assert "now answers as another agent" in caplog.text or "not as" in caplog.text
    assert "claims node id" in caplog.text


@pytest.mark.slow
def test_forged_mdns_records_change_no_approved_agent_and_make_no_node_id_approvable(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    async def main():
        async with joined_fleet(tmp_path, ("alpha", "mallory")) as f:
            alpha_id, mallory_id = f.node("alpha"), f.node("mallory")
            alpha = f.agents["alpha"]
            await f.fleet.async_add_address("127.0.0.1", alpha.control_port)
            f.fleet.approve(alpha_id)
            before = f.fleet.get(alpha_id)
            mallory_port = f.agents["mallory"].control_port
            fabricated = [secrets.token_hex(32) for _ in range(3)]
            forged = [Advertisement(instance=f"forged-{i}", node_id=node, fleet_id=f.host.credentials.fleet_id,
                                    version="0.1.0", devices=("GPU",), memory_bytes=64 << 30, state="paused",
                                    control_port=mallory_port, addresses=("127.0.0.1",))
                      for i, node in enumerate([alpha_id, *fabricated])]
            advertisers = [Advertiser("127.0.0.1") for _ in forged]
            browser = Browser("127.0.0.1", f.fleet.update_peers)
            try:
                for advertiser, ad in zip(advertisers, forged, strict=True):
                    await advertiser.async_start(ad)
                await browser.async_start()
                keys = set(fabricated) | {mallory_id}
                await until(lambda: keys <= {r.key for r in f.fleet.records()} and f.fleet.get(mallory_id).verified,
                            "the forged records listed and their address probed")
                await until(lambda: caplog.text.count("the agent there proved to be") >= 4, "every probe")
                after = f.fleet.get(alpha_id)
                assert (after.address, after.control_port, after.state, after.approved) == \
                    (before.address, before.control_port, before.state, True)
                assert not after.paused and "GPU" not in after.devices  # the forged hardware neither
                for node in fabricated:
                    record = f.fleet.get(node)
                    assert not record.verified and not record.approved
                    with pytest.raises(ForeignAgentError, match="mutual TLS"):
                        f.fleet.approve(node)
                    with pytest.raises(ForeignAgentError):
                        f.fleet.client(node)
                assert f.fleet.get(mallory_id).address == "127.0.0.1"  # mallory is only herself
            finally:
                await browser.async_close()
                for advertiser in advertisers:
                    await advertiser.async_close()

    run(main(), 120)
    assert "an mDNS record claims agent" in caplog.text


def test_an_mdns_flood_stops_at_the_browsers_caps(monkeypatch, caplog):
    """Past MAX_PEERS agents tracked, a new name is not even looked up (logged once)."""
    import engine.discovery.mdns as discovery

    monkeypatch.setattr(discovery, "MAX_PEERS", 2)
    browser = discovery.Browser("127.0.0.1")
    ad = Advertisement(instance="a", node_id="", fleet_id="", version="0.1.0", devices=(), memory_bytes=0,
                       state="idle", control_port=1, addresses=("127.0.0.1",))
    browser._peers = {"a": discovery.Peer(ad, 0.0), "b": discovery.Peer(ad, 0.0)}
    for name in ("c", "d"):  # outside a loop: a lookup that were started would raise here
        browser._on_service_state_change(None, discovery.SERVICE_TYPE, f"{name}.{discovery.SERVICE_TYPE}",
                                         discovery.ServiceStateChange.Added)
    assert not browser._pending and set(browser.peers()) == {"a", "b"}
    assert caplog.text.count("agents tracked already") == 1


@pytest.mark.slow
def test_removing_a_member_rotates_the_api_key_and_only_the_remaining_members_get_the_new_one(tmp_path, tiny_export):
    """The one fleet API key rode in every assignment, so a removed PC kept API access. Removing
    it rotates the key: the running API refuses the old key at once and takes the new one, the
    keyring holds the new one, and the remaining member's stored assignment (its tray's chat) gets
    a key of its own with the deny list (an old-shape assignment, accepted by a live agent, replaced);
    the removed PC gets nothing."""
    export = tiny_export("llama", 2)

    async def status(api, key):
        async with aiohttp.ClientSession() as session:
            async with session.get(api.url + "/models", headers={"Authorization": f"Bearer {key}"}) as resp:
                return resp.status

    async def main():
        async with joined_fleet(tmp_path, ("alpha", "beta"), exports={"tiny-2": export}) as f:
            old = f.host.api_key
            assert old
            detach = f.fleet.attach_api_key(f.host.rotate_api_key, f.host.member_key)
            for name, stage in (("alpha", 0), ("beta", 1)):
                a = f.agents[name]
                await f.fleet.async_add_address("127.0.0.1", a.control_port)
                f.fleet.approve(a.status().node_id)
                await f.fleet.client(a.status().node_id).async_assign(Assignment.create(
                    (export / "manifest.json").read_text(), export_id="tiny-2", stage=stage,
                    source=f.host.hub.shard_url("tiny-2"), listen_port=0, next_hop="127.0.0.1:1",
                    api_url="http://127.0.0.1:1/v1", api_key=old))
            alpha, beta = f.agents["alpha"], f.agents["beta"]
            async with served(tiny_export, dataclasses.replace(SETTINGS, api_key=old)) as (_, api):
                unsubscribe = f.host.subscribe_api_key(api.set_api_key)  # what the fleet service does for its API
                assert await status(api, old) == 200
                f.fleet.remove(beta.status().node_id)
                new = f.host.api_key
                assert new != old and new.startswith("sk-")
                assert await status(api, old) == 401 and await status(api, new) == 200
                assert await f.fleet.async_push_deny() == {}
                unsubscribe()
            # the remaining member gets a key of its own with the deny list, never the new console key (M9)
            own = f.host.member_key(alpha.status().node_id)
            assert alpha.assignment.api_key == own and own not in (new, old)
            assert f.host.keys.identify(own).node_id == alpha.status().node_id
            assert beta.assignment.api_key == old  # the removed PC was told nothing
            assert ConsoleSecrets(tmp_path / "console").get(API_KEY_SECRET) == new  # kept for the next start
            detach()

    run(main(), 180)


def test_a_refused_shard_fetch_reads_only_a_few_kib_of_the_answer(tmp_path, tiny_export):
    """A hub answering a fetch with an error and an endless body: the agent reads at most
    MAX_ERROR_BYTES of it and reports the refusal (it used to read the whole body first)."""
    from agent.service.store import MAX_ERROR_BYTES, FetchError, ShardStore, async_fetch
    from engine.trust.fleet_ca import FleetAuthority

    export = tiny_export("llama", 2)
    authority = FleetAuthority.create("fetch test")
    hub = authority.issue_credentials("console", role=Role.CONSOLE)
    member = authority.issue_credentials("member", role=Role.AGENT)
    sent = []

    async def endless(request):
        resp = web.StreamResponse(status=404)
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            while True:  # until the agent hangs up
                await resp.write(b"x" * 65536)
                sent.append(65536)
        return resp

    async def main():
        async with fake_server(hub, [("GET", "/shards/{tail:.*}", endless)]) as port:
            assignment = Assignment.create((export / "manifest.json").read_text(), export_id="tiny-2", stage=1,
                                           source=f"https://127.0.0.1:{port}/shards/tiny-2/", listen_port=0,
                                           next_hop="127.0.0.1:1")
            with pytest.raises(FetchError, match=f"HTTP 404.*exceeds {MAX_ERROR_BYTES} bytes"):
                await asyncio.wait_for(async_fetch(ShardStore(tmp_path / "shards"), assignment,
                                                   ssl=member.client_context(), service_node_id=hub.node_id,
                                                   timeout=10), 30)  # did not hang
        assert sent  # the body really was being streamed when the agent gave up

    run(main(), 60)
