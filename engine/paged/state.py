"""What the paged scheduler (:mod:`engine.paged.scheduler`) keeps and decides: its
settings, the state of one stream, and the actions the coordinator carries out.

Only :class:`~engine.paged.scheduler.BatchScheduler` writes a :class:`StreamState` (through its
book and the two halves it lends it to, :mod:`engine.paged.step_composer` and
:mod:`engine.paged.outcome_accountant`; prefix admission, :mod:`engine.paged.prefix_admission`,
reads one and returns what to attach to it);
the coordinator and the drafter read it (:class:`DraftSubject` is what a drafter needs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.errors import DeskfleetError
from engine.generation.request import FinishReason, GenerationRequest, TokenEvent
from engine.wire.format import StreamId
from engine.wire.step_plan import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE, MAX_STEP_TOKENS, SCRATCH_BLOCKS, bucket_tokens

Drafts = Mapping[int, tuple[Sequence[int], np.ndarray | None]]  # stream id -> (draft tokens, q [K, V] or None)


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler composes steps.

    ``pool_blocks``: blocks per stage pool, scratch blocks included. ``max_streams``: streams
    admitted at once; ``max_waiting``: requests queued beyond them (then OverloadedError).
    ``token_budget``: new tokens per step (decode rows first, then prefill chunks of at most
    ``prefill_chunk``). ``max_replays``: failovers a stream survives. ``pipeline_prefill``: a
    long prefill's next chunk may join a step while its earlier chunks are in flight (so the
    stages of a ring overlap on it: a failover's replay, a long prompt). ``fair_share``: while
    streams of several principals are added, each gets at most its share of the slots and of a
    step's rows and token budget (:mod:`engine.paged.fair_share`); off only to measure what it does.
    """

    block_size: int = CPU_BLOCK_SIZE
    pool_blocks: int = 1024
    max_streams: int = 16
    max_waiting: int = 64
    token_budget: int = 256
    prefill_chunk: int = 256
    context_length: int = 2048
    prefix_cache: bool = True
    max_replays: int = 3
    pipeline_prefill: bool = True
    fair_share: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.block_size not in (CPU_BLOCK_SIZE, GPU_BLOCK_SIZE):
            problems.append(f"block_size {self.block_size} is neither {CPU_BLOCK_SIZE} (CPU) nor "
                            f"{GPU_BLOCK_SIZE} (GPU)")
        if self.pool_blocks <= SCRATCH_BLOCKS:
            problems.append(f"pool_blocks {self.pool_blocks} leaves no block beside the {SCRATCH_BLOCKS} scratch ones")
        if self.max_streams < 1 or self.max_waiting < 0:
            problems.append(f"max_streams {self.max_streams} must be >= 1 and max_waiting {self.max_waiting} >= 0")
        if self.prefill_chunk < 1 or self.context_length < 2 or self.max_replays < 0:
            problems.append("prefill_chunk >= 1, context_length >= 2 and max_replays >= 0 are required")
        if not 1 <= self.token_budget <= MAX_STEP_TOKENS:
            problems.append(f"token_budget {self.token_budget} is outside 1..{MAX_STEP_TOKENS}")
        elif any(bucket_tokens(t) - t > SCRATCH_BLOCKS * self.block_size for t in range(1, self.token_budget + 1)):
            problems.append(f"a step of up to {self.token_budget} tokens pads past the {SCRATCH_BLOCKS} scratch "
                            f"blocks of {self.block_size}; lower token_budget")
        if problems:
            raise DeskfleetError("invalid scheduler settings: " + "; ".join(problems))


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Emit:
    """Deliver a token to the stream's consumer (``event.finish`` set on its last token)."""

    stream_id: StreamId
    event: TokenEvent


@dataclass(frozen=True)
class Finished:
    """The stream is over (stop, length, or cancelled) and its blocks are back in the pool."""

    stream_id: StreamId
    reason: FinishReason


@dataclass(frozen=True)
class Failed:
    """The stream cannot go on; deliver ``error`` to its consumer. Its blocks are back in the pool."""

    stream_id: StreamId
    error: DeskfleetError


@dataclass(frozen=True)
class FailOver:
    """A step did not complete. Its streams can be planned again as they are (a transient error)
    or, if the ring is lost, after :meth:`BatchScheduler.reset_for_replay`: the coordinator decides."""

    reason: str


Action = Emit | Finished | Failed | FailOver


# ----------------------------------------------------------------------------- stream state


class DraftSubject(Protocol):
    """What a drafter reads of a stream (engine.paged.speculation.Speculator)."""

    @property
    def stream_id(self) -> StreamId: ...

    @property
    def request(self) -> GenerationRequest: ...

    @property
    def generated(self) -> Sequence[int]: ...

    @property
    def last_accepted(self) -> int: ...


@dataclass(eq=False)
class StreamState:
    """One request, written only by :class:`~engine.paged.scheduler.BatchScheduler` (and the
    parts it lends its book to); prefix admission, the coordinator and the drafter only read it."""

    stream_id: StreamId
    request: GenerationRequest
    eos_ids: frozenset[int]
    added_at: float
    rng: np.random.Generator
    tokens: list[int]  # prompt + generated
    generated: list[int] = field(default_factory=list)
    cached: int = 0  # positions of ``tokens`` whose KV is in ``blocks``
    blocks: list[int] = field(default_factory=list)  # logical order; covers the rows in flight too
    hashes: list[bytes] = field(default_factory=list)  # chain hash of each full block (prefix cache)
    root: bytes = b""  # the hash its chain starts from: the model's and its request's cache scope
    order: int = 0  # admission order: the largest is the most recently admitted
    in_flight: int | None = None  # seq of the latest step it is in
    ahead: int = 0  # positions of ``tokens`` fed by steps in flight (beyond ``cached``); 0 when not in flight
    copying: bool = False  # that step copies a prefix block into its last block (undone if the step fails)
    cancelled: bool = False
    first_token_at: float | None = None
    last_drafted: int = 0  # drafts its last answered row carried (what Speculator.observe wants)
    last_accepted: int = 0  # of which the target accepted
    proposed_total: int = 0
    accepted_total: int = 0
    preemptions: int = 0
    replays: int = 0

    @property
    def pending(self) -> int:
        """Positions still to feed (1 when decoding)."""
        return len(self.tokens) - self.cached

    @property
    def fed(self) -> int:
        """Positions whose KV is in its blocks or on its way there (a step in flight feeds them)."""
        return self.cached + self.ahead

    @property
    def unfed(self) -> int:
        """Positions no step has fed yet: > 0 while in flight only for a prefill whose later
        chunks may follow the ones in flight (pipelined over the stages)."""
        return len(self.tokens) - self.cached - self.ahead
