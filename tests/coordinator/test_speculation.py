"""Speculative decoding policy: greedy and sampling verification, prompt lookup, adaptive K.

The sampling tests are statistical: many seeded trials of a tiny bigram "model" and a
chi-square goodness-of-fit of emitted-token frequencies against the target's probabilities.
Deliberately wrong acceptance rules run on the same setup to show the test has the power to fail.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from engine.errors import DeskfleetError, GenerationError
from engine.generation.request import SamplingParams
from engine.generation.sampling import choose, probabilities
from engine.paged.speculation_policy import (
    AdaptiveK,
    AdaptiveKConfig,
    PromptLookupDrafter,
    Verdict,
    best_k,
    expected_tokens,
    verify_greedy,
    verify_sampling,
)
from engine.shards.kv_layout import KVLayout

V = 8
BOS = V  # the bigram tables' extra row: the distribution of the first token
TRIALS = 20_000
PARAMS = {  # target/draft sampling settings: full support, and a truncated support
    "temperature": SamplingParams(temperature=0.8, seed=0),
    "top_k": SamplingParams(temperature=0.8, top_k=6, seed=0),
}


# ----------------------------------------------------------------------------- verify_greedy


@pytest.mark.parametrize(("draft", "top1", "expected"), [
    ((5, 6, 7), (5, 6, 7, 8), Verdict(3, (5, 6, 7, 8))),  # all accepted + bonus
    ((5, 6, 7), (4, 6, 7, 8), Verdict(0, (4,))),  # first rejected: correction only
    ((5, 6, 7), (5, 9, 7, 8), Verdict(1, (5, 9))),  # middle rejected; later matches do not count
    ((5, 6, 7), (5, 6, 1, 8), Verdict(2, (5, 6, 1))),  # last rejected
    ((), (3,), Verdict(0, (3,))),  # no draft: plain decode
])
def test_verify_greedy_cases(draft, top1, expected):
    assert verify_greedy(draft, top1) == expected


def test_verify_greedy_exhaustive_matches_longest_common_prefix():
    for k in range(4):
        for draft in itertools.product(range(2), repeat=k):
            for top1 in itertools.product(range(2), repeat=k + 1):
                lcp = next((i for i in range(k) if draft[i] != top1[i]), k)
                verdict = verify_greedy(draft, top1)
                assert verdict.accepted == lcp
                assert verdict.tokens == top1[: lcp + 1]  # always what the target alone would emit


def test_verify_greedy_rejects_wrong_target_length():
    with pytest.raises(GenerationError, match="needs 3 target tokens"):
        verify_greedy((1, 2), (1, 2))


def test_greedy_speculation_is_identical_to_plain_greedy_and_masks_line_up():
    """A deterministic toy target (next token a function of the last two), drafted by prompt
    lookup at varying K: same tokens as plain greedy, and the KV layout ends at the same length."""
    table = np.random.default_rng(7).integers(0, 12, size=(12, 12))

    def target(ctx):  # argmax after ctx
        return int(table[ctx[-2], ctx[-1]])

    prompt = [1, 2, 3, 4, 1, 2, 3]
    plain = list(prompt)
    for _ in range(60):
        plain.append(target(plain))

    ctx, drafter, layout = list(prompt), PromptLookupDrafter(), KVLayout()
    layout.append(len(prompt) - 1)  # prefill all but the last prompt token, which each step feeds
    accepted_total = rejected_total = 0
    for step in itertools.count():
        draft, q = drafter.propose(ctx, k=1 + step % 4)
        assert q is None
        top1 = [target(ctx + list(draft[:i])) for i in range(len(draft) + 1)]
        verdict = verify_greedy(draft, top1)
        layout.append(len(draft) + 1)  # [last, d_1 .. d_K] went through the target
        layout.mask_last(len(draft) - verdict.accepted)
        ctx.extend(verdict.tokens)
        accepted_total += verdict.accepted
        rejected_total += len(draft) - verdict.accepted
        assert layout.logical_len == len(ctx) - 1  # the newest token is fed next step
        if len(ctx) >= len(plain):
            break
    assert ctx[: len(plain)] == plain
    assert accepted_total > 0 and rejected_total > 0  # both paths were exercised


# ----------------------------------------------------------------------------- prompt lookup


def test_prompt_lookup_proposes_the_continuation_of_a_repeated_phrase():
    ctx = [10, 11, 12, 13, 14, 99, 10, 11, 12]
    assert PromptLookupDrafter().propose(ctx, 2) == ((13, 14), None)
    assert PromptLookupDrafter().propose(ctx, 10) == ((13, 14, 99, 10, 11, 12, 13, 14, 99, 10), None)


def test_prompt_lookup_without_a_match_proposes_nothing():
    assert PromptLookupDrafter().propose([1, 2, 3, 4], 3) == ((), None)
    assert PromptLookupDrafter().propose([7], 3) == ((), None)
    assert PromptLookupDrafter().propose([], 3) == ((), None)
    assert PromptLookupDrafter().propose([1, 2, 1], 0) == ((), None)
    assert PromptLookupDrafter(min_ngram=2).propose([1, 2, 3, 2], 3) == ((), None)


def test_prompt_lookup_prefers_the_longest_ngram():
    # The bigram (2, 3) was followed by 9; the later unigram (3) by 7.
    assert PromptLookupDrafter().propose([1, 2, 3, 9, 5, 3, 7, 2, 3], 1) == ((9,), None)
    assert PromptLookupDrafter(max_ngram=1).propose([1, 2, 3, 9, 5, 3, 7, 2, 3], 1) == ((7,), None)


def test_prompt_lookup_prefers_the_most_recent_occurrence():
    assert PromptLookupDrafter().propose([1, 2, 8, 1, 2, 9, 1, 2], 1) == ((9,), None)


def test_prompt_lookup_drafts_a_cycle_past_the_end_of_the_context():
    assert PromptLookupDrafter().propose([5, 1, 2, 1, 2], 5) == ((1, 2, 1, 2, 1), None)
    assert PromptLookupDrafter().propose([4, 4, 4], 3) == ((4, 4, 4), None)


def test_prompt_lookup_incremental_index_agrees_with_a_fresh_one():
    rng = np.random.default_rng(3)
    ctx = [int(t) for t in rng.integers(0, 5, size=300)]
    incremental = PromptLookupDrafter()
    for end in range(1, len(ctx) + 1):
        assert incremental.propose(ctx[:end], 4) == PromptLookupDrafter().propose(ctx[:end], 4)


def test_prompt_lookup_reindexes_a_rewritten_context():
    drafter = PromptLookupDrafter()
    assert drafter.propose([1, 2, 3, 1, 2], 1) == ((3,), None)
    assert drafter.propose([1, 2, 4, 1, 2], 1) == ((4,), None)  # same length, different tail
    assert drafter.propose([5, 6, 5], 1) == ((6,), None)  # shorter: a new stream


def test_prompt_lookup_rejects_bad_ngram_bounds():
    with pytest.raises(DeskfleetError, match="min_ngram <= max_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


# ----------------------------------------------------------------------------- adaptive K


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_best_k_grows_with_rtt_and_shrinks_with_low_acceptance():
    k_high_rtt = best_k(0.8, rtt=0.050, per_token=0.002, draft_per_token=0.0, k_max=8)
    k_low_rtt = best_k(0.8, rtt=0.001, per_token=0.010, draft_per_token=0.0, k_max=8)
    assert k_high_rtt > k_low_rtt
    assert best_k(0.05, rtt=0.050, per_token=0.002, draft_per_token=0.0, k_max=8) <= 1
    assert best_k(0.8, rtt=0.050, per_token=0.002, draft_per_token=0.0, k_max=0) == 0
    # An expensive drafter (a draft model fed token by token) pulls K down.
    assert best_k(0.8, 0.050, 0.002, 0.030, 8) < k_high_rtt


def _simulate(controller: AdaptiveK, alpha: float, rtt: float, per_token: float, steps: int, seed: int) -> list[int]:
    """Drive ``controller`` with geometric acceptances and linear step times plus 5% noise."""
    rng = np.random.default_rng(seed)
    chosen = []
    for _ in range(steps):
        k = controller.choose()
        chosen.append(k)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        seconds = (rtt + per_token * (k + 1)) * rng.uniform(0.95, 1.05)
        controller.update(k, accepted, seconds)
    return chosen


def test_adaptive_k_starts_at_the_configured_k_until_it_has_data():
    controller = AdaptiveK(AdaptiveKConfig(k_start=2, warmup_steps=3))
    assert controller.choose() == 2 and controller.alpha is None and controller.costs() is None
    assert _simulate(controller, alpha=0.99, rtt=0.05, per_token=0.001, steps=3, seed=0) == [2, 2, 2]
    assert controller.choose() > 2


def test_adaptive_k_picks_larger_k_under_high_rtt():
    high = AdaptiveK()
    low = AdaptiveK()
    _simulate(high, alpha=0.8, rtt=0.060, per_token=0.002, steps=300, seed=1)
    _simulate(low, alpha=0.8, rtt=0.002, per_token=0.010, steps=300, seed=1)
    assert high.choose() >= 5
    assert low.choose() <= 1
    # Measured, not assumed: the fit recovers the simulated costs and acceptance.
    rtt, per_token, _ = high.costs()
    assert rtt == pytest.approx(0.060, rel=0.15) and per_token == pytest.approx(0.002, abs=0.001)
    assert high.alpha == pytest.approx(0.8, abs=0.1)


def test_adaptive_k_picks_small_k_under_low_acceptance_and_recovers():
    controller = AdaptiveK()
    chosen = _simulate(controller, alpha=0.1, rtt=0.020, per_token=0.004, steps=200, seed=2)
    assert controller.choose() <= 1 and max(chosen[-50:]) <= 1
    # Exploration keeps measuring alpha while K sits at 0, so a later easy stretch is noticed.
    chosen = _simulate(controller, alpha=0.95, rtt=0.020, per_token=0.004, steps=200, seed=3)
    assert controller.choose() >= 4


def test_adaptive_k_trusts_configured_costs():
    controller = AdaptiveK(AdaptiveKConfig(rtt_seconds=0.05, seconds_per_token=0.001, warmup_steps=1))
    controller.update(3, 3, step_seconds=123.0)  # wild timing is ignored when costs are given
    assert controller.costs() == (0.05, 0.001, 0.0)


@pytest.mark.parametrize("kwargs", [dict(k_start=9, k_max=8), dict(alpha_decay=1.0), dict(rtt_seconds=-1.0)])
def test_adaptive_k_config_errors_say_what_is_wrong(kwargs):
    with pytest.raises(DeskfleetError, match="invalid adaptive-K settings"):
        AdaptiveKConfig(**kwargs)


# ----------------------------------------------------------------------------- speculative sampling


def _chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of ``counts`` to ``probs``; a count where probs is 0 is impossible (p = 0).
    Cells expecting fewer than 5 are pooled, as the chi-square approximation needs."""
    counts, probs = counts.ravel(), probs.ravel()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    f_obs = np.append(counts[big], counts[small].sum())
    f_exp = np.append(expected[big], expected[small].sum())
    if not small.any():
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    return float(chisquare(f_obs, f_exp).pvalue)


