"""Insiders on the data plane: a fellow member's real certificate (Role.AGENT, same fleet CA)
posing as the last stage, as an upstream stage, or reusing another connection's streams; a
revoked member; a live policy switch over a real worker's stdin; and the resource bounds (a
Hello-less 256 MiB first frame, 1,000 idle connections) while a real stream decodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys

import numpy as np
import pytest

from engine.codec import encode
from engine.coordinator import Coordinator, model_card
from engine.frame_server import FrameServer
from engine.handshake import HandshakeError, LocalIdentity
from engine.manifest import load_manifest
from engine.messages import Capture, Error, Forward, Hello, Release, Tokens
from engine.peer_policy import PeerPolicy, short
from engine.request import GenerationRequest
from engine.ring import RingPath
from engine.shard import Stage
from engine.stage_server import stage_frame_bound
from engine.transport import ConnectionClosedError, async_connect, async_read_frame
from engine.trust import FleetAuthority, Role
from engine.wire import (
    COORDINATOR_STAGE,
    HEADER_STRUCT,
    MAGIC,
    PROTOCOL_VERSION,
    DType,
    ErrorCode,
    FrameKind,
    StreamId,
)
from engine.wire import Role as WireRole
from engine.worker import PEERS_PREFIX, Address, StageWorker
from tests.asyncutil import collect, run
from tests.conftest import PROMPT_IDS

N = 12
LOOP = Address("127.0.0.1", 0)


@pytest.fixture(scope="module")
def fleet():
    """One fleet CA; the console, the desk serving the stage, and two fellow members."""
    authority = FleetAuthority.create("insider test fleet")
    return {name: authority.issue_credentials(name, role=role) for name, role in
            (("console", Role.CONSOLE), ("desk", Role.AGENT), ("mallory", Role.AGENT), ("bob", Role.AGENT))}


@pytest.fixture(scope="module")
def export(tiny_export):
    return tiny_export("llama", 1)


@pytest.fixture(scope="module")
def stage(export):
    return Stage(export, 0, exact=True)


def _fp(export) -> str:
    return load_manifest(export).model.fingerprint


def _refusals(caplog, node_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if "peer_refused" in r.getMessage() and short(node_id) in
            r.getMessage()]


def _step(ids, past: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage-0 inputs for ``ids`` after ``past`` positions: token ids [1, S], mask [1, past+S], positions [1, S]."""
    s = len(ids)
    return (np.asarray([ids], dtype=np.int64), np.ones((1, past + s), dtype=np.int64),
            np.arange(past, past + s, dtype=np.int64)[None, :])


async def _raw_frames_after_tls(address: Address, ctx, *frames) -> object:
    """Dial with TLS, send ``frames`` back to back without waiting, return the first reply (or "closed")."""
    reader, writer = await asyncio.open_connection(address.host, address.port, ssl=ctx)
    try:
        for frame in frames:
            writer.write(encode(frame))
        await writer.drain()
        try:
            return await async_read_frame(reader, timeout=5, idle_timeout=5)
        except ConnectionClosedError:
            return "closed"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# -- posing as the last stage (the coordinator's return port) and as stage 0's upstream ------------

