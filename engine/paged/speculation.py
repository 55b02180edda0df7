"""Speculative decoding in the coordinator: one drafter and one K controller per stream.

The policy (verification, prompt lookup, adaptive K) is pure and lives in
:mod:`engine.paged.speculation_policy`; this module owns the per-stream objects, runs a draft model on its
own thread so the event loop keeps serving, and times each verify step for :class:`AdaptiveK`.
Each stream speculates independently, so micro-batched streams each pick their own K.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.errors import DeskfleetError
from engine.paged.draft_model import DraftModelDrafter
from engine.paged.speculation_policy import AdaptiveK, AdaptiveKConfig, Drafter, PromptLookupDrafter
from engine.paged.state import DraftSubject
from engine.shards.stage import LocalChain
from engine.wire.format import StreamId

MODES = ("lookup", "draft")


@dataclass(frozen=True)
class SpeculationConfig:
    """``mode``: "lookup" (n-gram prompt lookup, no model) or "draft" (a 1-stage draft export).
    ``k``: a fixed number of drafts per step, or None to choose it per stream from measurements."""

    mode: str = "lookup"
    k: int | None = None
    k_max: int = 12
    draft_export: Path | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DeskfleetError(f"speculation mode {self.mode!r} is unknown; choose one of {', '.join(MODES)}")
        if self.mode == "draft" and self.draft_export is None:
            raise DeskfleetError("speculation with a draft model needs the draft's export directory")
        if self.k is not None and not 0 <= self.k <= 64:
            raise DeskfleetError(f"speculation k must be between 0 and 64, got {self.k}")


@dataclass
class _StreamSpec:
    drafter: Drafter
    k: AdaptiveK | None
    sent_at: float = 0.0
    draft_seconds: float = 0.0
    chosen: list[int] = field(default_factory=list)


class Speculator:
    """Per-stream drafting for a coordinator."""

    def __init__(self, config: SpeculationConfig, *, device: str = "CPU", exact: bool = False):
        self.config = config
        draft_export = config.draft_export if config.mode == "draft" else None  # set in "draft" mode
        self._draft_chain = (LocalChain.load(draft_export, device=device, exact=exact)
                             if draft_export is not None else None)
        self._executor = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deskfleet-draft")
                          if self._draft_chain is not None else None)
        self._streams: dict[StreamId, _StreamSpec] = {}
        self.proposed = 0
        self.accepted = 0
        self.steps = 0
        self.k_history: list[int] = []  # K chosen at every verify step of finished streams

    def _spec(self, state: DraftSubject) -> _StreamSpec:
        spec = self._streams.get(state.stream_id)
        if spec is None:
            if self._draft_chain is not None:
                seed = state.request.sampling.seed
                rng = np.random.default_rng(None if seed is None else seed + 1)
                drafter: Drafter = DraftModelDrafter(self._draft_chain, state.request.sampling, rng)
            else:
                drafter = PromptLookupDrafter()
            adaptive = AdaptiveK(AdaptiveKConfig(k_max=self.config.k_max)) if self.config.k is None else None
            spec = self._streams[state.stream_id] = _StreamSpec(drafter, adaptive)
        return spec

    async def async_propose(self, state: DraftSubject) -> tuple[tuple[int, ...], np.ndarray | None]:
        """Drafts for the stream's next verify step (possibly none)."""
        spec = self._spec(state)
        k = spec.k.choose() if spec.k is not None else int(self.config.k or 0)
        spec.chosen.append(k)
        started = time.perf_counter()
        context = state.request.prompt_ids + tuple(state.generated)
        draft: tuple[int, ...]
        q: np.ndarray | None
        if k <= 0:
            draft, q = (), None
        elif self._executor is not None:
            draft, q = await asyncio.get_running_loop().run_in_executor(self._executor, spec.drafter.propose,
                                                                        context, k)
        else:
            draft, q = spec.drafter.propose(context, k)
        now = time.perf_counter()
        spec.draft_seconds, spec.sent_at = now - started, now
        return draft, q

    def observe(self, state: DraftSubject, drafted: int, replied_at: float) -> None:
        """Feed the verify step's outcome and timing to the stream's K controller."""
        spec = self._streams.get(state.stream_id)
        if spec is None or not spec.sent_at:
            return
        self.steps += 1
        self.proposed += drafted
        self.accepted += state.last_accepted
        if spec.k is not None:
            spec.k.update(drafted, state.last_accepted, replied_at - spec.sent_at, spec.draft_seconds)

    def forget(self, stream_id: StreamId) -> list[int]:
        """Drop a finished stream's drafter; returns the K it chose at each step."""
        spec = self._streams.pop(stream_id, None)
        chosen = spec.chosen if spec is not None else []
        self.k_history.extend(chosen)
        return chosen

    def metrics(self) -> dict[str, float]:
        return {
            "speculation_proposed_total": float(self.proposed),
            "speculation_accepted_total": float(self.accepted),
            "speculation_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "speculation_steps_total": float(self.steps),
        }

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._streams.clear()
