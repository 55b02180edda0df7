"""A long prefill pipelined over the stages: its next chunk joins a step while the earlier ones are
in flight, in the room other streams leave, on free blocks only; a failed chunk voids the later
ones; a cancel waits for the last. Simulated model (the scheduler's rules) and a real 2-stage ring
of worker processes (real OpenVINO, a failover replayed through pipelined chunks)."""

from __future__ import annotations

import asyncio

import pytest

from engine.generation.request import FinishReason, GenerationRequest
from engine.paged.scheduler import BatchScheduler, Finished
from engine.paged.step import PagedOutcome
from engine.tools.local_fleet import paged_local_fleet
from engine.wire.step_plan import SCRATCH_BLOCKS
from tests.conftest import PROMPT_IDS
from tests.coordinator.paged_sim import EOS, Run, SimPagedModel, check_accounting, check_step, config, reference
from tests.coordinator.test_failover import _collect_with_kill
from tests.support.asyncutil import collect_events as collect
from tests.support.asyncutil import run

LONG = tuple(range(1, 51))  # 50 prompt tokens: four chunks of 16


def _rows(step) -> list[tuple[int, int, int, int]]:
    return [(r.stream_id, r.past_len, r.new_tokens, r.sample) for r in step.plan.rows]


def _plan(sched: BatchScheduler, model: SimPagedModel, run_: Run):
    step, actions = sched.next_step()
    run_.take(actions)
    if step is not None:
        check_step(sched, step)
        check_accounting(sched)
    return step


def _answer(sched: BatchScheduler, model: SimPagedModel, run_: Run, step, outcome=None) -> list:
    actions = sched.on_outcome(outcome if outcome is not None else model.run(step), 0.0)
    run_.take(actions)
    check_accounting(sched)
    return actions


def _finish(sched: BatchScheduler, model: SimPagedModel, run_: Run) -> None:
    for _ in range(1000):
        step = _plan(sched, model, run_)
        if step is None:
            assert sched.idle
            return
        _answer(sched, model, run_, step)
    raise AssertionError("did not finish")


def test_a_long_prefill_brings_every_chunk_before_the_first_returns_and_answers_as_alone() -> None:
    cfg = config(prefill_chunk=16, token_budget=16)
    sched, model, run_ = BatchScheduler(cfg), SimPagedModel(256, 16), Run()
    request = GenerationRequest(LONG, max_new_tokens=8, ignore_eos=True)
    sid = sched.add(request, {EOS}, 0.0)
    steps = [_plan(sched, model, run_) for _ in range(4)]
    assert [_rows(s) for s in steps] == [[(sid, 0, 16, 0)], [(sid, 16, 16, 0)], [(sid, 32, 16, 0)],
                                         [(sid, 48, 2, 1)]]
    assert _plan(sched, model, run_) is None  # the answer row is in flight: nothing more to feed
    assert sched.metrics()["sched_pipelined_chunks_total"] == 3
    outcomes = [model.run(s) for s in steps]  # each stage runs the steps in the order they were sent
    for outcome in outcomes[:3]:
        assert sched.on_outcome(outcome, 0.0) == []
        check_accounting(sched)
    run_.take(sched.on_outcome(outcomes[3], 0.0))
    assert sched.stream(sid).cached == 50 and len(run_.tokens[sid]) == 1
    _finish(sched, model, run_)
    assert run_.tokens[sid] == reference(request, cfg.context_length)
    assert sched.pool.used == 0


def test_without_pipelining_a_stream_in_flight_is_in_no_other_step() -> None:
    sched = BatchScheduler(config(prefill_chunk=16, token_budget=16, pipeline_prefill=False))
    sched.add(GenerationRequest(LONG, max_new_tokens=4), {EOS}, 0.0)
    assert sched.next_step()[0] is not None and sched.next_step()[0] is None


