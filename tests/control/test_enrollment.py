"""Joining over real HTTPS on loopback: the console's enrollment server and the agent's client."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from engine.control.enrollment import EnrollmentServer, async_join
from engine.errors import (
    EnrollmentError,
    EnrollmentTimeout,
    JoinRefused,
    JoinTokenError,
    WrongFleetError,
)
from engine.trust.fleet_ca import (
    FleetAuthority,
    Role,
    make_key_and_csr,
    peer_node_id,
    sanitize_name,
)
from engine.trust.join_token import JoinToken, TokenBook
from tests.support.asyncutil import run

LOGGER = "deskfleet.enrollment"


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


class Console:
    """A fleet CA, its token book and a running enrollment server; ``joins`` records on_join calls."""

    def __init__(self, tmp_path, authority=None, credentials=None):
        self.authority = authority or FleetAuthority.create("Acme")
        self.clock = Clock()
        self.book = TokenBook(tmp_path / "tokens.json", self.authority.fingerprint, clock=self.clock)
        self.credentials = credentials or self.authority.issue_credentials("console", role=Role.CONSOLE)
        self.joins: list[tuple[str, str, dict]] = []
        self.server = EnrollmentServer(self.authority, self.book, self.credentials,
                                       on_join=lambda node, name, info: self.joins.append((node, name, info)))
        self.address = ""

    async def __aenter__(self):
        host, port = await self.server.async_start("127.0.0.1", 0)
        self.address = f"{host}:{port}"
        return self

    async def __aexit__(self, *exc):
        await self.server.async_close()


async def _post(address, body: bytes | dict):
    """POST /v1/join as a hand-written client would (no pin check), returning (status, json)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
        async with session.post(f"https://{address}/v1/join", ssl=False, **kwargs) as resp:
            return resp.status, await resp.json()


async def _mutual_tls_call(server_ctx, client_ctx):
    """Node id the server saw for a client over mutual TLS, or the client's exception."""
    seen = []

    async def who(request):
        seen.append(peer_node_id(request.transport.get_extra_info("ssl_object").getpeercert(binary_form=True)))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", who)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx).start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            async with session.get(f"https://127.0.0.1:{runner.addresses[0][1]}/", ssl=client_ctx) as resp:
                assert await resp.text() == "ok"
    finally:
        await runner.cleanup()
    return seen


