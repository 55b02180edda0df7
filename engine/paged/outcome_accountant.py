"""Accounting for the last stage's answer to a paged step (the heart of
:meth:`~engine.paged.scheduler.BatchScheduler.on_outcome`, before the grammars settle).

``cached`` advances here only, by the rows the last stage accepted; blocks the step brought
beyond that (rejected drafts, a failed step) go back to the pool (rewind), and newly full blocks
join the prefix index. An answered row's drafts are verified and its tokens sampled
(:mod:`engine.paged.reply`); a stream ends on a stop token, its length, or a cancel that waited
for its step. A step that fails (or whose reply is malformed) is a :class:`FailOver`: its streams
keep what completed steps put in their blocks, and the later chunks of their prefills in flight
are void (computed over KV that is missing).

Pure: it writes the scheduler's :class:`~engine.paged.stream_book.StreamBook` (lent by the
scheduler, its one owner) and returns the actions.
"""
from __future__ import annotations

import numpy as np

from engine.errors import GenerationError
from engine.generation.request import FinishReason, TokenEvent
from engine.paged.flight import FlightRow
from engine.paged.prefix_blocks import chain_hash
from engine.paged.reply import decide, reply_problem
from engine.paged.state import Action, Emit, Failed, FailOver, Finished, SchedulerConfig, StreamState
from engine.paged.step import PagedOutcome
from engine.paged.stream_book import StreamBook


class OutcomeAccountant:
    """The scheduler's outcome accounting: advance, rewind, verify, sample, emit, finish."""

    def __init__(self, config: SchedulerConfig, book: StreamBook):
        self.config = config
        self.book = book

    def account(self, rows: list[FlightRow], outcome: PagedOutcome, now: float) -> list[Action]:
        """The answer to the step of ``rows`` (its flight already popped), before the grammars settle:
        the rows advance, rewind, emit and finish."""
        for r in rows:
            for digest in r.computing:
                if self.book.computing.get(digest) == outcome.seq:
                    del self.book.computing[digest]
        problem = outcome.error or reply_problem(outcome, sum(r.sample for r in rows),
                                                   sum(r.sample for r in rows if r.want_logits))
        if problem is not None:
            actions: list[Action] = [FailOver(f"step {outcome.seq} failed: {problem}")]
            for r in rows:
                if r.void:
                    continue
                self._void_later(r.stream, outcome.seq)
                self.book.abandon(r.stream)
                if r.stream.cancelled:
                    actions.extend(self.book.end(r.stream, Finished(r.stream.stream_id, FinishReason.CANCELLED)))
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
                    actions.extend(self.book.end(s, Finished(s.stream_id, FinishReason.CANCELLED)))
            elif r.sample:
                actions.extend(self._answer(s, r, ids, probs, logits, now))
        return actions

    def _answer(self, s: StreamState, r: FlightRow, ids: np.ndarray, probs: np.ndarray,
                logits: np.ndarray | None, now: float) -> list[Action]:
        try:
            verdict, token_probs = decide(s.request.sampling, s.rng, r.drafts, r.q, ids, probs, logits, s.tokens,
                                          len(s.request.prompt_ids))
        except GenerationError as exc:  # this stream cannot go on (a bias beyond the logits, NaN logits)
            return self.book.end(s, Failed(s.stream_id, exc))
        s.last_drafted, s.last_accepted = len(r.drafts), verdict.accepted
        s.proposed_total += len(r.drafts)
        s.accepted_total += verdict.accepted
        counters = self.book.counters
        counters["drafts_proposed"] += len(r.drafts)
        counters["drafts_accepted"] += verdict.accepted
        req, cfg = s.request, self.config
        actions: list[Action] = []
        finish = None
        for token, prob in zip(verdict.tokens, token_probs, strict=True):
            s.generated.append(token)
            s.tokens.append(token)
            counters["tokens"] += 1
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
            actions.extend(self.book.end(s, Finished(s.stream_id, finish)))
        return actions

    def _advance(self, s: StreamState, cached: int) -> None:
        """The last stage answered: ``cached`` positions now hold KV. Newly full blocks join the
        prefix index; blocks beyond ``cached`` (rejected drafts) go back to the pool."""
        s.cached = cached
        prefix = self.book.prefix
        if prefix is not None:
            bs = self.config.block_size
            while len(s.hashes) < cached // bs:
                i = len(s.hashes)
                digest = chain_hash(s.hashes[-1] if s.hashes else s.root, s.tokens[i * bs:(i + 1) * bs])
                s.hashes.append(digest)
                prefix.register_full(s.blocks[i], digest)
        self.book.trim(s)

    def _void_later(self, s: StreamState, seq: int) -> None:
        """Step ``seq`` of ``s`` failed: the later chunks of ``s`` in flight ran over KV that may be
        missing; their rows are void and the blocks they complete are no longer awaited."""
        for later, flight in self.book.flights.items():
            for r in flight.rows:
                if later > seq and r.stream is s and not r.void:
                    r.void = True
                    for digest in r.computing:
                        if self.book.computing.get(digest) == later:
                            del self.book.computing[digest]
