"""Speculative decoding policy, pure: what to draft, what to accept, and how far to speculate.

A drafter proposes up to K tokens; the target scores ``[last, d_1 .. d_K]`` in one step (K + 1
positions) and :func:`verify_greedy` / :func:`verify_sampling` decide how many drafts survive
plus one token of the target's own (the correction after a rejection, or the bonus after a full
accept). The coordinator then hides the ``len(draft) - verdict.accepted`` rejected positions
with :meth:`engine.shards.kv_layout.KVLayout.mask_last` and feeds ``verdict.tokens[-1]`` next step.
:class:`AdaptiveK` picks K per stream from measured acceptance and step times.

No sockets, no devices: every function here is a decision over arrays and counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.errors import DeskfleetError, GenerationError


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: ``tokens`` = accepted drafts + one target token."""

    accepted: int
    tokens: tuple[int, ...]  # len == accepted + 1


# ----------------------------------------------------------------------------- verification


def verify_greedy(draft: Sequence[int], target_top1: Sequence[int] | np.ndarray) -> Verdict:
    """Greedy verification: bit-exact with decoding the target alone.

    ``target_top1[i]`` is the target's argmax after the context and ``draft[:i]``; it has
    ``len(draft) + 1`` entries, the last one being the bonus token after a full accept.
    """
    if len(target_top1) != len(draft) + 1:
        raise GenerationError(
            f"greedy verification needs {len(draft) + 1} target tokens for a {len(draft)}-token "
            f"draft, got {len(target_top1)}; ask the last stage for all K + 1 positions"
        )
    # Accept draft[i] while it equals the target's own argmax at position i.
    # At the first mismatch emit the target's argmax there instead and stop.
    # If every draft matches, the target's argmax after the last draft is a free bonus token.
    accepted = 0
    while accepted < len(draft) and int(draft[accepted]) == int(target_top1[accepted]):
        accepted += 1
    tokens = tuple(int(t) for t in draft[:accepted]) + (int(target_top1[accepted]),)
    return Verdict(accepted, tokens)


def verify_sampling(
    draft: Sequence[int],
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): tokens ~ the target exactly.

    draft_probs: [K, V] q_i, the distribution ``draft[i]`` was drawn from, or None for a
    deterministic drafter (q_i = one-hot at ``draft[i]``, which keeps the result exact).
    target_probs: [K + 1, V] p_i, the target's sampling distribution at each position
    (``engine.generation.sampling.probabilities``), row K being the bonus position.
    A draft token with q(x) = 0 cannot have been sampled from q; it is treated as rejected.
    Consumes one uniform per draft token examined (whether or not p(x) < q(x)) and one per drawn
    token from ``rng``: how many are drawn then never depends on last-bit differences of p and q
    (a draft model equal to the target has p(x)/q(x) = 1 +- rounding), so a seeded stream stays
    reproducible when its logits come from differently shaped batches.
    """
    k = len(draft)
    p_all = np.asarray(target_probs, dtype=np.float64)
    if p_all.ndim != 2 or p_all.shape[0] != k + 1:
        raise GenerationError(
            f"sampling verification needs target probabilities of shape [{k + 1}, V] for a "
            f"{k}-token draft, got {p_all.shape}; ask the last stage for logits at all K + 1 positions"
        )
    vocab = p_all.shape[1]
    q_all = None
    if draft_probs is not None:
        q_all = np.asarray(draft_probs, dtype=np.float64)
        if q_all.shape != (k, vocab):
            raise GenerationError(
                f"draft probabilities must have shape [{k}, {vocab}] to match the draft and the "
                f"target's vocabulary, got {q_all.shape}; pass None for a deterministic drafter"
            )
    for i, x in enumerate(draft):
        x = int(x)
        if not 0 <= x < vocab:
            raise GenerationError(f"draft token {x} is outside the vocabulary of {vocab}; "
                                  "the draft and target models must share a tokenizer")
        p = p_all[i]  # [V]
        q_x = 1.0 if q_all is None else float(q_all[i, x])
        p_x = float(p[x])
        # Accept x ~ q with probability min(1, p(x) / q(x)).
        # On the first rejection draw from norm(max(0, p - q)), the mass q under-covers, and stop.
        # If all K are accepted, draw a bonus token from p_K.
        u = rng.random()
        if q_x > 0.0 and (p_x >= q_x or u * q_x < p_x):
            continue
        if q_all is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - q_all[i], 0.0)  # [V]
        # An all-zero residual means p <= q everywhere, i.e. p == q up to rounding; use p.
        weights = residual if residual.sum() > 1e-12 else p
        tokens = tuple(int(t) for t in draft[:i]) + (_draw(weights, rng),)
        return Verdict(i, tokens)
    return Verdict(k, tuple(int(t) for t in draft) + (_draw(p_all[k], rng),))


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn proportionally to non-negative ``weights`` [V] (need not sum to 1)."""
    cumulative = np.cumsum(weights)
    total = float(cumulative[-1])
    if not total > 0.0:
        raise GenerationError("the target's sampling distribution is all zeros (NaN logits?); "
                              "check the last stage's output")
    i = int(np.searchsorted(cumulative, rng.random() * total, side="right"))
    if i >= weights.shape[0]:  # u * total rounded up to total: take the last token with mass
        i = int(np.flatnonzero(weights)[-1])
    return i


