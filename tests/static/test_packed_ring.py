"""Packed serving across processes: the plan frame on the wire (Packed frames), packed stage
workers keeping their host KV rings in lockstep over real sockets, the packed generator behind
the OpenAI API, and `deskfleet serve` / `deskfleet generate` on static (NPU-target) exports.

Real OpenVINO on the CPU device, real TCP on loopback, the real `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

from engine.generation.generator import ModelCard, UnavailableError
from engine.generation.request import FinishReason, GenerationRequest
from engine.paged.stage import PagedStage
from engine.paged.worker import PagedStageWorker
from engine.shards.manifest import load_manifest
from engine.static.packed_generator import PackedGenerator, RingStatic
from engine.static.packed_ring import PackedRingPath
from engine.static.packed_stage import StaticChain, StaticStage, export_row_options, geometry_of, static_generate
from engine.static.packed_worker import PackedStageWorker
from engine.static.slot_scheduler import PromptTooLong
from engine.wire.address import Address
from engine.wire.format import StreamId
from engine.wire.messages import Packed, Step
from engine.wire.plan_frame import PlanFrame
from engine.wire.step_plan import CPU_BLOCK_SIZE, SCRATCH_BLOCKS, PlanRow, plan
from tests.conftest import PROMPT_IDS
from tests.support.api_helpers import serve_process
from tests.support.asyncutil import run
from tests.support.npu_helpers import npu_export

# (prompt length, new tokens): more requests than the 4 slots, different lengths, early finishers.
REQUESTS = ((17, 15), (5, 27), (9, 4), (12, 20), (3, 29), (14, 8), (1, 6))
TIMEOUT = 180


def _prompt(i: int, n: int) -> list[int]:
    return list((PROMPT_IDS * 3)[i : i + n])


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    packed = npu_export(tmp_path_factory, ckpt, stages=2, context=132, slots=4)
    alone = npu_export(tmp_path_factory, ckpt, stages=2, context=64, prefill_chunk=8)
    return packed, alone


@pytest.fixture(scope="module")
def expected(exports):
    """Each request's tokens served alone, in one process: what packing across PCs must give."""
    chain = StaticChain.load(exports[1], exact=True, graphs=["decode"])
    return [static_generate(chain, _prompt(i, n), new, ignore_eos=True) for i, (n, new) in enumerate(REQUESTS)]


@contextlib.asynccontextmanager
async def worker_ring(export: Path):
    """A packed stage worker per stage (real sockets on loopback) and a generator over their ring."""
    manifest = load_manifest(export)
    # dial_deadline: a session that finds stage 0 gone redials it for this long before it fails
    path = PackedRingPath(manifest.model.fingerprint, len(manifest.stages), Address("127.0.0.1", 0),
                    Address("127.0.0.1", 0), dial_deadline=20)
    workers: list[PackedStageWorker] = []
    next_hop = await path.async_listen()
    try:
        for i in reversed(range(len(manifest.stages))):
            worker = PackedStageWorker(StaticStage(export, i, exact=True, manifest=manifest),
                                       Address("127.0.0.1", 0), next_hop)
            workers.insert(0, worker)
            next_hop = await worker.async_start()
        path.first_remote = next_hop
        generator = PackedGenerator(RingStatic(path, step_timeout_s=20), ModelCard.from_manifest(manifest),
                                    geometry_of(manifest), export_row_options(manifest))
        async with generator:
            yield generator, workers
    finally:
        await path.async_close()
        for worker in workers:
            await worker.async_close()


async def _tokens(generator, prompt, new, **kw) -> list[int]:
    request = GenerationRequest(tuple(prompt), new, ignore_eos=True, **kw)
    return [e.token_id async for e in generator.stream(request)]