def _bigram(seed: int, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """A tiny "model": logits [V + 1, V] of the next token given the last (row BOS = first token)
    and the sampling distributions [V + 1, V] they give under ``params``."""
    logits = np.random.default_rng(seed).normal(size=(V + 1, V))
    return logits, np.array([probabilities(row, params) for row in logits])


def _sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    return min(int(np.searchsorted(np.cumsum(probs), rng.random(), side="right")), V - 1)


def _always_accept(draft, draft_probs, target_probs, rng):
    """WRONG: trusts the drafter; emits q's distribution."""
    return Verdict(len(draft), tuple(draft) + (_sample(target_probs[-1], rng),))


def _resample_target_on_reject(draft, draft_probs, target_probs, rng):
    """WRONG: the right acceptance test, but a rejection redraws from p instead of the residual."""
    for i, x in enumerate(draft):
        if rng.random() >= min(1.0, target_probs[i, x] / draft_probs[i, x]):
            return Verdict(i, tuple(draft[:i]) + (_sample(target_probs[i], rng),))
    return Verdict(len(draft), tuple(draft) + (_sample(target_probs[-1], rng),))


def _speculative_first_two(target: np.ndarray, draft: np.ndarray, k: int, verify, seed: int) -> np.ndarray:
    """TRIALS runs of speculative sampling on bigram tables target/draft [V + 1, V]; counts [V, V]
    of the first two emitted tokens. Drafts are drawn from the draft table as a model would."""
    rng = np.random.default_rng(seed)
    cum_draft = np.cumsum(draft, axis=1).tolist()
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(TRIALS):
        out: list[int] = []
        while len(out) < 2:
            last = out[-1] if out else BOS
            proposal = []
            for _ in range(k):
                row = proposal[-1] if proposal else last
                proposal.append(min(bisect.bisect_right(cum_draft[row], rng.random()), V - 1))
            rows = [last, *proposal]  # the target's distribution after last, d_1 .. d_K
            verdict = verify(proposal, draft[rows[:-1]], target[rows], rng)
            out.extend(verdict.tokens)
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(PARAMS))
def test_speculative_sampling_matches_the_target_and_wrong_rules_are_caught(setting):
    _, target = _bigram(11, PARAMS[setting])
    _, draft = _bigram(12, PARAMS[setting])
    joint = target[BOS][:, None] * target[:V]  # [V, V]: p(x) * p(y | x)

    counts = _speculative_first_two(target, draft, k=3, verify=verify_sampling, seed=100)
    assert _chisquare_pvalue(counts.sum(axis=1), target[BOS]) > 1e-3  # first token's marginal
    assert _chisquare_pvalue(counts, joint) > 1e-3  # joint of the first two tokens

    for wrong in (_always_accept, _resample_target_on_reject):
        bad = _speculative_first_two(target, draft, k=3, verify=wrong, seed=100)
        assert _chisquare_pvalue(bad, joint) < 1e-6, wrong.__name__


