"""The paged coordinator over stages in this process: every stream's tokens are its solo run's,
whatever it shares its steps with (the in-process greedy generator over the stateful stages is the
oracle); sampling, speculation, the prefix cache and cancellation work."""

from __future__ import annotations

import asyncio

import pytest

from engine.generation.generator import OverloadedError
from engine.generation.in_process import greedy_generate
from engine.generation.request import FinishReason, GenerationRequest, SamplingParams
from engine.paged.coordinator import BatchCoordinator
from engine.paged.speculation import SpeculationConfig, Speculator
from engine.shards.stage import LocalChain
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect_events as collect
from tests.support.asyncutil import run

POOL = 16 << 20  # the tiny model's blocks are small: a few hundred fit
PROMPTS = [PROMPT_IDS, PROMPT_IDS[3:], (7, 8, 9, 10, 11, 12), PROMPT_IDS[::-1], PROMPT_IDS * 3, (5,),
           tuple(range(40, 90)), PROMPT_IDS[5:12]]


def ids(events) -> list[int]:
    return [e.token_id for e in events]


def solo_greedy(export, prompts, n) -> list[list[int]]:
    """The identity reference: each prompt alone through the in-process oracle, exact settings."""
    chain = LocalChain.load(export, exact=True)
    return [list(greedy_generate(chain, p, n, ignore_eos=True).tokens) for p in prompts]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_batched_streams_match_their_solo_runs(tiny_export, stages):
    """Eight streams joining at once, then in a staggered order with small prefill chunks (so
    prefill chunks share steps with other streams' decode): every one gives its solo tokens."""
    export = tiny_export("llama", stages)
    n = 12
    expected = solo_greedy(export, PROMPTS, n)

    async def main():
        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL, slots=8, prefill_chunk=5,
                                          token_budget=24) as c:
            together = await asyncio.gather(*(collect(c, GenerationRequest(p, n, ignore_eos=True))
                                              for p in PROMPTS))

            async def late(i, p):
                await asyncio.sleep(0.01 * i)
                return await collect(c, GenerationRequest(p, n, ignore_eos=True))

            staggered = await asyncio.gather(*(late(i, p) for i, p in enumerate(PROMPTS)))
            await c.async_wait_idle()
            return together, staggered, c.metrics()

    together, staggered, metrics = run(main())
    assert [ids(t) for t in together] == expected
    assert [ids(t) for t in staggered] == expected
    assert metrics["requests_finished_total"] == 2 * len(PROMPTS)
    assert metrics["step_answered_rows_avg"] > 1  # steps really were shared
    assert metrics["kv_blocks_used"] == 0  # every block went back to the pool


def test_finish_reasons_and_stop_tokens(tiny_export):
    export = tiny_export("llama", 1)
    reference = solo_greedy(export, [PROMPT_IDS], 10)[0]
    stop = reference[4]

    async def main():
        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL) as c:
            stopped = await collect(c, GenerationRequest(PROMPT_IDS, 10, stop_token_ids=(stop,)))
            full = await collect(c, GenerationRequest(PROMPT_IDS, 10, ignore_eos=True))
        return stopped, full

    stopped, full = run(main())
    assert ids(stopped) == reference[: reference.index(stop) + 1] and stopped[-1].finish is FinishReason.STOP
    assert ids(full) == reference and full[-1].finish is FinishReason.LENGTH
    assert all(e.finish is None for e in full[:-1])


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_export):
    export = tiny_export("llama", 2)

    def req(seed):
        return GenerationRequest(PROMPT_IDS, 20, SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed),
                                 ignore_eos=True)

    async def main():
        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL) as c:
            a, b, other = await asyncio.gather(collect(c, req(7)), collect(c, req(7)), collect(c, req(8)))
            again = await collect(c, req(7))
        return a, b, other, again

    a, b, other, again = run(main())
    assert ids(a) == ids(b) == ids(again)
    assert ids(a) != ids(other)


@pytest.mark.parametrize("k", [2, None])
def test_prompt_lookup_speculation_keeps_greedy_tokens(tiny_export, k):
    """Verify rows of 1 + K and their rewind (past_len lowered, surplus blocks freed) change no token."""
    export = tiny_export("llama", 2)
    prompts = [PROMPT_IDS * 3, PROMPT_IDS[::-1] * 2, tuple(range(40, 90))]
    expected = solo_greedy(export, prompts, 24)

    async def main():
        spec = Speculator(SpeculationConfig("lookup", k=k), exact=True)
        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL, speculation=spec) as c:
            got = await asyncio.gather(*(collect(c, GenerationRequest(p, 24, ignore_eos=True)) for p in prompts))
            await c.async_wait_idle()
            return got, c.metrics()

    got, metrics = run(main())
    assert [ids(g) for g in got] == expected
    assert metrics["speculation_proposed_total"] > 0
    assert metrics["kv_blocks_used"] == 0