def test_packed_frames_keep_every_stage_in_lockstep_and_each_request_gets_its_own_tokens(exports, expected):
    async def scenario():
        async with worker_ring(exports[0]) as (generator, workers):
            results = await asyncio.gather(*(_tokens(generator, _prompt(i, n), new)
                                              for i, (n, new) in enumerate(REQUESTS)))
            return results, generator.steps, [w.steps for w in workers], generator.metrics()

    results, steps, worker_steps, metrics = run(scenario(), TIMEOUT)
    for i, got in enumerate(results):
        assert got == expected[i], f"request {i}"
    assert worker_steps == [steps, steps], "every stage ran every inference"
    assert steps < 0.5 * sum(n + new - 1 for n, new in REQUESTS), "requests shared inferences"
    assert metrics["packed_rows_per_step_avg"] > 2


def test_a_stage_that_lost_its_ring_fails_the_session_clearly_and_the_next_one_is_served(exports, expected):
    async def scenario():
        async with worker_ring(exports[0]) as (generator, workers):
            stream = generator.stream(GenerationRequest(tuple(_prompt(1, 5)), 27, ignore_eos=True))
            first = [await anext(stream), await anext(stream)]
            workers[1].stage.reset()  # as if stage 1 restarted: its ring no longer matches the plan
            with pytest.raises(UnavailableError) as failed:
                async for _ in stream:
                    pass
            again = await _tokens(generator, _prompt(0, 17), 15)
            return first, str(failed.value), again

    first, reason, again = run(scenario(), TIMEOUT)
    assert [e.token_id for e in first] == expected[1][:2]
    assert "stage 1" in reason and "out of step" in reason, reason
    assert again == expected[0], "a new session starts every stage on empty slots"


@pytest.mark.slow
def test_a_cancelled_request_frees_its_slot_and_a_prompt_too_long_is_refused(exports, expected):
    async def scenario():
        async with worker_ring(exports[0]) as (generator, _):
            with pytest.raises(PromptTooLong, match="a slot holds 32"):
                await _tokens(generator, list(range(1, 34)), 2)
            async with contextlib.aclosing(generator.stream(
                    GenerationRequest(tuple(_prompt(4, 3)), 29, ignore_eos=True))) as stream:
                events = [await anext(stream) for _ in range(3)]
            # four more requests: each needs a slot, one of them the cancelled request's
            results = await asyncio.gather(*(_tokens(generator, _prompt(i, n), new)
                                              for i, (n, new) in list(enumerate(REQUESTS))[:4]))
            busy = generator.metrics()["packed_slots_busy"]
            return events, results, busy

    events, results, busy = run(scenario(), TIMEOUT)
    assert [e.token_id for e in events] == expected[4][:3] and all(e.finish is None for e in events)
    assert results == expected[:4]
    assert busy == 0


