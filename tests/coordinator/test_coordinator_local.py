"""The coordinator over stages in this process: identity, isolation, sampling, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from engine.coordinator.coordinator import Coordinator
from engine.errors import GenerationError
from engine.generation.generator import OverloadedError
from engine.generation.in_process import greedy_generate
from engine.generation.request import FinishReason, GenerationRequest, SamplingParams
from engine.shards.stage import LocalChain
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect_events as collect
from tests.support.asyncutil import run


def test_greedy_equals_the_in_process_chain(tiny_export):
    export = tiny_export("llama", 2)
    expected = greedy_generate(LocalChain.load(export, exact=True), PROMPT_IDS, 24, ignore_eos=True).tokens

    async def main():
        async with Coordinator.local(export, exact=True, prefill_chunk=5) as c:
            events = await collect(c, GenerationRequest(PROMPT_IDS, 24, ignore_eos=True))
        return events

    events = run(main())
    assert tuple(e.token_id for e in events) == expected
    assert events[-1].finish is FinishReason.LENGTH and all(e.finish is None for e in events[:-1])


def test_concurrent_streams_do_not_influence_each_other(tiny_export):
    export = tiny_export("llama", 2)
    prompts = [PROMPT_IDS, PROMPT_IDS[3:], (7, 8, 9, 10, 11, 12), PROMPT_IDS[::-1]]

    async def main():
        async with Coordinator.local(export, exact=True, slots=3) as c:
            alone = [await collect(c, GenerationRequest(p, 16 + i, ignore_eos=True)) for i, p in enumerate(prompts)]
            together = await asyncio.gather(*(collect(c, GenerationRequest(p, 16 + i, ignore_eos=True))
                                              for i, p in enumerate(prompts)))
            await c.async_wait_idle()
            metrics = c.metrics()
        return alone, together, metrics

    alone, together, metrics = run(main())
    for a, t in zip(alone, together, strict=True):
        assert [e.token_id for e in a] == [e.token_id for e in t]
    assert metrics["active_streams"] == 0 and metrics["requests_finished_total"] == 8


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_export):
    export = tiny_export("llama", 1)

    def req(seed):
        return GenerationRequest(PROMPT_IDS, 20, SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed),
                                 ignore_eos=True)

    async def main():
        async with Coordinator.local(export, exact=True) as c:
            a, b, other = await asyncio.gather(collect(c, req(7)), collect(c, req(7)), collect(c, req(8)))
        return a, b, other

    a, b, other = run(main())
    ids = lambda evs: [e.token_id for e in evs]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(other)


def test_cancelling_frees_the_slot(tiny_export):
    export = tiny_export("llama", 2)

    async def main():
        async with Coordinator.local(export, exact=True, slots=1, max_waiting=0) as c:
            stream = c.stream(GenerationRequest(PROMPT_IDS, 200, ignore_eos=True))
            await stream.__anext__()
            with pytest.raises(OverloadedError):
                await collect(c, GenerationRequest(PROMPT_IDS, 4))
            await stream.aclose()
            await c.async_wait_idle()  # the slot frees once the step in flight returns
            done = await collect(c, GenerationRequest(PROMPT_IDS, 4, ignore_eos=True))
            return c.metrics(), done

    metrics, done = run(main())
    assert len(done) == 4
    assert metrics["requests_cancelled_total"] == 1 and metrics["requests_rejected_total"] == 1


def test_prompt_longer_than_the_context_is_refused(tiny_export):
    async def main():
        async with Coordinator.local(tiny_export("llama", 1)) as c:
            await collect(c, GenerationRequest(tuple(range(3, 600)), 4))

    with pytest.raises(GenerationError, match="context"):
        run(main())


def test_prefix_cache_warm_path_equals_cold_and_falls_back_when_a_capture_is_lost(tiny_export):
    export = tiny_export("llama", 2)
    history = PROMPT_IDS + (44, 55, 66, 77, 88, 99, 111, 122)
    follow_up = history + (133, 144, 155, 166)

    async def main():
        async with Coordinator.local(export, exact=True, prefix_cache=False) as cold:
            expected = await collect(cold, GenerationRequest(follow_up, 16, ignore_eos=True))
        async with Coordinator.local(export, exact=True, prefix_min_tokens=8) as c:
            await collect(c, GenerationRequest(history, 6, ignore_eos=True))  # captured at the end
            await c.async_wait_idle()
            warm = await collect(c, GenerationRequest(follow_up, 16, ignore_eos=True))
            hits = c.metrics()
            for store in c.path.stores:  # a stage loses every capture: restore must fall back
                store._items.clear()
            await collect(c, GenerationRequest(PROMPT_IDS + (9, 9, 9), 4, ignore_eos=True))
            await c.async_wait_idle()
            fallback = await collect(c, GenerationRequest(follow_up, 16, ignore_eos=True))
            return expected, warm, hits, fallback, c.metrics()

    expected, warm, hits, fallback, after = run(main())
    ids = lambda evs: [e.token_id for e in evs]  # noqa: E731
    assert ids(warm) == ids(expected)
    assert hits["prefix_hits_total"] == 1 and hits["prefix_tokens_reused_total"] >= len(history)
    assert ids(fallback) == ids(expected)
    assert after["prefix_fallbacks_total"] >= 1


def test_a_restore_that_never_answers_times_out_into_a_cold_prefill(tiny_export, monkeypatch):
    from engine.shards.step_path import LocalPath

    export = tiny_export("llama", 2)
    history = PROMPT_IDS + (44, 55, 66, 77)
    follow_up = history + (133, 144)
    real_cache = LocalPath._cache

    def stuck_restore(self, step):
        if step.is_capture:
            return real_cache(self, step)
        import time

        time.sleep(1.5)  # longer than the restore timeout below
        return real_cache(self, step)

    async def main():
        async with Coordinator.local(export, exact=True, prefix_cache=False) as cold:
            expected = await collect(cold, GenerationRequest(follow_up, 12, ignore_eos=True))
        monkeypatch.setattr(LocalPath, "_cache", stuck_restore)
        async with Coordinator.local(export, exact=True, prefix_min_tokens=8, restore_timeout_s=0.5) as c:
            await collect(c, GenerationRequest(history, 4, ignore_eos=True))
            await c.async_wait_idle()
            out = await collect(c, GenerationRequest(follow_up, 12, ignore_eos=True))
            await c.async_wait_idle()
            return expected, out, c.metrics()

    expected, out, metrics = run(main())
    assert [e.token_id for e in out] == [e.token_id for e in expected]
    assert metrics["prefix_fallbacks_total"] == 1 and metrics["prefix_hits_total"] == 0


def test_prefix_index_forgets_captures_of_another_model():
    from engine.shards.prefix_cache import PrefixIndex

    index = PrefixIndex(min_length=2, fingerprint="model-a")
    index.add(index.new_id(), (1, 2, 3, 4))
    assert index.lookup((1, 2, 3, 9), "model-a") is not None
    assert index.lookup((1, 2, 3, 9), "model-b") is None
    assert len(index) == 0


def test_prefix_index_finds_a_capture_only_for_its_own_scope():
    from engine.shards.prefix_cache import PrefixIndex

    index = PrefixIndex(min_length=2, fingerprint="m")
    victim = index.new_id()
    index.add(victim, (1, 2, 3, 4), scope="key:victim")
    assert index.lookup((1, 2, 3, 9), "m", scope="key:bob") is None
    assert index.lookup((1, 2, 3, 9), "m") is None
    assert index.lookup((1, 2, 3, 9), "m", scope="key:victim").capture_id == victim
