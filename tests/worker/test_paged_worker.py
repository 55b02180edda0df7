"""Paged stage workers on loopback: a ring of two real workers (real sockets, real OpenVINO)
answers the same plans exactly as the in-process LocalPagedPath; a session belongs to the
connection that opened it; a pool over the worker's budget and a frame it does not take are
refused as stream errors that reach the coordinator's return port; the retired stateful worker is
refused with the reason."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.cli.worker import check_runtime
from engine.errors import DeskfleetError, StatefulRuntimeRetiredError
from engine.paged.stage import LocalPagedPath, PagedStage
from engine.paged.step import PagedOutcome, PagedStep
from engine.paged.worker import PagedStageWorker
from engine.shards.manifest import load_manifest
from engine.wire.address import Address
from engine.wire.format import COORDINATOR_STAGE, ErrorCode, Role, StreamId
from engine.wire.frame_server import FrameServer
from engine.wire.handshake import LocalIdentity
from engine.wire.messages import Error, Hello, Message, Packed, Release, Step, StepReply
from engine.wire.plan_frame import PlanFrame
from engine.wire.step_plan import SCRATCH_BLOCKS, PlanRow, StepPlan, blocks_needed, plan
from engine.wire.transport import Connection, async_connect
from engine.worker.serve_worker import _open_worker
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import run

BS = 32
POOL = 24
BUDGET = 1 << 30
TIMEOUT = 30


@pytest.fixture(scope="module")
def export(tiny_export) -> Path:
    return tiny_export("llama", 2)


@pytest.fixture(scope="module")
def stages(export) -> list[PagedStage]:
    return LocalPagedPath.load(export, SCRATCH_BLOCKS + 1, BUDGET, exact=True).stages


def recorded_steps(stages: list[PagedStage]) -> list[tuple[PagedStep, PagedOutcome]]:
    """Three streams driven greedily in process (joins at steps 0, 1, 2; a prefill in chunks of 5
    beside decode; one stream asking for logits): every step and its outcome."""
    path = LocalPagedPath(stages, POOL, BUDGET)
    prompts = {1: list(PROMPT_IDS), 2: list(PROMPT_IDS[3:15]), 3: [5, 9, 11]}
    chunk = {1: None, 2: 5, 3: None}
    join = {1: 0, 2: 1, 3: 2}
    seqs = {sid: list(p) for sid, p in prompts.items()}
    past = dict.fromkeys(prompts, 0)
    blocks: dict[int, list[int]] = {sid: [] for sid in prompts}
    free = list(range(POOL - 1, SCRATCH_BLOCKS - 1, -1))
    recorded = []
    for t in range(8):
        rows, ids = [], []
        for sid in (s for s in prompts if join[s] <= t):
            feed = seqs[sid][past[sid]:]
            if past[sid] < len(prompts[sid]) and chunk[sid]:
                feed = feed[:chunk[sid]]
            while len(blocks[sid]) < blocks_needed(past[sid] + len(feed), BS):
                blocks[sid].append(free.pop())
            answers = past[sid] + len(feed) == len(seqs[sid])
            rows.append(PlanRow(sid, past[sid], len(feed), tuple(blocks[sid]), sample=int(answers),
                                want_logits=answers and sid == 3))
            ids += feed
        step = PagedStep(t + 1, plan(BS, POOL, rows), np.asarray(ids, dtype=np.int64))
        out = path.run(step)
        recorded.append((step, out))
        at = 0
        for row in rows:
            past[row.stream_id] += row.new_tokens
            if row.sample:
                seqs[row.stream_id].append(int(out.ids[at]))
                at += 1
    return recorded


@contextlib.asynccontextmanager
async def paged_ring(stages: list[PagedStage], budget: int = BUDGET):
    """A paged worker per stage on loopback, the return port's frames on a queue, and the
    coordinator's connection to stage 0."""
    fingerprint = stages[0].manifest.model.fingerprint
    replies: asyncio.Queue[Message] = asyncio.Queue()

    async def on_return(conn: Connection, msg: Message) -> None:
        await replies.put(msg)

    returns = FrameServer(on_return, LocalIdentity(fingerprint, COORDINATOR_STAGE, frozenset({Role.STAGE})))
    host, port = await returns.async_start("127.0.0.1", 0)
    next_hop = Address(host, port)
    workers: list[PagedStageWorker] = []
    conns: list[Connection] = []
    try:
        for stage in reversed(stages):
            worker = PagedStageWorker(stage, Address("127.0.0.1", 0), next_hop, kv_pool_bytes=budget,
                                      dial_deadline=TIMEOUT)
            workers.insert(0, worker)
            next_hop = await worker.async_start()

        async def dial() -> Connection:
            conn = await async_connect(next_hop.host, next_hop.port, Hello(fingerprint, 0, Role.COORDINATOR))
            conns.append(conn)
            return conn

        yield dial, replies, workers
    finally:
        for conn in conns:
            await conn.async_close()
        for worker in workers:
            await worker.async_close()
        await returns.async_close()