# ----------------------------------------------------------------------------- drafters


class Drafter(Protocol):
    """Proposes the next tokens of a stream; one instance per stream."""

    def propose(self, context: Sequence[int], k: int) -> tuple[tuple[int, ...], np.ndarray | None]:
        """Up to ``k`` tokens continuing ``context`` and their q distributions [n, V], or None
        when the proposal is deterministic."""
        ...


class PromptLookupDrafter:
    """Drafts by copying: find the latest earlier occurrence of the context's longest suffix
    n-gram (``max_ngram`` down to ``min_ngram`` tokens) and propose what followed it.

    Needs no model. The index maps each n-gram to where its most recent *completed* occurrence
    ended; it grows by :meth:`observe` in O(max_ngram) per token. ``propose`` syncs with the
    context it is given, so a context that only ever grows costs nothing extra; one that was
    rewritten is re-indexed from scratch.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise DeskfleetError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got "
                                 f"min_ngram={min_ngram}, max_ngram={max_ngram}; fix the speculation settings")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._tokens: list[int] = []
        self._next_after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it

    def reset(self) -> None:
        self._tokens.clear()
        self._next_after.clear()

    def observe(self, tokens: Sequence[int]) -> None:
        """Append tokens to the stream; each n-gram is indexed once the token after it exists,
        so the context's own suffix is never matched against itself."""
        seq = self._tokens
        for t in tokens:
            end = len(seq)  # the n-grams ending here now have a follower: the token at `end`
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._next_after[tuple(seq[end - n : end])] = end
            seq.append(int(t))

    def propose(self, context: Sequence[int], k: int) -> tuple[tuple[int, ...], None]:
        """Up to ``k`` tokens (maybe none) that followed the suffix's latest earlier match."""
        self._sync(context)
        seq = self._tokens
        if k <= 0:
            return (), None
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            start = self._next_after.get(tuple(seq[len(seq) - n :]))
            if start is None:
                continue
            # Copy forward from the match; running into the suffix keeps copying what was just
            # proposed, so a repeating cycle is drafted in full rather than cut at its end.
            out: list[int] = []
            for j in range(k):
                src = start + j
                out.append(seq[src] if src < len(seq) else out[src - len(seq)])
            return tuple(out), None
        return (), None

    def _sync(self, context: Sequence[int]) -> None:
        known = len(self._tokens)
        tail = min(known, self.max_ngram)
        if len(context) < known or any(int(context[i]) != self._tokens[i] for i in range(known - tail, known)):
            self.reset()
            known = 0
        self.observe(context[known:])


