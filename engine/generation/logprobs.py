"""Log-probabilities for a token event, from a logits row the generator holds (pure numpy).

What :class:`~engine.generation.request.TokenEvent` carries when a request asks for
``logprobs``: the log-softmax of the raw logits at temperature 1 (sampling's temperature, top-k
and top-p do not change them), after the grammar mask when the request has a constraint (a
disallowed token is -inf and never listed). The in-process paths, which hold full logits, call
:func:`token_logprobs`; the last stage of a ring computes the same thing (docs/PROTOCOL.md,
top-k on the step reply).
"""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    """[V] float64 log-probabilities of ``logits`` [V]; ``allowed`` ([V] bool) masks the rest to -inf."""
    x = np.asarray(logits, dtype=np.float64)
    if allowed is not None:
        x = np.where(allowed, x, -np.inf)
    top = np.max(x)
    if not np.isfinite(top):
        raise ValueError("no token is allowed (every logit is masked or -inf)")
    shifted = x - top
    return shifted - np.log(np.sum(np.exp(shifted)))


def token_logprobs(logits: np.ndarray, token: int, k: int, allowed: np.ndarray | None = None
                   ) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The chosen ``token``'s log-probability and the ``k`` most likely (id, log-probability)
    pairs, most likely first (ties: the lower id first); a masked-out id is never among them."""
    lp = log_softmax(logits, allowed)
    k = min(k, int(np.sum(np.isfinite(lp))))
    if k <= 0:
        return float(lp[token]), ()
    ids = np.argpartition(-lp, k - 1)[:k] if k < lp.shape[0] else np.arange(lp.shape[0])
    ids = ids[np.lexsort((ids, -lp[ids]))]
    return float(lp[token]), tuple((int(i), float(lp[i])) for i in ids)
