"""Bounded data-plane resources against a real paged stage: a Hello-less first frame refused from its
header, tensors bounded by the stage's real sizes, 1,000 idle connections refused past the cap
while a real stream decodes, per-member caps, idle timeouts that ring hops survive by Ping; and
no plaintext door (worker and serve refuse a non-loopback address without TLS)."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

from engine.generation.request import GenerationRequest
from engine.paged.worker import paged_frame_bound
from engine.shards.manifest import load_manifest
from engine.trust.peer_policy import PeerPolicy
from engine.wire.address import Address
from engine.wire.codec import encode
from engine.wire.format import (
    COORDINATOR_STAGE,
    HEADER_STRUCT,
    MAGIC,
    PROTOCOL_VERSION,
    DType,
    ErrorCode,
    FrameKind,
)
from engine.wire.format import Role as WireRole
from engine.wire.messages import Error, Hello
from engine.wire.step_codec import step_reply_bound
from engine.wire.transport import ConnectionClosedError, async_connect, async_read_frame
from tests.conftest import PROMPT_IDS
from tests.security.dataplane_helpers import N, coordinator, fp_of, reply_bound, ring_path, worker
from tests.support.asyncutil import collect, run

IDLE = 1000  # idle connections thrown at a live stage; each is answered (accepted or refused)
CASES = {"idle connections against a live stage": IDLE}  # what tests/architecture/test_fuzz_budget.py may count


# -- bounded resources ---------------------------------------------------------------------------------

def _header(kind: FrameKind, dtype: DType, dims: tuple[int, ...], stream: int = 0) -> bytes:
    """A valid header announcing a tensor of ``dims`` (the body is never sent)."""
    size = int(np.prod(dims)) * {DType.FLOAT32: 4, DType.INT64: 8}[dtype]
    padded = (*dims, *([0] * (4 - len(dims))))
    return HEADER_STRUCT.pack(MAGIC, PROTOCOL_VERSION, kind, 0, stream, 0, dtype, len(dims), 0, *padded, 0, size)


def test_a_huge_first_frame_is_refused_after_its_header_and_tensors_are_bounded_after_the_handshake(export,
                                                                                                    stage):
    """Each first frame's header goes alone: the listener must answer it without the body it announces
    (so it consumed 56 bytes), or this test's wait for the answer times out."""
    fp = fp_of(export)
    model = load_manifest(export).model
    bound = paged_frame_bound(model.hidden_size, model.max_position_embeddings, vocab_size=model.vocab_size)

    async def answer(reader, writer, data: bytes):
        writer.write(data)
        await writer.drain()
        return await async_read_frame(reader, timeout=10, idle_timeout=10)

    async def main():
        w = worker(stage, Address("127.0.0.1", 9))
        address = await w.async_start()
        try:
            reader, writer = await asyncio.open_connection(address.host, address.port)
            huge = _header(FrameKind.STEP_REPLY, DType.FLOAT32, (1024, 65535), stream=1)  # 256 MiB
            first = await answer(reader, writer, huge)
            writer.close()
            # under the stage's own bound but no Hello: refused as soon as its header is in
            reader, writer = await asyncio.open_connection(address.host, address.port)
            medium = _header(FrameKind.STEP, DType.FLOAT32, (64, model.hidden_size), stream=1)
            second = await answer(reader, writer, medium)
            writer.close()
            conn = await async_connect(address.host, address.port, Hello(fp, 0, WireRole.COORDINATOR), attempts=1)
            too_big = _header(FrameKind.STEP, DType.FLOAT32, (bound // (4 * model.hidden_size) + 1,
                                                              model.hidden_size), stream=3)
            later = await answer(conn._reader, conn._writer, too_big)
            await conn.async_close()
            return (first, second), later, conn.peer_max_frame_bytes, dict(w.listener.stats)
        finally:
            await w.async_close()

    firsts, later, announced, stats = run(main(), 60)
    for first in firsts:
        assert isinstance(first, Error) and first.code is ErrorCode.UNEXPECTED_FRAME
        assert "first frame must be a Hello of at most 198 bytes" in first.message
    assert isinstance(later, Error) and later.code is ErrorCode.FRAME_TOO_LARGE
    assert announced == bound < 256 << 20  # the HelloAck tells the dialer the stage's real bound
    assert stats["frame_error"] == 3