def step_frame(session: int, step: PagedStep) -> Step:
    ids = np.zeros(step.plan.padded_tokens, dtype=np.int64)
    ids[:step.plan.tokens] = step.token_ids
    return Step(StreamId(session), step.seq, step.plan, ids)


async def next_reply(replies: asyncio.Queue[Message]) -> Message:
    return await asyncio.wait_for(replies.get(), TIMEOUT)


def test_a_ring_of_paged_workers_answers_like_the_local_path(stages):
    recorded = recorded_steps(stages)

    async def main():
        async with paged_ring(stages) as (dial, replies, workers):
            conn = await dial()
            got = []
            for step, _ in recorded:
                await conn.async_send(step_frame(7, step))
                got.append(await next_reply(replies))
            sessions = [w.session for w in workers]
            for step, _ in recorded:  # a new session on the same pool, every step in flight at once
                await conn.async_send(step_frame(8, step))
            pipelined = [await next_reply(replies) for _ in recorded]
            await conn.async_send(Release(StreamId(8)))
            await asyncio.sleep(0.2)
            return got, pipelined, sessions, [w.session for w in workers], [w.steps for w in workers]

    got, pipelined, during, after, steps = run(main(), 120)
    assert during == [7, 7] and after == [None, None] and steps == [2 * len(recorded)] * 2
    for again, reply in zip(pipelined, got, strict=True):
        assert isinstance(again, StepReply) and (again.session, again.seq) == (8, reply.seq)
        assert again.ids.tolist() == reply.ids.tolist()
    for (step, want), reply in zip(recorded, got, strict=True):
        assert isinstance(reply, StepReply), reply
        assert (reply.session, reply.seq) == (7, step.seq)
        assert reply.ids.tolist() == want.ids.tolist()
        np.testing.assert_allclose(reply.probs, want.probs, rtol=0, atol=1e-6)
        assert (reply.logits is None) == (want.logits is None)
        if want.logits is not None:
            np.testing.assert_allclose(reply.logits, want.logits, rtol=0, atol=1e-4)
        assert len(reply.stage_ms) == 2 and all(ms > 0 for ms in reply.stage_ms)
    assert any(r.logits is not None for r in got)