def test_a_member_posing_as_last_stage_or_upstream_is_refused_and_the_stream_is_untouched(fleet, export, stage,
                                                                                        caplog):
    caplog.set_level(logging.WARNING, logger="engine.transport")
    console, desk, mallory = fleet["console"], fleet["desk"], fleet["mallory"]
    fp = _fp(export)
    request = GenerationRequest(PROMPT_IDS, N, ignore_eos=True)

    async def main():
        path = RingPath(fp, 1, LOOP, LOOP, server_ssl=console.server_context(), client_ssl=console.client_context(),
                        peers=PeerPolicy.of([desk.node_id], desk.node_id), dial_deadline=10)
        ret = await path.async_listen()
        worker = StageWorker(stage, LOOP, ret, server_ssl=desk.server_context(), client_ssl=desk.client_context(),
                             peers=PeerPolicy.of([console.node_id], console.node_id))
        path.first_remote = await worker.async_start()
        recovered = []

        async def recover(p, reason):
            recovered.append(reason)
            return p

        try:
            async with Coordinator(path, model_card(load_manifest(export)), recover=recover) as c:
                undisturbed = await collect(c, request)
                attacked = asyncio.create_task(collect(c, request))
                await asyncio.sleep(0.05)
                refused = {}
                with pytest.raises(HandshakeError) as as_last:
                    await async_connect(ret.host, ret.port, Hello(fp, COORDINATOR_STAGE, WireRole.STAGE),
                                        ssl=mallory.client_context(), attempts=1)
                refused["as last stage"] = as_last.value
                # the same with the answers already on the wire behind the Hello, for every likely stream
                forged = [Hello(fp, COORDINATOR_STAGE, WireRole.STAGE)]
                for stream in range(1, 5):
                    forged += [Tokens(StreamId(stream), seq, np.array([42]), np.array([1.0], dtype=np.float32))
                               for seq in range(4)]
                    forged.append(Error(ErrorCode.STREAM_FAILED, "injected", StreamId(stream), 1))
                raw = await _raw_frames_after_tls(ret, mallory.client_context(), *forged)
                with pytest.raises(HandshakeError) as as_upstream:
                    await async_connect(path.first_remote.host, path.first_remote.port,
                                        Hello(fp, 0, WireRole.COORDINATOR), ssl=mallory.client_context(), attempts=1)
                refused["as upstream"] = as_upstream.value
                during = await attacked
                return (undisturbed, during, refused, raw, recovered, c.metrics(), path.returns.stats,
                        worker.listener.stats)
        finally:
            await worker.async_close()
            await path.async_close()

    undisturbed, during, refused, raw, recovered, metrics, return_stats, stage_stats = run(main(), 120)
    assert during == undisturbed and len(undisturbed) == N
    assert recovered == [] and metrics["failovers_total"] == 0 and metrics["requests_failed_total"] == 0
    for who, error in refused.items():
        assert error.field == "peer" and error.code is ErrorCode.PEER_REFUSED, who
        text = str(error)
        for secret in (console.node_id, desk.node_id, fp, console.node_id[:12], desk.node_id[:12]):
            assert secret not in text, f"the refusal {who} echoed the local identity: {text}"
    assert isinstance(raw, Error) and raw.code is ErrorCode.PEER_REFUSED
    assert return_stats["peer_refused"] == 2 and stage_stats["peer_refused"] == 1
    # logged once per listener (the return port and the stage), naming the member
    assert len(_refusals(caplog, mallory.node_id)) == 2, [r.getMessage() for r in caplog.records]


def test_a_revoked_member_is_refused_though_expected_and_its_open_link_is_cut(fleet, export, stage):
    console, desk, mallory = fleet["console"], fleet["desk"], fleet["mallory"]
    fp = _fp(export)
    hello = Hello(fp, 0, WireRole.COORDINATOR)

    async def main():
        both = PeerPolicy.of([console.node_id, mallory.node_id], console.node_id)
        worker = StageWorker(stage, LOOP, Address("127.0.0.1", 9), server_ssl=desk.server_context(),
                             client_ssl=desk.client_context(), peers=both)
        address = await worker.async_start()
        try:
            open_link = await async_connect(address.host, address.port, hello, ssl=mallory.client_context(),
                                            attempts=1)
            await worker.async_set_peers(PeerPolicy.of(both.upstream, both.next, deny=[mallory.node_id]))
            try:
                cut = await open_link.async_recv(idle_timeout=5)
            except ConnectionClosedError:
                cut = "closed"
            with pytest.raises(HandshakeError, match="revoked") as again:
                await async_connect(address.host, address.port, hello, ssl=mallory.client_context(), attempts=1)
            console_link = await async_connect(address.host, address.port, hello, ssl=console.client_context(),
                                               attempts=1)
            await console_link.async_close()
            await open_link.async_close()
            return cut, again.value
        finally:
            await worker.async_close()

    cut, again = run(main(), 60)
    assert cut == "closed" or (isinstance(cut, Error) and cut.code is ErrorCode.PEER_REFUSED)
    assert again.field == "peer"


