"""The data-plane transport: frame reads on in-memory streams, then live loopback sockets over
plain TCP and mutual TLS — handshakes, refusals, dialling, and a fuzzing client that must never
disturb a well-behaved one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket

import numpy as np
import pytest

from engine.wire.codec import encode
from engine.wire.format import (
    HEADER_SIZE,
    MIN_FRAME_BOUND,
    PROTOCOL_VERSION,
    ErrorCode,
    FrameTooLargeError,
    Role,
    TruncatedFrameError,
    WireError,
)
from engine.wire.frame_server import FrameServer
from engine.wire.handshake import HandshakeError, LocalIdentity
from engine.wire.messages import Error, Hello, HelloAck, Packed, Ping, Pong
from engine.wire.transport import (
    ConnectionClosedError,
    DialError,
    FrameTimeoutError,
    async_connect,
    async_dial_with_retry,
    async_read_frame,
)
from tests.wire.tlsutil import Pki, make_pki
from tests.wire.wire_helpers import (
    FP,
    HEADER_FIELD_BOUNDS,
    SAMPLES,
    TENSOR_FRAME,
    assert_same,
    decode_or_wire_error,
    patch_header,
    tensor_frame,
)

# --- stream reads without sockets ---------------------------------------------------------------


def read_from(data: bytes, eof: bool, **timeouts):
    """async_read_frame on an in-memory stream holding ``data`` (then EOF if ``eof``)."""

    async def read():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await async_read_frame(reader, 1 << 20, **timeouts)

    return asyncio.run(read())


def test_read_frame_never_waits_forever():
    with pytest.raises(FrameTimeoutError, match="idle"):
        read_from(b"", eof=False, idle_timeout=0.05)
    with pytest.raises(FrameTimeoutError, match="stalled mid-frame"):
        read_from(TENSOR_FRAME[:10], eof=False, timeout=0.05)
    with pytest.raises(FrameTimeoutError, match="stalled mid-frame"):
        read_from(TENSOR_FRAME[:-1], eof=False, timeout=0.05)
    with pytest.raises(TruncatedFrameError, match="mid-frame"):
        read_from(TENSOR_FRAME[:-1], eof=True)
    with pytest.raises(ConnectionClosedError):
        read_from(b"", eof=True)
    assert isinstance(read_from(TENSOR_FRAME, eof=False), Packed)


# --- live loopback sockets ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    """A fleet CA and a stranger CA with their certificates, made once for this module."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(params=["plain", "tls"])
def security(request, pki):
    """(server context, client context) for one run over plain TCP and one over mutual TLS."""
    return (None, None) if request.param == "plain" else (pki.server, pki.client)


async def echo(conn, msg):
    """A FrameServer handler that sends every tensor frame straight back."""
    if isinstance(msg, Packed):
        await conn.async_send(msg)


def run(coro, seconds=60.0):
    """Run ``coro`` on a fresh loop with an overall deadline, so no test can hang."""

    async def bounded():
        async with asyncio.timeout(seconds):
            return await coro

    return asyncio.run(bounded())


def fuzz_cases(count: int, seed: int = 20260501) -> list[tuple[bytes, bool, bool]]:
    """``count`` malformed frames as (bytes, send_after_handshake, truncated), all refused locally."""
    rng = random.Random(seed)
    valid = [
        encode(tensor_frame(s=rng.randint(1, 4), h=16, rng=np.random.default_rng(i)))
        for i in range(8)
    ] + [encode(m) for m in SAMPLES]
    cases: list[tuple[bytes, bool, bool]] = []
    while len(cases) < count:
        frame = rng.choice(valid)
        how = rng.choice(["flip", "field", "truncate", "garbage", "oversize"])
        truncated = False
        if how == "flip":
            data = bytearray(frame)
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(min(len(data), HEADER_SIZE + 40))] = rng.randrange(256)
            data = bytes(data)
        elif how == "field":
            name = rng.choice(sorted(HEADER_FIELD_BOUNDS))
            data = patch_header(frame, **{name: rng.randint(0, HEADER_FIELD_BOUNDS[name])})
        elif how == "truncate":
            data, truncated = frame[: rng.randrange(1, len(frame))], True
        elif how == "garbage":
            data = rng.randbytes(rng.randint(HEADER_SIZE, 200))
        else:  # a real frame larger than the server's bound, sent in full
            data = encode(tensor_frame(s=rng.randint(70, 90), h=1024))
        result = decode_or_wire_error(data, bound=256 * 1024)
        if isinstance(result, WireError) and (
            truncated or not isinstance(result, TruncatedFrameError)
        ):
            cases.append((data, rng.random() < 0.8, truncated))
    return cases


