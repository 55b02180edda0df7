"""The WAN emulator: the pure link schedule, then real loopback sockets through the proxy —
delay as a lower bound, chunks in flight concurrently, order under jitter, the bandwidth cap,
end-of-stream and reset propagation, and a mutual-TLS data-plane link carried through it.

Timing asserts are lower bounds (the emulated delay must never be undercut); an upper bound only
where it tells a right proxy from a wrong one by a wide factor (chunks in flight together against
one held at a time; bytes against bits), never as a slack over the delay: a loaded machine may
schedule us late. How close to the configured delay the proxy stays is measured by the speedups
benchmark (``python -m tests.benchmarks speedups``, its WAN-emulator table)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import random
import socket
import time

import pytest

from engine.cli.wan import COMMAND, async_serve_wan
from engine.tools.wan_emulator import CHUNK_BYTES, LinkSchedule, WanProxy, WanProxyError
from engine.wire.address import Address
from engine.wire.format import Role
from engine.wire.frame_server import FrameServer
from engine.wire.handshake import LocalIdentity
from engine.wire.messages import Hello, Packed
from engine.wire.transport import async_connect
from tests.wire.tlsutil import make_pki
from tests.wire.wire_helpers import FP, assert_same, tensor_frame

D = 0.05  # one-way delay (s) of the timing tests
LOOPBACK = Address("127.0.0.1", 0)
IO_TIMEOUT = 10.0


def run(coro, seconds: float = 30.0):
    """Run ``coro`` on a fresh loop with an overall deadline, so no test can hang."""

    async def bounded():
        async with asyncio.timeout(seconds):
            return await coro

    return asyncio.run(bounded())


# --- the schedule, without sockets ------------------------------------------------------------


def test_schedule_delays_serialises_and_never_reorders():
    plain = LinkSchedule(0.05)
    assert plain.release_at(1.0, 100) == pytest.approx(1.05)
    assert plain.release_at(1.0, 0) == pytest.approx(1.05)  # end of stream travels like data

    capped = LinkSchedule(0.01, bandwidth_bps=8e6)  # 1 MB/s
    assert capped.release_at(0.0, 100_000) == pytest.approx(0.11)  # 0.1 s on the wire + 0.01
    assert capped.release_at(0.0, 100_000) == pytest.approx(0.21)  # queued behind the first
    assert capped.release_at(5.0, 100_000) == pytest.approx(5.11)  # the link went idle meanwhile

    jittery = LinkSchedule(0.02, 0.015, rng=random.Random(3))
    releases = [jittery.release_at(i * 0.001, 10) for i in range(500)]
    assert releases == sorted(releases)
    offsets = [r - i * 0.001 for i, r in enumerate(releases)]
    assert min(offsets) >= 0.005 - 1e-9
    assert max(offsets) > 0.03  # the jitter is really applied (and pushes later chunks too)


def test_schedule_clamps_jitter_at_zero_and_is_reproducible():
    wild = LinkSchedule(0.001, 0.5, rng=random.Random(1))
    assert all(wild.release_at(10.0, 1) >= 10.0 for _ in range(200))
    a, b = (LinkSchedule(0.02, 0.01, rng=random.Random(9)) for _ in range(2))
    assert [a.release_at(t, 1) for t in range(50)] == [b.release_at(t, 1) for t in range(50)]


@pytest.mark.parametrize(("name", "value"), [
    ("delay_ms", -1), ("delay_ms", math.nan), ("delay_ms", math.inf), ("jitter_ms", -0.5),
    ("bandwidth_mbit", 0), ("bandwidth_mbit", -10), ("queue_limit_bytes", 0), ("dial_timeout", 0),
])
def test_bad_parameters_are_refused_with_their_name(name, value):
    with pytest.raises(WanProxyError, match=name):
        WanProxy(LOOPBACK, LOOPBACK, **{"delay_ms": 1, name: value})


def test_cli_parses_its_arguments_and_reports_bad_ones():
    parser = argparse.ArgumentParser()
    COMMAND.configure(parser)
    args = parser.parse_args(["--listen", "127.0.0.1:0", "--target", "127.0.0.1:7002", "--delay-ms", "20",
                              "--jitter-ms", "2", "--bandwidth-mbit", "100"])
    assert (args.listen, args.target) == (LOOPBACK, Address("127.0.0.1", 7002))
    assert (args.delay_ms, args.jitter_ms, args.bandwidth_mbit, args.seed) == (20, 2, 100, None)
    with pytest.raises(WanProxyError, match="delay_ms"):
        run(async_serve_wan(parser.parse_args(["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1",
                                               "--delay-ms", "-3"])))


# --- live loopback sockets --------------------------------------------------------------------


def _nodelay(writer: asyncio.StreamWriter) -> None:
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send everything back; answer end of stream with end of stream."""
    _nodelay(writer)
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    writer.close()