def test_speculative_sampling_with_a_deterministic_drafter_matches_the_target():
    """q = None (prompt lookup): a fixed draft, one-hot q, still exactly the target's tokens."""
    _, target = _bigram(21, PARAMS["temperature"])
    fixed = (int(np.argmax(target[BOS])), 3, 5)  # a likely first token, then arbitrary ones
    rows = [BOS, *fixed]
    rng = np.random.default_rng(200)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(TRIALS):
        verdict = verify_sampling(fixed, None, target[rows], rng)
        second = verdict.tokens[1] if verdict.accepted else _sample(target[verdict.tokens[0]], rng)
        counts[verdict.tokens[0], second] += 1
    assert 0.1 < (counts[fixed[0]].sum() / TRIALS) < 0.9  # both accept and reject were exercised
    assert _chisquare_pvalue(counts, target[BOS][:, None] * target[:V]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(PARAMS))
def test_plain_sampling_matches_the_target(setting):
    logits, target = _bigram(11, PARAMS[setting])
    rng = np.random.default_rng(300)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(TRIALS):
        x, _ = choose(logits[BOS], PARAMS[setting], rng)
        y, _ = choose(logits[x], PARAMS[setting], rng)
        counts[x, y] += 1
    joint = target[BOS][:, None] * target[:V]
    assert _chisquare_pvalue(counts, joint) > 1e-3
    hotter = np.array([probabilities(row, SamplingParams(temperature=1.6)) for row in logits])
    assert _chisquare_pvalue(counts, hotter[BOS][:, None] * hotter[:V]) < 1e-6  # the test has power


