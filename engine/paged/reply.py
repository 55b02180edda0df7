"""What one stream's part of a paged step's reply means: the tokens it emits. Pure numpy.

The last stage answers a row's trailing ``sample`` rows with top-1 ids and probabilities, plus
full logits for streams that sample or asked for them (:class:`engine.paged.step.PagedOutcome`).
A decode row with K drafts was answered at K + 1 positions; the verdict keeps the accepted
drafts and one token of the target's own (:mod:`engine.paged.speculation_policy`).

A penalised stream (penalties or ``logit_bias``) always has its logits back: its K + 1 rows are
penalised here by what it has said, each position counting the drafts before it
(:func:`~engine.generation.penalties.penalise_rows`), and the verdict, greedy or sampled, is taken
against the penalised distribution, so speculation stays exact for it. The log-probabilities a
client asked for are the last stage's, of the raw (masked) logits: before penalties.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.errors import GenerationError
from engine.generation.penalties import penalise_rows
from engine.generation.request import SamplingParams
from engine.generation.sampling import choose, probabilities
from engine.paged.speculation_policy import Verdict, verify_greedy, verify_sampling
from engine.paged.step import PagedOutcome


def reply_problem(outcome: PagedOutcome, sampled: int, logit_rows: int) -> str | None:
    """Why a completed outcome cannot answer a step of ``sampled`` answered rows, ``logit_rows``
    of them with logits; None when it can."""
    if len(outcome.ids) != sampled or len(outcome.probs) != sampled:
        return f"the reply has {len(outcome.ids)} ids and {len(outcome.probs)} probabilities for {sampled} rows"
    got = 0 if outcome.logits is None else outcome.logits.shape[0]
    if got != logit_rows:
        return f"the reply has logits for {got} rows, the step asked for {logit_rows}"
    return None


def decide(params: SamplingParams, rng: np.random.Generator, drafts: Sequence[int], q: np.ndarray | None,
           ids: np.ndarray, probs: np.ndarray, logits: np.ndarray | None, tokens: Sequence[int] = (),
           prompt_len: int = 0) -> tuple[Verdict, list[float]]:
    """Accepted drafts + one token of the target's own, with each emitted token's probability.

    ids int64 [K+1], probs float32 [K+1]: the row's top-1 answers; logits float32 [K+1, V] or
    None; q [K, V] the drafts' distributions (None: a deterministic drafter). Draws from ``rng``
    only when sampling. ``tokens``: the stream's prompt (its first ``prompt_len``) and generated
    ids so far, what a penalised stream's penalties count (it must have its logits).
    """
    if params.penalised:
        if logits is None:
            raise GenerationError("a penalised stream's step came back without its logits")
        logits = penalise_rows(logits, params, tokens, prompt_len, drafts)
    if logits is not None and not params.greedy:
        if not drafts:
            token, prob = choose(logits[-1], params, rng)
            return Verdict(0, (token,)), [prob]
        target = np.stack([probabilities(row, params) for row in logits])  # [K+1, V]
        verdict = verify_sampling(drafts, q, target, rng)
        return verdict, [float(target[i, t]) for i, t in enumerate(verdict.tokens)]
    if logits is not None:  # logits wanted for another reason: greedy still decides
        verdict = verify_greedy(drafts, logits.argmax(axis=-1))
        return verdict, [1.0] * len(verdict.tokens)
    verdict = verify_greedy(drafts, ids)
    return verdict, [float(probs[i]) for i in range(len(verdict.tokens))]
