"""Penalties, bias, top-k and min-p, pure, against independent references: HF transformers'
``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper`` and ``MinPLogitsWarper`` (torch), and OpenAI's published formula for the
frequency and presence penalties (``mu[j] - c[j] * frequency - (c[j] > 0) * presence``, written
out here as a plain loop)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.errors import GenerationError
from engine.generation.penalties import penalise, penalise_rows
from engine.generation.request import SamplingParams
from engine.generation.sampling import choose, probabilities

V = 64


def logits_row(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, V).astype(np.float32)


def history(seed: int, n: int = 30) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed + 100).integers(0, V, n)]


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
@pytest.mark.parametrize("seed", range(4))
def test_repetition_penalty_equals_hf(penalty, seed):
    x, tokens = logits_row(seed), history(seed)
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([tokens]), torch.tensor(x[None, :]))[0].numpy()
    got = penalise(x, SamplingParams(repetition_penalty=penalty), tokens, prompt_len=10)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def openai_formula(x: np.ndarray, generated: list[int], frequency: float, presence: float) -> np.ndarray:
    counts = collections.Counter(generated)
    out = x.astype(np.float64).copy()
    for j, c in counts.items():
        out[j] = out[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence
    return out


@pytest.mark.parametrize("frequency, presence", [(0.5, 0.0), (0.0, 0.7), (1.2, -0.4), (-2.0, 2.0)])
@pytest.mark.parametrize("seed", range(3))
def test_frequency_and_presence_follow_openais_formula_over_the_generated_tokens(frequency, presence, seed):
    x, tokens = logits_row(seed), history(seed)
    prompt_len = 12  # the prompt's tokens do not count
    got = penalise(x, SamplingParams(frequency_penalty=frequency, presence_penalty=presence), tokens, prompt_len)
    np.testing.assert_allclose(got, openai_formula(x, tokens[prompt_len:], frequency, presence), rtol=1e-5,
                               atol=1e-5)


def test_nothing_generated_yet_means_no_frequency_or_presence_penalty():
    x = logits_row(1)
    got = penalise(x, SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), [3, 3, 3], prompt_len=3)
    np.testing.assert_array_equal(got, x)


def test_all_three_then_the_bias_in_order_and_the_grammar_mask_wins():
    x, tokens = logits_row(7), history(7)
    x[[5, 9]] = -np.inf  # refused by a grammar mask
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2,
                            logit_bias=((5, 100.0), (6, -100.0), (8, 3.5)))
    rep = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([tokens]), torch.tensor(x[None, :]))[0].numpy()
    want = openai_formula(rep, tokens[4:], 0.3, 0.2)
    want[6] -= 100.0
    want[8] += 3.5
    want[5] += 100.0
    got = penalise(x, params, tokens, prompt_len=4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert got[5] == -np.inf and got[9] == -np.inf  # a bias never lifts a refused token
    assert int(np.argmax(penalise(logits_row(8), SamplingParams(logit_bias=((33, 100.0),)), [], 0))) == 33


def test_a_bias_beyond_the_logits_is_a_generation_error():
    with pytest.raises(GenerationError, match="token id 64"):
        penalise(logits_row(0), SamplingParams(logit_bias=((64, 1.0),)), [], 0)


def test_a_verify_rows_positions_count_the_drafts_before_them():
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.8)
    rows = np.stack([logits_row(s) for s in range(4)])
    tokens, drafts = history(3), [7, 7, 21]
    got = penalise_rows(rows, params, tokens, 10, drafts)
    for i in range(4):
        np.testing.assert_array_equal(got[i], penalise(rows[i], params, tokens + drafts[:i], 10))


def hf_probabilities(x: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0) -> np.ndarray:
    scores = torch.tensor(x[None, :], dtype=torch.float64)
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 5, 1.0, 0.0), (0.7, 12, 1.0, 0.0), (1.0, 0, 1.0, 0.1), (1.5, 0, 1.0, 0.05), (0.8, 20, 1.0, 0.2),
    (1.0, 0, 0.9, 0.1), (1.2, 30, 0.8, 0.05)])
@pytest.mark.parametrize("seed", range(3))
def test_top_k_top_p_and_min_p_equal_hfs_warpers(temperature, top_k, top_p, min_p, seed):
    x = logits_row(seed)
    got = probabilities(x, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    want = hf_probabilities(x, temperature, top_k, top_p, min_p)
    np.testing.assert_array_equal(got > 0, want > 0)  # the same tokens kept
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_min_p_keeps_the_likeliest_and_greedy_ignores_it():
    x = logits_row(2)
    p = probabilities(x, SamplingParams(temperature=1.0, min_p=1.0))
    assert np.count_nonzero(p) == 1 and int(np.argmax(p)) == int(np.argmax(x))
    assert choose(x, SamplingParams(min_p=0.9, top_k=3), np.random.default_rng(0))[0] == int(np.argmax(x))


@pytest.mark.parametrize("bad, match", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": ((3, 1.0), (2, 1.0))}, "ascending"), ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "at most 300")])
def test_sampling_params_refuse_values_out_of_range(bad, match):
    with pytest.raises(GenerationError, match=match):
        SamplingParams(**bad)


def test_penalised_names_the_streams_whose_logits_are_adjusted():
    assert not SamplingParams().penalised and not SamplingParams(top_k=5, min_p=0.1, temperature=1.0).penalised
    for kw in ({"frequency_penalty": 0.1}, {"presence_penalty": -0.1}, {"repetition_penalty": 1.1},
               {"logit_bias": ((1, -5.0),)}):
        assert SamplingParams(**kw).penalised
