"""Guards for what issue 19 says must keep holding and no other test pinned down: 128-bit join
secrets, single use under 20 concurrent joins with one token, and TLS 1.2 as the floor of every
fleet context (an older client is refused by a real server; strict X.509 on both sides)."""

from __future__ import annotations

import asyncio
import ssl

import aiohttp
from aiohttp import web

from engine.enrollment import EnrollmentServer, _pinned_context, async_join
from engine.errors import JoinRefused
from engine.jointoken import TokenBook, parse_token
from engine.trust import FleetAuthority, Role
from tests.asyncutil import run

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
