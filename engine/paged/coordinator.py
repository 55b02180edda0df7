"""The paged coordinator: one loop that carries out what the batch scheduler decides.

Every step is one infer per stage for every stream taking part (continuous batching on
OpenVINO's PagedAttention): the pure :class:`~engine.paged.scheduler.BatchScheduler`
owns every stream's state and block table and composes each step; this module only moves
steps and outcomes between it and a :class:`~engine.paged.step.PagedPath`, the clients'
queues and the speculator. Read :meth:`BatchCoordinator._step` first: it is the whole engine.

Several steps are kept in flight at once (``lanes``; at least one per stage), each over streams
no other step in flight holds, so while stage 1 computes one micro-batch stage 0 computes the
next one.

Constrained output and log-probabilities (:attr:`BatchCoordinator.features`) are the scheduler's:
it asks its constraints for a step's masks and top-k before the step is sent and tells them the
accepted tokens with its verdict; this loop touches no grammar state.

One decode token's walk, in one direction: :meth:`BatchCoordinator.stream` adds the request to the
scheduler (with its grammar's matcher, built off the loop); :meth:`~BatchCoordinator._fill_lanes`
takes the speculator's drafts, the scheduler's next step and its masks, and hands the step to the
path; the stages answer on the path's queue; :meth:`~BatchCoordinator._step` gives the outcome to
the scheduler and carries out its actions (tokens to the clients' queues, ends, failovers).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import DeskfleetError
from engine.generation.generator import ModelCard, UnavailableError
from engine.generation.request import GenerationRequest, TokenEvent
from engine.generation.ring_report import RingReport, coordinator_report
from engine.paged.kv_pool import DEFAULT_KV_POOL_BYTES, pool_blocks_for
from engine.paged.scheduler import BatchScheduler, GrammarVocabulary  # the scheduler owns the grammars
from engine.paged.speculation import Speculator
from engine.paged.state import Action, Emit, Failed, FailOver, Finished, SchedulerConfig
from engine.paged.step import PagedOutcome, PagedPath
from engine.shards.manifest import Manifest, load_manifest
from engine.suppress import logged_suppress
from engine.tasks import start_task
from engine.wire.format import StreamId
from engine.wire.step_plan import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE

log = logging.getLogger(__name__)

_RATE_WINDOW_S = 10.0

# recover(broken_path, reason) -> a started path whose every stage answers (may be the same
# object, reconnected under a new session). Raising, or not returning within hold_timeout_s,
# fails the held streams.
PagedRecover = Callable[[PagedPath, str], Awaitable[PagedPath]]


@dataclass(frozen=True)
class StepTiming:
    """One answered (or failed) step as the coordinator saw it: monotonic send and answer times,
    its new tokens, answered rows and each stage's compute ms (what a benchmark's breakdown reads)."""

    seq: int
    sent_at: float
    answered_at: float
    tokens: int
    answered: int
    stage_ms: tuple[float, ...]
    failed: bool = False


@dataclass(frozen=True)
class RingHold:
    """Where the ring stands on failover, replaced whole at each change: serving (neither flag),
    ``recovering`` (streams held while ``recover`` works), ``down`` (the last failover failed, or
    there was nothing to fail over to; a repair may be ``recovering`` from it). ``detail`` and
    ``stage`` are what /health says meanwhile; ``cause`` what a failed failover was about (a
    request's repair attempt retells it)."""

    recovering: bool = False
    down: bool = False
    detail: str | None = None
    stage: int | None = None
    cause: str = ""

    @property
    def trouble(self) -> tuple[str, int | None] | None:
        """(detail, stage) while the ring recovers or is down; None while it serves."""
        return (self.detail, self.stage) if self.detail is not None else None


def block_size_for(device: str) -> int:
    """The PagedAttention block size of a device (the GPU plugin's is 16; implemented, untested here)."""
    return GPU_BLOCK_SIZE if device.upper().startswith("GPU") else CPU_BLOCK_SIZE


def paged_scheduler(manifest: Manifest, pool_blocks: int, block_size: int, *, slots: int = 16, max_waiting: int = 64,
                    token_budget: int = 256, prefill_chunk: int = 256, prefix_cache: bool = True,
                    grammar: GrammarVocabulary | None = None, fair_share: bool = True) -> BatchScheduler:
    """The scheduler of a paged ring serving ``manifest``'s model over a pool of ``pool_blocks``
    (``grammar``: its vocabulary for constrained output; ``fair_share``: off only to measure it)."""
    config = SchedulerConfig(block_size=block_size, pool_blocks=pool_blocks, max_streams=slots,
                             max_waiting=max_waiting, token_budget=token_budget, prefill_chunk=prefill_chunk,
                             context_length=manifest.model.max_position_embeddings, prefix_cache=prefix_cache,
                             fair_share=fair_share)
    return BatchScheduler(config, fingerprint=manifest.model.fingerprint, grammar=grammar)


class BatchCoordinator:
    """Implements :class:`engine.generation.generator.Generator` over a :class:`PagedPath`."""

    def __init__(self, path: PagedPath, model: ModelCard, scheduler: BatchScheduler, *, lanes: int | None = None,
                 speculation: Speculator | None = None, recover: PagedRecover | None = None,
                 step_timeout_s: float | None = None, hold_timeout_s: float = 60.0, ring_id: str = "default",
                 grammar: GrammarVocabulary | None = None):
        """``grammar``: the model's vocabulary for token masks (constrained output); without it
        only log-probabilities of the request features are served (see :attr:`features`)."""
        self.path = path
        self.ring_id = ring_id
        self._model = model
        self.scheduler = scheduler
        self.lanes = max(1, lanes if lanes is not None else path.num_stages)
        self.speculation = speculation
        self.recover = recover
        self.step_timeout_s = step_timeout_s
        self.hold_timeout_s = hold_timeout_s
        if grammar is not None:
            scheduler.use_grammar(grammar)
        self._queues: dict[StreamId, asyncio.Queue[TokenEvent | BaseException]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._failover: asyncio.Task | None = None  # the recovery running, if any
        self._hold = RingHold()  # serving, recovering or down
        self._counters: collections.Counter[str] = collections.Counter()
        self._token_times: collections.deque[float] = collections.deque()
        self._step_ms: collections.deque[float] = collections.deque(maxlen=256)
        self._step_rows: collections.deque[int] = collections.deque(maxlen=256)
        self._ttft: collections.deque[float] = collections.deque(maxlen=256)
        self.step_log: collections.deque[StepTiming] = collections.deque(maxlen=256)  # the latest steps

    @classmethod
    def local(cls, export_dir: Path | str, *, exact: bool = False, device: str = "CPU", num_threads: int | None = None,
              kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES, speculation: Speculator | None = None,
              **settings) -> BatchCoordinator:
        """A paged coordinator whose stages all run in this process; ``settings`` as
        :func:`paged_scheduler` (slots, max_waiting, token_budget, prefill_chunk, prefix_cache,
        fair_share)."""
        from engine.paged.stage import LocalPagedPath

        manifest = load_manifest(export_dir)
        block_size = block_size_for(device)
        pool = pool_blocks_for(manifest, kv_pool_bytes, block_size, precision="f32" if exact else None)
        path = LocalPagedPath.load(export_dir, pool, kv_pool_bytes, manifest=manifest, exact=exact, device=device,
                                   num_threads=num_threads)
        grammar = GrammarVocabulary.of_export(export_dir, manifest)
        return cls(path, ModelCard.from_manifest(manifest),
                   paged_scheduler(manifest, pool, block_size, grammar=grammar, **settings),
                   speculation=speculation, lanes=1)

    @property
    def model(self) -> ModelCard:
        return self._model

    @property
    def features(self) -> frozenset[str]:
        """The request features this coordinator honours beyond plain generation (keys of
        :data:`engine.api.openai_schema.NOT_YET_SERVED`): log-probabilities, and constrained output
        (``response_format``, a forced tool call) when it has the model's vocabulary."""
        return self.scheduler.features

    def use_grammar(self, vocabulary: GrammarVocabulary | None) -> None:
        """Constrain output with ``vocabulary`` from now on (None: refuse constrained requests);
        for whoever builds a coordinator without knowing the export (a fleet's helper)."""
        self.scheduler.use_grammar(vocabulary)

    @property
    def recovering(self) -> bool:
        """True while streams are held for a failover."""
        return self._hold.recovering

    # -- lifecycle ------------------------------------------------------------------------------

    async def async_start(self) -> None:
        await self.path.async_start()
        self._task = start_task(self._run(), name="deskfleet-batch-coordinator", logger=log)

    async def async_stop(self) -> None:
        """Fail every request still running, then close the path."""
        self._stopping = True
        error = UnavailableError("the coordinator is shutting down; retry on another instance")
        for stream_id in list(self._queues):
            self._deliver(stream_id, error)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        failover, self._failover = self._failover, None
        if failover is not None and not failover.done():  # a recovery must not redial a closed ring
            failover.cancel()
            with contextlib.suppress(asyncio.CancelledError), logged_suppress(log, "the cancelled failover"):
                await failover
        if self.speculation is not None:
            self.speculation.close()
        self.scheduler.close()
        await self.path.async_close()

    async def __aenter__(self) -> BatchCoordinator:
        await self.async_start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.async_stop()

    async def async_wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until no stream is running or waiting."""
        await asyncio.wait_for(self._idle.wait(), timeout)

    # -- the Generator protocol -----------------------------------------------------------------

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        if self._stopping or self._task is None or self._task.done():
            raise UnavailableError("the coordinator is not running")
        # A schema that does not compile is a GrammarError (400) before the request is queued.
        matcher = await self.scheduler.async_matcher(request.constraint) if request.constraint is not None else None
        stream_id = self.scheduler.add(request, self._model.eos_token_ids, time.perf_counter(), matcher)  # 429: full
        queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self._queues[stream_id] = queue
        self._idle.clear()
        self._wake.set()
        hold = self._hold
        if hold.down and self.recover is not None and hold.trouble is not None:
            self._fail_over(hold.cause, hold.stage)  # repair first: the request is held meanwhile
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish is not None:
                    finished = True
                    return
        finally:
            self._queues.pop(stream_id, None)
            if not finished:  # the consumer went away: the scheduler frees its blocks
                self._carry_out(self.scheduler.cancel(stream_id))
                self._wake.set()

    # -- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        results: asyncio.Task | None = None
        source: asyncio.Queue[PagedOutcome] | None = None  # the queue ``results`` waits on
        try:
            while True:
                await self._fill_lanes()
                if not self.scheduler.in_flight:
                    if self.scheduler.idle:
                        self._idle.set()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if results is None or source is not self.path.results:  # a failover may bring a new path
                    if results is not None:
                        results.cancel()
                    source = self.path.results
                    results = asyncio.ensure_future(source.get())
                waker = asyncio.ensure_future(self._wake.wait())
                timeout = self._time_left()
                done, _ = await asyncio.wait({results, waker}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                waker.cancel()
                self._wake.clear()
                if results in done:
                    outcome, results = results.result(), None
                    await self._step(outcome)
                elif not done:
                    self._on_overdue()
        finally:
            if results is not None:
                results.cancel()

    async def _fill_lanes(self) -> None:
        """Submit steps until every lane is busy or nothing is ready; each step takes at most its
        share of the running streams, so the lanes hold disjoint micro-batches of similar size."""
        while self.scheduler.in_flight < self.lanes and not self._hold.recovering and not self._stopping:
            drafts = await self._drafts()
            share = -(-max(1, self.scheduler.streams) // self.lanes) if self.lanes > 1 else None
            step, actions = self.scheduler.next_step(drafts, max_rows=share)
            self._carry_out(actions)
            if step is None:
                return
            step = await self.scheduler.async_masks(step)  # masks (off the loop) and top-k
            self.scheduler.sent(step.seq, time.monotonic())
            try:
                await self.path.async_submit(step)
            except DeskfleetError as exc:
                await self._step(PagedOutcome.failed(step.seq, f"sending a step failed: {exc}"))
                return

    async def _drafts(self) -> dict[int, tuple[tuple[int, ...], np.ndarray | None]]:
        """The speculator's drafts for the streams that may bring some (the scheduler cuts what the
        grammar refuses, the budget and the pool do not hold)."""
        if self.speculation is None:
            return {}
        drafts: dict[int, tuple[tuple[int, ...], np.ndarray | None]] = {}
        for subject in self.scheduler.wants_drafts():
            tokens, q = await self.speculation.async_propose(subject)
            if tokens:
                drafts[subject.stream_id] = (tokens, q)
        return drafts

    async def _step(self, outcome: PagedOutcome) -> None:
        """One outcome in: the scheduler's verdict out to the clients (and maybe a failover)."""
        sent = self.scheduler.flight(outcome.seq)
        if sent is None:
            log.debug("dropping the outcome of step %d (not in flight: a failover forgot it)", outcome.seq)
            return
        if outcome.error is None and self._hold.down and not self._hold.recovering:
            self._hold = RingHold()  # a step went round: the ring serves again
        now, answered = time.perf_counter(), time.monotonic()
        sent_at = sent.sent_at if sent.sent_at is not None else answered
        self._step_ms.append(1000 * (answered - sent_at))
        self.step_log.append(StepTiming(outcome.seq, sent_at, answered, sent.tokens, len(outcome.ids),
                                        outcome.stage_ms, outcome.error is not None))
        self._step_rows.append(len(outcome.ids))
        self._carry_out(self.scheduler.on_outcome(outcome, now))  # the verdict, grammars settled
        if self.speculation is not None:
            for sid in sent.offered:  # the drafts the step carried (budget or blocks may have cut them)
                subject = self.scheduler.stream(sid)
                if subject is not None:
                    self.speculation.observe(subject, subject.last_drafted, now)

    def _carry_out(self, actions: list[Action]) -> None:
        """Do what the scheduler decided: tokens to their consumers, ends, failovers."""
        for action in actions:
            match action:
                case Emit(stream_id=sid, event=event):
                    now = time.perf_counter()
                    self._token_times.append(now)
                    if event.index == 0:
                        state = self.scheduler.stream(sid)
                        if state is not None:
                            self._ttft.append(now - state.added_at)
                    self._deliver(sid, event)
                case Finished(stream_id=sid):
                    self._forget_drafter(sid)
                case Failed(stream_id=sid, error=error):
                    self._forget_drafter(sid)
                    self._deliver(sid, error)
                case FailOver(reason=reason):
                    self._fail_over(reason)

    def _forget_drafter(self, stream_id: StreamId) -> None:
        if self.speculation is not None:
            self.speculation.forget(stream_id)

    def _deliver(self, stream_id: StreamId, item: TokenEvent | BaseException) -> None:
        queue = self._queues.get(stream_id)
        if queue is not None:
            queue.put_nowait(item)

    # -- failover -------------------------------------------------------------------------------

    def _time_left(self) -> float | None:
        oldest = self.scheduler.oldest_sent_at() if self.step_timeout_s is not None else None
        if oldest is None or self.step_timeout_s is None:
            return None
        return max(0.0, oldest + self.step_timeout_s - time.monotonic())

    def _on_overdue(self) -> None:
        reason = f"a step got no reply within {self.step_timeout_s:.1f} s"
        self._fail_over(reason)

    def request_failover(self, reason: str, stage: int | None = None) -> None:
        """Fail over now, without waiting for a step timeout (e.g. the console heard that an agent
        paused, a supervisor saw ``stage``'s worker exit): ``reason`` is what /health says meanwhile."""
        self._fail_over(reason, stage)

    def _fail_over(self, reason: str, stage: int | None = None) -> None:
        if self._hold.recovering or self._stopping:
            return
        if self.recover is None:  # nothing to fail over to: every stream fails now
            self._hold = dataclasses.replace(self._hold, down=True, detail=reason, stage=stage)
            self._carry_out(self.scheduler.fail_all(UnavailableError(f"a stage stopped answering: {reason}")))
            return
        self._hold = dataclasses.replace(self._hold, recovering=True, detail=reason, stage=stage)
        self._failover = start_task(self._async_failover(reason), name="deskfleet-failover", logger=log)

    async def _async_failover(self, reason: str) -> None:
        """Hold every stream, get a working ring from ``recover``, and let the scheduler replay
        what each stream had fed (its blocks are gone with the old ring's pools)."""
        assert self.recover is not None
        log.warning("failing over: %s", reason)
        self._counters["failovers"] += 1
        self._carry_out(self.scheduler.reset_for_replay())  # steps in flight forgotten: late outcomes dropped by seq
        try:
            self.path = await asyncio.wait_for(self.recover(self.path, reason), self.hold_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure to recover ends the held streams
            detail = (str(exc) if isinstance(exc, DeskfleetError) else
                      f"no replacement was ready within {self.hold_timeout_s:.0f} s ({exc!r})")
            error = UnavailableError(f"a stage stopped answering ({reason}) and {detail}; retry when the fleet "
                                     "is back")
            stage = getattr(exc, "stage", None)
            stage = stage if stage is not None else self._hold.stage
            self._hold = RingHold(recovering=True, down=True, detail=f"{reason}; {detail}", stage=stage, cause=reason)
            self._carry_out(self.scheduler.fail_all(error))
            log.warning("failover failed: %s", detail)
        else:
            self._hold = RingHold(recovering=True)
            log.info("ring recovered; replaying the held streams")
        finally:
            self._hold = dataclasses.replace(self._hold, recovering=False)
            self._wake.set()

    # -- health ---------------------------------------------------------------------------------

    def ring_reports(self) -> tuple[RingReport, ...]:
        """This ring's state for /health and a router: recovering while streams are held, down
        when it cannot serve (not running, its last failover failed, its first hop is closed)."""
        running = self.scheduler.running
        alive = not (self._stopping or self._task is None or self._task.done())
        return (coordinator_report(self.ring_id, self._model.name, running=alive, recovering=self._hold.recovering,
                                   down=self._hold.down, trouble=self._hold.trouble, path=self.path, active=running,
                                   waiting=self.scheduler.streams - running),)

    # -- metrics --------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        now = time.perf_counter()
        while self._token_times and now - self._token_times[0] > _RATE_WINDOW_S:
            self._token_times.popleft()
        out = {
            "tokens_per_second": len(self._token_times) / _RATE_WINDOW_S,
            "ttft_seconds_avg": sum(self._ttft) / len(self._ttft) if self._ttft else 0.0,
            "stages": float(self.path.num_stages),
            "lanes": float(self.lanes),
            "failovers_total": float(self._counters["failovers"]),
            "step_ms_avg": sum(self._step_ms) / len(self._step_ms) if self._step_ms else 0.0,
            "step_answered_rows_avg": sum(self._step_rows) / len(self._step_rows) if self._step_rows else 0.0,
        }
        out.update(self.scheduler.metrics())
        out.update(self.path.stage_metrics())
        if self.speculation is not None:
            out.update(self.speculation.metrics())
        return out