async def fuzz_one(host, port, client_ctx, data, after_handshake, truncated) -> str:
    """Send one malformed frame on its own connection; return how the server answered."""
    reader, writer = await asyncio.open_connection(host, port, ssl=client_ctx)
    try:
        if after_handshake:
            writer.write(encode(Hello(FP, 1, Role.STAGE)))
            assert isinstance(await async_read_frame(reader, timeout=5), HelloAck)
        writer.write(data)
        if truncated and writer.can_write_eof():
            writer.write_eof()  # plain TCP: the server sees the stream end mid-frame
        # TLS cannot half-close: the server's frame timeout must catch the stalled frame instead.
        try:
            reply = await async_read_frame(reader, timeout=5, idle_timeout=5)
        except ConnectionClosedError:
            return "closed"
        assert isinstance(reply, Error), f"malformed frame answered with {reply!r}"
        return f"error:{reply.code.name}"
    finally:
        writer.close()
        with contextlib.suppress(OSError):  # the server may reset after its Error frame
            await writer.wait_closed()


@pytest.mark.slow
def test_live_fuzzing_never_disturbs_a_well_behaved_stream(security):
    server_ctx, client_ctx = security
    cases = fuzz_cases(1000)

    async def scenario():
        server = FrameServer(
            echo,
            LocalIdentity(FP, 1),
            ssl=server_ctx,
            frame_timeout=0.5,
            max_frame_bytes=256 * 1024,
            handshake_timeout=2,
            max_per_peer=32,  # the 24 concurrent fuzzers all dial from 127.0.0.1
        )
        host, port = await server.async_start()
        good = await async_connect(host, port, Hello(FP, 1, Role.STAGE), ssl=client_ctx)
        fuzz_done = asyncio.Event()
        rng = np.random.default_rng(1)
        answered: list[float] = []

        async def well_behaved():
            seq = 0
            while not fuzz_done.is_set() or seq < 20:
                msg = tensor_frame(stream=42, seq=seq, s=int(rng.integers(1, 5)), h=64, rng=rng)
                await good.async_send(msg)
                reply = await good.async_recv(idle_timeout=10)
                assert_same(reply, msg)
                answered.append(asyncio.get_running_loop().time())
                seq += 1

        gate = asyncio.Semaphore(24)

        async def fuzz_all():
            async def guarded(case):
                async with gate, asyncio.timeout(15):
                    return await fuzz_one(host, port, client_ctx, *case)

            try:
                return await asyncio.gather(*(guarded(c) for c in cases))
            finally:
                fuzz_done.set()

        loop = asyncio.get_running_loop()
        started = loop.time()
        outcomes, _ = await asyncio.gather(fuzz_all(), well_behaved())
        finished = loop.time()
        during = [t for t in answered if started <= t <= finished]
        gaps = np.diff([started, *during, finished])
        fresh = await async_connect(host, port, Hello(FP, 1, Role.STAGE), ssl=client_ctx)
        await fresh.async_send(tensor_frame(stream=7))
        assert_same(await fresh.async_recv(idle_timeout=5), tensor_frame(stream=7))
        await fresh.async_close()
        await good.async_close()
        await server.async_close()
        return outcomes, during, gaps, server.stats

    outcomes, during, gaps, stats = run(scenario(), 100)
    assert len(outcomes) == len(cases) >= 1000
    errors = [o for o in outcomes if o.startswith("error:")]  # the rest closed cleanly
    assert len(errors) >= 0.99 * len(cases), sorted(set(outcomes))
    assert len(during) >= 20 and gaps.max() < 5.0, "the good stream stalled while fuzzing ran"
    assert stats["internal_error"] == 0
    assert stats["frame_error"] + stats["timeout"] == len(cases)


OTHER_VERSION = PROTOCOL_VERSION + 1  # a release ahead of this one


def test_handshake_mismatches_are_named(security):
    server_ctx, client_ctx = security

    async def scenario():
        server = FrameServer(echo, LocalIdentity(FP, 1, frozenset({Role.STAGE})), ssl=server_ctx)
        host, port = await server.async_start()
        fields_named = []
        for hello in (
            Hello(FP, 1, Role.STAGE, protocol_version=OTHER_VERSION),
            Hello("sha256-other", 1, Role.STAGE),
            Hello(FP, 3, Role.STAGE),
            Hello(FP, 1, Role.COORDINATOR),
        ):
            with pytest.raises(HandshakeError) as refused:
                await async_connect(host, port, hello, ssl=client_ctx, attempts=1)
            fields_named.append((refused.value.field, str(refused.value)))
        # A peer whose frame header carries another version is refused before any field is read.
        reader, writer = await asyncio.open_connection(host, port, ssl=client_ctx)
        writer.write(patch_header(encode(Hello(FP, 1, Role.STAGE)), version=OTHER_VERSION))
        reply = await async_read_frame(reader, timeout=5)
        writer.close()
        good = await async_connect(host, port, Hello(FP, 1, Role.STAGE), ssl=client_ctx)
        await good.async_send(Ping(99))
        pong = await good.async_recv(idle_timeout=5)
        await good.async_close()
        await server.async_close()
        return fields_named, reply, pong, server.stats

    fields_named, reply, pong, stats = run(scenario())
    names = [f for f, _ in fields_named]
    assert names == ["protocol_version", "model_fingerprint", "stage_index", "role"]
    for name, text in fields_named:
        assert f"{name} mismatch" in text
    assert reply.code is ErrorCode.PROTOCOL_VERSION_MISMATCH and f"version {OTHER_VERSION}" in reply.message
    assert pong == Pong(99)
    assert stats["handshake_refused"] == 4


