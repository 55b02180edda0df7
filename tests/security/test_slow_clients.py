"""Slow clients cannot hold a listener (security review M4): every HTTP listener's runner
(engine/http_limits.py) closes a request whose headers or body do not arrive within their deadline,
and reclaims a waiting connection when a newcomer needs its slot. Played live on loopback: many
connections trickling header bytes from several 127.0.0.x addresses against the real enrolment
endpoint (TLS, no client certificate: the listener a stranger reaches), then an honest client."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import ssl

import aiohttp
import pytest
from aiohttp import web

from engine.control.enrollment import EnrollmentServer
from engine.http_limits import ConnectionCounter, ConnectionLimits, LimitedAppRunner, Phase
from engine.trust.fleet_ca import FleetAuthority, Role
from engine.trust.join_token import TokenBook
from tests.support.asyncutil import run, until

ADDRESSES = [f"127.0.0.{i}" for i in range(2, 10)]  # 8 attacking addresses, as in the review
LIMITS = ConnectionLimits(per_ip=8, total=64, header_timeout_s=1.0, body_timeout_s=1.0)
GUARD_S = 30.0  # a hang guard, not a speed figure


@pytest.fixture(scope="module")
def enrolment(tmp_path_factory):
    """A real enrolment endpoint (not started) with short deadlines."""
    authority = FleetAuthority.create("slow")
    console = authority.issue_credentials("console", role=Role.CONSOLE)
    book = TokenBook(tmp_path_factory.mktemp("slow") / "tokens.json", authority.fingerprint)
    return lambda: EnrollmentServer(authority, book, console, limits=LIMITS)


def _client_tls() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the stranger pins nothing
    return ctx


async def _trickler(port: int, source: str, head: bytes, stop: asyncio.Event) -> bytes:
    """One hostile connection: ``head``, then a byte every 0.2 s until the server closes it (what
    it answered is returned) or ``stop``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_client_tls(), local_addr=(source, 0))
    answer = b""
    try:
        writer.write(head)
        while not stop.is_set():
            writer.write(b"X")
            await writer.drain()
            try:
                answer += await asyncio.wait_for(reader.read(4096), 0.2)
            except TimeoutError:
                continue
            if reader.at_eof():
                return answer + b"<closed>"
    except (ConnectionError, ssl.SSLError):
        return answer + b"<closed>"
    finally:
        writer.close()
    return answer + b"<open>"


@pytest.mark.slow  # 64 TLS connections and a deadline: several seconds on a busy CI box
def test_trickling_connections_from_eight_addresses_cannot_deny_an_honest_client(enrolment):
    server = enrolment()

    async def main():
        _, port = await server.async_start("127.0.0.1", 0)
        stop = asyncio.Event()
        head = b"POST /v1/join HTTP/1.1\r\nHost: console\r\nX-Slow: "
        try:
            hostile = [asyncio.create_task(_trickler(port, source, head, stop))
                       for source in ADDRESSES for _ in range(LIMITS.per_ip)]
            counter = server._runner.connections
            await until(lambda: counter.total == LIMITS.total, "the trickling connections to fill every slot")
            async with aiohttp.ClientSession() as session:
                async with session.get(f"https://127.0.0.1:{port}/v1/ca", ssl=_client_tls(),
                                       timeout=aiohttp.ClientTimeout(total=GUARD_S)) as reply:
                    served = reply.status, "BEGIN CERTIFICATE" in await reply.text()
            outcomes = await asyncio.wait_for(asyncio.gather(*hostile), GUARD_S)
            return served, outcomes, counter.total
        finally:
            stop.set()
            await server.async_close()

    served, outcomes, left = run(main(), 120)
    assert served == (200, True)
    assert all(o.endswith(b"<closed>") for o in outcomes), outcomes  # closed by the header deadline
    assert not any(o.startswith(b"HTTP/1.1 2") for o in outcomes)
    assert left == 0