def test_a_thousand_idle_connections_are_refused_past_the_cap_while_a_real_stream_decodes(export, stage):
    """1,000 TCP connections from 125 loopback addresses (8 each, at the per-peer cap) against a stage
    whose listener takes 64; the ring's own connection was there first and its stream decodes exactly
    as without them. Then 12 from one address: those past the per-peer cap of 8 are refused."""
    request = GenerationRequest(PROMPT_IDS, N, ignore_eos=True)

    async def main():
        path = ring_path(export, dial_deadline=10)
        ret = await path.async_listen()
        w = worker(stage, ret, handshake_timeout=60)
        path.first_remote = address = await w.async_start()
        listener = w.listener
        idle: list[asyncio.StreamWriter] = []

        async def settle(total: int) -> None:
            for _ in range(400):  # every connection accepted, or refused at once
                if listener.stats["refused_cap"] + listener.open_connections >= total:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"the listener did not settle: {listener.stats}, {listener.open_connections}")

        async def dial(source: str):
            _, writer = await asyncio.open_connection(address.host, address.port, local_addr=(source, 0))
            idle.append(writer)

        try:
            async with coordinator(path, export) as c:
                undisturbed = await collect(c, request)
                for batch in range(0, IDLE, 100):
                    await asyncio.gather(*(dial(f"127.0.0.{2 + i % 125}") for i in range(batch, batch + 100)))
                await settle(IDLE + 1)
                peak = listener.open_connections
                flooded = dict(listener.stats)
                during = await collect(c, request)
                for writer in idle:
                    writer.close()
                idle.clear()
                for _ in range(200):
                    if listener.open_connections == 1:
                        break
                    await asyncio.sleep(0.05)
                before = listener.stats["refused_cap"]
                await asyncio.gather(*(dial("127.0.0.200") for _ in range(12)))
                await settle(1 + 12 + before)
                one_peer = listener.stats["refused_cap"] - before
                after = await collect(c, request)
                return undisturbed, during, after, peak, flooded, one_peer
        finally:
            for writer in idle:
                writer.close()
            await w.async_close()
            await path.async_close()

    undisturbed, during, after, peak, flooded, one_peer = run(main(), 120)
    assert len(undisturbed) == N and during == undisturbed and after == undisturbed
    assert peak == 64  # the ring's connection plus 63 idle ones
    assert flooded["refused_cap"] == IDLE - 63
    assert one_peer == 12 - 8



@pytest.mark.slow
def test_ring_hops_idle_between_requests_stay_up_while_a_silent_dialer_is_timed_out(export, stage):
    """Both listeners close links silent for 1.5 s; the ring's dialers Ping every 0.3 s, so the same
    two connections carry a request after 4 s of idleness, while a dialer that only handshook is cut."""
    fp = fp_of(export)
    request = GenerationRequest(PROMPT_IDS, N, ignore_eos=True)

    async def main():
        path = ring_path(export, dial_deadline=10, ping_interval=0.3, idle_timeout=1.5)
        ret = await path.async_listen()
        w = worker(stage, ret, idle_timeout=1.5, ping_interval=0.3)
        path.first_remote = await w.async_start()
        try:
            async with coordinator(path, export) as c:
                first = await collect(c, request)
                silent = await async_connect(path.first_remote.host, path.first_remote.port,
                                             Hello(fp, 0, WireRole.COORDINATOR), attempts=1)
                await asyncio.sleep(4)
                try:
                    cut = await silent.async_recv(idle_timeout=5)
                except ConnectionClosedError:
                    cut = "closed"
                await silent.async_close()
                second = await collect(c, request)
                return (first, second, cut, dict(w.listener.stats), dict(path.returns.stats),
                        w.listener.open_connections, path.returns.open_connections)
        finally:
            await w.async_close()
            await path.async_close()

    first, second, cut, stage_stats, return_stats, stage_open, return_open = run(main(), 90)
    assert second == first and len(first) == N
    assert isinstance(cut, Error) and cut.code is ErrorCode.TIMEOUT
    assert stage_stats == {"timeout": 1} and return_stats == {}  # only the silent dialer was closed
    assert (stage_open, return_open) == (1, 1)


def test_one_member_may_hold_only_so_many_connections_from_any_number_of_addresses(fleet, export, stage):
    console, desk = fleet["console"], fleet["desk"]
    fp = fp_of(export)
    hello = Hello(fp, 0, WireRole.COORDINATOR)

    async def main():
        w = worker(stage, Address("127.0.0.1", 9), server_ssl=desk.server_context(), client_ssl=desk.client_context(),
                   peers=PeerPolicy.of([console.node_id]), max_per_peer=3)
        address = await w.async_start()
        held, outcomes = [], []
        try:
            for i in range(5):  # a new source address each time: only the node id cap can bind
                reader, writer = await asyncio.open_connection(address.host, address.port, ssl=console.client_context(),
                                                               local_addr=(f"127.0.0.{10 + i}", 0))
                held.append(writer)
                writer.write(encode(hello))
                await writer.drain()
                reply = await async_read_frame(reader, timeout=10, idle_timeout=10)
                outcomes.append(type(reply).__name__ if not isinstance(reply, Error) else reply.code.name)
            return outcomes, dict(w.listener.stats)
        finally:
            for writer in held:
                writer.close()
            await w.async_close()

    outcomes, stats = run(main(), 60)
    assert outcomes == ["HelloAck"] * 3 + ["PEER_REFUSED"] * 2
    assert stats["refused_cap"] == 2


