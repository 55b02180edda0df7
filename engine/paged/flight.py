"""The paged scheduler's record of a step in flight (:mod:`engine.paged.scheduler`): its rows and
what the coordinator reads of it. The scheduler is the one owner of these records and the one writer
(they sit in its :class:`~engine.paged.stream_book.StreamBook`; :mod:`engine.paged.step_composer` makes them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.paged.state import StreamState
from engine.wire.format import StreamId
from engine.wire.step_plan import StepPlan


@dataclass
class FlightRow:
    """One stream's row of a step in flight, as the scheduler planned it."""

    stream: StreamState
    past: int  # the position its first row feeds
    n: int
    drafts: tuple[int, ...]
    q: np.ndarray | None
    sample: int
    want_logits: bool
    computing: list[bytes] = field(default_factory=list)  # full blocks this prefill chunk completes
    void: bool = False  # an earlier step of its stream failed: this row's KV and answer are not used


@dataclass
class Flight:
    """A step handed out whose outcome has not come back: the one record of it (the coordinator
    reads it by seq, :meth:`BatchScheduler.flight`, and stamps when it left, :meth:`BatchScheduler.sent`)."""

    seq: int
    rows: list[FlightRow]
    plan: StepPlan  # as composed (before masks): the answered rows' order, what its outcome answers
    offered: tuple[StreamId, ...]  # streams of the step that were offered drafts (budget or blocks may cut them)
    sent_at: float | None = None  # monotonic, once sent

    @property
    def tokens(self) -> int:
        """New tokens the step carries (its real rows)."""
        return self.plan.tokens