@contextlib.asynccontextmanager
async def behind_proxy(handler=echo, **proxy_kwargs):
    """A loopback server running ``handler``, and a started WanProxy in front of it."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    target = Address("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        async with WanProxy(LOOPBACK, target, **proxy_kwargs) as proxy:
            yield proxy
    finally:
        server.close()
        await server.wait_closed()


async def dial(address: Address) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port), IO_TIMEOUT)
    _nodelay(writer)
    return reader, writer


async def read_to_end(reader: asyncio.StreamReader) -> bytes:
    """Everything up to end of stream; a reset counts as the end."""
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while data := await asyncio.wait_for(reader.read(CHUNK_BYTES), IO_TIMEOUT):
            chunks.append(data)
    return b"".join(chunks)


def test_round_trip_costs_twice_the_one_way_delay():
    async def scenario():
        async with behind_proxy(delay_ms=D * 1000) as proxy:
            reader, writer = await dial(proxy.address)
            started = time.perf_counter()
            writer.write(b"ping")
            echoed = await asyncio.wait_for(reader.readexactly(4), IO_TIMEOUT)
            elapsed = time.perf_counter() - started
            writer.close()
            return echoed, elapsed, proxy.stats

    echoed, elapsed, stats = run(scenario())
    assert echoed == b"ping"
    assert 2 * D <= elapsed
    assert (stats.connections, stats.up.bytes, stats.down.bytes) == (1, 4, 4)


@pytest.mark.parametrize("size", [16, CHUNK_BYTES], ids=["small", "chunk-sized"])
def test_back_to_back_messages_are_in_flight_together(size):
    """Twenty messages sent without waiting all come back within about one round trip.

    Chunk-sized messages cannot be merged into one read, so a proxy that held each chunk for
    the delay before reading the next would need at least 20 × delay each way: 40 × in all, against
    2 × for a proxy that keeps them in flight together. The bound between them, 20 ×, leaves a
    loaded machine 18 delays of slack."""
    count, delay = 20, 0.1

    async def scenario():
        async with behind_proxy(delay_ms=delay * 1000) as proxy:
            reader, writer = await dial(proxy.address)
            payload = [bytes([i]) * size for i in range(count)]
            started = time.perf_counter()

            async def send():
                for message in payload:
                    writer.write(message)
                    await writer.drain()

            sending = asyncio.create_task(send())
            echoed = await asyncio.wait_for(reader.readexactly(count * size), IO_TIMEOUT)
            elapsed = time.perf_counter() - started
            await sending
            writer.close()
            return echoed == b"".join(payload), elapsed

    intact, elapsed = run(scenario())
    assert intact
    assert 2 * delay <= elapsed < count * delay


def test_jitter_never_reorders_the_stream():
    async def scenario():
        async with behind_proxy(delay_ms=20, jitter_ms=15, seed=7) as proxy:
            reader, writer = await dial(proxy.address)
            sent = b"".join(b"%04d;" % i for i in range(100))
            for i in range(0, len(sent), 5):
                writer.write(sent[i:i + 5])
                await asyncio.sleep(0.001)  # pacing, so the proxy reads many separately jittered chunks
            echoed = await asyncio.wait_for(reader.readexactly(len(sent)), IO_TIMEOUT)
            writer.close()
            return sent, echoed, proxy.stats

    sent, echoed, stats = run(scenario())
    assert echoed == sent
    assert stats.up.chunks >= 10  # otherwise this test did not exercise jitter between chunks


def test_bandwidth_cap_paces_a_bulk_transfer():
    size = 1_000_000  # 8 Mbit: at least 0.8 s through a 10 Mbit/s link

    async def scenario():
        async with behind_proxy(delay_ms=5, bandwidth_mbit=10) as proxy:
            reader, writer = await dial(proxy.address)
            started = time.perf_counter()
            writer.write(bytes(size))
            echoed = await asyncio.wait_for(reader.readexactly(size), IO_TIMEOUT)
            elapsed = time.perf_counter() - started
            writer.close()
            return len(echoed), elapsed, proxy.stats

    n, elapsed, stats = run(scenario())
    assert n == size and stats.up.bytes == stats.down.bytes == size
    assert 0.8 <= elapsed < 4.0  # the upper bound catches a bits/bytes mix-up (6.4 s), not a slow machine


def test_end_of_stream_follows_the_data_both_ways():
    async def scenario():
        async with behind_proxy(delay_ms=D * 1000) as proxy:
            reader, writer = await dial(proxy.address)
            started = time.perf_counter()
            writer.write(b"last words")
            writer.write_eof()  # half-close: the echo still has to come back
            echoed = await read_to_end(reader)
            elapsed = time.perf_counter() - started
            writer.close()
            return echoed, elapsed

    echoed, elapsed = run(scenario())
    assert echoed == b"last words"
    assert elapsed >= 2 * D


def test_target_closing_reaches_the_client_and_client_closing_reaches_the_target():
    async def scenario():
        target_saw_eof: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def greet_then_listen(reader, writer):
            writer.write(b"hello")
            target_saw_eof.set_result(await read_to_end(reader))
            writer.close()

        async def greet_then_hang_up(reader, writer):
            writer.write(b"bye")
            writer.close()

        async with behind_proxy(greet_then_hang_up, delay_ms=10) as proxy:
            reader, writer = await dial(proxy.address)
            from_closing_target = await read_to_end(reader)
            writer.close()
        async with behind_proxy(greet_then_listen, delay_ms=10) as proxy:
            reader, writer = await dial(proxy.address)
            greeting = await asyncio.wait_for(reader.readexactly(5), IO_TIMEOUT)
            writer.write(b"thanks")
            writer.close()  # a full close: the target must see the data, then end of stream
            left_over = await asyncio.wait_for(target_saw_eof, IO_TIMEOUT)
        return from_closing_target, greeting, left_over

    assert run(scenario()) == (b"bye", b"hello", b"thanks")


def test_closing_the_proxy_ends_its_connections_and_stops_listening():
    async def scenario():
        async with behind_proxy(delay_ms=10) as proxy:
            address = proxy.address
            reader, writer = await dial(address)
            writer.write(b"x")
            assert await asyncio.wait_for(reader.readexactly(1), IO_TIMEOUT) == b"x"
            await proxy.async_close()
            rest = await read_to_end(reader)
            writer.close()
            with pytest.raises(ConnectionRefusedError):
                await dial(address)
            return rest

    assert run(scenario()) == b""


def test_unreachable_target_resets_the_client_and_warns_once(caplog):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = Address("127.0.0.1", probe.getsockname()[1])

    async def scenario():
        async with WanProxy(LOOPBACK, dead, delay_ms=1, dial_timeout=0.3) as proxy:
            for _ in range(2):
                reader, writer = await dial(proxy.address)
                assert await read_to_end(reader) == b""
                writer.close()

    with caplog.at_level(logging.DEBUG, logger="engine.tools.wan_emulator"):
        run(scenario())
    levels = [r.levelno for r in caplog.records if "could not reach" in r.getMessage()]
    assert levels == [logging.WARNING, logging.DEBUG]


def test_a_target_that_starts_late_is_redialled():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario():
        async with WanProxy(LOOPBACK, Address("127.0.0.1", port), delay_ms=1) as proxy:
            reader, writer = await dial(proxy.address)
            writer.write(b"early")
            server = await asyncio.start_server(echo, "127.0.0.1", port)
            async with server:
                echoed = await asyncio.wait_for(reader.readexactly(5), IO_TIMEOUT)
                writer.close()
            return echoed

    assert run(scenario()) == b"early"


def test_a_mutual_tls_data_plane_link_runs_through_the_proxy(tmp_path):
    """The proxy sits below TLS and the wire protocol: a ring hop cannot tell it is there."""
    pki = make_pki(tmp_path)

    async def reflect(conn, msg):
        if isinstance(msg, Packed):
            await conn.async_send(msg)

    async def scenario():
        server = FrameServer(reflect, LocalIdentity(FP, 1), ssl=pki.server)
        host, port = await server.async_start("127.0.0.1", 0)
        try:
            async with WanProxy(LOOPBACK, Address(host, port), delay_ms=D * 1000, jitter_ms=5) as proxy:
                conn = await async_connect(proxy.address.host, proxy.address.port,
                                           Hello(FP, 1, Role.STAGE), ssl=pki.client, deadline=IO_TIMEOUT)
                sent = tensor_frame(s=4, h=64)
                started = time.perf_counter()
                await conn.async_send(sent)
                back = await conn.async_recv(idle_timeout=IO_TIMEOUT)
                elapsed = time.perf_counter() - started
                await conn.async_close()
                return sent, back, elapsed
        finally:
            await server.async_close()

    sent, back, elapsed = run(scenario())
    assert_same(sent, back)
    assert 2 * (D - 0.005) <= elapsed  # the delay less the most the jitter takes off it, both ways