def test_the_next_chunk_takes_only_the_room_other_streams_leave() -> None:
    cfg = config(prefill_chunk=16, token_budget=16)
    sched, model, run_ = BatchScheduler(cfg), SimPagedModel(256, 16), Run()
    short = sched.add(GenerationRequest((3, 4, 5), max_new_tokens=20, ignore_eos=True), {EOS}, 0.0)
    _answer(sched, model, run_, _plan(sched, model, run_))  # short now decodes
    long_ = sched.add(GenerationRequest(LONG, max_new_tokens=4, ignore_eos=True), {EOS}, 0.0)
    first = _plan(sched, model, run_)
    assert _rows(first) == [(short, 3, 1, 1), (long_, 0, 15, 0)]  # decode first, then a chunk in the rest
    late = sched.add(GenerationRequest((7, 8, 9, 10, 11), max_new_tokens=4, ignore_eos=True), {EOS}, 0.0)
    second = _plan(sched, model, run_)  # short and long are in flight: the newcomer first, then long's next
    assert _rows(second) == [(late, 0, 5, 1), (long_, 15, 11, 0)]
    for step in (first, second):
        _answer(sched, model, run_, step)
    _finish(sched, model, run_)
    for sid, prompt, n in ((short, (3, 4, 5), 20), (long_, LONG, 4), (late, (7, 8, 9, 10, 11), 4)):
        assert run_.tokens[sid] == reference(GenerationRequest(prompt, n, ignore_eos=True), cfg.context_length)
    assert sched.counters["preemptions"] == 0


def test_the_next_chunk_uses_free_blocks_only_and_preempts_nobody() -> None:
    cfg = config(prefill_chunk=16, token_budget=16, pool_blocks=SCRATCH_BLOCKS + 4)
    sched, model, run_ = BatchScheduler(cfg), SimPagedModel(cfg.pool_blocks, 16), Run()
    long_ = sched.add(GenerationRequest(LONG[:40], max_new_tokens=4, ignore_eos=True), {EOS}, 0.0)
    first = _plan(sched, model, run_)  # long [0, 16): 1 block
    newer = sched.add(GenerationRequest(tuple(range(60, 93)), max_new_tokens=2, ignore_eos=True), {EOS}, 0.0)
    second = _plan(sched, model, run_)  # newer's first chunk takes the budget: 1 block
    assert _rows(second) == [(newer, 0, 16, 0)]
    _answer(sched, model, run_, first)
    _answer(sched, model, run_, second)
    third = _plan(sched, model, run_)  # long [16, 32): a 2nd block; 1 left free
    fourth = _plan(sched, model, run_)  # newer [16, 32): the last free block
    assert _rows(third) == [(long_, 16, 16, 0)] and _rows(fourth) == [(newer, 16, 16, 0)]
    assert sched.pool.free == 0
    _answer(sched, model, run_, fourth)  # newer waits for a block, not in flight; long is
    # long's next chunk would need a block: it does not preempt newer (an older stream's row would)
    assert _plan(sched, model, run_) is None and sched.counters["preemptions"] == 0
    _answer(sched, model, run_, third)
    last = _plan(sched, model, run_)
    assert _rows(last) == [(long_, 32, 8, 1)] and sched.counters["preemptions"] == 1
    _answer(sched, model, run_, last)
    _finish(sched, model, run_)
    assert run_.tokens[long_] == reference(GenerationRequest(LONG[:40], 4, ignore_eos=True), cfg.context_length)
    assert run_.tokens[newer] == reference(GenerationRequest(tuple(range(60, 93)), 2, ignore_eos=True),
                                           cfg.context_length)


@pytest.mark.parametrize("prompt", [LONG[:40], LONG[:30]], ids=["prefill-after", "answer-after"])
def test_a_failed_chunk_voids_the_later_ones_and_the_stream_replans_from_its_cache(prompt) -> None:
    """The first chunk fails on the stages; the second ran over the KV it did not write (a prefill
    chunk, or the answer row: its token is wrong) and must change nothing."""
    cfg = config(prefill_chunk=16, token_budget=16)
    sched, model, run_ = BatchScheduler(cfg), SimPagedModel(256, 16), Run()
    request = GenerationRequest(prompt, max_new_tokens=6, ignore_eos=True)
    sid = sched.add(request, {EOS}, 0.0)
    first, second = _plan(sched, model, run_), _plan(sched, model, run_)
    assert _rows(second)[0][1] == 16
    later = model.run(second)  # the stages ran it after dropping the first
    failed = _answer(sched, model, run_, first, PagedOutcome.failed(first.seq, "stage 0 dropped it"))
    assert len(failed) == 1 and sched.stream(sid).cached == 0 and sched.stream(sid).in_flight is None
    assert _answer(sched, model, run_, second, later) == [] and not run_.tokens[sid]
    assert sched.stream(sid).cached == 0
    again = _plan(sched, model, run_)
    assert _rows(again)[0][:3] == (sid, 0, 16)
    _answer(sched, model, run_, again)
    _finish(sched, model, run_)
    assert run_.tokens[sid] == reference(request, cfg.context_length)


