"""Where the coordinator's steps run: a :class:`StepPath`.

The coordinator decides *what* each stream computes next; a path carries the step through the
stages and hands back the last stage's reply. :class:`LocalPath` runs every stage in this
process (one PC); :class:`engine.coordinator.ring.RingPath` sends steps around a ring of stage workers.
Both reply the same way (:func:`last_stage_top1` or :func:`last_stage_logits`), so the
coordinator cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.shards.prefix_cache import CaptureStore
from engine.shards.stage import LocalChain, StageStream, StepInputs
from engine.shards.step_answer import top1
from engine.wire.format import StreamId


@dataclass(frozen=True)
class StepRequest:
    """One step of one stream: the inputs of stage 0 plus what the last stage should send back."""

    stream_id: StreamId
    seq: int
    inputs: StepInputs
    reply_last: int = 1  # trailing positions to answer for (0 = all)
    want_logits: bool = False


@dataclass(frozen=True)
class CacheStep:
    """A prefix-cache operation on every stage: capture the stream's KV (``keep`` = physical
    positions to keep) or restore the first ``length`` positions of a capture into the stream."""

    stream_id: StreamId
    seq: int
    capture_id: int
    keep: np.ndarray | None = None  # capture
    length: int = 0  # restore

    @property
    def is_capture(self) -> bool:
        return self.keep is not None


@dataclass(frozen=True)
class StepResult:
    """The last stage's reply: top-1 ``ids``/``probs`` [n], or ``logits`` [n, V]; or an error.
    ``stage_ms``: the compute ms of every remote stage the step passed, in ring order."""

    stream_id: StreamId
    seq: int
    ids: np.ndarray | None = None
    probs: np.ndarray | None = None
    logits: np.ndarray | None = None
    error: str | None = None
    ack: bool = False  # a CacheStep completed on every stage
    stage_ms: tuple[float, ...] = ()


def _reply_rows(logits: np.ndarray, reply_last: int) -> np.ndarray:
    """The rows [n, V] of logits [1, S, V] a reply answers for: the last ``reply_last`` (0 = all)."""
    return logits[0] if reply_last == 0 else logits[0, -reply_last:]


def last_stage_logits(logits: np.ndarray, reply_last: int) -> np.ndarray:
    """The reply that wants logits: the answered rows of logits [1, S, V] as float32 [n, V]."""
    return np.ascontiguousarray(_reply_rows(logits, reply_last), dtype=np.float32)


def last_stage_top1(logits: np.ndarray, reply_last: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-1 reply: (ids [n] int64, probs [n] float32) of the answered rows of logits [1, S, V]."""
    return top1(_reply_rows(logits, reply_last))


class StepPath(Protocol):
    """Carries steps through the stages; replies arrive on :attr:`results` in submission order per stream."""

    results: asyncio.Queue[StepResult]
    num_stages: int

    async def async_start(self) -> None: ...

    async def async_submit(self, step: StepRequest | CacheStep) -> None: ...

    async def async_release(self, stream_id: StreamId) -> None: ...

    async def async_close(self) -> None: ...

    def stage_metrics(self) -> dict[str, float]: ...


class LocalPath:
    """Every stage in this process; steps run one at a time on a worker thread (OpenVINO
    releases the GIL in ``infer``, so the event loop keeps serving meanwhile)."""

    def __init__(self, chain: LocalChain, capture_bytes_per_stage: int = 256 << 20):
        self.chain = chain
        self.stores = [CaptureStore(capture_bytes_per_stage) for _ in chain.stages]
        self.num_stages = len(chain.stages)
        self.results: asyncio.Queue[StepResult] = asyncio.Queue()
        self._streams: dict[StreamId, list[StageStream]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deskfleet-local-path")
        self._compute_s = [0.0] * self.num_stages
        self._steps = 0

    async def async_start(self) -> None:
        return None

    def _cache(self, step: CacheStep) -> StepResult:
        if step.keep is not None:  # a capture
            streams = self._streams.get(step.stream_id)
            if streams is None:
                return StepResult(step.stream_id, step.seq, error="capture of an unknown stream")
            for store, stream in zip(self.stores, streams, strict=True):
                store.capture(stream, step.capture_id, step.keep)
            return StepResult(step.stream_id, step.seq, ack=True)
        if not all(store.holds(step.capture_id) for store in self.stores):  # all stages or none
            return StepResult(step.stream_id, step.seq, error=f"capture {step.capture_id} is no longer held")
        self._streams[step.stream_id] = [store.restore(stage, step.capture_id, step.length)
                                         for store, stage in zip(self.stores, self.chain.stages, strict=True)]
        return StepResult(step.stream_id, step.seq, ack=True)

    def _run(self, step: StepRequest | CacheStep) -> StepResult:
        if isinstance(step, CacheStep):
            return self._cache(step)
        streams = self._streams.get(step.stream_id)
        if streams is None:
            streams = self._streams[step.stream_id] = self.chain.new_streams()
        x = step.inputs.x
        for i, stream in enumerate(streams):
            started = time.perf_counter()
            x = stream.forward(StepInputs(x, step.inputs.attention_mask, step.inputs.position_ids, step.reply_last))
            self._compute_s[i] += time.perf_counter() - started
        self._steps += 1
        if step.want_logits:
            return StepResult(step.stream_id, step.seq, logits=last_stage_logits(x, step.reply_last))
        ids, probs = last_stage_top1(x, step.reply_last)
        return StepResult(step.stream_id, step.seq, ids=ids, probs=probs)

    async def async_submit(self, step: StepRequest | CacheStep) -> None:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._run, step)

        def deliver(f: asyncio.Future) -> None:
            exc = f.exception()
            if exc is not None:
                self.results.put_nowait(StepResult(step.stream_id, step.seq, error=f"{type(exc).__name__}: {exc}"))
            else:
                self.results.put_nowait(f.result())

        future.add_done_callback(deliver)

    async def async_release(self, stream_id: StreamId) -> None:
        # Dropping the InferRequests frees the stream's KV state; do it on the compute thread so a
        # step in flight for this stream finishes first.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._streams.pop, stream_id, None)

    async def async_close(self) -> None:
        self._executor.shutdown(wait=True)
        self._streams.clear()

    def stage_metrics(self) -> dict[str, float]:
        steps = max(self._steps, 1)
        return {f"stage_compute_ms_per_step{{stage=\"{i}\"}}": 1000 * s / steps for i, s in enumerate(self._compute_s)}