def test_dialers_check_who_answers_before_sending_anything(fleet, export, stage):
    """The coordinator dialling stage 0, and a stage dialling its next hop, each find a fellow
    member at the address: no Hello and no step reaches it."""
    console, desk, mallory = fleet["console"], fleet["desk"], fleet["mallory"]
    fp = _fp(export)

    async def main():
        seen = []

        async def record(conn, msg):
            seen.append(msg)

        impostor = FrameServer(record, LocalIdentity(fp, COORDINATOR_STAGE, frozenset({WireRole.STAGE})),
                               ssl=mallory.server_context(), peer_check=lambda node: None)
        host, port = await impostor.async_start()
        # a real stage whose next hop (the return port) has been taken over by mallory
        worker = StageWorker(stage, LOOP, Address(host, port), server_ssl=desk.server_context(),
                             client_ssl=desk.client_context(),
                             peers=PeerPolicy.of([console.node_id], console.node_id))
        address = await worker.async_start()
        # the coordinator, whose stage 0 address now answers with mallory's certificate
        path = RingPath(fp, 1, Address(host, port), LOOP, server_ssl=console.server_context(),
                        client_ssl=console.client_context(), peers=PeerPolicy.of([desk.node_id], desk.node_id),
                        dial_deadline=5)
        try:
            with pytest.raises(HandshakeError) as ring_dial:
                await path.async_start()
            upstream = await async_connect(address.host, address.port, Hello(fp, 0, WireRole.COORDINATOR),
                                           ssl=console.client_context(), attempts=1)
            await upstream.async_send(Forward(StreamId(1), 0, *_step(PROMPT_IDS[:4], 0), reply_last=1))
            try:
                answer = await upstream.async_recv(idle_timeout=20)
            except ConnectionClosedError:
                answer = "closed"
            await upstream.async_close()
            return ring_dial.value, answer, seen, dict(impostor.stats)
        finally:
            await path.async_close()
            await worker.async_close()
            await impostor.async_close()

    ring_dial, answer, seen, impostor_stats = run(main(), 90)
    assert ring_dial.field == "peer" and short(mallory.node_id) in str(ring_dial)
    assert isinstance(answer, Error) or answer == "closed"  # the step failed loudly, not into the impostor
    assert seen == [] and impostor_stats.get("frame_error", 0) == 0
    assert impostor_stats["closed"] == 2  # both dialers hung up without a single frame


def test_a_tls_ring_or_worker_without_expected_peers_admits_nobody(fleet, export, stage):
    """There is no "any member" default: a TLS RingPath needs its ends named, and a TLS worker
    given no policy refuses every member until one arrives."""
    from engine.peer_policy import PeerPolicyError

    console, desk = fleet["console"], fleet["desk"]
    with pytest.raises(PeerPolicyError, match="peers=PeerPolicy"):
        RingPath(_fp(export), 1, LOOP, LOOP, server_ssl=console.server_context(), client_ssl=console.client_context())

    async def main():
        worker = StageWorker(stage, LOOP, Address("127.0.0.1", 9), server_ssl=desk.server_context(),
                             client_ssl=desk.client_context())
        address = await worker.async_start()
        try:
            with pytest.raises(HandshakeError, match="no upstream peer is expected") as refused:
                await async_connect(address.host, address.port, Hello(_fp(export), 0, WireRole.COORDINATOR),
                                    ssl=console.client_context(), attempts=1)
            return refused.value
        finally:
            await worker.async_close()

    assert run(main(), 60).field == "peer"


# -- streams belong to the connection that opened them ----------------------------------------------

