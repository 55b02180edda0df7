"""Constrained decoding and log-probabilities on the paged path: what each step asks, what each reply means.

The paged scheduler (:mod:`engine.paged.scheduler`) keeps one :class:`StreamConstraints` for its
model (the one place grammar state is updated, as vLLM's scheduler does; the static runtime keeps
its own). For every stream with a constraint (``response_format``,
a forced tool call) it holds a :class:`~engine.generation.grammar.GrammarMatcher`; for every stream
asking for ``logprobs`` it remembers k. Around each step it does two things, both pure bookkeeping:

- :meth:`StreamConstraints.annotate` puts on the scheduler's plan, for each answered row of a
  constrained stream, its allowed-token mask (a verify of K drafts gets K + 1 rows from
  :meth:`~engine.generation.grammar.GrammarMatcher.draft_masks`, which never advances the
  matcher), and the top-k count of streams asking for log-probabilities. The last stage then
  picks the top-1 among allowed tokens, returns masked logits to sampling streams and the top-k
  log-probabilities (log-softmax of the raw logits after the mask: docs/PROTOCOL.md).
- :meth:`StreamConstraints.settle` reads the scheduler's verdict (its :class:`Emit` actions, in
  order) against the reply: each emitted token is consumed by the stream's matcher (accepted
  drafts and the target's own token; a rejected draft was never consumed, so nothing is rolled
  back), its :class:`~engine.generation.request.TokenEvent` gets ``logprob``/``top_logprobs``, and
  a grammar that is complete with nothing left to add (``is_stopped``) ends the stream there with
  finish STOP, without spending a step on the end-of-sequence token.

The verdict itself needs no grammar: a greedy pick is the last stage's masked top-1, a sampling
stream draws from logits the last stage already masked (-inf: probability 0), and a draft token
the grammar refuses can never equal the masked target pick nor be kept by speculative sampling
(p = 0), so the scheduler's :func:`~engine.paged.reply.decide` stays right unchanged.

The chosen token's log-probability: a greedy stream's token is the row's top-1, so its rows ask
for ``top_k = max(k, 1)`` and the top-k section carries it; a sampling stream already holds the
row's masked logits, so its log-probability is computed from them (``top_k = k``, possibly 0).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from engine.errors import GenerationError
from engine.generation.grammar import (
    Grammar,
    GrammarError,
    GrammarMatcher,
    GrammarStateError,
    GrammarTokenizer,
    load_grammar_tokenizer,
)
from engine.generation.grammar_pool import (
    GrammarBudgetError,
    check_constraint_size,
    check_mask_time,
    grammar_pool,
)
from engine.generation.logprobs import log_softmax
from engine.generation.request import (
    Constraint,
    FinishReason,
    GenerationRequest,
    JsonConstraint,
    ToolCallConstraint,
)
from engine.generation.response_format import ToolCallTemplate, json_schema_grammar, tool_call_grammar
from engine.paged.state import Action, Emit, Failed, Finished
from engine.paged.step import PagedOutcome, PagedStep
from engine.wire.format import StreamId
from engine.wire.step_plan import StepPlan

# The request features a paged coordinator honours (keys of engine.api.openai_schema.NOT_YET_SERVED):
# log-probabilities always, the two grammar ones when it knows the model's tokenizer.
LOGPROBS = "logprobs"
GRAMMAR_FEATURES = frozenset({"response_format", "forced_tool_call"})
T = TypeVar("T")


class NoGrammarTokenizerError(GenerationError):
    """A constrained request reached a coordinator that was not given its model's tokenizer
    (``tokenizer.json``), so it cannot build token masks: the server must not offer the feature."""


# -- constraints to grammars ---------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def grammar_for(constraint: Constraint) -> Grammar:
    """The grammar a request's constraint compiles to (cached: one client sends one schema many
    times). Raises :class:`~engine.generation.grammar.GrammarError` naming the field at fault."""
    match constraint:
        case JsonConstraint(schema=None):
            return json_schema_grammar({"type": "object"}, strict=True, description="response_format json_object")
        case JsonConstraint(schema=text, name=name, strict=strict):
            schema = _json(text, "response_format.json_schema.schema")
            grammar = json_schema_grammar(schema, strict=strict, description="response_format.json_schema.schema")
            return Grammar(grammar.source, f"response_format json_schema {name!r}", grammar.warnings)
        case ToolCallConstraint(functions=functions, opening=opening, closing=closing):
            # The call's text as engine.generation.tool_calls writes and parses it:
            # opening {"name": "<name>", "arguments": <arguments>} closing
            calls = [ToolCallTemplate(f.name, _json(f.parameters, f"the parameters of function {f.name!r}"),
                                      before=f'{opening}{{"name": {json.dumps(f.name)}, "arguments": ',
                                      after=f"}}{closing}") for f in functions]
            return tool_call_grammar(calls)
    raise GrammarError(f"unknown constraint {type(constraint).__name__}")


def _json(text: str | None, field: str) -> Any:
    try:
        return json.loads(text or "")
    except ValueError as exc:
        raise GrammarError(f"{field} is not JSON: {exc}") from exc


# -- the model's vocabulary for masks ------------------------------------------------------------


@dataclass(frozen=True)
class GrammarVocabulary:
    """Where a model's :class:`~engine.generation.grammar.GrammarTokenizer` comes from: its
    ``tokenizer.json`` (or a directory holding one), its logits width (the last stage's V, the
    manifest's vocabulary size, which may exceed the tokenizer's) and its end-of-sequence ids.
    Built on first use (~0.4 s for 49,152 tokens), then cached per process."""

    tokenizer: Path
    logits_width: int
    eos_ids: tuple[int, ...]

    @classmethod
    def of_export(cls, export_dir: Path | str, manifest) -> GrammarVocabulary | None:
        """The vocabulary of an export (``manifest`` its :class:`~engine.shards.manifest.Manifest`),
        None when the export carries no ``tokenizer/tokenizer.json``."""
        path = Path(export_dir) / "tokenizer" / "tokenizer.json"
        if not path.is_file():
            return None
        model = manifest.model
        return cls(path, int(model.vocab_size), tuple(int(t) for t in model.eos_token_ids))

    def load(self) -> GrammarTokenizer:
        return load_grammar_tokenizer(self.tokenizer, logits_width=self.logits_width, eos_ids=self.eos_ids)


# -- per-stream state ----------------------------------------------------------------------------


@dataclass
class _Stream:
    request: GenerationRequest
    matcher: GrammarMatcher | None
    broken: GenerationError | None = None  # its matcher failed building a mask: the stream fails at its reply


@dataclass(frozen=True)
class Settled:
    """:meth:`StreamConstraints.settle`'s result: the actions to carry out (events with their
    log-probabilities; a stream's events after its grammar stopped dropped) and the streams the
    scheduler must end now, each with the action that reports it (Finished STOP or Failed)."""

    actions: list[Action]
    ended: dict[StreamId, Action]


class StreamConstraints:
    """The matchers and log-probability requests of one paged coordinator's streams.

    ``vocabulary`` None: constrained requests are refused (:class:`NoGrammarTokenizerError`);
    log-probabilities still work. One owner (the paged scheduler, on the coordinator's loop) calls everything; matchers
    are built on the process's grammar workers (:meth:`async_matcher`) and a step's masks on this
    ring's mask thread (:meth:`async_annotate`), while the loop waits for nothing.
    """

    def __init__(self, vocabulary: GrammarVocabulary | None = None):
        self.vocabulary = vocabulary
        self._streams: dict[StreamId, _Stream] = {}
        self._masker: concurrent.futures.ThreadPoolExecutor | None = None  # this ring's mask thread

    @property
    def features(self) -> frozenset[str]:
        """The request features served (see :data:`GRAMMAR_FEATURES`)."""
        return frozenset({LOGPROBS}) | (GRAMMAR_FEATURES if self.vocabulary is not None else frozenset())

    # -- streams in and out ------------------------------------------------------------------------

    def build_matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for ``constraint``, built here (a worker's job: see :meth:`async_matcher`).
        GrammarError (a 400) for a schema that does not compile, NoGrammarTokenizerError when this
        coordinator has no tokenizer for masks."""
        vocabulary = self._vocabulary_or_refuse()
        return vocabulary.load().matcher(grammar_for(constraint))

    async def async_matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A matcher for ``constraint`` from the process's grammar pool (off the loop, bounded: see
        :mod:`engine.generation.grammar_pool`). Its size budget is checked first, here; then
        GrammarBudgetError (400) past its time budget, GrammarBusyError (429) when the pool or the
        caller's share of it is full, GrammarError (400) for a schema that does not compile."""
        vocabulary = self._vocabulary_or_refuse()
        pool = grammar_pool()
        check_constraint_size(constraint, pool.budget)
        return await pool.async_matcher((vocabulary, constraint),
                                        lambda: vocabulary.load().matcher(grammar_for(constraint)))

    def _vocabulary_or_refuse(self) -> GrammarVocabulary:
        if self.vocabulary is None:
            raise NoGrammarTokenizerError("this server cannot constrain output: its coordinator was started "
                                          "without the model's tokenizer.json")
        return self.vocabulary

    def track(self, stream_id: StreamId, request: GenerationRequest, matcher: GrammarMatcher | None) -> None:
        """Follow a stream added to the scheduler (nothing to do without a matcher or logprobs)."""
        if matcher is not None or request.logprobs is not None:
            self._streams[stream_id] = _Stream(request, matcher)

    @property
    def tracks_any(self) -> bool:
        """Some stream has a matcher or asks for log-probabilities (else a step needs nothing from here)."""
        return bool(self._streams)

    def forget(self, stream_id: StreamId) -> None:
        self._streams.pop(stream_id, None)

    def matcher(self, stream_id: StreamId) -> GrammarMatcher | None:
        entry = self._streams.get(stream_id)
        return entry.matcher if entry is not None else None

    def close(self) -> None:
        self._streams.clear()
        self.close_mask_thread()

    def close_mask_thread(self) -> None:
        """Stop the mask thread (a later step starts another)."""
        if self._masker is not None:
            self._masker.shutdown(wait=True)
            self._masker = None

    # -- before a step -----------------------------------------------------------------------------

    def allowed_drafts(self, stream_id: StreamId, drafts: Sequence[int]) -> int:
        """How many of a drafter's ``drafts`` the stream's grammar allows in a row (all of them for
        a free stream): the ones after would only be rejected (the target's masked pick cannot be a
        refused token), so the coordinator does not send them."""
        entry = self._streams.get(stream_id)
        if entry is None or entry.matcher is None or entry.broken is not None or not drafts:
            return len(drafts)
        return int(entry.matcher.llg.validate_tokens([int(t) for t in drafts]))

    async def async_annotate(self, step: PagedStep) -> PagedStep:
        """:meth:`annotate` on this ring's mask thread (llguidance drops the GIL while it computes a
        mask), so the event loop serves every other client meanwhile. Only the stream's own matchers
        are touched there: the loop neither settles nor drafts for a step it has not sent yet."""
        if not self._streams or not any(self._constrained(row) for row in step.plan.rows):
            return self.annotate(step)  # top-k counts only: nothing worth a thread hop
        return await self.async_off_loop(self.annotate, step)

    async def async_off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on this ring's mask thread (one per coordinator: a ring's steps are
        sequential, so its masks are too; other rings' masks run on theirs)."""
        if self._masker is None:
            self._masker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deskfleet-masks")
        return await asyncio.get_running_loop().run_in_executor(self._masker, work, *args)

    def _constrained(self, row) -> bool:
        entry = self._streams.get(StreamId(row.stream_id))
        return entry is not None and entry.matcher is not None and bool(row.sample)

    def annotate(self, step: PagedStep) -> PagedStep:
        """``step`` with masks and top-k counts on the answered rows of the streams followed here
        (the same step when none takes part). A row's drafts are the last ``sample - 1`` of its fed
        tokens; its masks are uint32 [sample, W].

        A stream whose masks for this step took longer than the grammar pool's ``mask_budget_s``
        fails at its reply (GrammarBudgetError naming the budget): its grammar would slow every
        step of the ring it shares."""
        if not self._streams:
            return step
        rows, changed, begin = [], False, 0
        for row in step.plan.rows:
            entry = self._streams.get(StreamId(row.stream_id))
            end = begin + row.new_tokens
            if entry is None or not row.sample:
                rows.append(row)
                begin = end
                continue
            mask = None
            if entry.matcher is not None and entry.broken is None:
                drafts = [int(t) for t in step.token_ids[end - row.sample + 1:end]]
                started = time.monotonic()
                try:
                    mask = entry.matcher.draft_masks(drafts) if drafts else entry.matcher.mask()[None, :]
                except GrammarStateError as exc:  # the row goes unmasked; its reply fails the stream
                    entry.broken = GenerationError(f"the output constraint failed: {exc}")
                try:
                    check_mask_time(time.monotonic() - started)
                except GrammarBudgetError as exc:
                    entry.broken = entry.broken or exc
            rows.append(dataclasses.replace(row, mask=mask, top_k=_top_k(entry.request, row.want_logits)))
            changed = True
            begin = end
        if not changed:
            return step
        return PagedStep(step.seq, dataclasses.replace(step.plan, rows=tuple(rows)), step.token_ids)

    # -- after a step ------------------------------------------------------------------------------

    def settle(self, plan: StepPlan, outcome: PagedOutcome, actions: Sequence[Action]) -> Settled:
        """Follow the scheduler's verdict on ``outcome`` (the reply to a step of ``plan``): consume
        each emitted token, attach its log-probabilities, end the streams whose grammar stopped.

        A stream's i-th Emit of this outcome is the token its i-th answered row chose (accepted
        drafts, then the target's own token), so the reply's row of that token is the stream's
        first answered row + i."""
        if not self._streams or outcome.error is not None:
            return Settled(list(actions), {})
        first_row, first_logit, at, logit_at = {}, {}, 0, 0
        for row in plan.rows:
            first_row[StreamId(row.stream_id)] = at
            at += row.sample
            if row.want_logits:
                first_logit[StreamId(row.stream_id)] = logit_at
                logit_at += row.sample
        emitted: dict[StreamId, int] = {}
        out: list[Action] = []
        ended: dict[StreamId, Action] = {}
        for action in actions:
            if not isinstance(action, Emit) or action.stream_id not in self._streams:
                out.append(action)
                continue
            sid = action.stream_id
            if sid in ended:
                continue  # tokens after the grammar's end (an accepted draft past it) are not the answer
            i = emitted.get(sid, 0)
            emitted[sid] = i + 1
            entry = self._streams[sid]
            try:
                event = self._event(entry, action, outcome, first_row[sid] + i,
                                    first_logit.get(sid, -1) + i if sid in first_logit else None)
            except GenerationError as exc:
                ended[sid] = Failed(sid, exc)
                continue
            if event.finish is None and entry.matcher is not None and entry.matcher.is_stopped:
                event = dataclasses.replace(event, finish=FinishReason.STOP)
                ended[sid] = Finished(sid, FinishReason.STOP)
            out.append(Emit(sid, event))
        return Settled(out, ended)

    def _event(self, entry: _Stream, action: Emit, outcome: PagedOutcome, row: int, logit_row: int | None):
        event = action.event
        if entry.broken is not None:
            raise entry.broken
        if entry.matcher is not None:
            try:
                entry.matcher.consume([event.token_id])
            except GrammarStateError as exc:
                raise GenerationError(f"the last stage chose token {event.token_id}, which the request's "
                                      f"constraint does not allow (was the step's mask applied?): {exc}") from exc
        k = entry.request.logprobs
        if k is None:
            return event
        logprob, top = _logprobs(event.token_id, k, outcome, row, logit_row)
        return dataclasses.replace(event, logprob=logprob, top_logprobs=top)