def test_the_return_port_refuses_an_oversized_frame_from_the_last_stage_unread(fleet, export):
    """The coordinator's return port is bounded by what the last stage can send (a StepReply of
    the step's answered rows, each with logits over the export's vocabulary), not by the wire's
    256 MiB: a StepReply announcing twice the rows' logits is refused from its header, even from
    the expected last stage."""
    console, desk = fleet["console"], fleet["desk"]
    model = load_manifest(export).model
    bound = reply_bound(export)
    too_big = _header(FrameKind.STEP_REPLY, DType.FLOAT32, (2 * bound // (4 * model.vocab_size), model.vocab_size),
                      stream=1)

    async def main():
        path = ring_path(export, Address("127.0.0.1", 9), server_ssl=console.server_context(),
                         client_ssl=console.client_context(), peers=PeerPolicy.of([desk.node_id]))
        address = await path.async_listen()
        try:
            conn = await async_connect(address.host, address.port, Hello(fp_of(export), COORDINATOR_STAGE,
                                                                        WireRole.STAGE),
                                       ssl=desk.client_context(), attempts=1)
            conn._writer.write(too_big)  # the header alone: an answer proves the body was never awaited
            await conn._writer.drain()
            answer = await async_read_frame(conn._reader, timeout=10, idle_timeout=10)
            await conn.async_close()
            return answer, conn.peer_max_frame_bytes
        finally:
            await path.async_close()

    assert bound < int(np.frombuffer(too_big[-8:], "<u8")[0]) < 256 << 20  # under today's bound, over the real one
    answer, announced = run(main(), 60)
    assert isinstance(answer, Error) and answer.code is ErrorCode.FRAME_TOO_LARGE
    assert announced == bound < 256 << 20
    assert step_reply_bound(150_000, 1 << 20, 1 << 20) == 256 << 20  # an unknown or huge export: today's bound


# -- no plaintext door ------------------------------------------------------------------------------

def test_a_worker_refuses_to_listen_beyond_loopback_without_tls(export):
    import subprocess

    cmd = [sys.executable, "-m", "engine.cli.main", "worker", "--shard", str(export), "--next", "127.0.0.1:9",
           "--paged"]
    exposed = subprocess.run([*cmd, "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=120)
    flags = subprocess.run([*cmd, "--expect-upstream", "a" * 64], capture_output=True, text=True, timeout=120)
    assert exposed.returncode == 1 and "--tls-stdin" in exposed.stderr and "0.0.0.0:0" in exposed.stderr
    assert flags.returncode == 1 and "need --tls-stdin" in flags.stderr


def test_serve_over_a_ring_needs_tls_off_loopback_and_the_ring_ends_with_it(fleet, tmp_path):
    import argparse

    from engine.cli.serve import configure, ring_options
    from engine.errors import DeskfleetError

    parser = argparse.ArgumentParser()
    configure(parser)
    console, desk = fleet["console"], fleet["desk"]
    creds = tmp_path / "console.json"
    creds.write_text(json.dumps({"ca_pem": console.ca_pem.decode(), "cert_pem": console.cert_pem.decode(),
                                 "key_pem": console.key_pem.decode()}))

    def options(*argv):
        return ring_options(parser.parse_args(["--shards", str(tmp_path), *argv]))

    assert parser.parse_args(["--shards", "x"]).return_listen == Address("127.0.0.1", 7100)
    assert options("--first-stage", "127.0.0.1:7101") == {}  # a loopback ring may stay plaintext
    assert options() == {}
    with pytest.raises(DeskfleetError, match="--first-stage"):
        options("--workers", "--tls-credentials", str(creds))
    with pytest.raises(DeskfleetError, match="--tls-credentials"):
        options("--first-stage", "10.0.0.5:7101")
    with pytest.raises(DeskfleetError, match="--tls-credentials"):
        options("--first-stage", "127.0.0.1:7101", "--return-listen", "0.0.0.0:7100")
    with pytest.raises(DeskfleetError, match="--expect-first"):
        options("--first-stage", "10.0.0.5:7101", "--tls-credentials", str(creds))
    ring = options("--first-stage", "10.0.0.5:7101", "--return-listen", "0.0.0.0:7100", "--tls-credentials",
                   str(creds), "--expect-first", desk.node_id, "--expect-last", desk.node_id)
    assert ring["peers"] == PeerPolicy.of([desk.node_id], desk.node_id)
    assert ring["server_ssl"] is not None and ring["client_ssl"] is not None