def test_a_stream_opened_on_one_connection_cannot_be_touched_from_another(fleet, export, stage):
    console, desk = fleet["console"], fleet["desk"]
    fp = _fp(export)
    hello = Hello(fp, 0, WireRole.COORDINATOR)
    prefill, decode = _step(PROMPT_IDS[:8], 0), _step(PROMPT_IDS[8:9], 8)

    async def main():
        replies: asyncio.Queue = asyncio.Queue()

        async def sink_handler(conn, msg):
            await replies.put(msg)

        sink = FrameServer(sink_handler, LocalIdentity(fp, COORDINATOR_STAGE, frozenset({WireRole.STAGE})),
                           ssl=console.server_context(), peer_check=PeerPolicy.of([desk.node_id]).refuse_upstream)
        host, port = await sink.async_start()
        worker = StageWorker(stage, LOOP, Address(host, port), server_ssl=desk.server_context(),
                             client_ssl=desk.client_context(), max_streams=2,
                             peers=PeerPolicy.of([console.node_id], console.node_id))
        address = await worker.async_start()
        x = await async_connect(address.host, address.port, hello, ssl=console.client_context(), attempts=1)
        y = await async_connect(address.host, address.port, hello, ssl=console.client_context(), attempts=1)

        async def reply():
            return await asyncio.wait_for(replies.get(), 30)

        try:
            await x.async_send(Forward(StreamId(5), 0, *prefill, reply_last=1))
            first = await reply()
            refusals = []
            for msg in (Release(StreamId(5)), Forward(StreamId(5), 1, *decode, reply_last=1),
                        Capture(StreamId(5), 1, 77, np.arange(8, dtype=np.int64)),
                        Error(ErrorCode.STREAM_FAILED, "injected", StreamId(5), 1)):
                await y.async_send(msg)
                refusals.append(await y.async_recv(idle_timeout=10))
            await x.async_send(Forward(StreamId(5), 1, *decode, reply_last=1))
            second = await reply()
            # the same two steps on a stream nobody interfered with
            await x.async_send(Forward(StreamId(6), 0, *prefill, reply_last=1))
            await x.async_send(Forward(StreamId(6), 1, *decode, reply_last=1))
            clean = [await reply(), await reply()]
            await x.async_send(Forward(StreamId(7), 0, *prefill, reply_last=1))  # a third stream: over the cap
            over_cap = await reply()
            held = worker.stream_count
            await y.async_close()
            await x.async_close()
            for _ in range(100):  # the closed connection's streams are dropped with it
                if worker.stream_count == 0:
                    break
                await asyncio.sleep(0.05)
            return first, refusals, second, clean, over_cap, held, worker.stream_count, replies.qsize()
        finally:
            await worker.async_close()
            await sink.async_close()

    first, refusals, second, clean, over_cap, held, left, stray = run(main(), 90)
    assert all(isinstance(r, Error) and r.code is ErrorCode.UNKNOWN_STREAM and r.stream_id == 5 for r in refusals)
    assert isinstance(first, Tokens) and isinstance(second, Tokens), (first, second)
    assert [first.ids.tolist(), second.ids.tolist()] == [m.ids.tolist() for m in clean]
    assert (first.stream_id, second.stream_id) == (5, 5)
    assert isinstance(over_cap, Error) and over_cap.code is ErrorCode.STREAM_LIMIT and over_cap.stream_id == 7
    assert held == 2 and left == 0 and stray == 0


def test_a_static_workers_packed_session_belongs_to_the_connection_that_started_it(tmp_path_factory,
                                                                                   tiny_checkpoint):
    from engine.messages import Packed
    from engine.packed_stage import StaticStage
    from engine.packed_worker import PackedStageWorker
    from engine.packing import PlanFrame
    from tests.npu_helpers import npu_export

    export = npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=1, context=32)
    manifest = load_manifest(export)
    fp = manifest.model.fingerprint
    hello = Hello(fp, 0, WireRole.COORDINATOR)

    def step(stream: int, seq: int, position: int) -> Packed:
        return Packed(StreamId(stream), seq, PlanFrame.of([(0, position, 0)], 1), np.array([[5 + position]], np.int64))

    async def main():
        replies: asyncio.Queue = asyncio.Queue()

        async def sink_handler(conn, msg):
            await replies.put(msg)

        sink = FrameServer(sink_handler, LocalIdentity(fp, COORDINATOR_STAGE, frozenset({WireRole.STAGE})))
        host, port = await sink.async_start()
        worker = PackedStageWorker(StaticStage(export, 0, exact=True, manifest=manifest), LOOP, Address(host, port))
        address = await worker.async_start()
        x = await async_connect(address.host, address.port, hello, attempts=1)
        y = await async_connect(address.host, address.port, hello, attempts=1)

        async def reply():
            return await asyncio.wait_for(replies.get(), 30)

        try:
            await x.async_send(step(3, 0, 0))
            first = await reply()
            refusals = []
            for msg in (step(9, 0, 0), Release(StreamId(3))):  # a new session would empty the slots
                await y.async_send(msg)
                refusals.append(await y.async_recv(idle_timeout=10))
            await x.async_send(step(3, 1, 1))  # position 1 follows only from X's own first step
            second = await reply()
            await x.async_close()
            await asyncio.sleep(0.2)
            await y.async_send(step(9, 0, 0))  # X's connection is gone: the ring is Y's to carry on
            taken_over = await reply()
            await y.async_close()
            return first, refusals, second, taken_over, worker.session
        finally:
            await worker.async_close()
            await sink.async_close()

    first, refusals, second, taken_over, session = run(main(), 120)
    assert all(isinstance(r, Error) and r.code is ErrorCode.UNKNOWN_STREAM for r in refusals), refusals
    assert isinstance(first, Tokens) and isinstance(second, Tokens), (first, second)
    assert (first.stream_id, second.stream_id, second.seq) == (3, 3, 1)
    assert isinstance(taken_over, Tokens) and taken_over.stream_id == 9 and session == 9


