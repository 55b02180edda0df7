"""The paged path's scheduler, pure: the one owner of every stream's state and block table.

The coordinator only carries out what this decides (vLLM's ``EngineCore.step()``: schedule,
execute, update from the output)::

    sched = BatchScheduler(SchedulerConfig(...), fingerprint=model.fingerprint, grammar=vocabulary)
    matcher = await sched.async_matcher(constraint)  # a constrained request's grammar (off the loop)
    sid = sched.add(request, eos_ids, now, matcher)  # OverloadedError / GenerationError at once
    subjects = sched.wants_drafts()                  # decoding streams not in flight (DraftSubject)
    step, actions = sched.next_step(drafts, max_rows)  # a PagedStep over streams not in flight, or None
    step = await sched.async_masks(step)             # its token masks and top-k (the mask thread)
    sched.sent(step.seq, monotonic_now)              # step timeouts count from here (sched.flight(seq))
    actions = sched.on_outcome(outcome, now)         # Emit / Finished / Failed / FailOver, grammars settled
    actions = sched.cancel(sid)
    actions = sched.reset_for_replay()               # the ring was lost: the pool is empty again
    actions = sched.fail_all(error)                  # no ring will come back

Every stream that was added ends with exactly one :class:`Finished` or :class:`Failed` action.
The steps in flight are indexed here only (:class:`Flight`); the coordinator reads them by seq.

**Constraints** (:mod:`engine.paged.constraints`) live under the scheduler: a draft the grammar
refuses is cut in :meth:`next_step`, a step's masks come from :meth:`async_masks`, and
:meth:`on_outcome` feeds the accepted tokens to the grammars, attaches log-probabilities and ends
a stream whose grammar is complete.

**One rule for every row.** A stream's token sequence is ``prompt + generated``; ``cached`` of its
positions have KV in its blocks. A step feeds ``tokens[cached : cached + n]``; when that reaches
the end of the sequence the last row predicts the next token (``sample`` 1, or 1 + K when K
drafts are appended to a decode row), otherwise the row is a prefill chunk and nothing is
answered. Prefill, chunked prefill, decode, speculative verify, re-prefill after preemption and
failover replay are all this one rule. (The stateful path replays ``prompt + generated[:-1]``,
drops the prediction of the replay's last position and then decodes ``generated[-1]``; here the
last row of the replay is ``generated[-1]`` itself, which predicts the next new token: the same
positions, no prediction of an emitted token, one step fewer.)

``cached`` advances only in :meth:`on_outcome`, by the rows the last stage accepted; blocks the
step brought beyond that (rejected drafts, a failed step) are released then (rewind). Several
steps may be in flight (micro-batches); a stream in flight is in no other step, with one
exception: a long prefill (a new prompt, a re-prefill, a failover's replay) may bring its next
chunk while earlier ones are in flight, when a step has room after every other stream, so the
first stage computes chunk 2 while the second computes chunk 1 (each stage runs the steps of its
connection in order, so chunk 2 finds chunk 1's KV). A step that fails voids the later chunks of
its streams (their answers are ignored, computed over KV that is missing).

**Blocks.** A step allocates the blocks of the rows it brings. When the pool is short, running
streams admitted after the one asking and not in flight are preempted, the most recent first:
their blocks are freed (kept in the prefix cache while the pool allows) and they wait at the
front of the queue to re-prefill ``prompt + generated``. A waiting request is admitted only if
its first chunk fits without preempting anyone. Admission reuses the longest indexed prefix
(:mod:`engine.paged.prefix_blocks`): full blocks by reference, part of a block by copy
(:mod:`engine.paged.prefix_admission`).

**Its parts.** The scheduler owns the state (:class:`~engine.paged.stream_book.StreamBook`: the
queues, the steps in flight, the block moves that free a stream) and the constraints, and lends
the book to its two halves: composing a step (:mod:`engine.paged.step_composer`: rows, blocks,
preemption, admission, each principal's fair share: :mod:`engine.paged.fair_share`) and accounting
for its outcome (:mod:`engine.paged.outcome_accountant`: advance, rewind, verify, sample, finish).
Here: requests in and out, the grammars around an outcome, replay, metrics.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable

from engine.errors import DeskfleetError, GenerationError
from engine.generation.generator import OverloadedError, UnavailableError
from engine.generation.grammar import GrammarMatcher
from engine.generation.penalties import PENALTY_FEATURES
from engine.generation.request import Constraint, FinishReason, GenerationRequest
from engine.generation.sampling import make_rng
from engine.paged.block_pool import BlockPool, PoolExhausted
from engine.paged.constraints import GrammarVocabulary, StreamConstraints
from engine.paged.flight import Flight
from engine.paged.outcome_accountant import OutcomeAccountant
from engine.paged.prefix_blocks import PrefixBlocks
from engine.paged.state import (
    Action,
    Drafts,
    DraftSubject,
    Emit,
    Failed,
    FailOver,
    Finished,
    SchedulerConfig,
    StreamState,
)
from engine.paged.step import PagedOutcome, PagedStep
from engine.paged.step_composer import StepComposer
from engine.paged.stream_book import StreamBook
from engine.wire.format import StreamId
from engine.wire.step_plan import blocks_needed

__all__ = [
    "Action", "BatchScheduler", "DraftSubject", "Drafts", "Emit", "FailOver", "Failed", "Finished", "Flight",
    "GrammarVocabulary", "PoolExhausted", "SchedulerConfig", "StreamState",
]


# ----------------------------------------------------------------------------- the scheduler


class BatchScheduler:
    """Admission, step composition, block tables, replies to events, for every stream."""

    def __init__(self, config: SchedulerConfig, fingerprint: str = "", grammar: GrammarVocabulary | None = None):
        """``grammar``: the model's vocabulary for token masks (constrained output); without it only
        log-probabilities of the request features are served (see :attr:`features`)."""
        self.config = config
        self.constraints = StreamConstraints(grammar)  # masks before a step, grammar state after it: here only
        pool = BlockPool(config.pool_blocks)
        prefix = PrefixBlocks(pool, config.block_size, fingerprint) if config.prefix_cache else None
        self._ids = itertools.count(1)
        # the state, and the two halves that write it: composing a step, accounting for its outcome
        self._book = StreamBook(config, pool, prefix, self.constraints.forget)
        self._composer = StepComposer(config, self._book, self.constraints.allowed_drafts)
        self._accountant = OutcomeAccountant(config, self._book)

    @property
    def counters(self) -> collections.Counter[str]:
        """What happened so far, by name (requests, tokens, preemptions, ...): :meth:`metrics` reads them."""
        return self._book.counters

    @property
    def pool(self) -> BlockPool:
        return self._book.pool

    @pool.setter
    def pool(self, pool: BlockPool) -> None:
        self._book.pool = pool

    @property
    def prefix(self) -> PrefixBlocks | None:
        """The prefix index (None without ``prefix_cache``)."""
        return self._book.prefix

    # -- constrained output and log-probabilities ---------------------------------------------------

    @property
    def features(self) -> frozenset[str]:
        """The request features served beyond plain generation: the penalties (applied to a penalised
        stream's logits when its verdict is taken, :mod:`engine.paged.reply`) and
        :attr:`StreamConstraints.features` (shared with the static runtime, which applies no penalties)."""
        return self.constraints.features | PENALTY_FEATURES

    def use_grammar(self, vocabulary: GrammarVocabulary | None) -> None:
        """Constrain output with ``vocabulary`` from now on (None: refuse constrained requests)."""
        self.constraints.vocabulary = vocabulary

    async def async_matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for a request's ``constraint``, built off the loop by the process's grammar
        pool (GrammarError, a 400, for a schema that does not compile): pass it to :meth:`add`."""
        return await self.constraints.async_matcher(constraint)

    async def async_masks(self, step: PagedStep) -> PagedStep:
        """``step`` with its constrained rows' token masks (built on the ring's mask thread, the loop
        free meanwhile) and its log-probability rows' top-k: what the stages are sent."""
        return await self.constraints.async_annotate(step)

    def close(self) -> None:
        """Stop the mask thread and forget the grammars (the coordinator stops)."""
        self.constraints.close()

    # -- requests in and out ---------------------------------------------------------------------

    def add(self, request: GenerationRequest, eos_ids: Iterable[int], now: float,
            matcher: GrammarMatcher | None = None) -> StreamId:
        """Queue a request (``matcher``: its constraint's, from :meth:`async_matcher`); it joins the
        next step that has room. GenerationError when it can never run (prompt too long for the
        context or the pool), OverloadedError when the queue is full."""
        cfg, n = self.config, len(request.prompt_ids)
        if n >= cfg.context_length:
            raise GenerationError(f"the prompt has {n} tokens but the model's context is {cfg.context_length}; "
                                  "shorten the conversation")
        need = blocks_needed(n, cfg.block_size)
        if need > self.pool.capacity:
            raise GenerationError(f"the prompt's {n} tokens need {need} KV blocks of {cfg.block_size} but the pool "
                                  f"holds {self.pool.capacity}; shorten the prompt or give the stages more KV memory")
        book = self._book
        if len(book.running) + len(book.waiting) >= cfg.max_streams + cfg.max_waiting:
            book.counters["rejected_overloaded"] += 1
            raise OverloadedError(f"{len(book.running)} streams are running and {len(book.waiting)} requests are "
                                  "waiting; retry shortly")
        if request.sampling.penalised and not request.want_logits:  # its tokens are chosen from its logits
            request = dataclasses.replace(request, want_logits=True)
        sid = StreamId(next(self._ids))
        state = StreamState(sid, request, frozenset(eos_ids), now, make_rng(request.sampling), list(request.prompt_ids))
        if self.prefix is not None:
            state.root = self.prefix.root_for(request.cache_scope)  # one key's blocks are never another's
        book.streams[sid] = state
        book.waiting.append(state)
        self.constraints.track(sid, request, matcher)
        book.counters["requests"] += 1
        return sid

    def cancel(self, stream_id: int, reason: FinishReason = FinishReason.CANCELLED) -> list[Action]:
        """Stop a stream: its blocks are freed now, or when the step it is in returns (then
        :meth:`on_outcome` reports it). Unknown or already cancelled streams: nothing. ``reason``
        STOP ends a stream not in flight as complete (its output constraint has nothing left)."""
        state = self._book.streams.get(StreamId(stream_id))
        if state is None or state.cancelled:
            return []
        state.cancelled = True
        if state.in_flight is not None:
            return []
        return self._book.end(state, Finished(state.stream_id, reason))

    def stream(self, stream_id: int) -> StreamState | None:
        return self._book.streams.get(StreamId(stream_id))

    def wants_drafts(self) -> list[StreamState]:
        """Decoding streams not in flight that may bring drafts to the next step (for the Speculator)."""
        return [s for s in self._book.running
                if s.in_flight is None and s.pending == 1 and s.generated and not s.cancelled]

    @property
    def streams(self) -> int:
        """Streams added and not ended (running and waiting)."""
        return len(self._book.streams)

    @property
    def running(self) -> int:
        """Streams admitted (holding or about to hold blocks)."""
        return len(self._book.running)

    @property
    def idle(self) -> bool:
        """No stream running or waiting."""
        return not self._book.streams

    @property
    def in_flight(self) -> int:
        """Steps handed out whose outcome has not come back."""
        return len(self._book.flights)

    def flight(self, seq: int) -> Flight | None:
        """Step ``seq`` while it is in flight (None once answered, or forgotten by a replay)."""
        return self._book.flights.get(seq)

    def sent(self, seq: int, at: float) -> None:
        """Step ``seq`` left for the stages at monotonic time ``at`` (what step timeouts count from)."""
        flight = self._book.flights.get(seq)
        if flight is not None:
            flight.sent_at = at

    def oldest_sent_at(self) -> float | None:
        """When the oldest step in flight was sent (None: none is)."""
        return min((f.sent_at for f in self._book.flights.values() if f.sent_at is not None), default=None)

    def block_tables(self) -> dict[StreamId, tuple[int, ...]]:
        return {s.stream_id: tuple(s.blocks) for s in self._book.running if s.blocks}

    # -- composing a step ------------------------------------------------------------------------

    def next_step(self, drafts: Drafts | None = None, max_rows: int | None = None
                  ) -> tuple[PagedStep | None, list[Action]]:
        """The next step over streams not in flight, within the token budget: decode rows (with
        their drafts, cut to the room left) first, oldest stream first, then prefill chunks of
        running streams, then newly admitted ones (:mod:`engine.paged.step_composer`). ``max_rows``
        caps the streams in it (to spread them over micro-batches). The actions are streams that
        failed while planning."""
        return self._composer.next_step(drafts, max_rows)

    # -- outcomes --------------------------------------------------------------------------------

    def on_outcome(self, outcome: PagedOutcome, now: float) -> list[Action]:
        """Account for the last stage's answer to a step: advance, rewind, emit, finish. An outcome
        of a step this scheduler no longer knows (before a replay) is ignored."""
        book = self._book
        flight = book.flights.pop(outcome.seq, None)
        if flight is None:
            return []
        if outcome.error is not None or not self.constraints.tracks_any:
            return self._accountant.account(flight.rows, outcome, now)
        book.settling = []  # streams ending in this outcome keep their grammar until it is settled
        try:
            actions = self._accountant.account(flight.rows, outcome, now)
            settled = self.constraints.settle(flight.plan, outcome, actions)  # grammars consume, logprobs attach
        finally:
            ended, book.settling = book.settling, None
        for sid in ended:
            self.constraints.forget(sid)
        actions = settled.actions
        for sid, end in settled.ended.items():  # a grammar's end (or a broken constraint): over now
            # not in flight any more: ends now (counted as finished or cancelled); ``end`` is what its consumer hears
            self.cancel(sid, end.reason if isinstance(end, Finished) else FinishReason.CANCELLED)
            actions.append(end)
        return actions

    # -- ending and replaying --------------------------------------------------------------------

    def reset_for_replay(self) -> list[Action]:
        """The ring was lost: the new ring's pools are empty. Every stream drops its blocks (and
        the prefix index empties); running streams re-prefill ``prompt + generated`` from the next
        step on, in their order. Steps in flight are forgotten (their outcomes, if any, ignored).
        Streams past ``max_replays`` fail; cancelled streams finish."""
        book = self._book
        book.flights.clear()
        book.computing.clear()
        book.pool.reset()
        if book.prefix is not None:
            book.prefix.reset()
        actions: list[Action] = []
        for s in list(book.running) + list(book.waiting):
            was_running = s in book.running
            s.blocks, s.hashes, s.cached, s.in_flight, s.ahead, s.copying = [], [], 0, None, 0, False
            if s.cancelled:
                actions.extend(book.end(s, Finished(s.stream_id, FinishReason.CANCELLED)))
            elif was_running:
                s.replays += 1
                book.counters["replays"] += 1
                if s.replays > self.config.max_replays:
                    actions.extend(book.end(s, Failed(s.stream_id, UnavailableError(
                        f"stream {s.stream_id} lost its stages {s.replays} times; giving up"))))
        return actions

    def fail_all(self, error: DeskfleetError) -> list[Action]:
        """End every stream with ``error`` (the ring is gone and no other comes): their blocks are
        freed and steps in flight forgotten."""
        book = self._book
        book.flights.clear()
        book.computing.clear()
        actions: list[Action] = []
        for s in list(book.running) + list(book.waiting):
            book.abandon(s)
            actions.extend(book.end(s, Failed(s.stream_id, error)))
        return actions

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {
            "requests_total": float(c["requests"]),
            "requests_finished_total": float(c["finished"]),
            "requests_cancelled_total": float(c["cancelled"]),
            "requests_failed_total": float(c["failed"]),
            "requests_rejected_total": float(c["rejected_overloaded"]),
            "tokens_generated_total": float(c["tokens"]),
            "active_streams": float(len(self._book.running)),
            "waiting_requests": float(len(self._book.waiting)),
            "slots": float(self.config.max_streams),
            "sched_steps_in_flight": float(len(self._book.flights)),
            "sched_steps_total": float(c["steps"]),
            "sched_step_tokens_total": float(c["step_tokens"]),
            "sched_preemptions_total": float(c["preemptions"]),
            "sched_replays_total": float(c["replays"]),
            "sched_pipelined_chunks_total": float(c["pipelined"]),
            "sched_fair_steps_total": float(c["fair_steps"]),
            "sched_fair_withheld_rows_total": float(c["fair_withheld"]),
            "sched_fair_preemptions_total": float(c["fair_preemptions"]),
            "prefix_hits_total": float(c["prefix_hits"]),
            "prefix_tokens_reused_total": float(c["prefix_tokens_reused"]),
            "prefix_block_copies_total": float(c["prefix_copies"]),
            "kv_blocks_total": float(self.pool.capacity),
            "kv_blocks_free": float(self.pool.free),
            "kv_blocks_used": float(self.pool.used),
            "kv_blocks_cached": float(self.pool.cached),
            "kv_blocks_evicted_total": float(self.pool.evictions),
        }
