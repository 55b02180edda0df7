"""Speculative decoding end to end on the paged runtime: greedy output identical to plain decoding
(the in-process greedy generator is the oracle), over stages in this process and over the ring,
with prompt lookup and with a draft model."""

from __future__ import annotations

import asyncio

import pytest

from engine.generation.in_process import greedy_generate
from engine.generation.request import GenerationRequest, SamplingParams
from engine.paged.coordinator import BatchCoordinator
from engine.paged.speculation import SpeculationConfig, Speculator
from engine.shards.stage import LocalChain
from engine.tools.local_fleet import paged_local_fleet
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect, run

N = 40
POOL = 16 << 20  # the tiny model's blocks are small: a few hundred fit
# A prompt that repeats itself, so prompt lookup has something to find.
LOOPY = PROMPT_IDS + PROMPT_IDS[1:] + PROMPT_IDS[1:9]




@pytest.fixture(scope="module")
def expected(tiny_export):
    chain = LocalChain.load(tiny_export("llama", 1), exact=True)
    return {p: greedy_generate(chain, p, N, ignore_eos=True).tokens for p in (PROMPT_IDS, LOOPY)}


@pytest.mark.parametrize("k", [None, 1, 4, 9])
def test_prompt_lookup_is_identical_in_process(k, tiny_export, expected):
    async def main():
        spec = Speculator(SpeculationConfig("lookup", k=k))
        async with BatchCoordinator.local(tiny_export("llama", 2), exact=True, kv_pool_bytes=POOL,
                                          speculation=spec) as c:
            out = [await collect(c, GenerationRequest(p, N, ignore_eos=True)) for p in (PROMPT_IDS, LOOPY)]
            await c.async_wait_idle()
            return out, c.metrics()

    (plain, loopy), metrics = run(main())
    assert tuple(plain) == expected[PROMPT_IDS] and tuple(loopy) == expected[LOOPY]
    if k:
        assert metrics["speculation_proposed_total"] > 0


def test_draft_model_is_identical_and_accepts_everything_when_draft_equals_target(tiny_export, expected):
    """The 1-stage export as its own draft: every draft must be accepted (a strong check of the
    draft's mask-rewind alignment), and the output must not change."""

    async def main():
        spec = Speculator(SpeculationConfig("draft", k=4, draft_export=tiny_export("llama", 1)), exact=True)
        async with BatchCoordinator.local(tiny_export("llama", 3), exact=True, kv_pool_bytes=POOL,
                                          speculation=spec) as c:
            out = await collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))
            await c.async_wait_idle()
            return out, c.metrics()

    out, metrics = run(main())
    assert tuple(out) == expected[PROMPT_IDS]
    assert metrics["speculation_acceptance_rate"] == 1.0
    assert metrics["speculation_steps_total"] < N / 3  # 5 tokens per verify step


@pytest.mark.slow
def test_a_weaker_draft_is_rejected_often_yet_output_is_identical(tiny_checkpoint, tiny_export, tmp_path, expected):
    from export.exporter import ExportOptions, export_model

    other = export_model(tiny_checkpoint("llama"), tmp_path / "int8-draft", stages=1,
                         options=ExportOptions(weights="int8", kv_cache_precision="f32")).out_dir

    async def main():
        spec = Speculator(SpeculationConfig("draft", k=3, draft_export=other), exact=True)
        async with BatchCoordinator.local(tiny_export("llama", 2), exact=True, kv_pool_bytes=POOL,
                                          speculation=spec) as c:
            out = await collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))
            await c.async_wait_idle()
            return out, c.metrics()

    out, metrics = run(main())
    assert tuple(out) == expected[PROMPT_IDS]
    assert 0 < metrics["speculation_acceptance_rate"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_speculation_over_the_ring_is_identical(stages, tiny_export, expected):
    async def main():
        async with paged_local_fleet(tiny_export("llama", stages), exact=True, kv_pool_bytes=POOL, slots=2) as c:
            c.speculation = Speculator(SpeculationConfig("lookup", k=5))
            # two micro-batched streams, each speculating independently
            return await asyncio.gather(collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True)),
                                        collect(c, GenerationRequest(LOOPY, N, ignore_eos=True)))

    plain, loopy = run(main())
    assert tuple(plain) == expected[PROMPT_IDS] and tuple(loopy) == expected[LOOPY]


def test_speculative_sampling_is_seed_reproducible(tiny_export):
    req = GenerationRequest(LOOPY, 24, SamplingParams(temperature=0.8, seed=5), ignore_eos=True)

    async def main():
        spec = Speculator(SpeculationConfig("draft", k=3, draft_export=tiny_export("llama", 1)), exact=True)
        async with BatchCoordinator.local(tiny_export("llama", 2), exact=True, kv_pool_bytes=POOL,
                                          speculation=spec) as c:
            return await collect(c, req), await collect(c, req)

    a, b = run(main())
    assert a == b and len(a) == 24


@pytest.mark.slow
def test_ring_behind_wan_emulators_on_every_hop(tiny_export, expected):
    """The hop hook puts a delaying proxy on each of the 3 hops; output must not change."""
    from engine.tools.wan_emulator import WanProxy
    from engine.wire.address import Address

    proxies = []

    async def hop(target):
        proxies.append(WanProxy(Address("127.0.0.1", 0), target, delay_ms=5))
        return await proxies[-1].async_start()

    async def main():
        try:
            async with paged_local_fleet(tiny_export("llama", 2), exact=True, kv_pool_bytes=POOL, hop=hop,
                                         speculation=Speculator(SpeculationConfig("lookup"))) as c:
                return await collect(c, GenerationRequest(LOOPY, N, ignore_eos=True))
        finally:
            for p in proxies:
                await p.async_close()

    out = run(main())
    assert tuple(out) == expected[LOOPY]
    assert len(proxies) == 3 and all(p.stats.up.bytes > 0 for p in proxies)


@pytest.mark.slow
def test_speculative_sampling_matches_plain_sampling_on_the_real_tiny_model(tiny_checkpoint, tiny_export, tmp_path):
    """Two-sample chi-square over the first two sampled tokens: speculative (an INT8 draft, so
    drafts are sometimes rejected) vs plain sampling from the same OpenVINO target."""
    from scipy.stats import chi2_contingency

    from export.exporter import ExportOptions, export_model

    draft = export_model(tiny_checkpoint("llama"), tmp_path / "draft", stages=1,
                         options=ExportOptions(weights="int8", kv_cache_precision="f32")).out_dir
    trials = 1200

    def params(seed, temperature=1.0):
        return SamplingParams(temperature=temperature, top_k=3, seed=seed)

    async def sample(speculator, temperature=1.0):
        async with BatchCoordinator.local(tiny_export("llama", 1), exact=True, kv_pool_bytes=POOL, prefix_cache=False,
                                          speculation=speculator) as c:
            out = []
            for seed in range(trials):
                req = GenerationRequest(PROMPT_IDS, 2, params(seed, temperature), ignore_eos=True)
                out.append(tuple(await collect(c, req)))
            return out

    spec = run(sample(Speculator(SpeculationConfig("draft", k=2, draft_export=draft), exact=True)))
    plain = run(sample(None))
    hotter = run(sample(None, temperature=3.0))

    def table(a, b):
        cells = sorted(set(a) | set(b))
        return [[a.count(c) for c in cells], [b.count(c) for c in cells]]

    assert len(set(plain)) > 3, "the test needs a spread of outcomes"
    assert chi2_contingency(table(spec, plain)).pvalue > 1e-3
    assert chi2_contingency(table(hotter, plain)).pvalue < 1e-6  # the test can tell distributions apart