def test_a_trickled_body_is_cut_off_at_the_body_deadline(enrolment):
    server = enrolment()

    async def main():
        _, port = await server.async_start("127.0.0.1", 0)
        stop = asyncio.Event()
        head = (b"POST /v1/join HTTP/1.1\r\nHost: console\r\nContent-Type: application/json\r\n"
                b"Content-Length: 60000\r\n\r\n{")
        try:
            return await asyncio.wait_for(_trickler(port, "127.0.0.2", head, stop), GUARD_S)
        finally:
            stop.set()
            await server.async_close()

    answer = run(main(), 60)
    assert answer.startswith(b"HTTP/1.1 408 ") and answer.endswith(b"<closed>"), answer


def test_requests_that_run_keep_their_slots_and_a_newcomer_past_the_cap_is_closed():
    """Reclaiming takes only waiting connections: requests whose handlers run are never cut."""
    release = asyncio.Event

    async def main():
        gate = release()
        app = web.Application()

        async def hold(request):
            await gate.wait()
            return web.Response(text="held")

        app.router.add_get("/hold", hold)
        runner = LimitedAppRunner(app, limits=ConnectionLimits(per_ip=2, total=2, header_timeout_s=2.0))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}/hold"
                held = [asyncio.create_task(session.get(url)) for _ in range(2)]
                await until(lambda: sum(s.phase is Phase.RUNNING for s in runner.connections._slots.values()) == 2,
                            "two running requests")
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))
                writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
                newcomer = await asyncio.wait_for(reader.read(), GUARD_S)  # closed at once: no answer
                writer.close()
                gate.set()
                statuses = [(await t).status for t in held]
            return newcomer, statuses, runner.connections.refused
        finally:
            await runner.cleanup()

    newcomer, statuses, refused = run(main(), 60)
    assert newcomer == b"" and refused == 1
    assert statuses == [200, 200]


def test_the_cap_policy_reclaims_the_longest_waiting_connection_of_the_crowded_address():
    counter: ConnectionCounter[str] = ConnectionCounter(ConnectionLimits(per_ip=2, total=3))
    assert counter.admit("a1", "A", 0.0).reclaim is None
    assert counter.admit("a2", "A", 1.0).reclaim is None
    assert counter.admit("a3", "A", 2.0).reclaim == "a1"  # per address: A's own oldest waiting one
    assert counter.admit("b1", "B", 3.0).reclaim is None
    counter.running("a2")
    assert counter.admit("c1", "C", 4.0).reclaim == "a3"  # in all: the crowded A's waiting one
    counter.running("c1")
    counter.running("b1")
    refused = counter.admit("d1", "D", 5.0)  # every slot runs a request
    assert not refused.admitted and refused.reclaim is None and counter.refused == 1
    counter.waiting("b1", 6.0)
    assert counter.admit("d1", "D", 7.0).reclaim == "b1"
    counter.release("b1")  # the reclaimed connection's own close is a no-op
    assert counter.total == 3 and dict(counter.by_ip) == {"A": 1, "C": 1, "D": 1}


def test_every_http_listener_uses_the_limited_runner():
    for module in ("engine.api.server", "engine.control.enrollment", "engine.control.hub", "agent.service.service",
                   "console.fleet.admin_api"):
        source = inspect.getsource(importlib.import_module(module))
        assert "LimitedAppRunner(" in source and "web.AppRunner(" not in source, module
        assert "web.TCPSite(" not in source, module  # LimitedSite: its TLS handshakes end at the header deadline


def test_a_silent_tls_client_is_dropped_at_the_header_deadline(enrolment):
    """A stranger that connects and never starts its TLS handshake holds the socket only until the
    header deadline (1 s here), not asyncio's default 60 s."""
    server = enrolment()

    async def main():
        _, port = await server.async_start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        try:
            return await asyncio.wait_for(reader.read(), GUARD_S)  # b"" once the server closes it
        except TimeoutError:
            return None
        finally:
            writer.close()
            await server.async_close()

    assert run(main(), 60) == b""
