"""Insiders on the data plane of a paged ring: a fellow member's real certificate (Role.AGENT,
same fleet CA) posing as the last stage, as an upstream stage, as a next hop, or reusing another
connection's session; a revoked member; a live policy switch over a real worker's stdin. The
resource bounds and the plaintext refusals are in test_dataplane_bounds.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys

import numpy as np
import pytest

from engine.generation.request import GenerationRequest
from engine.shards.manifest import load_manifest
from engine.trust.peer_policy import PeerPolicy, short
from engine.wire.address import Address
from engine.wire.codec import encode
from engine.wire.format import (
    COORDINATOR_STAGE,
    ErrorCode,
    StreamId,
)
from engine.wire.format import Role as WireRole
from engine.wire.frame_server import FrameServer
from engine.wire.handshake import HandshakeError, LocalIdentity
from engine.wire.messages import Error, Hello, Release, Step, StepReply, Tokens
from engine.wire.step_plan import CPU_BLOCK_SIZE, SCRATCH_BLOCKS, PlanRow, plan
from engine.wire.transport import ConnectionClosedError, async_connect, async_read_frame
from engine.worker.status_lines import PEERS_PREFIX
from tests.conftest import PROMPT_IDS
from tests.security.dataplane_helpers import LOOP, N, coordinator, fp_of, ring_path, worker
from tests.support.asyncutil import collect, run


def _refusals(caplog, node_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if "peer_refused" in r.getMessage() and short(node_id) in
            r.getMessage()]


def _step(session: int, seq: int, ids, past: int) -> Step:
    """Session ``session``'s step ``seq`` into stage 0: one stream bringing ``ids`` after ``past``
    positions, in the first block past the scratch blocks of a small pool, its last row answered."""
    row = PlanRow(StreamId(1), past, len(ids), (SCRATCH_BLOCKS,), sample=1)
    step_plan = plan(CPU_BLOCK_SIZE, SCRATCH_BLOCKS + 4, [row])
    tokens = np.zeros(step_plan.padded_tokens, dtype=np.int64)
    tokens[:len(ids)] = ids
    return Step(StreamId(session), seq, step_plan, tokens)


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
    caplog.set_level(logging.WARNING, logger="engine.wire.transport")
    console, desk, mallory = fleet["console"], fleet["desk"], fleet["mallory"]
    fp = fp_of(export)
    request = GenerationRequest(PROMPT_IDS, N, ignore_eos=True)

    async def main():
        path = ring_path(export, server_ssl=console.server_context(), client_ssl=console.client_context(),
                         peers=PeerPolicy.of([desk.node_id], desk.node_id), dial_deadline=10)
        ret = await path.async_listen()
        w = worker(stage, ret, server_ssl=desk.server_context(), client_ssl=desk.client_context(),
                   peers=PeerPolicy.of([console.node_id], console.node_id))
        path.first_remote = await w.async_start()
        recovered = []

        async def recover(p, reason):
            recovered.append(reason)
            return p

        try:
            async with coordinator(path, export, recover=recover) as c:
                undisturbed = await collect(c, request)
                attacked = asyncio.create_task(collect(c, request))
                await asyncio.sleep(0.05)
                refused = {}
                with pytest.raises(HandshakeError) as as_last:
                    await async_connect(ret.host, ret.port, Hello(fp, COORDINATOR_STAGE, WireRole.STAGE),
                                        ssl=mallory.client_context(), attempts=1)
                refused["as last stage"] = as_last.value
                # the same with the answers already on the wire behind the Hello, for every likely session
                forged = [Hello(fp, COORDINATOR_STAGE, WireRole.STAGE)]
                for session in range(1, path.session + 4):
                    forged += [StepReply(StreamId(session), seq, np.array([42]), np.array([1.0], dtype=np.float32))
                               for seq in range(1, 5)]
                    forged.append(Error(ErrorCode.STREAM_FAILED, "injected", StreamId(session), 1))
                raw = await _raw_frames_after_tls(ret, mallory.client_context(), *forged)
                with pytest.raises(HandshakeError) as as_upstream:
                    await async_connect(path.first_remote.host, path.first_remote.port,
                                        Hello(fp, 0, WireRole.COORDINATOR), ssl=mallory.client_context(), attempts=1)
                refused["as upstream"] = as_upstream.value
                during = await attacked
                return (undisturbed, during, refused, raw, recovered, c.metrics(), path.returns.stats,
                        w.listener.stats)
        finally:
            await w.async_close()
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
    fp = fp_of(export)
    hello = Hello(fp, 0, WireRole.COORDINATOR)

    async def main():
        both = PeerPolicy.of([console.node_id, mallory.node_id], console.node_id)
        w = worker(stage, Address("127.0.0.1", 9), server_ssl=desk.server_context(), client_ssl=desk.client_context(),
                   peers=both)
        address = await w.async_start()
        try:
            open_link = await async_connect(address.host, address.port, hello, ssl=mallory.client_context(),
                                            attempts=1)
            await w.async_set_peers(PeerPolicy.of(both.upstream, both.next, deny=[mallory.node_id]))
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
            await w.async_close()

    cut, again = run(main(), 60)
    assert cut == "closed" or (isinstance(cut, Error) and cut.code is ErrorCode.PEER_REFUSED)
    assert again.field == "peer"


def test_dialers_check_who_answers_before_sending_anything(fleet, export, stage):
    """The coordinator dialling stage 0, and a stage dialling its next hop, each find a fellow
    member at the address: no Hello and no step reaches it."""
    console, desk, mallory = fleet["console"], fleet["desk"], fleet["mallory"]
    fp = fp_of(export)

    async def main():
        seen = []

        async def record(conn, msg):
            seen.append(msg)

        impostor = FrameServer(record, LocalIdentity(fp, COORDINATOR_STAGE, frozenset({WireRole.STAGE})),
                               ssl=mallory.server_context(), peer_check=lambda node: None)
        host, port = await impostor.async_start()
        # a real stage whose next hop (the return port) has been taken over by mallory
        w = worker(stage, Address(host, port), server_ssl=desk.server_context(), client_ssl=desk.client_context(),
                   peers=PeerPolicy.of([console.node_id], console.node_id))
        address = await w.async_start()
        # the coordinator, whose stage 0 address now answers with mallory's certificate
        path = ring_path(export, Address(host, port), server_ssl=console.server_context(),
                         client_ssl=console.client_context(), peers=PeerPolicy.of([desk.node_id], desk.node_id),
                         dial_deadline=5)
        try:
            with pytest.raises(HandshakeError) as ring_dial:
                await path.async_start()
            upstream = await async_connect(address.host, address.port, Hello(fp, 0, WireRole.COORDINATOR),
                                           ssl=console.client_context(), attempts=1)
            await upstream.async_send(_step(1, 1, PROMPT_IDS[:4], 0))
            try:
                answer = await upstream.async_recv(idle_timeout=20)
            except ConnectionClosedError:
                answer = "closed"
            await upstream.async_close()
            return ring_dial.value, answer, seen, dict(impostor.stats)
        finally:
            await path.async_close()
            await w.async_close()
            await impostor.async_close()

    ring_dial, answer, seen, impostor_stats = run(main(), 90)
    assert ring_dial.field == "peer" and short(mallory.node_id) in str(ring_dial)
    assert isinstance(answer, Error) or answer == "closed"  # the step failed loudly, not into the impostor
    assert seen == [] and impostor_stats.get("frame_error", 0) == 0
    assert impostor_stats["closed"] == 2  # both dialers hung up without a single frame


def test_a_tls_ring_or_worker_without_expected_peers_admits_nobody(fleet, export, stage):
    """There is no "any member" default: a TLS ring path needs its ends named, and a TLS worker
    given no policy refuses every member until one arrives."""
    from engine.trust.peer_policy import PeerPolicyError

    console, desk = fleet["console"], fleet["desk"]
    with pytest.raises(PeerPolicyError, match="peers=PeerPolicy"):
        ring_path(export, server_ssl=console.server_context(), client_ssl=console.client_context())

    async def main():
        w = worker(stage, Address("127.0.0.1", 9), server_ssl=desk.server_context(), client_ssl=desk.client_context())
        address = await w.async_start()
        try:
            with pytest.raises(HandshakeError, match="no upstream peer is expected") as refused:
                await async_connect(address.host, address.port, Hello(fp_of(export), 0, WireRole.COORDINATOR),
                                    ssl=console.client_context(), attempts=1)
            return refused.value
        finally:
            await w.async_close()

    assert run(main(), 60).field == "peer"


# -- a session belongs to the connection that opened it ----------------------------------------------

def test_a_session_opened_on_one_connection_cannot_be_touched_from_another(fleet, export, stage):
    """Connection X opens session 5 on a paged worker; while X is open, another connection of the
    same member can neither step it, nor start a session of its own (which would empty the pool
    under X's streams), nor release it: each is refused to that connection and never passed on.
    X's steps then answer exactly as the same steps of a session nobody interfered with; when X
    closes, its session ends with it."""
    console, desk = fleet["console"], fleet["desk"]
    fp = fp_of(export)
    hello = Hello(fp, 0, WireRole.COORDINATOR)

    def prefill(session: int) -> Step:
        return _step(session, 1, PROMPT_IDS[:8], 0)

    def decode(session: int) -> Step:
        return _step(session, 2, PROMPT_IDS[8:9], 8)

    async def main():
        replies: asyncio.Queue = asyncio.Queue()

        async def sink_handler(conn, msg):
            await replies.put(msg)

        sink = FrameServer(sink_handler, LocalIdentity(fp, COORDINATOR_STAGE, frozenset({WireRole.STAGE})),
                           ssl=console.server_context(), peer_check=PeerPolicy.of([desk.node_id]).refuse_upstream)
        host, port = await sink.async_start()
        w = worker(stage, Address(host, port), server_ssl=desk.server_context(), client_ssl=desk.client_context(),
                   peers=PeerPolicy.of([console.node_id], console.node_id))
        address = await w.async_start()

        async def dial():
            return await async_connect(address.host, address.port, hello, ssl=console.client_context(), attempts=1)

        async def reply():
            return await asyncio.wait_for(replies.get(), 30)

        async def refused(msg):
            """``msg`` from a connection of its own (each refusal first waits out the owner's
            close grace, so the three run side by side)."""
            y = await dial()
            try:
                await y.async_send(msg)
                return await y.async_recv(idle_timeout=10)
            finally:
                await y.async_close()

        x = await dial()
        try:
            await x.async_send(prefill(5))
            first = await reply()
            held = w.session
            refusals = await asyncio.gather(refused(decode(5)), refused(prefill(9)), refused(Release(StreamId(5))))
            await x.async_send(decode(5))
            second = await reply()
            # the same two steps in a session nobody interfered with
            await x.async_send(prefill(6))
            await x.async_send(decode(6))
            clean = [await reply(), await reply()]
            await x.async_close()
            for _ in range(100):  # the closed connection's session ends with it
                if w.session is None:
                    break
                await asyncio.sleep(0.05)
            return first, refusals, second, clean, held, w.session, replies.qsize()
        finally:
            await x.async_close()
            await w.async_close()
            await sink.async_close()

    first, refusals, second, clean, held, left, stray = run(main(), 90)
    assert all(isinstance(r, Error) and r.code is ErrorCode.UNKNOWN_STREAM for r in refusals), refusals
    assert [r.stream_id for r in refusals] == [5, 9, 5]
    assert isinstance(first, StepReply) and isinstance(second, StepReply), (first, second)
    assert [first.ids.tolist(), second.ids.tolist()] == [m.ids.tolist() for m in clean]
    assert [(first.session, first.seq), (second.session, second.seq)] == [(5, 1), (5, 2)]
    assert held == 5 and left is None and stray == 0


def test_an_error_for_a_session_from_another_connection_is_refused_not_passed_on(fleet, export, stage):
    console, desk = fleet["console"], fleet["desk"]
    fp = fp_of(export)
    hello = Hello(fp, 0, WireRole.COORDINATOR)

    async def main():
        replies: asyncio.Queue = asyncio.Queue()

        async def sink_handler(conn, msg):
            await replies.put(msg)

        sink = FrameServer(sink_handler, LocalIdentity(fp, COORDINATOR_STAGE, frozenset({WireRole.STAGE})),
                           ssl=console.server_context(), peer_check=PeerPolicy.of([desk.node_id]).refuse_upstream)
        host, port = await sink.async_start()
        w = worker(stage, Address(host, port), server_ssl=desk.server_context(), client_ssl=desk.client_context(),
                   peers=PeerPolicy.of([console.node_id], console.node_id))
        address = await w.async_start()
        x = await async_connect(address.host, address.port, hello, ssl=console.client_context(), attempts=1)
        y = await async_connect(address.host, address.port, hello, ssl=console.client_context(), attempts=1)
        try:
            await x.async_send(_step(5, 1, PROMPT_IDS[:8], 0))
            await asyncio.wait_for(replies.get(), 30)
            await y.async_send(Error(ErrorCode.STREAM_FAILED, "injected", StreamId(5), 2))
            answer = await y.async_recv(idle_timeout=3)  # past the owner's 2 s close grace
            await x.async_send(_step(5, 2, PROMPT_IDS[8:9], 8))
            after = await asyncio.wait_for(replies.get(), 30)  # X's next answer, not the injected failure
            return answer, after
        finally:
            await y.async_close()
            await x.async_close()
            await w.async_close()
            await sink.async_close()

    answer, after = run(main(), 90)
    assert isinstance(answer, Error) and answer.code is ErrorCode.UNKNOWN_STREAM and answer.stream_id == 5
    assert isinstance(after, StepReply) and (after.session, after.seq) == (5, 2)


@pytest.mark.slow
def test_a_static_workers_packed_session_belongs_to_the_connection_that_started_it(tmp_path_factory,
                                                                                   tiny_checkpoint):
    from engine.static.packed_stage import StaticStage
    from engine.static.packed_worker import PackedStageWorker
    from engine.wire.messages import Packed
    from engine.wire.plan_frame import PlanFrame
    from tests.support.npu_helpers import npu_export

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
    fp = fp_of(export)
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
            sys.executable, "-m", "engine.cli.main", "worker", "--shard", str(export), "--listen", "127.0.0.1:0",
            "--next", "127.0.0.1:9", "--exact", "--paged", "--tls-stdin", stdin=asyncio.subprocess.PIPE,
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