def test_sessions_belong_to_their_connection_and_refusals_reach_the_return_port(stages):
    """Another open connection's frames are refused; once the owner closes (even just after the
    new connection's first frame, as on a coordinator's redial) the session is taken over."""
    one = plan(BS, POOL, [PlanRow(1, 0, 3, (SCRATCH_BLOCKS,))])
    step = PagedStep(1, one, np.asarray([5, 6, 7], dtype=np.int64))
    huge = StepPlan(BS, 4096, one.rows)
    budget = 1024 * stages[0].block_bytes

    async def main():
        async with paged_ring(stages, budget) as (dial, replies, workers):
            first, second = await dial(), await dial()
            await first.async_send(step_frame(3, step))
            ok = await next_reply(replies)
            await second.async_send(step_frame(4, step))  # the session is the first connection's
            refused = await asyncio.wait_for(second.async_recv(), TIMEOUT)
            await first.async_send(Step(StreamId(3), 2, huge, np.zeros(huge.padded_tokens, np.int64)))
            grown = await next_reply(replies)  # the pool never grows within a session
            await first.async_send(Step(StreamId(5), 1, huge, np.zeros(huge.padded_tokens, np.int64)))
            over = await next_reply(replies)  # a new session's pool over the budget
            await first.async_send(Packed(StreamId(3), 3, PlanFrame.of([(0, 0, 0)], 1), np.array([[5]], np.int64)))
            wrong_frame = await next_reply(replies)
            # A redial: the new connection's first frame reaches stage 0 before the old one's close.
            await second.async_send(step_frame(4, step))
            await asyncio.sleep(0.3)
            await first.async_close()
            taken_over = await next_reply(replies)
            return ok, refused, grown, over, wrong_frame, taken_over, workers[0].session

    ok, refused, grown, over, wrong_frame, taken_over, session = run(main(), 120)
    assert isinstance(ok, StepReply) and ok.session == 3
    assert isinstance(refused, Error) and refused.code == ErrorCode.UNKNOWN_STREAM and refused.stream_id == 4
    assert isinstance(grown, Error) and grown.code == ErrorCode.STREAM_FAILED and (grown.stream_id, grown.seq) == (3, 2)
    assert "pool of 4096 blocks" in grown.message and f"holds {POOL}" in grown.message
    assert isinstance(over, Error) and over.code == ErrorCode.STREAM_FAILED and (over.stream_id, over.seq) == (5, 1)
    assert str(4096 * stages[0].block_bytes) in over.message and str(budget) in over.message
    assert isinstance(wrong_frame, Error) and "Step frames" in wrong_frame.message
    assert isinstance(taken_over, StepReply) and taken_over.session == 4 and session == 4
    assert taken_over.ids.tolist() == ok.ids.tolist()


def test_open_worker_serves_a_cpu_export_paged(export):
    worker = _open_worker(export, 1, Address("127.0.0.1", 0), Address("127.0.0.1", 1), device="CPU", exact=True,
                          num_threads=None, server_ssl=None, client_ssl=None, cache_dir=None, peers=None,
                          kv_pool_bytes=12345)
    assert isinstance(worker, PagedStageWorker) and worker.kv_pool_bytes == 12345 and worker.stage.is_last
    assert load_manifest(export).stages[1].has_head


def test_the_retired_stateful_worker_is_refused_with_the_reason(export):
    """An old caller asking for the stateful worker (paged=False), or an old command line naming the
    stateful runtime, hears what serves instead; a runtime the export is not served by is named."""
    with pytest.raises(StatefulRuntimeRetiredError, match="stateful runtime was retired; paged serves CPU/GPU, "
                                                          "static the NPU"):
        _open_worker(export, 0, Address("127.0.0.1", 0), Address("127.0.0.1", 1), device="CPU", exact=True,
                     num_threads=None, server_ssl=None, client_ssl=None, cache_dir=None, peers=None, paged=False)
    with pytest.raises(StatefulRuntimeRetiredError, match="stateful runtime was retired"):
        check_runtime("stateful", export)
    with pytest.raises(DeskfleetError, match="served by the paged runtime"):
        check_runtime("static", export)
    check_runtime("paged", export)
    check_runtime(None, export)


def test_deskfleet_worker_runtime_stateful_exits_with_the_message(export):
    """The command line, not an argparse crash: the message names the change."""
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", "worker", "--shard", str(export), "--next",
                           "127.0.0.1:9", "--runtime", "stateful"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "the stateful runtime was retired; paged serves CPU/GPU, static the NPU" in proc.stderr
    assert "Traceback" not in proc.stderr
