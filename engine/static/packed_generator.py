"""Packed serving behind the OpenAI API: a :class:`~engine.generation.generator.Generator` over static stages.

Requests share the slots of a static (NPU-target) export: each inference carries decode rows of
every running request and prefill chunks of new ones (:mod:`engine.static.slot_scheduler` decides).
Where the stages run is a :class:`StaticBackend`: in this process (:class:`LocalStatic`) or in a
ring of packed stage workers (:class:`RingStatic`, Packed frames out, each row's top-1 back).

Static exports decode greedily: the last stage returns top-1 ids, so sampling parameters other
than greedy are served greedily (the model card says so). A request with a constraint or asking
for ``logprobs`` (:attr:`PackedGenerator.features`) makes each step that samples its row ask the
stages for every row's logits instead, and its token is chosen here (:mod:`engine.static.packed_choice`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.errors import GenerationError
from engine.generation.generator import ModelCard, OverloadedError, UnavailableError
from engine.generation.request import FinishReason, GenerationRequest, TokenEvent
from engine.static.packed_choice import MatcherSource, RowAsk, RowChoice, choose_rows
from engine.static.packed_ring import PackedReply, PackedRingPath
from engine.static.packed_stage import StaticChain
from engine.static.packing import SlotGeometry
from engine.static.slot_scheduler import (
    SlotRequest,
    admit,
    admit_queued,
    empty_slots,
    plan,
    retire,
    update,
)
from engine.suppress import logged_suppress
from engine.tasks import start_task
from engine.wire.format import StreamId
from engine.wire.plan_frame import PlanFrame

log = logging.getLogger(__name__)

MAX_QUEUE = 64  # requests waiting for a slot before new ones are answered 429
LOGPROBS = "logprobs"  # the request feature served without a grammar (engine.api.openai_schema.NOT_YET_SERVED)


class StaticBackend(Protocol):
    """Runs one packed inference on every stage and returns each row's top-1 id."""

    async def async_start(self) -> None: ...

    async def async_top1(self, frame: PlanFrame, tokens: np.ndarray) -> np.ndarray:
        """int64 [S]: the greedy next token of every row (idle rows included; ignore them)."""
        ...

    async def async_logits(self, frame: PlanFrame, tokens: np.ndarray) -> np.ndarray:
        """float32 [S, V]: every row's logits (for requests that ask more than the top-1)."""
        ...

    async def async_reset(self, failed: bool = False) -> None:
        """Empty every slot on every stage (the next inference starts a new session); ``failed``:
        the session ended in an error, so the stages may have restarted."""
        ...

    async def async_close(self) -> None: ...


class LocalStatic:
    """Every stage of a static export in this process, on one executor thread."""

    def __init__(self, chain: StaticChain):
        self.chain = chain
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deskfleet-static")

    async def async_start(self) -> None:
        pass

    def _top1(self, frame: PlanFrame, tokens: np.ndarray) -> np.ndarray:
        return self.chain.step(frame, tokens)[0].argmax(axis=-1).astype(np.int64)

    def _logits(self, frame: PlanFrame, tokens: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.chain.step(frame, tokens)[0], dtype=np.float32)

    async def async_top1(self, frame: PlanFrame, tokens: np.ndarray) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._top1, frame, tokens)

    async def async_logits(self, frame: PlanFrame, tokens: np.ndarray) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._logits, frame, tokens)

    async def async_reset(self, failed: bool = False) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self.chain.reset)

    async def async_close(self) -> None:
        self._executor.shutdown(wait=True)