def test_a_cancel_with_two_chunks_in_flight_frees_the_blocks_when_the_last_returns() -> None:
    sched, model, run_ = BatchScheduler(config(prefill_chunk=16, token_budget=16)), SimPagedModel(256, 16), Run()
    sid = sched.add(GenerationRequest(LONG, max_new_tokens=4), {EOS}, 0.0)
    first, second = _plan(sched, model, run_), _plan(sched, model, run_)
    assert sched.cancel(sid) == [] and sched.pool.used == 2
    assert _answer(sched, model, run_, first) == [] and sched.pool.used == 2  # the second still writes its block
    assert _answer(sched, model, run_, second) == [Finished(sid, FinishReason.CANCELLED)]
    assert sched.pool.used == 0 and sched.idle and _plan(sched, model, run_) is None


# ----------------------------------------------------------------------------- a real ring

POOL = 16 << 20
N = 40


@pytest.mark.slow
def test_a_long_prompt_pipelined_through_two_worker_processes_answers_as_alone(tiny_export, unsplit_greedy):
    export = tiny_export("llama", 2)
    prompts = (tuple(range(40, 100)), PROMPT_IDS)

    async def main():
        async with paged_local_fleet(export, exact=True, kv_pool_bytes=POOL, prefill_chunk=8, token_budget=8,
                                     lanes=2) as c:
            got = [await collect(c, GenerationRequest(p, 12, ignore_eos=True)) for p in prompts]
            together = await asyncio.gather(*(collect(c, GenerationRequest(p, 12, ignore_eos=True))
                                              for p in prompts))
            await c.async_wait_idle()
            return got, together, c.metrics()

    got, together, metrics = run(main())
    for prompt, alone, batched in zip(prompts, got, together, strict=True):
        assert tuple(e.token_id for e in alone) == unsplit_greedy(prompt, 12)
        assert tuple(e.token_id for e in batched) == unsplit_greedy(prompt, 12)
    assert metrics["sched_pipelined_chunks_total"] >= 7 and metrics["kv_blocks_used"] == 0


@pytest.mark.slow
def test_a_killed_stage_is_replayed_through_pipelined_chunks_and_answers_are_identical(tiny_export, unsplit_greedy):
    export = tiny_export("llama", 2)
    prompts = (tuple(range(40, 100)),)  # alone: with two streams both lanes are busy without pipelining
    seen = {}

    async def main():
        async with paged_local_fleet(export, exact=True, kv_pool_bytes=POOL, failover=True, step_timeout_s=2.0,
                                     prefill_chunk=8, token_budget=8, lanes=2) as c:
            await collect(c, GenerationRequest((1, 2), 1))  # warm: the ring answers
            seen["before"] = c.metrics()["sched_pipelined_chunks_total"]
            got = await _collect_with_kill(c, prompts, kill_stage=1, after_tokens=N // 2)
            return got, c.metrics()

    got, metrics = run(main())
    for prompt in prompts:
        assert tuple(got[prompt]) == unsplit_greedy(prompt, N)
    assert metrics["failovers_total"] >= 1 and metrics["sched_replays_total"] >= 1
    # 7 chunks followed the first of the 60-token prompt; the ~80 replayed tokens bring 9 more
    assert metrics["sched_pipelined_chunks_total"] - seen["before"] >= 15
    assert metrics["requests_failed_total"] == 0