def test_a_draft_model_equal_to_the_target_is_always_accepted_and_changes_nothing(tiny_export):
    """The 1-stage export as its own draft: every draft accepted (the verify rows' positions and
    blocks line up with the draft's), and the greedy output unchanged."""
    export = tiny_export("llama", 3)
    expected = solo_greedy(export, [PROMPT_IDS], 24)[0]

    async def main():
        spec = Speculator(SpeculationConfig("draft", k=4, draft_export=tiny_export("llama", 1)), exact=True)
        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL, speculation=spec) as c:
            out = await collect(c, GenerationRequest(PROMPT_IDS, 24, ignore_eos=True))
            await c.async_wait_idle()
            return out, c.metrics()

    out, metrics = run(main())
    assert ids(out) == expected
    assert metrics["speculation_acceptance_rate"] == 1.0 and metrics["speculation_steps_total"] < 24 / 3


def test_speculative_sampling_is_seed_reproducible(tiny_export):
    req = GenerationRequest(PROMPT_IDS * 2, 24, SamplingParams(temperature=0.8, seed=5), ignore_eos=True)

    async def main():
        spec = Speculator(SpeculationConfig("draft", k=3, draft_export=tiny_export("llama", 1)), exact=True)
        async with BatchCoordinator.local(tiny_export("llama", 2), exact=True, kv_pool_bytes=POOL,
                                          speculation=spec) as c:
            return await collect(c, req), await collect(c, req)

    a, b = run(main())
    assert ids(a) == ids(b) and len(a) == 24


def test_a_follow_up_turn_reuses_the_conversation_blocks(tiny_export):
    """Turn 2's prompt is turn 1's prompt, its answer and more: the shared full blocks (and the
    copied partial one) are reused, and the answer is the cold run's."""
    export = tiny_export("llama", 2)
    first = tuple(range(40, 120))  # 80 tokens: two full blocks and a partial one

    async def main():
        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL) as c:
            answer = ids(await collect(c, GenerationRequest(first, 8, ignore_eos=True)))
            follow = first + tuple(answer) + (7, 8, 9)
            warm = ids(await collect(c, GenerationRequest(follow, 8, ignore_eos=True)))
            await c.async_wait_idle()
            return follow, warm, c.metrics()

    follow, warm, metrics = run(main())
    assert warm == solo_greedy(export, [follow], 8)[0]
    assert metrics["prefix_hits_total"] >= 1 and metrics["prefix_tokens_reused_total"] >= 64


def test_cancelling_frees_the_blocks_and_a_full_queue_is_refused(tiny_export):
    export = tiny_export("llama", 2)

    async def main():
        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL, slots=1, max_waiting=0) as c:
            stream = c.stream(GenerationRequest(PROMPT_IDS, 200, ignore_eos=True))
            await stream.__anext__()
            with pytest.raises(OverloadedError):
                await collect(c, GenerationRequest(PROMPT_IDS, 4))
            await stream.aclose()
            await c.async_wait_idle()
            after = c.metrics()
            done = await collect(c, GenerationRequest(PROMPT_IDS, 4, ignore_eos=True))
        return after, done

    after, done = run(main())
    assert after["kv_blocks_used"] == 0 and after["requests_cancelled_total"] == 1
    assert len(done) == 4


def test_stopping_during_a_failover_cancels_the_recovery(tiny_export):
    """A coordinator closed while its ring is being recovered stops that recovery (before, it ran on
    and redialled a path already closed) and fails the held stream instead of leaving it waiting."""
    export = tiny_export("llama", 2)
    state = {"entered": asyncio.Event(), "cancelled": False}

    async def recover(path, reason):
        state["entered"].set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        return path

    async def main():
        c = BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL)
        await c.async_start()
        c.recover = recover
        stream = asyncio.create_task(collect(c, GenerationRequest(PROMPT_IDS, 64, ignore_eos=True)))
        await asyncio.sleep(0.05)
        c.request_failover("a test pulls the ring")
        await asyncio.wait_for(state["entered"].wait(), 10)
        await asyncio.wait_for(c.async_stop(), 10)
        cancelled = state["cancelled"]  # now: the end of the loop would cancel it anyway
        return cancelled, await asyncio.wait_for(asyncio.gather(stream, return_exceptions=True), 10)

    cancelled, (outcome,) = run(main())
    assert cancelled, "the recovery kept running after the coordinator stopped"
    assert isinstance(outcome, Exception), outcome