class RingStatic:
    """A ring of packed stage workers, reached through a :class:`~engine.static.packed_ring.PackedRingPath`.

    Each session is one stream id; ``async_reset`` releases it on every stage and opens the next.
    """

    def __init__(self, path: PackedRingPath, step_timeout_s: float = 120.0):
        self.path = path
        self.step_timeout_s = step_timeout_s
        self.session = StreamId(1)
        self._seq = 0
        self._redial = False

    async def async_start(self) -> None:
        await self.path.async_start()

    async def async_top1(self, frame: PlanFrame, tokens: np.ndarray) -> np.ndarray:
        result = await self._async_answer(frame, tokens, want_logits=False)
        if result.ids is None or result.ids.shape != (frame.rows,):
            raise UnavailableError(f"the static ring answered step {result.seq} with no top-1 per row")
        return result.ids

    async def async_logits(self, frame: PlanFrame, tokens: np.ndarray) -> np.ndarray:
        result = await self._async_answer(frame, tokens, want_logits=True)
        if result.logits is None or result.logits.shape[0] != frame.rows:
            raise UnavailableError(f"the static ring answered step {result.seq} without the logits of its "
                                   f"{frame.rows} rows; its workers may be older than this coordinator")
        return result.logits

    async def _async_answer(self, frame: PlanFrame, tokens: np.ndarray, *, want_logits: bool) -> PackedReply:
        if self._redial or not self.path.connected:  # a session failed: the first stage may be a new process
            await self.path.async_reconnect()
            self._redial = False
        self._seq += 1
        seq = self._seq
        await self.path.async_submit_packed(self.session, seq, frame, tokens, want_logits=want_logits)
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UnavailableError(f"the static ring did not answer step {seq} within {self.step_timeout_s:.0f} s")
            try:
                result = await asyncio.wait_for(self.path.results.get(), remaining)
            except TimeoutError:
                continue
            if (result.stream_id, result.seq) != (self.session, seq):
                log.debug("static ring: dropping a stale reply %s/%s", result.stream_id, result.seq)
                continue
            if result.error is not None:
                raise UnavailableError(f"the static ring failed: {result.error}")
            return result

    async def async_reset(self, failed: bool = False) -> None:
        with logged_suppress(log, "releasing the session on the ring (a ring that is down holds nothing)"):
            await self.path.async_release(self.session)
        self.session = StreamId(self.session + 1)
        self._redial = self._redial or failed

    async def async_close(self) -> None:
        await self.path.async_close()

    def stage_metrics(self) -> dict[str, float]:
        """The ring's figures: its round trip and every stage's median compute ms per step."""
        return self.path.stage_metrics()


@dataclass
class _Waiting:
    request: SlotRequest
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stops: frozenset[int] = frozenset()
    produced: int = 0
    ask: RowAsk | None = None  # a constraint or logprobs: its rows are chosen from logits


