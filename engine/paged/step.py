"""Where a paged coordinator's steps run: a :class:`PagedPath`, and what goes in and comes out.

One step carries every taking-part stream's new
tokens (a :class:`~engine.wire.step_plan.StepPlan` and the token ids of its rows), and one
outcome answers all of them. :class:`engine.paged.stage.LocalPagedPath` runs the stages in
this process; :class:`engine.paged.ring_path.PagedRingPath` sends the step around a ring
of paged stage workers. Several steps may be in flight at once (micro-batches over disjoint
streams); outcomes arrive in submission order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.wire.step_plan import StepPlan


@dataclass(frozen=True, eq=False)
class PagedStep:
    """One step: its plan and the token ids int64 [T] of its real rows, in plan order (the
    path pads them to ``plan.padded_tokens``)."""

    seq: int
    plan: StepPlan
    token_ids: np.ndarray


@dataclass(frozen=True, eq=False)
class PagedOutcome:
    """The last stage's answer to one step, or why there is none.

    ``ids`` int64 [R] and ``probs`` float32 [R]: the top-1 of every answered row (R =
    ``plan.sampled``, plan order); ``logits`` float32 [L, V] for the rows of the streams that
    wanted them (L = ``plan.logit_rows``, plan order) or None; ``stage_ms`` each stage's compute
    time for this step. ``top_ids`` int64 [R, k] and ``top_logprobs`` float32 [R, k] when the plan
    asks for top-k (k = ``plan.top_k``; an entry a row did not ask for is id -1, log-probability
    -inf), else None. ``error`` set: the step did not complete (every field else is empty).
    """

    seq: int
    ids: np.ndarray
    probs: np.ndarray
    logits: np.ndarray | None = None
    stage_ms: tuple[float, ...] = ()
    error: str | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    @classmethod
    def failed(cls, seq: int, error: str) -> PagedOutcome:
        return cls(seq, np.zeros(0, np.int64), np.zeros(0, np.float32), error=error)


class PagedPath(Protocol):
    """Carries paged steps through the stages; outcomes arrive on :attr:`results` in submission order."""

    results: asyncio.Queue[PagedOutcome]
    num_stages: int
    block_size: int

    async def async_start(self) -> None: ...

    async def async_submit(self, step: PagedStep) -> None: ...

    async def async_close(self) -> None: ...

    def stage_metrics(self) -> dict[str, float]: ...
