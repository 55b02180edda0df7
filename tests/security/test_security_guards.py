"""Guards for what issue 19 says must keep holding and no other test pinned down: 128-bit join
secrets, single use under 20 concurrent joins with one token, and TLS 1.2 as the floor of every
fleet context (an older client is refused by a real server; strict X.509 on both sides)."""

from __future__ import annotations

import asyncio
import ssl

import aiohttp
from aiohttp import web

from engine.control.enrollment import EnrollmentServer, _pinned_context, async_join
from engine.control.hub import FleetHub
from engine.errors import JoinRefused
from engine.http_limits import ConnectionLimits
from engine.trust.fleet_ca import FleetAuthority, Role
from engine.trust.join_token import TokenBook, parse_token
from tests.support.asyncutil import run

JOINS = 20


def test_join_secrets_are_128_bits_and_never_repeat(tmp_path):
    authority = FleetAuthority.create("guards")
    book = TokenBook(tmp_path / "tokens.json", authority.fingerprint)
    secrets_seen = {parse_token(book.issue()).secret for _ in range(32)}
    assert len(secrets_seen) == 32
    assert {len(s) for s in secrets_seen} == {16}


def test_one_token_admits_exactly_one_of_twenty_concurrent_joins(tmp_path):
    authority = FleetAuthority.create("guards")
    book = TokenBook(tmp_path / "tokens.json", authority.fingerprint)
    console = authority.issue_credentials("console", role=Role.CONSOLE)
    joined: list[str] = []
    server = EnrollmentServer(authority, book, console, on_join=lambda node, name, info: joined.append(node))

    async def main():
        host, port = await server.async_start("127.0.0.1", 0)
        token = book.issue()
        try:
            return await asyncio.gather(*(async_join(f"{host}:{port}", token, f"pc-{i}") for i in range(JOINS)),
                                        return_exceptions=True)
        finally:
            await server.async_close()

    outcomes = run(main(), 120)
    admitted = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, JoinRefused)]
    assert len(admitted) == 1 and len(refused) == JOINS - 1, outcomes
    assert joined == [admitted[0].credentials.node_id]


def test_every_fleet_context_is_tls_1_2_or_later_strict_and_an_older_client_is_refused():
    authority = FleetAuthority.create("guards")
    console = authority.issue_credentials("console", role=Role.CONSOLE)
    member = authority.issue_credentials("pc", role=Role.AGENT)
    for ctx in (console.server_context(), console.server_context(verify_clients=False), member.client_context(),
                _pinned_context(authority.ca_pem)):  # the join's, before the PC has a certificate
        assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
        assert ctx.verify_flags & ssl.VERIFY_X509_STRICT
    assert console.server_context().verify_mode is ssl.CERT_REQUIRED
    assert member.client_context().verify_mode is ssl.CERT_REQUIRED

    old = member.client_context()  # the same member's certificate, offering only TLS 1.0/1.1
    old.minimum_version = ssl.TLSVersion.TLSv1
    old.maximum_version = ssl.TLSVersion.TLSv1_1

    async def call(client_ctx):
        app = web.Application()
        app.router.add_get("/", lambda request: web.Response(text="ok"))
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=console.server_context()).start()
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                async with session.get(f"https://127.0.0.1:{runner.addresses[0][1]}/", ssl=client_ctx) as resp:
                    return await resp.text()
        except aiohttp.ClientError as exc:
            return exc
        finally:
            await runner.cleanup()

    assert run(call(member.client_context()), 30) == "ok"  # the same member, current TLS: admitted
    assert isinstance(run(call(old), 30), aiohttp.ClientError)


def test_past_its_connection_caps_a_listener_reclaims_waiting_connections_and_keeps_serving():
    """The hub with small caps (2 per address, 3 in all; the real defaults are 32 and 256): a
    keep-alive client registers, and connections from its address and two others each get a slot by
    closing the longest-waiting connection (of its own address, past the per-address cap; of the
    most crowded one, past the total cap); the hub still serves its member afterwards. That a running
    request keeps its slot, and what every listener uses, is in test_slow_clients.py."""
    authority = FleetAuthority.create("guards")
    console = authority.issue_credentials("console", role=Role.CONSOLE)
    member = authority.issue_credentials("pc", role=Role.AGENT)
    hub = FleetHub(console, limits=ConnectionLimits(per_ip=2, total=3))

    async def raw(source: str):
        """A raw TLS connection from ``source``: 'served' if it answers a request, else 'closed'."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", hub.port, ssl=member.client_context(),
                                                           local_addr=(source, 0))
            writer.write(b"GET /v1/shards/none/x HTTP/1.1\r\nHost: hub\r\n\r\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 10)  # did not hang
        except (ConnectionError, ssl.SSLError):
            return "closed", None
        return ("served" if line.startswith(b"HTTP/1.1 ") else "closed"), writer

    async def main():
        await hub.async_start("127.0.0.1", 0)
        held = []
        try:
            connector = aiohttp.TCPConnector(limit=1, ssl=member.client_context())
            async with aiohttp.ClientSession(connector=connector) as session:
                url = f"https://127.0.0.1:{hub.port}/v1/register"
                async with session.post(url, json={"name": "pc"}) as resp:
                    first = resp.status
                outcomes, reclaimed = [], []
                for source in ("127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.3"):
                    outcome, writer = await raw(source)
                    outcomes.append(outcome)
                    reclaimed.append(hub._runner.connections.reclaimed)
                    if writer is not None:
                        held.append(writer)
                async with session.post(url, json={"name": "pc"}) as resp:
                    again = resp.status
            return first, outcomes, reclaimed, again
        finally:
            for writer in held:
                writer.close()
            await hub.async_close()

    first, outcomes, reclaimed, again = run(main(), 60)
    assert first == 200 and again == 200
    assert outcomes == ["served"] * 4
    assert reclaimed == [0, 1, 1, 2]  # the client's idle connection, then the first raw one of 127.0.0.1
