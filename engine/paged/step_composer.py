"""Composing the paged scheduler's next step (:meth:`~engine.paged.scheduler.BatchScheduler.next_step`).

Within the token budget, over the streams not in flight: decode rows first (with their drafts,
cut to what the grammar allows, the room left and the free blocks), oldest stream first; then
prefill chunks of running streams (after catching up on full blocks another stream computed);
then newly admitted streams, onto the longest indexed prefix; then the next chunks of prefills
still in flight, in the room left. Each row gets its blocks here: when the pool is short, running
streams admitted after the one asking and not in flight are preempted, the most recent first (their
blocks freed, kept in the prefix cache while the pool allows; they wait at the front of the queue to
re-prefill). A waiting request is admitted only if its first chunk fits without preempting anyone.

While streams of several principals (API keys, members) are added, every phase spends each
principal's share (:mod:`engine.paged.fair_share`): a row whose principal has used up its share of
the step's rows or tokens waits (a prefill chunk is cut to what is left), the next waiting stream
admitted is the first in line of the first principal under its slot share, and when no slot is free
a principal over its share gives one up (its newest stream not in flight is preempted).

Pure: it writes the scheduler's :class:`~engine.paged.stream_book.StreamBook` (lent by the
scheduler, its one owner) and returns the step; the outcome is accounted for in
:mod:`engine.paged.outcome_accountant`.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from engine.errors import GenerationError
from engine.paged.fair_share import FairShare, StepFairness, plan_step
from engine.paged.flight import Flight, FlightRow
from engine.paged.prefix_admission import CaughtUp
from engine.paged.state import Action, Drafts, Failed, SchedulerConfig, StreamState
from engine.paged.step import PagedStep
from engine.paged.stream_book import StreamBook
from engine.wire.format import StreamId
from engine.wire.step_plan import PlanRow, StepPlan, blocks_needed


class StepComposer:
    """The scheduler's step composition: rows, their blocks, preemption, admission."""

    def __init__(self, config: SchedulerConfig, book: StreamBook,
                 allowed_drafts: Callable[[StreamId, Sequence[int]], int]):
        """``allowed_drafts``: how many of a stream's drafts its grammar allows in a row (the
        scheduler's constraints)."""
        self.config = config
        self.book = book
        self.allowed_drafts = allowed_drafts
        self._seqs = itertools.count(1)
        self._orders = itertools.count(1)
        self.fair = FairShare()
        self._step_fairness: StepFairness | None = None  # while a step is composed: its principals' shares
        self._withheld = False  # the last step composed left rows out for their principals' shares

    def next_step(self, drafts: Drafts | None = None, max_rows: int | None = None
                  ) -> tuple[PagedStep | None, list[Action]]:
        """The next step over streams not in flight, within the token budget (None: nothing to do),
        recorded as in flight; ``max_rows`` caps the streams in it. The actions are streams that
        failed while planning (:meth:`BatchScheduler.next_step`). A step the shares leave empty
        (the shares' rows could not be made: streams waiting for blocks) is composed uncapped."""
        step, actions = self._compose(drafts, max_rows, self.config.fair_share)
        if step is None and self.config.fair_share and self._withheld:
            more, again = self._compose(drafts, max_rows, fair_share=False)
            return more, actions + again
        return step, actions

    def _compose(self, drafts: Drafts | None, max_rows: int | None, fair_share: bool
                 ) -> tuple[PagedStep | None, list[Action]]:
        cfg, book = self.config, self.book
        drafts = drafts or {}
        limit = max_rows if max_rows is not None else len(book.streams)
        budget = cfg.token_budget
        seq = next(self._seqs)
        rows: list[FlightRow] = []
        copies: list[tuple[int, int]] = []
        actions: list[Action] = []
        preempted: set[StreamId] = set()
        offered: list[StreamId] = []
        fair = self._step_fairness = plan_step(self.fair, book.streams.values(), book.running,
                                               cfg) if fair_share else None
        if fair is not None:
            self._rebalance_slots(fair, preempted)
            fair.divide(book.running, book.waiting, cfg, drafts, limit, budget, preempted)

        def ready(s: StreamState) -> bool:
            return s in book.running and s.in_flight is None and not s.cancelled

        def room(s: StreamState, want: int) -> int:  # what the share of its principal leaves of ``want`` tokens
            return fair.room(s, want) if fair is not None else want

        for s in list(book.running):  # decode rows
            if budget < 1 or len(rows) >= limit:
                break
            if not ready(s) or s.pending != 1:
                continue
            share = room(s, budget)
            if share < 1:
                continue
            tokens, q = drafts.get(s.stream_id, ((), None)) if s.generated else ((), None)
            if tokens:  # a draft the grammar refuses would only be rejected: never sent
                tokens = tokens[:self.allowed_drafts(s.stream_id, tokens)]
            k = max(0, min(len(tokens), len(q) if q is not None else len(tokens), share - 1, self._room(s)))
            # drafts only where blocks are free; a plain decode row may preempt a newer stream
            while k and blocks_needed(s.cached + 1 + k, cfg.block_size) - len(s.blocks) > book.pool.free:
                k -= 1
            if not self._reserve(s, 1 + k, preempted, actions):
                continue
            draft = tuple(int(t) for t in tokens[:k])
            if tokens:
                offered.append(s.stream_id)
            rows.append(self._row(s, seq, 1 + k, draft, q[:k] if q is not None and k else None))
            budget -= 1 + k

        for s in list(book.running):  # prefill chunks of admitted streams
            if budget < 1 or len(rows) >= limit:
                break
            if not ready(s) or s.pending == 1:
                continue
            caught = book.sharing.catch_up(s)
            self._share_caught_up(s, caught)
            if caught.wait:
                continue
            n = room(s, min(cfg.prefill_chunk, budget, s.pending))
            if n < 1:
                continue
            free = (len(s.blocks) + book.pool.free) * cfg.block_size - s.cached
            if free >= 1:  # a smaller chunk rather than preempting anyone
                n = min(n, free)
            if self._reserve(s, n, preempted, actions):
                rows.append(self._row(s, seq, n))
                budget -= n

        pins: list[int] = []
        while book.waiting and budget >= 1 and len(rows) < limit:
            waiting = self._next_waiting(preempted)
            if waiting is None:
                break
            s = waiting
            if blocks_needed(len(s.tokens), cfg.block_size) > book.pool.capacity:  # preempted at the pool's end
                actions.extend(book.end(s, Failed(s.stream_id, self._too_big(s, len(s.tokens)))))
                continue
            attach = book.sharing.admit(s, room(s, budget), copies, pins)
            if attach is None:
                break
            s.blocks, s.hashes, s.cached, s.copying = attach.blocks, attach.hashes, attach.cached, attach.copying
            first = attach.first
            book.waiting.remove(s)
            s.order = next(self._orders)
            book.running.append(s)
            if fair is not None:
                fair.admitted(s)
            if first:  # else it waits for a block another stream is computing, and shares it next step
                rows.append(self._row(s, seq, first))
                budget -= first
        for block in pins:  # copy sources were held only while blocks were allocated around them
            book.pool.release(block)

        for s in list(book.running):  # the next chunks of prefills in flight, in the room left
            if budget < 1 or len(rows) >= limit:
                break
            n = self._follow_up(s, seq, room(s, budget)) if s.in_flight not in (None, seq) and s.unfed > 0 else 0
            if n:
                rows.append(self._row(s, seq, n))
                budget -= n

        self._step_fairness = None
        self._withheld = fair is not None and fair.withheld > 0
        if fair is not None:
            book.counters["fair_steps"] += 1
            book.counters["fair_withheld"] += fair.withheld
            for r in rows:
                self.fair.served(r.stream.request.principal, r.n)
        if not rows:
            return None, actions
        plan = StepPlan(cfg.block_size, cfg.pool_blocks,
                        tuple(PlanRow(r.stream.stream_id, r.past, r.n, tuple(r.stream.blocks), r.sample,
                                      r.want_logits) for r in rows),
                        copies=tuple(copies), token_budget=cfg.token_budget)
        ids = np.fromiter(itertools.chain.from_iterable(self._feed(r) for r in rows), dtype=np.int64,
                          count=plan.tokens)
        book.flights[seq] = Flight(seq, rows, plan, tuple(offered))
        book.counters["steps"] += 1
        book.counters["step_tokens"] += plan.tokens
        return PagedStep(seq, plan, ids), actions

    def _next_waiting(self, preempted: set[StreamId]) -> StreamState | None:
        """The waiting stream to admit next if a slot is free (None: nobody now): first come first
        served, or with several principals the first in line of the first one under its slot share."""
        book, fair = self.book, self._step_fairness
        if len(book.running) >= self.config.max_streams:
            return None
        if fair is None:
            s = book.waiting[0]
            return s if s.stream_id not in preempted else None
        return fair.next_waiting(book.waiting, preempted)

    def _rebalance_slots(self, fair: StepFairness, preempted: set[StreamId]) -> None:
        """Before any row is planned (rows put their streams in flight): while principals under their
        slot share wait for more slots than are free, the principal most over its share gives one up,
        its newest stream not in flight preempted (the slot then waits for those under their share)."""
        book = self.book
        while fair.admissible(book.waiting, preempted) > self.config.max_streams - len(book.running):
            victim = fair.victim(book.running)
            if victim is None:
                return
            self._preempt(victim)
            preempted.add(victim.stream_id)
            book.counters["fair_preemptions"] += 1

    def _share_caught_up(self, s: StreamState, caught: CaughtUp) -> None:
        """Put the full blocks ``s`` caught up on in its table (each replacing its own partial copy
        of that block, if any: the shared one holds the same KV and more)."""
        for j, (block, digest) in enumerate(zip(caught.blocks, caught.hashes, strict=True), start=caught.start):
            if len(s.blocks) > j:
                self.book.pool.release(s.blocks[j])
                s.blocks[j] = block
            else:
                s.blocks.append(block)
            s.hashes.append(digest)
        s.cached = caught.cached

    def _room(self, s: StreamState) -> int:
        """Drafts a decode row may carry: positions left in the context and tokens left to generate."""
        return max(0, min(self.config.context_length - len(s.tokens) - 1,
                          s.request.max_new_tokens - len(s.generated) - 1))

    def _row(self, s: StreamState, seq: int, n: int, drafts: tuple[int, ...] = (),
             q: np.ndarray | None = None) -> FlightRow:
        past, fed = s.fed, n - len(drafts)
        s.in_flight = seq
        s.ahead += fed
        sample = (1 + len(drafts)) if past + fed == len(s.tokens) else 0
        want = bool(sample) and (s.request.want_logits or not s.request.sampling.greedy)
        row = FlightRow(s, past, n, drafts, q, sample, want)
        if self._step_fairness is not None:
            self._step_fairness.take(s, n)
        if not sample:  # streams after this one in the step (or later steps) wait for these blocks
            row.computing = self.book.sharing.computing_blocks(s, past, n)
            self.book.computing.update(dict.fromkeys(row.computing, seq))
        return row

    @staticmethod
    def _feed(r: FlightRow) -> list[int]:
        return r.stream.tokens[r.past:r.past + r.n - len(r.drafts)] + list(r.drafts)

    def _follow_up(self, s: StreamState, seq: int, budget: int) -> int:
        """Rows of the next prefill chunk of ``s`` while its earlier ones are in flight, with blocks
        allocated for them; 0 when it is not in flight (or in this step), has nothing left to feed
        before its answer row, or would need more blocks than are free (nobody is preempted for it).
        Its blocks are its own: a stream with the same prefix shares them once computed (catch-up)."""
        if not self.config.pipeline_prefill or s.in_flight is None or s.in_flight == seq or s.cancelled \
                or s.unfed < 1:
            return 0
        bs = self.config.block_size
        n = min(self.config.prefill_chunk, budget, s.unfed, (len(s.blocks) + self.book.pool.free) * bs - s.fed)
        if n < 1:
            return 0
        s.blocks.extend(self.book.pool.allocate(blocks_needed(s.fed + n, bs) - len(s.blocks)))
        self.book.counters["pipelined"] += 1
        return n

    def _reserve(self, s: StreamState, n: int, preempted: set[StreamId], actions: list[Action]) -> bool:
        """Give ``s`` the blocks for ``n`` more rows; if the pool is short, preempt running streams
        admitted after ``s`` and not in flight, most recent first. False: ``s`` waits (or failed)."""
        bs = self.config.block_size
        total = blocks_needed(s.cached + n, bs)
        if total > self.book.pool.capacity:
            actions.extend(self.book.end(s, Failed(s.stream_id, self._too_big(s, s.cached + n))))
            return False
        need = total - len(s.blocks)
        while need > self.book.pool.free:
            victims = [v for v in self.book.running if v.in_flight is None and v is not s]
            victim = max(victims, key=lambda v: v.order, default=None)
            if victim is None or victim.order < s.order:
                return False  # only newer streams make way; the oldest always progresses
            self._preempt(victim)
            preempted.add(victim.stream_id)
        s.blocks.extend(self.book.pool.allocate(need))
        return True

    def _too_big(self, s: StreamState, positions: int) -> GenerationError:
        bs = self.config.block_size
        return GenerationError(f"stream {s.stream_id} needs {positions} cached positions, "
                               f"{blocks_needed(positions, bs)} KV blocks of {bs}, more than the whole pool of "
                               f"{self.book.pool.capacity}; give the stages more KV memory or ask for fewer tokens")

    def _preempt(self, s: StreamState) -> None:
        """Free a running stream's blocks; it waits at the front and later re-prefills its tokens
        (its own blocks, kept in the prefix cache, make that cheap while they last)."""
        self.book.release_blocks(s)
        self.book.running.remove(s)
        self.book.waiting.appendleft(s)
        s.preemptions += 1
        self.book.counters["preemptions"] += 1
        if self._step_fairness is not None:
            self._step_fairness.left(s)
