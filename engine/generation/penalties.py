"""Penalties and bias: a stream's logits adjusted by what it has already said, before sampling. Pure numpy.

Applied to a penalised stream's row (:attr:`~engine.generation.request.SamplingParams.penalised`)
in this order, on the row the last stage returned (already grammar-masked: a refused token's -inf
stays -inf whatever is added, so the grammar always wins over a bias):

1. ``repetition_penalty`` r (HF's ``RepetitionPenaltyLogitsProcessor``, vLLM's, llama.cpp's
   ``repeat_penalty``): every token id present in the prompt or the generated text has its logit
   divided by r when positive and multiplied by r when negative (r > 1 discourages repeating).
2. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's formula): ``logit[j] -= c[j] * f +
   (c[j] > 0) * p``, c[j] the times token j was generated so far (the prompt does not count, as
   OpenAI and vLLM count it).
3. ``logit_bias``: ``logit[j] += bias[j]`` (OpenAI's: -100 practically bans a token, +100 practically
   forces it), last, so a bias means the same whatever the penalties did.

Temperature, top-k, top-p and min-p come after (:mod:`engine.generation.sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.errors import GenerationError
from engine.generation.request import SamplingParams

# The request features these are (keys of engine.api.openai_schema.NOT_YET_SERVED): a runtime that
# applies them says so in its ``features``; top_k and min_p need none (a greedy pick keeps the top).
PENALTY_FEATURES = frozenset({"frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias"})


def penalise(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], prompt_len: int) -> np.ndarray:
    """A penalised copy of one row of ``logits`` float [V] (float32 out), for the next token after
    ``tokens`` (the prompt's ``prompt_len`` ids, then the generated ones)."""
    x = np.array(logits, dtype=np.float32)
    seen = np.asarray(tokens, dtype=np.int64)
    vocab = x.shape[-1]
    if params.repetition_penalty != 1.0 and seen.size:
        ids = _within(np.unique(seen), vocab, "the stream's tokens")
        score = x[ids]
        r = np.float32(params.repetition_penalty)
        x[ids] = np.where(score < 0, score * r, score / r)
    if (params.frequency_penalty or params.presence_penalty) and seen.size > prompt_len:
        ids, counts = np.unique(seen[prompt_len:], return_counts=True)
        ids = _within(ids, vocab, "the stream's tokens")
        x[ids] -= (counts * params.frequency_penalty + params.presence_penalty).astype(np.float32)
    if params.logit_bias:
        ids = _within(np.fromiter((t for t, _ in params.logit_bias), np.int64, len(params.logit_bias)), vocab,
                      "logit_bias")
        x[ids] += np.fromiter((b for _, b in params.logit_bias), np.float32, len(params.logit_bias))
    return x


def penalise_rows(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], prompt_len: int,
                  drafts: Sequence[int]) -> np.ndarray:
    """A verify row's K + 1 positions penalised, float32 [K+1, V] from ``logits`` [K+1, V]: position
    i follows ``tokens`` and the first i ``drafts``, so a draft is judged by the distribution the
    stream would have sampled it from had the drafts before it been its own tokens."""
    history = list(tokens)
    out = np.empty(logits.shape, dtype=np.float32)
    for i in range(logits.shape[0]):
        out[i] = penalise(logits[i], params, history, prompt_len)
        if i < len(drafts):
            history.append(int(drafts[i]))
    return out


def _within(ids: np.ndarray, vocab: int, what: str) -> np.ndarray:
    if ids.size and int(ids[-1]) >= vocab:  # ids ascending (np.unique, and logit_bias is sorted)
        raise GenerationError(f"{what} names token id {int(ids[-1])}, beyond this model's {vocab} logits")
    return ids
