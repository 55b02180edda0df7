"""Log-probabilities for a token event, from a logits row the generator holds (pure numpy).

What :class:`~engine.generation.request.TokenEvent` carries when a request asks for
``logprobs``: the log-softmax of the raw logits at temperature 1 (sampling's temperature, top-k
and top-p do not change them), after the grammar mask when the request has a constraint (a
disallowed token is -inf and never listed). The in-process paths, which hold full logits, call
:func:`token_logprobs`; the last stage of a ring computes the same thing with the same functions
(:mod:`engine.shards.step_answer`; docs/PROTOCOL.md, top-k on the step reply), here in float64.
"""

from __future__ import annotations

import numpy as np

from engine.shards import step_answer


def log_softmax(logits: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    """[V] float64 log-probabilities of ``logits`` [V]; ``allowed`` ([V] bool) masks the rest to -inf.

    ValueError when no token is allowed. A packed uint32 mask: :func:`step_answer.mask_in_place` first.
    """
    x = np.asarray(logits, dtype=np.float64)
    if allowed is not None:
        x = np.where(allowed, x, -np.inf)
    return step_answer.log_softmax(x)


def token_logprobs(logits: np.ndarray, token: int, k: int, allowed: np.ndarray | None = None
                   ) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The chosen ``token``'s log-probability and the ``k`` most likely (id, log-probability)
    pairs, most likely first (ties: the lower id first); a masked-out id is never among them."""
    lp = log_softmax(logits, allowed)
    if k <= 0:
        return float(lp[token]), ()
    ids, values = step_answer.row_top_k(lp, min(k, lp.shape[0]))
    return float(lp[token]), tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
