"""The paged ring of worker processes: batched answers equal solo greedy runs; a worker killed
mid-answer is restarted and every stream's blocks are rebuilt by replay with no token lost or
repeated; without a replacement the streams fail clearly within the hold time."""

from __future__ import annotations

import asyncio

import pytest

from engine.generation.generator import UnavailableError
from engine.generation.request import GenerationRequest
from engine.tools.local_fleet import paged_local_fleet
from tests.conftest import PROMPT_IDS
from tests.coordinator.test_failover import _collect_with_kill, _kill_worker
from tests.support.asyncutil import collect_events as collect
from tests.support.asyncutil import run

N = 40
POOL = 16 << 20  # a small pool: the tiny model's blocks are small


@pytest.mark.slow
def test_batched_streams_through_worker_processes_match_solo_greedy(tiny_export, unsplit_greedy):
    export = tiny_export("llama", 2)
    prompts = [PROMPT_IDS, PROMPT_IDS[:7], tuple(range(40, 90)), PROMPT_IDS[::-1], (5, 6)]

    async def main():
        async with paged_local_fleet(export, exact=True, kv_pool_bytes=POOL, prefill_chunk=5, token_budget=16,
                                     lanes=2) as c:  # two micro-batches in flight, as on separate PCs
            got = await asyncio.gather(*(collect(c, GenerationRequest(p, 16, ignore_eos=True)) for p in prompts))
            await c.async_wait_idle()
            return got, c.metrics()

    got, metrics = run(main())
    for prompt, events in zip(prompts, got, strict=True):
        assert tuple(e.token_id for e in events) == unsplit_greedy(prompt, 16)
    assert metrics["lanes"] == 2 and metrics["kv_blocks_used"] == 0
    assert metrics['stage_compute_ms_per_step{stage="1"}'] > 0


@pytest.mark.slow
@pytest.mark.parametrize("kill_stage", [1, 0])
def test_a_killed_paged_stage_is_replaced_and_answers_are_identical(tiny_export, unsplit_greedy, kill_stage):
    export = tiny_export("llama", 2)
    prompts = (PROMPT_IDS, PROMPT_IDS[:7], tuple(range(40, 60)))

    async def main():
        async with paged_local_fleet(export, exact=True, kv_pool_bytes=POOL, failover=True, step_timeout_s=2.0,
                                     prefill_chunk=5) as c:
            got = await _collect_with_kill(c, prompts, kill_stage=kill_stage, after_tokens=N // 2)
            return got, c.metrics()

    got, metrics = run(main())
    for prompt in prompts:
        assert tuple(got[prompt]) == unsplit_greedy(prompt, N)
    assert metrics["failovers_total"] >= 1 and metrics["sched_replays_total"] >= 1
    assert metrics["requests_failed_total"] == 0


@pytest.mark.slow
def test_without_a_replacement_paged_streams_fail_clearly_after_the_hold_time(tiny_export, unsplit_greedy):
    export = tiny_export("llama", 2)

    async def main():
        async with paged_local_fleet(export, exact=True, kv_pool_bytes=POOL, failover=True, step_timeout_s=1.0,
                                     hold_timeout_s=2.0) as c:
            c.recover = never
            tokens = []
            with pytest.raises(UnavailableError, match="no replacement"):
                async for event in c.stream(GenerationRequest(PROMPT_IDS, N, ignore_eos=True)):
                    tokens.append(event.token_id)
                    if len(tokens) == 5:
                        _kill_worker(1)
            return tokens, c.metrics()

    async def never(path, reason):
        await asyncio.sleep(3600)

    tokens, metrics = run(main())
    assert 5 <= len(tokens) < N and tuple(tokens) == unsplit_greedy(PROMPT_IDS, N)[: len(tokens)]
    assert metrics["requests_failed_total"] == 1