def test_join_gives_working_fleet_credentials(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)

    async def scenario():
        async with Console(tmp_path) as console:
            token = console.book.issue()
            joined = await async_join(console.address, token, "Büro PC 3", info={"os": "Windows 11"})
            creds = joined.credentials
            # The console is known by its certificate as seen over the join's TLS (the agent pins it).
            assert joined.console_node_id == console.credentials.node_id
            # The node id is the certificate's fingerprint, and the console was told of it.
            der = x509.load_pem_x509_certificate(creds.cert_pem).public_bytes(serialization.Encoding.DER)
            assert creds.node_id == hashlib.sha256(der).hexdigest()
            # the console records the name as engine.trust.fleet_ca cleans it (a safe alphabet)
            assert console.joins == [(creds.node_id, sanitize_name("Büro PC 3"), {"os": "Windows 11"})]
            assert creds.fleet_id == console.authority.fleet_id and creds.role is Role.AGENT
            assert creds.ca_pem == console.authority.ca_pem
            # The new member and the console authenticate each other, in both directions.
            seen = await _mutual_tls_call(creds.server_context(), console.credentials.client_context())
            assert seen == [console.credentials.node_id]
            seen = await _mutual_tls_call(console.credentials.server_context(), creds.client_context())
            assert seen == [creds.node_id]
            return creds

    run(scenario(), 60)
    assert any(f"admitted {sanitize_name('Büro PC 3')}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("case", ["used", "expired", "unknown"])
def test_refused_tokens_are_403_with_the_reason_and_logged(tmp_path, caplog, case):
    async def scenario():
        async with Console(tmp_path) as console:
            if case == "unknown":
                token = JoinToken.new(console.authority.fingerprint).text
            else:
                token = console.book.issue(ttl_s=60)
            if case == "used":
                await async_join(console.address, token, "first")
            if case == "expired":
                console.clock.now += 61
            caplog.clear()
            with pytest.raises(JoinRefused) as refused:
                await async_join(console.address, token, "second")
            assert console.joins == ([] if case != "used" else console.joins[:1])
            return refused.value

    refused = run(scenario(), 60)
    assert refused.reason == case and "ask the admin for a new token" in str(refused)
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and case in warnings[0].getMessage() and "second" in warnings[0].getMessage()


def test_malformed_requests_are_400_or_403_with_a_clear_message_and_logged(tmp_path, caplog):
    async def scenario():
        async with Console(tmp_path) as console:
            token = console.book.issue()
            _, csr = make_key_and_csr("pc")
            good = {"token": token, "csr_pem": csr.decode(), "name": "pc"}
            answers = [
                await _post(console.address, b"{not json"),
                await _post(console.address, {"token": token}),
                await _post(console.address, b"x" * (128 << 10)),
                await _post(console.address, {**good, "csr_pem": "-----BEGIN CERTIFICATE REQUEST-----junk"}),
                await _post(console.address, {**good, "token": "DFJ1-what"}),
            ]
            # None of that used the token up: the genuine request still gets in.
            ok = await _post(console.address, good)
            return answers, ok

    answers, ok = run(scenario(), 60)
    assert [(status, body["reason"]) for status, body in answers] == [
        (400, "bad_request"), (400, "bad_request"), (400, "too_large"), (400, "bad_csr"), (403, "malformed")]
    assert "not JSON" in answers[0][1]["error"] and "csr_pem, name" in answers[1][1]["error"]
    assert "larger than" in answers[2][1]["error"] and "PEM CSR" in answers[3][1]["error"]
    assert "copy it again" in answers[4][1]["error"]
    assert ok[0] == 200 and set(ok[1]) >= {"cert_pem", "ca_pem", "fleet_id"}
    refusals = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(refusals) == 5 and "malformed" in refusals[-1]


def test_typo_in_token_is_caught_before_anything_is_sent(tmp_path, caplog):
    async def scenario():
        async with Console(tmp_path) as console:
            token = console.book.issue()
            with pytest.raises(JoinTokenError, match="typo"):
                await async_join(console.address, token[:-1] + ("A" if token[-1] != "A" else "B"), "pc")
            assert console.book.outstanding() == 1

    run(scenario(), 60)
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_token_for_another_fleet_is_refused_before_the_csr_is_sent(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    other = FleetAuthority.create("Elsewhere")

    async def scenario():
        async with Console(tmp_path) as console:
            foreign = TokenBook(tmp_path / "other.json", other.fingerprint).issue()
            with pytest.raises(WrongFleetError, match="not the fleet your token is for"):
                await async_join(console.address, foreign, "pc")
            assert console.joins == []

    run(scenario(), 60)
    assert not [r for r in caplog.records if r.name == LOGGER]  # no join request ever arrived


def test_a_console_that_cannot_prove_the_pinned_ca_is_refused(tmp_path):
    # It serves the genuine CA certificate (public) but holds no certificate that CA signed.
    genuine = FleetAuthority.create("Acme")
    impostor = FleetAuthority.create("Impostor").issue_credentials("console", role=Role.CONSOLE)

    async def scenario():
        async with Console(tmp_path, authority=genuine, credentials=impostor) as console:
            token = console.book.issue()
            with pytest.raises(EnrollmentError, match="did not sign"):
                await async_join(console.address, token, "pc")
            assert console.book.outstanding() == 1 and console.joins == []

    run(scenario(), 60)


def test_every_wait_is_bounded(tmp_path):
    authority = FleetAuthority.create("Acme")
    token = JoinToken.new(authority.fingerprint).text

    async def scenario():
        async def silent(reader, writer):
            with contextlib.suppress(Exception):
                await reader.read()  # accept, then never answer (not even the TLS handshake)
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(EnrollmentTimeout, match="did not answer within 0.5 s"):
                await async_join(f"127.0.0.1:{port}", token, "pc", timeout=0.5)
        finally:
            server.close()
            await server.wait_closed()
        with pytest.raises(EnrollmentError, match="cannot connect"):
            await async_join(f"127.0.0.1:{port}", token, "pc", timeout=5)
        with pytest.raises(EnrollmentError, match="host:port"):
            await async_join("console-without-port", token, "pc")

    run(scenario(), 60)