# ----------------------------------------------------------------------------- adaptive K


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens emitted per step with K drafts each accepted with probability alpha (plus one)."""
    if alpha >= 1.0 - 1e-12:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, rtt: float, per_token: float, draft_per_token: float, k_max: int) -> int:
    """K in [0, k_max] maximising expected tokens per second (smallest K on ties).

    A step with K drafts is modelled as ``rtt + per_token * (K + 1)`` seconds of target plus
    ``draft_per_token * K`` seconds of drafting.
    """
    best, best_rate = 0, -1.0
    for k in range(k_max + 1):
        seconds = max(rtt + per_token * (k + 1) + draft_per_token * k, 1e-9)
        rate = expected_tokens(alpha, k) / seconds
        if rate > best_rate * (1.0 + 1e-9):
            best, best_rate = k, rate
    return best


@dataclass(frozen=True)
class AdaptiveKConfig:
    """How :class:`AdaptiveK` learns. Costs left as None are measured; given ones are trusted."""

    k_max: int = 8
    k_start: int = 3  # used until warmup_steps verified drafts and step times are in
    warmup_steps: int = 4
    alpha_decay: float = 0.9  # weight of history in the acceptance average (window ~ 10 steps)
    time_decay: float = 0.98  # weight of history in the step-time fit (window ~ 50 steps)
    explore_every: int = 16  # every Nth step tries best K + 1, so alpha and the slope stay known; 0 = never
    rtt_seconds: float | None = None  # per-step cost independent of K
    seconds_per_token: float | None = None  # target cost per verified position
    draft_seconds_per_token: float | None = None  # drafter cost per proposed token

    def __post_init__(self) -> None:
        problems = []
        if self.k_max < 0 or not 0 <= self.k_start <= self.k_max:
            problems.append(f"need 0 <= k_start <= k_max, got k_start={self.k_start}, k_max={self.k_max}")
        if not (0.0 <= self.alpha_decay < 1.0 and 0.0 <= self.time_decay < 1.0):
            problems.append("alpha_decay and time_decay must be in [0, 1)")
        if self.warmup_steps < 0 or self.explore_every < 0:
            problems.append("warmup_steps and explore_every must be >= 0")
        costs = (self.rtt_seconds, self.seconds_per_token, self.draft_seconds_per_token)
        if any(c is not None and c < 0 for c in costs):
            problems.append("costs must be >= 0 seconds")
        if problems:
            raise DeskfleetError("invalid adaptive-K settings: " + "; ".join(problems))


class AdaptiveK:
    """Per-stream K from the measured acceptance rate and step-time model (mutable, loop-owned).

    Acceptance: each verified draft token is a trial; a step with ``accepted < proposed`` ends
    in exactly one rejection and tests nothing after it, so alpha = accepted / (accepted +
    rejections), exponentially weighted. (accepted / proposed would be biased low.)
    Step time: weighted least squares of seconds on K + 1 verified positions.
    """

    def __init__(self, config: AdaptiveKConfig | None = None):
        self.config = config or AdaptiveKConfig()
        self.steps = 0
        self._trials = 0.0  # decayed accepted + rejections
        self._accepts = 0.0  # decayed accepted
        self._alpha_steps = 0  # steps that verified at least one draft
        self._fit = np.zeros(5)  # decayed sums of w, x, y, x*x, x*y (x = positions, y = seconds)
        self._xs: set[int] = set()  # distinct positions seen: the slope needs two
        self._draft_tokens = 0.0
        self._draft_seconds = 0.0

    def update(self, proposed: int, accepted: int, step_seconds: float, draft_seconds: float = 0.0) -> None:
        """Record one step: ``proposed`` drafts were verified in a target step of
        ``step_seconds`` (without drafting), ``accepted`` of them survived; drafting took
        ``draft_seconds``."""
        if not 0 <= accepted <= proposed:
            raise GenerationError(f"accepted={accepted} must be between 0 and proposed={proposed}; "
                                  "report the verdict's accepted count and the draft's length")
        if not (step_seconds >= 0.0 and draft_seconds >= 0.0):
            raise GenerationError(f"step times must be non-negative seconds, got {step_seconds} and "
                                  f"{draft_seconds}; time steps with time.perf_counter()")
        cfg = self.config
        self.steps += 1
        if proposed > 0:
            rejected = 1 if accepted < proposed else 0
            self._accepts = cfg.alpha_decay * self._accepts + accepted
            self._trials = cfg.alpha_decay * self._trials + accepted + rejected
            self._alpha_steps += 1
            self._draft_tokens = cfg.time_decay * self._draft_tokens + proposed
            self._draft_seconds = cfg.time_decay * self._draft_seconds + draft_seconds
        x = proposed + 1
        self._fit = cfg.time_decay * self._fit + np.array([1.0, x, step_seconds, x * x, x * step_seconds])
        self._xs.add(x)

    @property
    def alpha(self) -> float | None:
        """Estimated per-draft acceptance probability, or None before any draft was verified."""
        return self._accepts / self._trials if self._trials > 0 else None

    def costs(self) -> tuple[float, float, float] | None:
        """(rtt, seconds per verified position, seconds per drafted token), or None before any
        step was timed. Configured costs override measured ones."""
        cfg = self.config
        w, sx, sy, sxx, sxy = self._fit
        rtt, per_token = cfg.rtt_seconds, cfg.seconds_per_token
        if rtt is None or per_token is None:
            if w <= 0.0:
                return None
            mean_x, mean_y = sx / w, sy / w
            if rtt is not None:
                per_token = (sxy - rtt * sx) / sxx
            elif per_token is not None:
                rtt = mean_y - per_token * mean_x
            else:
                var_x = sxx / w - mean_x * mean_x
                per_token = (sxy / w - mean_x * mean_y) / var_x if len(self._xs) > 1 and var_x > 1e-12 else 0.0
                per_token = max(per_token, 0.0)
                rtt = mean_y - per_token * mean_x
        draft = cfg.draft_seconds_per_token
        if draft is None:
            draft = self._draft_seconds / self._draft_tokens if self._draft_tokens > 0 else 0.0
        return max(float(rtt), 0.0), max(float(per_token), 0.0), max(float(draft), 0.0)

    def choose(self) -> int:
        """K for the next step (0 = plain decode). Pure: calling it twice gives the same K."""
        cfg = self.config
        alpha, costs = self.alpha, self.costs()
        if alpha is None or costs is None or self._alpha_steps < cfg.warmup_steps:
            return cfg.k_start
        k = best_k(alpha, *costs, cfg.k_max)
        if cfg.explore_every and self.steps % cfg.explore_every == cfg.explore_every - 1:
            k = k + 1 if k < cfg.k_max else max(k - 1, 0)
        return k