# -- the peer policy of a real worker process, switched over its stdin --------------------------------

def test_a_running_worker_switches_its_accepted_upstream_from_stdin_without_restarting(fleet, export):
    console, desk, bob = fleet["console"], fleet["desk"], fleet["bob"]
    fp = _fp(export)
    hello = Hello(fp, 0, WireRole.COORDINATOR)
    creds = {"ca_pem": desk.ca_pem.decode(), "cert_pem": desk.cert_pem.decode(), "key_pem": desk.key_pem.decode(),
             "expect_upstream": [console.node_id], "expect_next": console.node_id}

    async def admitted(address, who) -> bool:
        try:
            conn = await async_connect(address.host, address.port, hello, ssl=who.client_context(), attempts=1)
        except HandshakeError as exc:
            assert exc.field == "peer", exc
            return False
        await conn.async_close()
        return True

    async def main():
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine.cli", "worker", "--shard", str(export), "--listen", "127.0.0.1:0",
            "--next", "127.0.0.1:9", "--exact", "--tls-stdin", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)

        async def line(prefix: str) -> str:
            while True:
                text = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
                assert text, f"the worker exited: {(await proc.stderr.read()).decode()[-2000:]}"
                if text.startswith(prefix):
                    return text

        async def send(text: str) -> None:
            proc.stdin.write(text.encode() + b"\n")
            await proc.stdin.drain()

        try:
            await send(json.dumps(creds))
            ready = await line("deskfleet worker:")
            address = Address.parse(ready.split(" on ", 1)[1].split(",", 1)[0].strip())
            before = (await admitted(address, console), await admitted(address, bob))
            held = await async_connect(address.host, address.port, hello, ssl=console.client_context(), attempts=1)
            await send(json.dumps({"expect_upstream": [bob.node_id], "expect_next": console.node_id}))
            await line(PEERS_PREFIX)
            try:
                cut = await held.async_recv(idle_timeout=5)
            except ConnectionClosedError:
                cut = "closed"
            after = (await admitted(address, console), await admitted(address, bob))
            await send("{not json")  # bad lines: logged, ignored, the policy stays
            await send(json.dumps({"expect_upstream": ["abc"]}))
            await send(json.dumps({"expect_upstream": [bob.node_id], "expct_next": "x"}))
            await send(json.dumps({"expect_upstream": [bob.node_id], "expect_next": console.node_id}))
            await line(PEERS_PREFIX)  # lines apply in order: the bad ones were read before this one
            still = (await admitted(address, console), await admitted(address, bob))
            running = proc.returncode is None
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 60)
        errors = (await proc.stderr.read()).decode()
        return before, cut, after, still, running, code, errors

    before, cut, after, still, running, code, errors = run(main(), 240)
    assert before == (True, False)
    assert cut == "closed" or (isinstance(cut, Error) and cut.code is ErrorCode.PEER_REFUSED)
    assert after == (False, True)
    assert still == (False, True) and running and code == 0
    assert errors.count("ignoring a peer-policy update") == 3, errors[-3000:]


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
    fp = _fp(export)
    model = load_manifest(export).model
    bound = stage_frame_bound(model.hidden_size, model.max_position_embeddings)

    async def answer(reader, writer, data: bytes):
        writer.write(data)
        await writer.drain()
        return await async_read_frame(reader, timeout=10, idle_timeout=10)

    async def main():
        worker = StageWorker(stage, LOOP, Address("127.0.0.1", 9))
        address = await worker.async_start()
        try:
            reader, writer = await asyncio.open_connection(address.host, address.port)
            huge = _header(FrameKind.LOGITS, DType.FLOAT32, (1, 1024, 65535), stream=1)  # 256 MiB
            first = await answer(reader, writer, huge)
            writer.close()
            # under the stage's own bound but no Hello: refused as soon as its header is in
            reader, writer = await asyncio.open_connection(address.host, address.port)
            medium = _header(FrameKind.FORWARD, DType.FLOAT32, (1, 64, model.hidden_size), stream=1)
            second = await answer(reader, writer, medium)
            writer.close()
            conn = await async_connect(address.host, address.port, Hello(fp, 0, WireRole.COORDINATOR), attempts=1)
            too_big = _header(FrameKind.FORWARD, DType.FLOAT32, (1, bound // (4 * model.hidden_size) + 1,
                                                                  model.hidden_size), stream=3)
            later = await answer(conn._reader, conn._writer, too_big)
            await conn.async_close()
            return (first, second), later, conn.peer_max_frame_bytes, dict(worker.listener.stats)
        finally:
            await worker.async_close()

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
    fp = _fp(export)
    request = GenerationRequest(PROMPT_IDS, N, ignore_eos=True)

    async def main():
        path = RingPath(fp, 1, LOOP, LOOP, dial_deadline=10)
        ret = await path.async_listen()
        worker = StageWorker(stage, LOOP, ret, handshake_timeout=60)
        path.first_remote = address = await worker.async_start()
        listener = worker.listener
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
            async with Coordinator(path, model_card(load_manifest(export))) as c:
                undisturbed = await collect(c, request)
                for batch in range(0, 1000, 100):
                    await asyncio.gather(*(dial(f"127.0.0.{2 + i % 125}") for i in range(batch, batch + 100)))
                await settle(1001)
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
            await worker.async_close()
            await path.async_close()

    undisturbed, during, after, peak, flooded, one_peer = run(main(), 120)
    assert len(undisturbed) == N and during == undisturbed and after == undisturbed
    assert peak == 64  # the ring's connection plus 63 idle ones
    assert flooded["refused_cap"] == 1000 - 63
    assert one_peer == 12 - 8



