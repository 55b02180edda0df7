"""The coordinator: admits requests into slots and keeps every active stream's step in flight.

One asyncio task reads replies from the :class:`StepPath`; each reply advances its stream
(:mod:`engine.coordinator.scheduler`) and immediately submits that stream's next step. With several streams
active, their steps interleave through the stages, so while stage 1 computes stream A's step,
stage 0 computes stream B's (micro-batching, paper §7). Requests join when a slot frees and
leave when they finish or are cancelled; a stream's output never depends on its batch-mates
because each has its own KV state on every stage and its own sampling generator.

Constrained output and log-probabilities (:attr:`Coordinator.features`): a stream with a
``constraint`` gets a grammar matcher when it arrives (built off the loop, from the model's
``tokenizer.json``); from then on its steps ask for logits and the stream's policy masks, picks
and ranks them (:mod:`engine.coordinator.scheduler`), so the stages need nothing new.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path

from engine.coordinator.constrained import GrammarVocabulary, StreamConstraints
from engine.coordinator.scheduler import (
    StreamState,
    apply_reply,
    apply_restore,
    fed_tokens,
    plan_capture,
    plan_restore,
    plan_step,
    reset_for_replay,
)
from engine.coordinator.speculation import Speculator
from engine.errors import DeskfleetError, GenerationError
from engine.generation.generator import ModelCard, OverloadedError, UnavailableError
from engine.generation.grammar_pool import check_mask_time, timed
from engine.generation.request import FinishReason, GenerationRequest, TokenEvent
from engine.generation.ring_report import RingReport, coordinator_report
from engine.shards.prefix_cache import PrefixIndex
from engine.shards.stage import LocalChain
from engine.shards.step_path import LocalPath, StepPath, StepResult
from engine.wire.format import StreamId

log = logging.getLogger(__name__)

_RATE_WINDOW_S = 10.0
MAX_FAILOVERS_PER_STREAM = 3

# recover(broken_path, reason) -> a started path whose every stage answers (may be the same
# object, reconnected). Raising, or not returning within hold_timeout_s, fails the streams.
Recover = Callable[[StepPath, str], Awaitable[StepPath]]


class Coordinator:
    """Implements :class:`engine.generation.generator.Generator` over a :class:`StepPath`."""

    def __init__(self, path: StepPath, model: ModelCard, *, slots: int = 4, max_waiting: int = 32,
                 prefill_chunk: int = 256, prefix_cache: bool = True, prefix_min_tokens: int = 16,
                 speculation: Speculator | None = None, restore_timeout_s: float = 10.0,
                 recover: Recover | None = None, step_timeout_s: float | None = None,
                 hold_timeout_s: float = 60.0, ring_id: str = "default", grammar: GrammarVocabulary | None = None):
        """``grammar``: the model's vocabulary for token masks (constrained output); without it
        only log-probabilities of the request features are served (see :attr:`features`)."""
        if slots < 1:
            raise DeskfleetError("a coordinator needs at least one slot")
        self.path = path
        self._model = model
        self.slots = slots
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.prefix = (PrefixIndex(min_length=prefix_min_tokens, fingerprint=model.fingerprint)
                       if prefix_cache else None)
        self.speculation = speculation
        self.restore_timeout_s = restore_timeout_s
        self.recover = recover
        self.step_timeout_s = step_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self._recovering = False
        self.ring_id = ring_id
        # why the ring is recovering or down (detail, stage or None); None while it serves
        self._trouble: tuple[str, int | None] | None = None
        self._cause = ""  # what the failed failover was about: a request's repair attempt retells it
        self._down = False  # the last failover failed (or a stage stopped answering with no hook)
        self._sent_at: dict[StreamId, float] = {}
        self._watchdog: asyncio.Task | None = None
        self._ids = itertools.count(1)
        self._active: dict[StreamId, StreamState] = {}
        self._waiting: collections.deque[StreamState] = collections.deque()
        self._queues: dict[StreamId, asyncio.Queue[TokenEvent | BaseException]] = {}
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._stopping = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._counters: collections.Counter[str] = collections.Counter()
        self._token_times: collections.deque[float] = collections.deque()
        self._ttft_sum = 0.0
        self._overhead_s = 0.0  # reply received -> next step submitted (policy, sampling, send)
        self._overhead_n = 0
        # builds the streams' grammar matchers (only that: the masks are the stream policy's business)
        self._grammar = StreamConstraints(grammar)

    @classmethod
    def local(cls, export_dir: Path | str, *, slots: int = 4, exact: bool = False, device: str = "CPU",
              num_threads: int | None = None, **kwargs) -> Coordinator:
        """A coordinator whose stages all run in this process."""
        chain = LocalChain.load(export_dir, exact=exact, device=device, num_threads=num_threads)
        kwargs.setdefault("grammar", GrammarVocabulary.of_export(export_dir, chain.manifest))
        return cls(LocalPath(chain), ModelCard.from_manifest(chain.manifest), slots=slots, **kwargs)

    @property
    def model(self) -> ModelCard:
        return self._model

    @property
    def features(self) -> frozenset[str]:
        """The request features this coordinator honours beyond plain generation (keys of
        :data:`engine.api.openai_schema.NOT_YET_SERVED`): log-probabilities, and constrained output
        (``response_format``, a forced tool call) when it has the model's vocabulary."""
        return self._grammar.features

    def use_grammar(self, vocabulary: GrammarVocabulary | None) -> None:
        """Constrain output with ``vocabulary`` from now on (None: refuse constrained requests)."""
        self._grammar.vocabulary = vocabulary

    # -- lifecycle ------------------------------------------------------------------------------

    async def async_start(self) -> None:
        await self.path.async_start()
        self._task = asyncio.create_task(self._run(), name="deskfleet-coordinator")
        if self.step_timeout_s is not None:
            self._watchdog = asyncio.create_task(self._async_watchdog(), name="deskfleet-step-watchdog")

    async def async_stop(self) -> None:
        """Fail every request still running, then close the path."""
        self._stopping = True
        for state in list(self._active.values()) + list(self._waiting):
            self._deliver(state, UnavailableError("the coordinator is shutting down; retry on another instance"))
        for task in (self._task, self._watchdog):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for task in list(self._background):
            task.cancel()
        await self.path.async_close()
        if self.speculation is not None:
            self.speculation.close()
        self._grammar.close()

    async def __aenter__(self) -> Coordinator:
        await self.async_start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.async_stop()

    # -- the Generator protocol -----------------------------------------------------------------

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        if self._stopping or self._task is None or (self._task.done() and not self._recovering):
            raise UnavailableError("the coordinator is not running")
        if len(self._active) >= self.slots and len(self._waiting) >= self.max_waiting:
            self._counters["rejected_overloaded"] += 1
            raise OverloadedError(
                f"all {self.slots} slots are busy and {len(self._waiting)} requests are waiting; retry shortly"
            )
        matcher = await self._grammar.async_matcher(request.constraint) if request.constraint is not None else None
        state = StreamState(StreamId(next(self._ids)), request, self._model.context_length,
                            frozenset(self._model.eos_token_ids), matcher=matcher)
        queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self._queues[state.stream_id] = queue
        self._waiting.append(state)
        self._counters["requests"] += 1
        if self._down and self.recover is not None and self._trouble is not None:
            self._start_failover(self._cause, self._trouble[1])  # repair first: the request waits meanwhile
        await self._admit()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish is not None:
                    return
        finally:
            self._queues.pop(state.stream_id, None)
            if state.finish is None:
                self._cancel(state)

    async def async_wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until no stream is active or waiting (end-of-stream captures included)."""
        await asyncio.wait_for(self._idle.wait(), timeout)

    def metrics(self) -> dict[str, float]:
        now = time.perf_counter()
        while self._token_times and now - self._token_times[0] > _RATE_WINDOW_S:
            self._token_times.popleft()
        first = self._counters["first_tokens"]
        out = {
            "requests_total": float(self._counters["requests"]),
            "requests_finished_total": float(self._counters["finished"]),
            "requests_cancelled_total": float(self._counters["cancelled"]),
            "requests_failed_total": float(self._counters["failed"]),
            "requests_rejected_total": float(self._counters["rejected_overloaded"]),
            "tokens_generated_total": float(self._counters["tokens"]),
            "tokens_per_second": len(self._token_times) / _RATE_WINDOW_S,
            "ttft_seconds_avg": self._ttft_sum / first if first else 0.0,
            "active_streams": float(len(self._active)),
            "waiting_requests": float(len(self._waiting)),
            "slots": float(self.slots),
            "stages": float(self.path.num_stages),
            "coordinator_overhead_ms_per_step": 1000 * self._overhead_s / self._overhead_n if self._overhead_n else 0.0,
            "prefix_hits_total": float(self._counters["prefix_hits"]),
            "prefix_fallbacks_total": float(self._counters["prefix_fallbacks"]),
            "prefix_tokens_reused_total": float(self._counters["prefix_tokens_reused"]),
            "prefix_captures_total": float(self._counters["prefix_captures"]),
            "failovers_total": float(self._counters["failovers"]),
        }
        out.update(self.path.stage_metrics())
        if self.speculation is not None:
            out.update(self.speculation.metrics())
        return out

    def ring_reports(self) -> tuple[RingReport, ...]:
        """This ring's state for /health and a router: recovering while streams are held, down
        when it cannot serve (not running, its last failover failed, its first hop is closed)."""
        alive = not (self._stopping or self._task is None or (self._task.done() and not self._recovering))
        return (coordinator_report(self.ring_id, self._model.name, running=alive, recovering=self._recovering,
                                   down=self._down, trouble=self._trouble, path=self.path,
                                   active=len(self._active), waiting=len(self._waiting)),)

    # -- the loop -------------------------------------------------------------------------------

    async def _admit(self) -> None:
        while self._waiting and len(self._active) < self.slots and not self._stopping and not self._recovering:
            state = self._waiting.popleft()
            if state.cancelled:
                continue
            self._active[state.stream_id] = state
            self._idle.clear()
            hit = (self.prefix.lookup(state.request.prompt_ids, self._model.fingerprint, state.request.cache_scope)
                   if self.prefix is not None else None)
            if hit is not None:
                step = plan_restore(state, hit)
                # A restore that does not come back in time is treated as failed; its late reply
                # carries an old sequence number and is dropped.
                asyncio.get_running_loop().call_later(self.restore_timeout_s, self._restore_overdue, state, step.seq)
                await self._send(state, step)
            else:
                await self._submit(state)

    async def _submit(self, state: StreamState) -> None:
        draft: tuple[int, ...] = ()
        q = None
        if self.speculation is not None and not state.prefilling and state.generated:
            draft, q = await self.speculation.async_propose(state)
        try:
            if state.matcher is None:
                step = plan_step(state, self.prefill_chunk, draft, q)
            else:  # the masks on the ring's mask thread; in flight meanwhile, so a cancel waits for the step
                state.in_flight = True
                step, took = await self._grammar.async_off_loop(timed, plan_step, state, self.prefill_chunk, draft, q)
                check_mask_time(took)
        except GenerationError as exc:  # the stream's grammar could not build its masks (or took too long)
            state.in_flight = False
            await self._fail(state, GenerationError(f"the output constraint failed: {exc}"))
            return
        await self._send(state, step)

    async def _send(self, state: StreamState, step) -> None:
        if self._recovering:
            state.in_flight = False  # replayed once the ring is back
            return
        self._sent_at[state.stream_id] = time.monotonic()
        try:
            await self.path.async_submit(step)
        except DeskfleetError as exc:
            state.in_flight = False
            if self.recover is not None:
                self._start_failover(f"sending a step failed: {exc}")
            else:
                await self._fail(state, exc)

    # -- failover -------------------------------------------------------------------------------

    async def _async_watchdog(self) -> None:
        """A step that has not come back within ``step_timeout_s`` means a stage stopped answering
        (crashed, killed, paused, link lost): fail over instead of hanging."""
        assert self.step_timeout_s is not None
        while True:
            await asyncio.sleep(min(0.5, self.step_timeout_s / 4))
            if self._recovering:
                continue
            now = time.monotonic()
            late = [s for s in self._active.values()
                    if s.in_flight and now - self._sent_at.get(s.stream_id, now) > self.step_timeout_s]
            if late:
                reason = f"stream {late[0].stream_id} got no reply within {self.step_timeout_s:.1f} s"
                if self.recover is not None:
                    self._start_failover(reason)
                else:
                    self._down, self._trouble = True, (reason, None)
                    for state in late:
                        await self._fail(state, UnavailableError(f"a stage stopped answering: {reason}"))

    @property
    def recovering(self) -> bool:
        """True while streams are held for a failover."""
        return self._recovering

    def request_failover(self, reason: str, stage: int | None = None) -> None:
        """Fail over now, without waiting for a step timeout (e.g. the console heard that an
        agent paused, a supervisor saw ``stage``'s worker exit). Ignored without a ``recover`` hook
        or while a failover is under way."""
        if self.recover is not None and self._task is not None:
            self._start_failover(reason, stage)

    def _start_failover(self, reason: str, stage: int | None = None) -> None:
        if self._recovering or self._stopping:
            return
        self._recovering = True
        self._trouble = (reason, stage)
        task = asyncio.get_running_loop().create_task(self._async_failover(reason), name="deskfleet-failover")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _async_failover(self, reason: str) -> None:
        """Hold every stream, get a working ring from ``recover``, rebuild each stream's KV there
        by replaying what it had fed, and carry on. Clients see a delay, never an error, unless
        no replacement comes within ``hold_timeout_s``."""
        assert self.recover is not None
        log.warning("failing over: %s", reason)
        self._counters["failovers"] += 1
        reader = self._task
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        for state in list(self._active.values()):
            if state.capturing is not None:  # finished: only its end-of-stream capture was lost
                state.capturing = None
                self._active.pop(state.stream_id, None)
                self._counters["finished"] += 1
            else:
                reset_for_replay(state)
        stale = await self._async_renumber()
        try:
            self.path = await asyncio.wait_for(self.recover(self.path, reason), self.hold_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure to recover ends the held streams
            self._recovering = False
            self._task = asyncio.create_task(self._run(), name="deskfleet-coordinator")
            # a named error from the hook explains itself; anything else is reported as it came
            detail = (str(exc) if isinstance(exc, DeskfleetError) else
                      f"no replacement was ready within {self.hold_timeout_s:.0f} s ({exc!r})")
            error = UnavailableError(f"a stage stopped answering ({reason}) and {detail}; retry when the fleet "
                                     "is back")
            stage = getattr(exc, "stage", None)
            held_stage = self._trouble[1] if self._trouble is not None else None
            stage = stage if stage is not None else held_stage
            self._down, self._cause, self._trouble = True, reason, (f"{reason}; {detail}", stage)
            held = list(self._active.values()) + list(self._waiting)  # every held request, not only the running
            self._waiting.clear()
            for state in held:
                await self._fail(state, error)
            return
        self._task = asyncio.create_task(self._run(), name="deskfleet-coordinator")
        self._recovering = False
        self._down, self._trouble = False, None
        log.info("ring recovered; replaying %d stream(s)", len(self._active))
        for stream_id in stale:  # again on the new ring, in case the old connection was already gone
            with contextlib.suppress(DeskfleetError, OSError):
                await self.path.async_release(stream_id)
        for state in list(self._active.values()):
            if state.failovers > MAX_FAILOVERS_PER_STREAM:
                await self._fail(state, UnavailableError(f"stream {state.stream_id} failed over "
                                                         f"{state.failovers} times; giving up"))
            elif state.cancelled:
                await self._retire(state, "cancelled")
            else:
                await self._submit(state)
        await self._admit()
        if not self._active and not self._waiting:
            self._idle.set()

    async def _async_renumber(self) -> list[StreamId]:
        """Give every held stream a new wire id; release the old ids on the old connection first.

        Frames sent before the failure may still sit in a surviving stage's queue and be computed
        after the ring is back; under a new id the replay never shares KV state with them. The
        Release goes out on the same connection behind them, so the stage drops their state once
        they are done. Returns the old ids."""
        stale = list(self._active)

        async def release_old() -> None:
            for stream_id in stale:
                await self.path.async_release(stream_id)

        with contextlib.suppress(DeskfleetError, OSError, TimeoutError):
            await asyncio.wait_for(release_old(), 2.0)
        for state in list(self._active.values()):
            old = state.stream_id
            state.stream_id = StreamId(next(self._ids))
            self._active[state.stream_id] = self._active.pop(old)
            if old in self._queues:
                self._queues[state.stream_id] = self._queues.pop(old)
            self._sent_at.pop(old, None)
            if self.speculation is not None:
                self.speculation.forget(old)
        return stale

    async def _run(self) -> None:
        while True:
            result = await self.path.results.get()
            state = self._active.get(result.stream_id)
            if state is None or result.seq != state.seq:
                log.debug("dropping a reply for stream %s seq %s", result.stream_id, result.seq)
                continue
            await self._on_reply(state, result)

    async def _on_reply(self, state: StreamState, result: StepResult) -> None:
        if state.restoring is not None:
            await self._on_restored(state, result)
            return
        if state.capturing is not None:
            state.in_flight = False
            if result.ack and self.prefix is not None:
                self.prefix.add(state.capturing, fed_tokens(state), state.request.cache_scope)
                self._counters["prefix_captures"] += 1
            await self._retire(state, "finished")
            return
        started = time.perf_counter()
        drafted = len(state.draft)
        if result.error is None and self._down and not self._recovering:
            self._down, self._trouble = False, None  # a step went round: the ring serves again
        if result.error is not None and self.recover is not None:
            state.in_flight = False
            self._start_failover(f"stage error on stream {state.stream_id}: {result.error}")
            return
        try:
            events = apply_reply(state, result)
        except GenerationError as exc:
            await self._fail(state, exc)
            return
        if self.speculation is not None and not state.prefilling:
            self.speculation.observe(state, drafted, started)
        for event in events:
            self._counters["tokens"] += 1
            self._token_times.append(started)
            if event.index == 0:
                self._counters["first_tokens"] += 1
                self._ttft_sum += (state.first_token_at or 0.0) - state.admitted_at
            self._deliver(state, event)
        if state.cancelled:
            await self._retire(state, "cancelled")
        elif (state.finish is not None and self.prefix is not None
              and state.layout.logical_len >= self.prefix.min_length):
            await self._send(state, plan_capture(state, self.prefix.new_id()))
        elif state.finish is not None:
            await self._retire(state, "finished")
        else:
            await self._submit(state)
            self._overhead_s += time.perf_counter() - started
            self._overhead_n += 1

    def _restore_overdue(self, state: StreamState, seq: int) -> None:
        if state.restoring is None or state.seq != seq or state.stream_id not in self._active:
            return
        state.seq += 1  # the late reply, if any, no longer matches
        task = asyncio.get_running_loop().create_task(
            self._on_restored(state, StepResult(state.stream_id, state.seq, error="restore timed out")))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_restored(self, state: StreamState, result: StepResult) -> None:
        hit = state.restoring
        assert hit is not None
        if apply_restore(state, result):
            self._counters["prefix_hits"] += 1
            self._counters["prefix_tokens_reused"] += hit.length
        else:  # a stage lost the capture: forget it, clear any partial restore, prefill cold
            log.info("prefix restore of capture %d failed (%s); prefilling cold", hit.capture_id, result.error)
            self._counters["prefix_fallbacks"] += 1
            if self.prefix is not None:
                self.prefix.forget(hit.capture_id)
            with contextlib.suppress(DeskfleetError):
                await self.path.async_release(state.stream_id)
        if state.cancelled:
            await self._retire(state, "cancelled")
        else:
            await self._submit(state)

    def _deliver(self, state: StreamState, item: TokenEvent | BaseException) -> None:
        queue = self._queues.get(state.stream_id)
        if queue is not None:
            queue.put_nowait(item)

    async def _fail(self, state: StreamState, exc: BaseException) -> None:
        log.warning("stream %s failed: %s", state.stream_id, exc)
        state.finish = FinishReason.CANCELLED
        self._deliver(state, exc)
        await self._retire(state, "failed")

    async def _retire(self, state: StreamState, outcome: str) -> None:
        """Free the stream's slot and its KV state on every stage, then admit the next request."""
        self._counters[outcome] += 1
        if self.speculation is not None:
            self.speculation.forget(state.stream_id)
        if self._active.pop(state.stream_id, None) is not None:
            with contextlib.suppress(DeskfleetError):
                await self.path.async_release(state.stream_id)
        await self._admit()
        if not self._active and not self._waiting:
            self._idle.set()

    def _cancel(self, state: StreamState) -> None:
        """The consumer went away: stop the stream now, or as soon as its step in flight returns."""
        state.cancelled = True
        if state.stream_id in self._active and not state.in_flight:
            task = asyncio.get_running_loop().create_task(self._retire(state, "cancelled"))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif state in self._waiting:
            self._waiting.remove(state)
            self._counters["cancelled"] += 1