def test_tls_refuses_strangers_and_sockets_are_tuned(pki):
    async def scenario():
        seen = []

        async def record(conn, msg):
            sock = conn.get_extra_info("socket")
            seen.append(
                (
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                    conn.peer_certificate() is not None,
                )
            )
            await conn.async_send(msg)

        server_bound = MIN_FRAME_BOUND
        server = FrameServer(
            record, LocalIdentity(FP, 0), ssl=pki.server, max_frame_bytes=server_bound
        )
        host, port = await server.async_start()
        with pytest.raises((HandshakeError, DialError)):  # client cert from another CA
            await async_connect(host, port, Hello(FP, 0, Role.STAGE), ssl=pki.stranger, attempts=1)
        start = asyncio.get_running_loop().time()
        with pytest.raises(DialError, match="fleet CA"):  # server cert untrusted: not retried
            await async_dial_with_retry(host, port, pki.naive, deadline=30)
        assert asyncio.get_running_loop().time() - start < 10
        conn = await async_connect(host, port, Hello(FP, 0, Role.STAGE), ssl=pki.client)
        sock = conn.get_extra_info("socket")
        client_opts = (
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        )
        await conn.async_send(tensor_frame())
        await conn.async_recv(idle_timeout=5)
        assert conn.peer_max_frame_bytes == server_bound  # announced in HelloAck
        with pytest.raises(FrameTooLargeError):  # refused before a byte is written
            await conn.async_send(tensor_frame(s=64, h=1024))
        await conn.async_close()
        await server.async_close()
        return seen, client_opts

    seen, client_opts = run(scenario())
    assert client_opts == (1, 1)
    assert seen == [(1, 1, True)]


def test_dial_retries_until_the_listener_appears():
    class FirstFailure(logging.Handler):
        def __init__(self, event):
            super().__init__()
            self.event = event

        def emit(self, record):
            if "attempt 1 failed" in record.getMessage():
                self.event.set()

    async def scenario():
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()  # a free port nobody listens on yet
        failed_once = asyncio.Event()
        handler = FirstFailure(failed_once)
        logging.getLogger("engine.wire.transport").addHandler(handler)
        try:
            dial = asyncio.create_task(
                async_connect("127.0.0.1", port, Hello(FP, 0, Role.COORDINATOR), deadline=20)
            )
            await failed_once.wait()
            server = FrameServer(echo, LocalIdentity(FP, 0))
            await server.async_start("127.0.0.1", port)
            conn = await dial
        finally:
            logging.getLogger("engine.wire.transport").removeHandler(handler)
        await conn.async_close()
        await server.async_close()
        with pytest.raises(DialError, match=f"127.0.0.1:{port} after 3 attempts"):
            await async_dial_with_retry("127.0.0.1", port, attempts=3, first_delay=0.01)

    run(scenario())


def test_a_failing_handler_costs_only_its_own_connection():
    async def scenario():
        async def fragile(conn, msg):
            if isinstance(msg, Packed) and msg.stream_id == 13:
                raise RuntimeError("stage exploded")
            await conn.async_send(msg)

        server = FrameServer(fragile, LocalIdentity(FP, 0))
        host, port = await server.async_start()
        a = await async_connect(host, port, Hello(FP, 0, Role.STAGE))
        b = await async_connect(host, port, Hello(FP, 0, Role.STAGE))
        await a.async_send(tensor_frame(stream=13))
        reply = await a.async_recv(idle_timeout=5)
        with pytest.raises(ConnectionClosedError):
            await a.async_recv(idle_timeout=5)
        await b.async_send(tensor_frame(stream=14))
        echoed = await b.async_recv(idle_timeout=5)
        await a.async_close()
        await b.async_close()
        await server.async_close()
        return reply, echoed, server.stats

    reply, echoed, stats = run(scenario())
    assert reply.code is ErrorCode.INTERNAL and "stage exploded" in reply.message
    assert_same(echoed, tensor_frame(stream=14))
    assert stats["internal_error"] == 1
