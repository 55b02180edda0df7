"""Choosing the next token from logits: greedy, or temperature / top-k / top-p / min-p with a seed.

Pure numpy. A request's generator is seeded once, so the same seed gives the same tokens, and
one request's draws never depend on another's.
"""

from __future__ import annotations

import numpy as np

from engine.generation.request import SamplingParams


def make_rng(params: SamplingParams) -> np.random.Generator:
    return np.random.default_rng(params.seed)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from: softmax(logits / T) restricted by top-k, then top-p,
    then min-p (HF's warpers' order: min-p drops the tokens less likely than ``min_p`` times the
    likeliest that top-k and top-p kept). A penalised stream's logits come here penalised
    (:func:`engine.generation.penalties.penalise`).

    logits: [V] float. Returns [V] float64 summing to 1 (zeros outside the kept set).
    """
    x = np.asarray(logits, dtype=np.float64) / max(params.temperature, 1e-6)
    if params.top_k and params.top_k < x.shape[0]:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - np.max(x))
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = order[: int(np.searchsorted(cumulative, params.top_p) + 1)]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> tuple[int, float]:
    """Next token id and its probability under the sampling distribution (1.0 for greedy)."""
    if params.greedy:
        return int(np.argmax(logits)), 1.0
    p = probabilities(logits, params)
    token = int(rng.choice(p.shape[0], p=p))
    return token, float(p[token])
