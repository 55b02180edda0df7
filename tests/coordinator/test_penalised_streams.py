"""Penalties, bias and min-p on the paged runtime: the verdict of a penalised row (pure, with and
without drafts), and the tiny model's penalised greedy output through a real coordinator equal to
an independent reference (HF's ``RepetitionPenaltyLogitsProcessor`` and OpenAI's formula applied
in torch to the logits of one plain forward pass per token), with and without speculation, beside
unpenalised streams whose output does not change; log-probabilities stay the raw model's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.errors import GenerationError
from engine.generation.in_process import greedy_generate
from engine.generation.penalties import penalise_rows
from engine.generation.request import GenerationRequest, SamplingParams
from engine.generation.sampling import probabilities
from engine.paged.coordinator import BatchCoordinator
from engine.paged.reply import decide
from engine.paged.speculation import SpeculationConfig, Speculator
from engine.shards.stage import LocalChain
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect, collect_events, run
from tests.support.penalty_reference import reference

N = 24
POOL = 16 << 20
LOOPY = PROMPT_IDS + PROMPT_IDS[1:] + PROMPT_IDS[1:9]  # prompt lookup finds drafts in it
PENALISED = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                           logit_bias=((2, -100.0), (300, 1.5)))


# -- the verdict of one row, pure -----------------------------------------------------------------

def rows(seed: int, k: int, v: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, (k + 1, v)).astype(np.float32)


def test_a_penalised_greedy_row_is_verified_against_the_penalised_argmax():
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((4, -100.0),))
    logits, tokens = rows(0, 3), [1, 2, 3, 4, 5]
    logits[:, 4] = 50.0  # the raw argmax everywhere; banned by the bias
    want = penalise_rows(logits, params, tokens, 2, [9, 9, 9]).argmax(axis=1)
    ids = logits.argmax(axis=1)
    assert set(ids) == {4} and 4 not in set(want)
    drafts = [int(want[0]), 4, 0]  # the first right, the second the raw model's pick
    verdict, probs = decide(params, np.random.default_rng(0), drafts, None, ids, np.ones(4, np.float32), logits,
                            tokens, 2)
    second = int(penalise_rows(logits, params, tokens, 2, drafts)[1].argmax())
    assert verdict.accepted == 1 and verdict.tokens == (drafts[0], second) and probs == [1.0, 1.0]


def test_a_penalised_sampled_row_draws_from_the_penalised_distribution():
    params = SamplingParams(temperature=1.0, seed=3, logit_bias=((7, -100.0),), presence_penalty=1.0)
    logits, tokens = rows(1, 1), [0, 5, 6, 6]
    q = np.zeros((1, logits.shape[1]))
    q[0, 7] = 1.0  # a drafter sure of the banned token
    target = np.stack([probabilities(r, params) for r in penalise_rows(logits, params, tokens, 1, [7])])
    verdict, probs = decide(params, np.random.default_rng(0), [7], q, logits.argmax(1), np.ones(2, np.float32),
                            logits, tokens, 1)
    assert verdict.accepted == 0 and verdict.tokens[0] != 7  # p(7) ~ e^-100: rejected
    assert probs[0] == pytest.approx(target[0, verdict.tokens[0]] / (1 - target[0, 7]), rel=1e-6)


def test_a_penalised_row_without_its_logits_is_an_error():
    with pytest.raises(GenerationError, match="without its logits"):
        decide(PENALISED, np.random.default_rng(0), [], None, np.zeros(1, np.int64), np.ones(1, np.float32), None)


# -- the tiny model through a real coordinator --------------------------------------------------------

@pytest.fixture(scope="module")
def expected(tiny_export):
    chain = LocalChain.load(tiny_export("llama", 1), exact=True)
    return {"plain": greedy_generate(chain, PROMPT_IDS, N, ignore_eos=True).tokens,
            **{p: reference(chain, p, N, PENALISED) for p in (PROMPT_IDS, LOOPY)}}


@pytest.mark.parametrize("speculation", [None, "lookup"])
def test_penalised_greedy_equals_the_reference_beside_plain_streams(speculation, tiny_export, expected):
    async def main():
        spec = Speculator(SpeculationConfig("lookup", k=4)) if speculation else None
        async with BatchCoordinator.local(tiny_export("llama", 2), exact=True, kv_pool_bytes=POOL,
                                          speculation=spec) as c:
            jobs = [collect_events(c, GenerationRequest(PROMPT_IDS, N, PENALISED, ignore_eos=True, logprobs=1)),
                    collect(c, GenerationRequest(LOOPY, N, PENALISED, ignore_eos=True)),
                    collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))]
            out = await asyncio.gather(*jobs)
            return out, c.metrics()

    (events, loopy, plain), metrics = run(main())
    want_tokens, want_logprobs = expected[PROMPT_IDS]
    assert [e.token_id for e in events] == want_tokens
    assert loopy == expected[LOOPY][0]
    assert tuple(plain) == expected["plain"]  # an unpenalised stream in the same steps is untouched
    assert want_tokens != list(expected["plain"])  # the penalties changed the answer (the test can fail)
    assert 2 not in want_tokens  # the banned token
    # log-probabilities are the raw model's (after the grammar mask, before penalties)
    np.testing.assert_allclose([e.logprob for e in events], want_logprobs, atol=1e-4)
    if speculation:
        assert metrics["speculation_proposed_total"] > 0


def test_the_scheduler_asks_logits_for_penalised_streams_only(tiny_export):
    async def main():
        async with BatchCoordinator.local(tiny_export("llama", 1), exact=True, kv_pool_bytes=POOL) as c:
            sched = c.scheduler
            ids = [sched.add(GenerationRequest(PROMPT_IDS, 2, s), (), 0.0) for s in (
                PENALISED, SamplingParams(), SamplingParams(top_k=3, min_p=0.2))]
            wanted = [sched.stream(i).request.want_logits for i in ids]
            for i in ids:
                c._carry_out(sched.cancel(i))
            return wanted

    assert run(main()) == [True, False, False]


def test_a_bias_beyond_the_vocabulary_fails_that_stream_alone(tiny_export):
    async def main():
        async with BatchCoordinator.local(tiny_export("llama", 1), exact=True, kv_pool_bytes=POOL) as c:
            bad = collect(c, GenerationRequest(PROMPT_IDS, 4, SamplingParams(logit_bias=((1 << 20, 5.0),))))
            good = collect(c, GenerationRequest(PROMPT_IDS, 4))
            return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = run(main())
    assert isinstance(bad, GenerationError) and "beyond this model's" in str(bad)
    assert len(good) == 4
