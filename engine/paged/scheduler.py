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
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable

import numpy as np

from engine.errors import DeskfleetError, GenerationError
from engine.generation.generator import OverloadedError, UnavailableError
from engine.generation.grammar import GrammarMatcher
from engine.generation.request import Constraint, FinishReason, GenerationRequest, TokenEvent
from engine.generation.sampling import make_rng
from engine.paged.block_pool import BlockPool, PoolExhausted
from engine.paged.constraints import GrammarVocabulary, StreamConstraints
from engine.paged.flight import Flight, FlightRow
from engine.paged.prefix_admission import CaughtUp, PrefixAdmission
from engine.paged.prefix_blocks import PrefixBlocks, chain_hash
from engine.paged.reply import decide, reply_problem
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
from engine.wire.format import StreamId
from engine.wire.step_plan import PlanRow, StepPlan, blocks_needed

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
        self._seqs = itertools.count(1)
        self._orders = itertools.count(1)
        self._streams: dict[StreamId, StreamState] = {}
        self._running: list[StreamState] = []  # admitted, oldest first
        self._waiting: collections.deque[StreamState] = collections.deque()
        self._flights: dict[int, Flight] = {}
        self._settling: list[StreamId] | None = None  # while on_outcome settles: streams that ended in it
        self._computing: dict[bytes, int] = {}  # chain hash of a full block a prefill row in flight completes -> seq
        self.counters: collections.Counter[str] = collections.Counter()
        # the pool and the prefix index live on the prefix-sharing helper: one object each, whoever reads them
        self._sharing = PrefixAdmission(config.block_size, config.prefill_chunk, pool, prefix, self._computing,
                                        self.counters)

    @property
    def pool(self) -> BlockPool:
        return self._sharing.pool

    @pool.setter
    def pool(self, pool: BlockPool) -> None:
        self._sharing.pool = pool

    @property
    def prefix(self) -> PrefixBlocks | None:
        """The prefix index (None without ``prefix_cache``)."""
        return self._sharing.prefix

    # -- constrained output and log-probabilities ---------------------------------------------------

    @property
    def features(self) -> frozenset[str]:
        """The request features served beyond plain generation (:attr:`StreamConstraints.features`)."""
        return self.constraints.features

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
        if len(self._running) + len(self._waiting) >= cfg.max_streams + cfg.max_waiting:
            self.counters["rejected_overloaded"] += 1
            raise OverloadedError(f"{len(self._running)} streams are running and {len(self._waiting)} requests are "
                                  "waiting; retry shortly")
        sid = StreamId(next(self._ids))
        state = StreamState(sid, request, frozenset(eos_ids), now, make_rng(request.sampling), list(request.prompt_ids))
        if self.prefix is not None:
            state.root = self.prefix.root_for(request.cache_scope)  # one key's blocks are never another's
        self._streams[sid] = state
        self._waiting.append(state)
        self.constraints.track(sid, request, matcher)
        self.counters["requests"] += 1
        return sid

    def cancel(self, stream_id: int, reason: FinishReason = FinishReason.CANCELLED) -> list[Action]:
        """Stop a stream: its blocks are freed now, or when the step it is in returns (then
        :meth:`on_outcome` reports it). Unknown or already cancelled streams: nothing. ``reason``
        STOP ends a stream not in flight as complete (its output constraint has nothing left)."""
        state = self._streams.get(StreamId(stream_id))
        if state is None or state.cancelled:
            return []
        state.cancelled = True
        if state.in_flight is not None:
            return []
        return self._end(state, Finished(state.stream_id, reason))

    def stream(self, stream_id: int) -> StreamState | None:
        return self._streams.get(StreamId(stream_id))

    def wants_drafts(self) -> list[StreamState]:
        """Decoding streams not in flight that may bring drafts to the next step (for the Speculator)."""
        return [s for s in self._running
                if s.in_flight is None and s.pending == 1 and s.generated and not s.cancelled]

    @property
    def streams(self) -> int:
        """Streams added and not ended (running and waiting)."""
        return len(self._streams)

    @property
    def running(self) -> int:
        """Streams admitted (holding or about to hold blocks)."""
        return len(self._running)

    @property
    def idle(self) -> bool:
        """No stream running or waiting."""
        return not self._streams

    @property
    def in_flight(self) -> int:
        """Steps handed out whose outcome has not come back."""
        return len(self._flights)

    def flight(self, seq: int) -> Flight | None:
        """Step ``seq`` while it is in flight (None once answered, or forgotten by a replay)."""
        return self._flights.get(seq)

    def sent(self, seq: int, at: float) -> None:
        """Step ``seq`` left for the stages at monotonic time ``at`` (what step timeouts count from)."""
        flight = self._flights.get(seq)
        if flight is not None:
            flight.sent_at = at

    def oldest_sent_at(self) -> float | None:
        """When the oldest step in flight was sent (None: none is)."""
        return min((f.sent_at for f in self._flights.values() if f.sent_at is not None), default=None)

    def block_tables(self) -> dict[StreamId, tuple[int, ...]]:
        return {s.stream_id: tuple(s.blocks) for s in self._running if s.blocks}

    # -- composing a step ------------------------------------------------------------------------

    def next_step(self, drafts: Drafts | None = None, max_rows: int | None = None
                  ) -> tuple[PagedStep | None, list[Action]]:
        """The next step over streams not in flight, within the token budget: decode rows (with
        their drafts, cut to the room left) first, oldest stream first, then prefill chunks of
        running streams, then newly admitted ones. ``max_rows`` caps the streams in it (to spread
        them over micro-batches). The actions are streams that failed while planning."""
        cfg = self.config
        drafts = drafts or {}
        limit = max_rows if max_rows is not None else len(self._streams)
        budget = cfg.token_budget
        seq = next(self._seqs)
        rows: list[FlightRow] = []
        copies: list[tuple[int, int]] = []
        actions: list[Action] = []
        preempted: set[StreamId] = set()
        offered: list[StreamId] = []

        def ready(s: StreamState) -> bool:
            return s in self._running and s.in_flight is None and not s.cancelled

        for s in list(self._running):  # decode rows
            if budget < 1 or len(rows) >= limit:
                break
            if not ready(s) or s.pending != 1:
                continue
            tokens, q = drafts.get(s.stream_id, ((), None)) if s.generated else ((), None)
            if tokens:  # a draft the grammar refuses would only be rejected: never sent
                tokens = tokens[:self.constraints.allowed_drafts(s.stream_id, tokens)]
            k = max(0, min(len(tokens), len(q) if q is not None else len(tokens), budget - 1, self._room(s)))
            # drafts only where blocks are free; a plain decode row may preempt a newer stream
            while k and blocks_needed(s.cached + 1 + k, cfg.block_size) - len(s.blocks) > self.pool.free:
                k -= 1
            if not self._reserve(s, 1 + k, preempted, actions):
                continue
            draft = tuple(int(t) for t in tokens[:k])
            if tokens:
                offered.append(s.stream_id)
            rows.append(self._row(s, seq, 1 + k, draft, q[:k] if q is not None and k else None))
            budget -= 1 + k

        for s in list(self._running):  # prefill chunks of admitted streams
            if budget < 1 or len(rows) >= limit:
                break
            if not ready(s) or s.pending == 1:
                continue
            caught = self._sharing.catch_up(s)
            self._share_caught_up(s, caught)
            if caught.wait:
                continue
            n = min(cfg.prefill_chunk, budget, s.pending)
            room = (len(s.blocks) + self.pool.free) * cfg.block_size - s.cached
            if room >= 1:  # a smaller chunk rather than preempting anyone
                n = min(n, room)
            if self._reserve(s, n, preempted, actions):
                rows.append(self._row(s, seq, n))
                budget -= n

        pins: list[int] = []
        while (self._waiting and budget >= 1 and len(rows) < limit and len(self._running) < cfg.max_streams
               and self._waiting[0].stream_id not in preempted):
            s = self._waiting[0]
            if blocks_needed(len(s.tokens), cfg.block_size) > self.pool.capacity:  # preempted at the pool's end
                actions.extend(self._end(s, Failed(s.stream_id, self._too_big(s, len(s.tokens)))))
                continue
            attach = self._sharing.admit(s, budget, copies, pins)
            if attach is None:
                break
            s.blocks, s.hashes, s.cached, s.copying = attach.blocks, attach.hashes, attach.cached, attach.copying
            first = attach.first
            self._waiting.popleft()
            s.order = next(self._orders)
            self._running.append(s)
            if first:  # else it waits for a block another stream is computing, and shares it next step
                rows.append(self._row(s, seq, first))
                budget -= first
        for block in pins:  # copy sources were held only while blocks were allocated around them
            self.pool.release(block)

        for s in list(self._running):  # the next chunks of prefills in flight, in the room left
            if budget < 1 or len(rows) >= limit:
                break
            n = self._follow_up(s, seq, budget)
            if n:
                rows.append(self._row(s, seq, n))
                budget -= n

        if not rows:
            return None, actions
        plan = StepPlan(cfg.block_size, cfg.pool_blocks,
                        tuple(PlanRow(r.stream.stream_id, r.past, r.n, tuple(r.stream.blocks), r.sample,
                                      r.want_logits) for r in rows),
                        copies=tuple(copies), token_budget=cfg.token_budget)
        ids = np.fromiter(itertools.chain.from_iterable(self._feed(r) for r in rows), dtype=np.int64,
                          count=plan.tokens)
        self._flights[seq] = Flight(seq, rows, plan, tuple(offered))
        self.counters["steps"] += 1
        self.counters["step_tokens"] += plan.tokens
        return PagedStep(seq, plan, ids), actions

    def _share_caught_up(self, s: StreamState, caught: CaughtUp) -> None:
        """Put the full blocks ``s`` caught up on in its table (each replacing its own partial copy
        of that block, if any: the shared one holds the same KV and more)."""
        for j, (block, digest) in enumerate(zip(caught.blocks, caught.hashes, strict=True), start=caught.start):
            if len(s.blocks) > j:
                self.pool.release(s.blocks[j])
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
        if not sample:  # streams after this one in the step (or later steps) wait for these blocks
            row.computing = self._sharing.computing_blocks(s, past, n)
            self._computing.update(dict.fromkeys(row.computing, seq))
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
        n = min(self.config.prefill_chunk, budget, s.unfed, (len(s.blocks) + self.pool.free) * bs - s.fed)
        if n < 1:
            return 0
        s.blocks.extend(self.pool.allocate(blocks_needed(s.fed + n, bs) - len(s.blocks)))
        self.counters["pipelined"] += 1
        return n

    def _reserve(self, s: StreamState, n: int, preempted: set[StreamId], actions: list[Action]) -> bool:
        """Give ``s`` the blocks for ``n`` more rows; if the pool is short, preempt running streams
        admitted after ``s`` and not in flight, most recent first. False: ``s`` waits (or failed)."""
        bs = self.config.block_size
        total = blocks_needed(s.cached + n, bs)
        if total > self.pool.capacity:
            actions.extend(self._end(s, Failed(s.stream_id, self._too_big(s, s.cached + n))))
            return False
        need = total - len(s.blocks)
        while need > self.pool.free:
            victims = [v for v in self._running if v.in_flight is None and v is not s]
            victim = max(victims, key=lambda v: v.order, default=None)
            if victim is None or victim.order < s.order:
                return False  # only newer streams make way; the oldest always progresses
            self._preempt(victim)
            preempted.add(victim.stream_id)
        s.blocks.extend(self.pool.allocate(need))
        return True

    def _too_big(self, s: StreamState, positions: int) -> GenerationError:
        bs = self.config.block_size
        return GenerationError(f"stream {s.stream_id} needs {positions} cached positions, "
                               f"{blocks_needed(positions, bs)} KV blocks of {bs}, more than the whole pool of "
                               f"{self.pool.capacity}; give the stages more KV memory or ask for fewer tokens")

    def _preempt(self, s: StreamState) -> None:
        """Free a running stream's blocks; it waits at the front and later re-prefills its tokens
        (its own blocks, kept in the prefix cache, make that cheap while they last)."""
        self._release_blocks(s)
        self._running.remove(s)
        self._waiting.appendleft(s)
        s.preemptions += 1
        self.counters["preemptions"] += 1

    # -- outcomes --------------------------------------------------------------------------------

    def on_outcome(self, outcome: PagedOutcome, now: float) -> list[Action]:
        """Account for the last stage's answer to a step: advance, rewind, emit, finish. An outcome
        of a step this scheduler no longer knows (before a replay) is ignored."""
        flight = self._flights.pop(outcome.seq, None)
        if flight is None:
            return []
        if outcome.error is not None or not self.constraints.tracks_any:
            return self._account(flight.rows, outcome, now)
        self._settling = []  # streams ending in this outcome keep their grammar until it is settled
        try:
            actions = self._account(flight.rows, outcome, now)
            settled = self.constraints.settle(flight.plan, outcome, actions)  # grammars consume, logprobs attach
        finally:
            ended, self._settling = self._settling, None
        for sid in ended:
            self.constraints.forget(sid)
        actions = settled.actions
        for sid, end in settled.ended.items():  # a grammar's end (or a broken constraint): over now
            # not in flight any more: ends now (counted as finished or cancelled); ``end`` is what its consumer hears
            self.cancel(sid, end.reason if isinstance(end, Finished) else FinishReason.CANCELLED)
            actions.append(end)
        return actions

    def _account(self, rows: list[FlightRow], outcome: PagedOutcome, now: float) -> list[Action]:
        """:meth:`on_outcome` before the constraints: the rows advance, rewind, emit and finish."""
        for r in rows:
            for digest in r.computing:
                if self._computing.get(digest) == outcome.seq:
                    del self._computing[digest]
        problem = outcome.error or reply_problem(outcome, sum(r.sample for r in rows),
                                                   sum(r.sample for r in rows if r.want_logits))
        if problem is not None:
            actions: list[Action] = [FailOver(f"step {outcome.seq} failed: {problem}")]
            for r in rows:
                if r.void:
                    continue
                self._void_later(r.stream, outcome.seq)
                self._abandon(r.stream)
                if r.stream.cancelled:
                    actions.extend(self._end(r.stream, Finished(r.stream.stream_id, FinishReason.CANCELLED)))
            return actions
        actions = []
        at = logit_at = 0
        for r in rows:
            s = r.stream
            ids, probs = outcome.ids[at:at + r.sample], outcome.probs[at:at + r.sample]
            at += r.sample
            logits = None
            if r.want_logits:
                assert outcome.logits is not None
                logits = outcome.logits[logit_at:logit_at + r.sample]
                logit_at += r.sample
            if r.void:
                continue
            last = s.in_flight == outcome.seq  # else a later chunk of its prefill is still in flight
            s.copying = False
            if last:
                s.in_flight = None
            if r.sample:
                s.ahead = 0  # an answered row is its stream's last in flight
            else:
                s.ahead -= r.n
                self._advance(s, r.past + r.n)
            if s.cancelled:
                if last:
                    actions.extend(self._end(s, Finished(s.stream_id, FinishReason.CANCELLED)))
            elif r.sample:
                actions.extend(self._answer(s, r, ids, probs, logits, now))
        return actions

    def _answer(self, s: StreamState, r: FlightRow, ids: np.ndarray, probs: np.ndarray,
                logits: np.ndarray | None, now: float) -> list[Action]:
        verdict, token_probs = decide(s.request.sampling, s.rng, r.drafts, r.q, ids, probs, logits)
        s.last_drafted, s.last_accepted = len(r.drafts), verdict.accepted
        s.proposed_total += len(r.drafts)
        s.accepted_total += verdict.accepted
        self.counters["drafts_proposed"] += len(r.drafts)
        self.counters["drafts_accepted"] += verdict.accepted
        req, cfg = s.request, self.config
        actions: list[Action] = []
        finish = None
        for token, prob in zip(verdict.tokens, token_probs, strict=True):
            s.generated.append(token)
            s.tokens.append(token)
            self.counters["tokens"] += 1
            if s.first_token_at is None:
                s.first_token_at = now
            if not req.ignore_eos and (token in s.eos_ids or token in req.stop_token_ids):
                finish = FinishReason.STOP
            elif len(s.generated) >= req.max_new_tokens or len(s.tokens) >= cfg.context_length:
                finish = FinishReason.LENGTH
            actions.append(Emit(s.stream_id, TokenEvent(token, len(s.generated) - 1, prob, finish)))
            if finish is not None:
                break
        # Everything but the last emitted token is now cached: the row's fed tokens up to the last
        # accepted draft (rejected ones are rewound; accepted ones after a stop are dropped).
        self._advance(s, len(s.tokens) - 1)
        if finish is not None:
            actions.extend(self._end(s, Finished(s.stream_id, finish)))
        return actions

    def _advance(self, s: StreamState, cached: int) -> None:
        """The last stage answered: ``cached`` positions now hold KV. Newly full blocks join the
        prefix index; blocks beyond ``cached`` (rejected drafts) go back to the pool."""
        s.cached = cached
        if self.prefix is not None:
            bs = self.config.block_size
            while len(s.hashes) < cached // bs:
                i = len(s.hashes)
                digest = chain_hash(s.hashes[-1] if s.hashes else s.root, s.tokens[i * bs:(i + 1) * bs])
                s.hashes.append(digest)
                self.prefix.register_full(s.blocks[i], digest)
        self._trim(s)

    def _void_later(self, s: StreamState, seq: int) -> None:
        """Step ``seq`` of ``s`` failed: the later chunks of ``s`` in flight ran over KV that may be
        missing; their rows are void and the blocks they complete are no longer awaited."""
        for later, flight in self._flights.items():
            for r in flight.rows:
                if later > seq and r.stream is s and not r.void:
                    r.void = True
                    for digest in r.computing:
                        if self._computing.get(digest) == later:
                            del self._computing[digest]

    def _abandon(self, s: StreamState) -> None:
        """The steps ``s`` is in will not be answered: keep what completed steps put in its blocks.
        A prefix copy made by that step may be missing on some stage: only the shared full blocks count."""
        s.in_flight, s.ahead = None, 0
        if s.copying:
            s.cached -= s.cached % self.config.block_size
            s.copying = False
        self._trim(s)

    def _trim(self, s: StreamState) -> None:
        keep = blocks_needed(s.fed, self.config.block_size)  # chunks in flight keep theirs
        while len(s.blocks) > keep:
            self.pool.release(s.blocks.pop())

    # -- ending and replaying --------------------------------------------------------------------

    def _release_blocks(self, s: StreamState) -> None:
        """Give back every block of ``s`` (not in flight); its partial last block stays reusable."""
        bs = self.config.block_size
        self._trim(s)
        if self.prefix is not None and s.cached % bs and s.blocks:
            full = s.cached // bs
            parent = s.hashes[full - 1] if full else s.root
            self.prefix.register_partial(s.blocks[-1], parent, s.tokens[full * bs:s.cached])
        for block in reversed(s.blocks):  # the tail is evicted first: a prefix is only useful from its start
            self.pool.release(block)
        s.blocks, s.hashes, s.cached = [], [], 0

    def _end(self, s: StreamState, action: Finished | Failed) -> list[Action]:
        self._release_blocks(s)
        if s in self._running:
            self._running.remove(s)
        elif s in self._waiting:
            self._waiting.remove(s)
        self._streams.pop(s.stream_id, None)
        if self._settling is None:
            self.constraints.forget(s.stream_id)
        else:
            self._settling.append(s.stream_id)
        if isinstance(action, Failed):
            self.counters["failed"] += 1
        else:
            self.counters["cancelled" if action.reason is FinishReason.CANCELLED else "finished"] += 1
        return [action]

    def reset_for_replay(self) -> list[Action]:
        """The ring was lost: the new ring's pools are empty. Every stream drops its blocks (and
        the prefix index empties); running streams re-prefill ``prompt + generated`` from the next
        step on, in their order. Steps in flight are forgotten (their outcomes, if any, ignored).
        Streams past ``max_replays`` fail; cancelled streams finish."""
        self._flights.clear()
        self._computing.clear()
        self.pool.reset()
        if self.prefix is not None:
            self.prefix.reset()
        actions: list[Action] = []
        for s in list(self._running) + list(self._waiting):
            was_running = s in self._running
            s.blocks, s.hashes, s.cached, s.in_flight, s.ahead, s.copying = [], [], 0, None, 0, False
            if s.cancelled:
                actions.extend(self._end(s, Finished(s.stream_id, FinishReason.CANCELLED)))
            elif was_running:
                s.replays += 1
                self.counters["replays"] += 1
                if s.replays > self.config.max_replays:
                    actions.extend(self._end(s, Failed(s.stream_id, UnavailableError(
                        f"stream {s.stream_id} lost its stages {s.replays} times; giving up"))))
        return actions

    def fail_all(self, error: DeskfleetError) -> list[Action]:
        """End every stream with ``error`` (the ring is gone and no other comes): their blocks are
        freed and steps in flight forgotten."""
        self._flights.clear()
        self._computing.clear()
        actions: list[Action] = []
        for s in list(self._running) + list(self._waiting):
            self._abandon(s)
            actions.extend(self._end(s, Failed(s.stream_id, error)))
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
            "active_streams": float(len(self._running)),
            "waiting_requests": float(len(self._waiting)),
            "slots": float(self.config.max_streams),
            "sched_steps_in_flight": float(len(self._flights)),
            "sched_steps_total": float(c["steps"]),
            "sched_step_tokens_total": float(c["step_tokens"]),
            "sched_preemptions_total": float(c["preemptions"]),
            "sched_replays_total": float(c["replays"]),
            "sched_pipelined_chunks_total": float(c["pipelined"]),
            "prefix_hits_total": float(c["prefix_hits"]),
            "prefix_tokens_reused_total": float(c["prefix_tokens_reused"]),
            "prefix_block_copies_total": float(c["prefix_copies"]),
            "kv_blocks_total": float(self.pool.capacity),
            "kv_blocks_free": float(self.pool.free),
            "kv_blocks_used": float(self.pool.used),
            "kv_blocks_cached": float(self.pool.cached),
            "kv_blocks_evicted_total": float(self.pool.evictions),
        }