def test_ring_hops_idle_between_requests_stay_up_while_a_silent_dialer_is_timed_out(export, stage):
    """Both listeners close links silent for 1.5 s; the ring's dialers Ping every 0.3 s, so the same
    two connections carry a request after 4 s of idleness, while a dialer that only handshook is cut."""
    fp = _fp(export)
    request = GenerationRequest(PROMPT_IDS, N, ignore_eos=True)

    async def main():
        path = RingPath(fp, 1, LOOP, LOOP, dial_deadline=10, ping_interval=0.3, idle_timeout=1.5)
        ret = await path.async_listen()
        worker = StageWorker(stage, LOOP, ret, idle_timeout=1.5, ping_interval=0.3)
        path.first_remote = await worker.async_start()
        try:
            async with Coordinator(path, model_card(load_manifest(export))) as c:
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
                return (first, second, cut, dict(worker.listener.stats), dict(path.returns.stats),
                        worker.listener.open_connections, path.returns.open_connections)
        finally:
            await worker.async_close()
            await path.async_close()

    first, second, cut, stage_stats, return_stats, stage_open, return_open = run(main(), 90)
    assert second == first and len(first) == N
    assert isinstance(cut, Error) and cut.code is ErrorCode.TIMEOUT
    assert stage_stats == {"timeout": 1} and return_stats == {}  # only the silent dialer was closed
    assert (stage_open, return_open) == (1, 1)


def test_one_member_may_hold_only_so_many_connections_from_any_number_of_addresses(fleet, export, stage):
    console, desk = fleet["console"], fleet["desk"]
    fp = _fp(export)
    hello = Hello(fp, 0, WireRole.COORDINATOR)

    async def main():
        worker = StageWorker(stage, LOOP, Address("127.0.0.1", 9), server_ssl=desk.server_context(),
                             client_ssl=desk.client_context(), peers=PeerPolicy.of([console.node_id]), max_per_peer=3)
        address = await worker.async_start()
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
            return outcomes, dict(worker.listener.stats)
        finally:
            for writer in held:
                writer.close()
            await worker.async_close()

    outcomes, stats = run(main(), 60)
    assert outcomes == ["HelloAck"] * 3 + ["PEER_REFUSED"] * 2
    assert stats["refused_cap"] == 2


# -- no plaintext door ------------------------------------------------------------------------------

def test_a_worker_refuses_to_listen_beyond_loopback_without_tls(export):
    import subprocess

    cmd = [sys.executable, "-m", "engine.cli", "worker", "--shard", str(export), "--next", "127.0.0.1:9"]
    exposed = subprocess.run([*cmd, "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=120)
    flags = subprocess.run([*cmd, "--expect-upstream", "a" * 64], capture_output=True, text=True, timeout=120)
    assert exposed.returncode == 1 and "--tls-stdin" in exposed.stderr and "0.0.0.0:0" in exposed.stderr
    assert flags.returncode == 1 and "need --tls-stdin" in flags.stderr


def test_serve_over_a_ring_needs_tls_off_loopback_and_the_ring_ends_with_it(fleet, tmp_path):
    import argparse

    from engine.errors import DeskfleetError
    from engine.serve_cli import configure, ring_options

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