def test_verify_sampling_edge_cases():
    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    # q(x) = 0 for the drafted token: rejected without dividing by zero, correction from p - q.
    verdict = verify_sampling([2], np.array([[0.5, 0.5, 0.0]]), p, rng)
    assert verdict.accepted == 0 and verdict.tokens[0] in (0, 1)
    # p == q: the residual is all zero; whatever happens, tokens come from p.
    for _ in range(200):
        verdict = verify_sampling([0], np.array([[0.5, 0.5, 0.0]]), p, rng)
        assert verdict.tokens[0] in (0, 1) and verdict.tokens[-1] in (0, 1, 2)
    # No draft: one token from p_0. A certain draft: always accepted, then the bonus.
    assert verify_sampling([], None, p[:1], rng).tokens[0] in (0, 1)
    verdict = verify_sampling([2], None, p[::-1], rng)
    assert verdict.accepted == 1 and verdict.tokens[0] == 2 and verdict.tokens[1] in (0, 1)
    assert verify_sampling([2], None, np.array([[0, 0, 1.0], [0, 1.0, 0]]), rng) == Verdict(1, (2, 1))
    with pytest.raises(GenerationError, match=r"shape \[2, V\]"):
        verify_sampling([1], None, p[:1], rng)
    with pytest.raises(GenerationError, match="pass None for a deterministic drafter"):
        verify_sampling([1], np.ones((1, 4)) / 4, p, rng)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        verify_sampling([7], None, p, rng)