def _top_k(request: GenerationRequest, has_logits: bool) -> int:
    """The top-k a stream's answered rows ask for: k, and at least 1 when the chosen token's
    log-probability must come from the top-k section (no logits to compute it from)."""
    if request.logprobs is None:
        return 0
    return request.logprobs if has_logits else max(request.logprobs, 1)


def _logprobs(token: int, k: int, outcome: PagedOutcome, row: int, logit_row: int | None
              ) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(the chosen token's log-probability, the k likeliest (id, log-probability), best first)
    from row ``row`` of the reply (``logit_row``: that row's logits, when the stream has them)."""
    top: tuple[tuple[int, float], ...] = ()
    ids = lps = None
    if outcome.top_ids is not None and outcome.top_logprobs is not None:
        ids, lps = outcome.top_ids[row], outcome.top_logprobs[row]
        top = tuple((int(t), float(lp)) for t, lp in zip(ids[:k], lps[:k], strict=True) if t >= 0)
    elif k or logit_row is None:
        raise GenerationError("the last stage answered without the top-k log-probabilities the step asked for; "
                              "its workers may be older than this coordinator (protocol 4)")
    if logit_row is not None and outcome.logits is not None:
        return float(log_softmax(outcome.logits[logit_row])[token]), top
    assert ids is not None and lps is not None
    hit = np.flatnonzero(ids == token)
    if hit.size:
        return float(lps[hit[0]]), top
    if token == int(outcome.ids[row]):  # the top-1 in a tie the top-k broke the other way: same value
        return float(lps[0]), top
    raise GenerationError(f"token {token} is neither the top-1 nor among the top-k of its row, and its "
                          "logits were not returned")
