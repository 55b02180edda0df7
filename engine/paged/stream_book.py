"""The paged scheduler's book of streams: what :class:`~engine.paged.scheduler.BatchScheduler`
keeps, and the block-table moves its two halves share.

The scheduler owns one :class:`StreamBook` and lends it to the half that composes a step
(:mod:`engine.paged.step_composer`) and the half that accounts for its outcome
(:mod:`engine.paged.outcome_accountant`); nothing else writes it. It holds every stream added and
not ended, the running ones (oldest first), the waiting queue, the steps in flight, the full
blocks a prefill row in flight completes, the counters, and the pool and prefix index (on the
prefix-sharing helper, :mod:`engine.paged.prefix_admission`). Pure: no I/O, no loop.
"""
from __future__ import annotations

import collections
from collections.abc import Callable

from engine.generation.request import FinishReason
from engine.paged.block_pool import BlockPool
from engine.paged.flight import Flight
from engine.paged.prefix_admission import PrefixAdmission
from engine.paged.prefix_blocks import PrefixBlocks
from engine.paged.state import Action, Failed, Finished, SchedulerConfig, StreamState
from engine.wire.format import StreamId
from engine.wire.step_plan import blocks_needed


class StreamBook:
    """Every stream's place (running, waiting, in flight) and blocks, and the moves that free them."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, prefix: PrefixBlocks | None,
                 forget: Callable[[StreamId], None]):
        """``forget``: drop an ended stream's constraints (the scheduler's grammars)."""
        self.config = config
        self.streams: dict[StreamId, StreamState] = {}
        self.running: list[StreamState] = []  # admitted, oldest first
        self.waiting: collections.deque[StreamState] = collections.deque()
        self.flights: dict[int, Flight] = {}
        self.computing: dict[bytes, int] = {}  # chain hash of a full block a prefill row in flight completes -> seq
        self.settling: list[StreamId] | None = None  # while an outcome's grammars settle: streams that ended in it
        self.forget = forget
        self.counters: collections.Counter[str] = collections.Counter()
        # the pool and the prefix index live on the prefix-sharing helper: one object each, whoever reads them
        self.sharing = PrefixAdmission(config.block_size, config.prefill_chunk, pool, prefix, self.computing,
                                       self.counters)

    @property
    def pool(self) -> BlockPool:
        return self.sharing.pool

    @pool.setter
    def pool(self, pool: BlockPool) -> None:
        self.sharing.pool = pool

    @property
    def prefix(self) -> PrefixBlocks | None:
        """The prefix index (None without ``prefix_cache``)."""
        return self.sharing.prefix

    def trim(self, s: StreamState) -> None:
        """Give back the blocks of ``s`` beyond the positions it has fed (chunks in flight keep theirs)."""
        keep = blocks_needed(s.fed, self.config.block_size)
        while len(s.blocks) > keep:
            self.pool.release(s.blocks.pop())

    def abandon(self, s: StreamState) -> None:
        """The steps ``s`` is in will not be answered: keep what completed steps put in its blocks.
        A prefix copy made by that step may be missing on some stage: only the shared full blocks count."""
        s.in_flight, s.ahead = None, 0
        if s.copying:
            s.cached -= s.cached % self.config.block_size
            s.copying = False
        self.trim(s)

    def release_blocks(self, s: StreamState) -> None:
        """Give back every block of ``s`` (not in flight); its partial last block stays reusable."""
        bs = self.config.block_size
        self.trim(s)
        if self.prefix is not None and s.cached % bs and s.blocks:
            full = s.cached // bs
            parent = s.hashes[full - 1] if full else s.root
            self.prefix.register_partial(s.blocks[-1], parent, s.tokens[full * bs:s.cached])
        for block in reversed(s.blocks):  # the tail is evicted first: a prefix is only useful from its start
            self.pool.release(block)
        s.blocks, s.hashes, s.cached = [], [], 0

    def end(self, s: StreamState, action: Finished | Failed) -> list[Action]:
        """``s`` is over (``action`` says how): its blocks go back, it leaves every queue, and its
        constraints are forgotten (after the outcome being settled, if one is)."""
        self.release_blocks(s)
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        self.streams.pop(s.stream_id, None)
        if self.settling is None:
            self.forget(s.stream_id)
        else:
            self.settling.append(s.stream_id)
        if isinstance(action, Failed):
            self.counters["failed"] += 1
        else:
            self.counters["cancelled" if action.reason is FinishReason.CANCELLED else "finished"] += 1
        return [action]