@pytest.mark.slow
def test_paged_and_static_workers_refuse_each_others_frames(tmp_path_factory, tiny_checkpoint, tiny_export):
    """A Packed frame to a paged stage, or a Step to a static one, is answered with a
    stream-level error at the coordinator, not silently dropped."""
    paged_export = tiny_export("llama", 1)

    async def answer(worker_of, fingerprint, msg):
        path = PackedRingPath(fingerprint, 1, Address("127.0.0.1", 0), Address("127.0.0.1", 0))
        worker = worker_of(await path.async_listen())
        try:
            path.first_remote = await worker.async_start()
            await path.async_start()
            await path._out.async_send(msg)
            return await asyncio.wait_for(path.results.get(), 60)
        finally:
            await path.async_close()
            await worker.async_close()

    one_stage = npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=1, context=32)
    static_manifest = load_manifest(one_stage)
    step_plan = plan(CPU_BLOCK_SIZE, SCRATCH_BLOCKS + 1, [PlanRow(4, 0, 1, (SCRATCH_BLOCKS,))])
    to_paged = run(answer(lambda hop: PagedStageWorker(PagedStage(paged_export, 0), Address("127.0.0.1", 0), hop,
                                                       kv_pool_bytes=16 << 20),
                          load_manifest(paged_export).model.fingerprint,
                          Packed(StreamId(3), 1, PlanFrame.of([(0, 0, 0)], 1), np.array([[5]], np.int64))))
    to_static = run(answer(lambda hop: PackedStageWorker(StaticStage(one_stage, 0, manifest=static_manifest),
                                                         Address("127.0.0.1", 0), hop),
                           static_manifest.model.fingerprint,
                           Step(StreamId(4), 1, step_plan, np.zeros(step_plan.padded_tokens, np.int64))))
    assert to_paged.error and "takes Step frames, not Packed" in to_paged.error
    assert to_static.error and "takes Packed frames, not Step" in to_static.error


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGTERM")
def test_serve_workers_answers_the_openai_client_from_a_static_export(exports):
    packed = exports[0]
    with serve_process("--shards", str(packed), "--workers", "--exact", ready_timeout=TIMEOUT,
                       timeout=TIMEOUT) as url:
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=TIMEOUT) as c:
            model = c.models.list().data[0].id
            answers = [c.completions.create(model=model, prompt=p, max_tokens=5, temperature=0)
                       for p in ("Hello", "The sky is")]
            chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4)
            with pytest.raises(openai.BadRequestError, match="slot holds"):
                c.completions.create(model=model, prompt="word " * 60, max_tokens=2)
        assert [a.usage.completion_tokens for a in answers] == [5, 5]
        assert answers[0].choices[0].text != answers[1].choices[0].text
        assert chat.choices[0].message.content is not None


@pytest.mark.slow
def test_generate_answers_from_a_static_export_with_the_in_process_tokens(exports):
    alone = exports[1]
    out = subprocess.run([sys.executable, "-m", "engine.cli.main", "generate", "--shards", str(alone), "--prompt",
                          "Hello there", "--raw", "--max-new-tokens", "6", "--exact"],
                         cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    from engine.generation.tokenizer import ChatTokenizer

    tok = ChatTokenizer(alone / "tokenizer")
    chain = StaticChain.load(alone, exact=True)
    want = static_generate(chain, tok.encode("Hello there"), 6, eos_ids=chain.manifest.model.eos_token_ids)
    assert out.stdout.strip() == tok.decode(want).strip()
    assert "static 1-slot export" in out.stderr


def test_finish_reasons_follow_the_stop_tokens(exports, expected):
    async def scenario():
        async with worker_ring(exports[0]) as (generator, _):
            stop = expected[2][1]  # the second token request 2 produces
            request = GenerationRequest(tuple(_prompt(2, 9)), 4, stop_token_ids=(stop,), ignore_eos=True)
            stopped = [e async for e in generator.stream(request)]
            full = [e async for e in generator.stream(GenerationRequest(tuple(_prompt(2, 9)), 4, ignore_eos=True))]
            return stopped, full

    stopped, full = run(scenario(), TIMEOUT)
    assert [e.token_id for e in stopped] == expected[2][:2] and stopped[-1].finish is FinishReason.STOP
    assert [e.token_id for e in full] == expected[2] and full[-1].finish is FinishReason.LENGTH


@pytest.mark.slow
def test_a_restarted_first_stage_fails_the_session_in_flight_and_the_next_one_reconnects(exports, expected):
    async def scenario():
        async with worker_ring(exports[0]) as (generator, workers):
            assert await _tokens(generator, _prompt(2, 9), 4) == expected[2]
            address = workers[0].address
            await workers[0].async_close()  # the PC of stage 0 restarts its worker
            with pytest.raises(UnavailableError):
                await _tokens(generator, _prompt(0, 17), 15)
            manifest = load_manifest(exports[0])
            workers[0] = PackedStageWorker(StaticStage(exports[0], 0, exact=True, manifest=manifest), address,
                                           workers[1].address)
            await workers[0].async_start()
            return await _tokens(generator, _prompt(0, 17), 15)

    assert run(scenario(), TIMEOUT) == expected[0]