class PackedGenerator:
    """Greedy packed serving of many requests on the slots of one static export."""

    def __init__(self, backend: StaticBackend, card: ModelCard, geometry: SlotGeometry,
                 row_options: tuple[int, ...], *, max_queue: int = MAX_QUEUE, grammar: MatcherSource | None = None):
        """``grammar``: builds the requests' grammar matchers (constrained output; the caller gives
        an engine.paged.constraints.StreamConstraints over the model's vocabulary); without it
        only log-probabilities of the request features are served (see :attr:`features`)."""
        self.backend = backend
        self.card = card
        self.geometry = geometry
        self.row_options = row_options
        self.max_queue = max_queue
        self.slots = empty_slots(geometry)
        self.queue: list[SlotRequest] = []
        self._requests: dict[int, _Waiting] = {}
        self._next_id = 1
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._session_open = False
        self._cancelled: set[int] = set()
        self.steps = 0
        self.tokens = 0
        self.rows_used = 0
        self.logit_steps = 0  # steps that asked the stages for logits
        self._grammar = grammar

    @property
    def model(self) -> ModelCard:
        return self.card

    @property
    def features(self) -> frozenset[str]:
        """The request features served beyond plain generation (keys of
        :data:`engine.api.openai_schema.NOT_YET_SERVED`): log-probabilities, and constrained output
        when this generator has the model's vocabulary."""
        return frozenset({LOGPROBS}) | (self._grammar.features if self._grammar is not None else frozenset())

    async def __aenter__(self) -> PackedGenerator:
        await self.async_start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.async_stop()

    async def async_start(self) -> None:
        """Reach the stages (a ring: dial its first stage) and start serving."""
        await self.backend.async_start()
        self._loop_task = start_task(self._run(), name="deskfleet-packed-loop", logger=log)

    async def async_stop(self) -> None:
        """Fail every request still waiting or running, then close the stages (a ring: its path)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for waiting in self._requests.values():
            waiting.events.put_nowait(UnavailableError("the server is stopping"))
        await self.backend.async_close()
        if self._grammar is not None:
            self._grammar.close()

    def _slot_request(self, request: GenerationRequest) -> tuple[SlotRequest, frozenset[int]]:
        if request.want_logits:
            raise GenerationError("a static (NPU-target) export returns top-1 tokens only, not logits")
        if request.sampling.penalised:
            raise GenerationError("a static (NPU-target) export decodes from its last stage's top-1 and applies no "
                                  "penalties or logit_bias; leave them out or serve the model from a CPU/GPU export")
        stops = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos
                                                      else frozenset(self.card.eos_token_ids))
        slot_request = SlotRequest(self._next_id, tuple(request.prompt_ids), request.max_new_tokens, stops)
        admit(empty_slots(self.geometry), slot_request, self.geometry)  # a prompt no slot can hold: refused now
        return slot_request, stops

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        if len(self.queue) >= self.max_queue:
            raise OverloadedError(f"{len(self.queue)} requests are waiting for a slot; retry later")
        slot_request, stops = self._slot_request(request)
        matcher = None
        if request.constraint is not None:
            if self._grammar is None:
                raise GenerationError("this server cannot constrain output: its generator was started without "
                                      "the model's tokenizer.json")
            matcher = await self._grammar.async_matcher(request.constraint)
        ask = RowAsk(matcher, request.logprobs) if matcher is not None or request.logprobs is not None else None
        self._next_id += 1
        waiting = self._requests[slot_request.request_id] = _Waiting(slot_request, stops=stops, ask=ask)
        self.queue.append(slot_request)
        self._wake.set()
        finished = False
        try:
            while not finished:
                event = await waiting.events.get()
                if isinstance(event, BaseException):
                    raise event
                finished = event.finish is not None
                yield event
        finally:
            self._requests.pop(slot_request.request_id, None)
            if not finished:  # cancelled by the consumer: free its slot (or its place in the queue)
                self.queue = [r for r in self.queue if r.request_id != slot_request.request_id]
                self._cancelled.add(slot_request.request_id)  # applied between steps, never mid-step

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while await self._step():
                    pass
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every request in flight fails with the reason; new ones may retry
                log.error("packed serving failed: %s", exc)
                await self._async_fail_all(exc)

    async def _async_fail_all(self, exc: Exception) -> None:
        error = exc if isinstance(exc, UnavailableError) else UnavailableError(f"the static stages failed: {exc}")
        for waiting in self._requests.values():
            waiting.events.put_nowait(error)
        self.queue.clear()
        self._cancelled.clear()
        self.slots = empty_slots(self.geometry)
        self._session_open = False
        with logged_suppress(log, "resetting the static stages after a failure"):
            await self.backend.async_reset(failed=True)

    async def _step(self) -> bool:
        """One inference; False when there is nothing to do (the session is then closed)."""
        for request_id in self._cancelled:
            self.slots = retire(self.slots, request_id, self.geometry)
        self._cancelled.clear()
        self.slots = admit_queued(self.slots, self.queue, self.geometry)
        schedule = plan(self.slots, self.row_options)
        if schedule is None:
            if self._session_open:  # idle: free every stage's slots (a new session starts on the next request)
                await self.backend.async_reset()
                self.slots = empty_slots(self.geometry)
                self._session_open = False
            return False
        self._session_open = True
        row_of = {self.slots[k].request.request_id: row for k, row in schedule.sample.items()}  # type: ignore[union-attr]
        asks = {row: self._ask(rid) for rid, row in row_of.items()}
        choices: dict[int, RowChoice] = {}
        if any(a is not None for a in asks.values()):
            self.logit_steps += 1
            logits = await self.backend.async_logits(schedule.frame, schedule.tokens)
            if self._grammar is not None and any(a is not None and a.matcher is not None for a in asks.values()):
                choices = await self._grammar.async_off_loop(choose_rows, logits, asks)  # masks off the loop
            else:
                choices = choose_rows(logits, asks)
            sampled = {row: c.token for row, c in choices.items()}
        else:
            ids = await self.backend.async_top1(schedule.frame, schedule.tokens)
            sampled = {row: int(ids[row]) for row in schedule.sample.values()}
        self.slots, events = update(self.slots, schedule, sampled, self.geometry)
        self.steps += 1
        self.rows_used += int((schedule.frame.slot >= 0).sum())
        for e in events:
            waiting = self._requests.get(e.request_id)
            if waiting is None:
                continue  # cancelled while its step ran
            choice = choices.get(row_of[e.request_id])
            finish = None
            if e.finished:
                finish = FinishReason.STOP if e.token in waiting.stops else FinishReason.LENGTH
            elif choice is not None and choice.stopped:  # the grammar is complete: nothing may follow
                finish = FinishReason.STOP
                self.slots = retire(self.slots, e.request_id, self.geometry)
            waiting.events.put_nowait(TokenEvent(e.token, waiting.produced, None, finish,
                                                 choice.logprob if choice else None,
                                                 choice.top_logprobs if choice else ()))
            waiting.produced += 1
            self.tokens += 1
        return True

    def _ask(self, request_id: int) -> RowAsk | None:
        waiting = self._requests.get(request_id)
        return waiting.ask if waiting is not None else None

    def metrics(self) -> dict[str, float]:
        busy = sum(1 for s in self.slots if s.request is not None)
        return {"packed_steps_total": float(self.steps), "generated_tokens_total": float(self.tokens),
                "packed_slots_busy": float(busy), "packed_slots": float(self.geometry.slots),
                "queue_depth": float(len(self.queue)), "packed_logit_steps_total": float(self.logit_steps),
                "packed_rows_per_step_avg": self.rows_used / self.steps if self.steps else 0.0,
                **(self.backend.stage_metrics() if isinstance(self.backend, RingStatic) else {})}
