"""The stateful runtime's side of a ring of stage workers: a :class:`StepPath` over the network.

Steps go out to stage 0 (or, when the coordinator hosts stage 0 itself, are computed here and
their hidden states go to stage 1) as Forward frames; replies come back from the last stage on the
return port of :class:`~engine.ring.ends.RingEnds`. Each reply is matched to its stream by id and
sequence number.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import numpy as np

from engine.errors import DeskfleetError
from engine.ring.ends import RingEnds, return_frame_bound
from engine.shards.prefix_cache import CaptureStore
from engine.shards.stage import Stage, StageStream
from engine.shards.step_path import CacheStep, StepRequest, StepResult
from engine.wire.address import Address
from engine.wire.format import StreamId
from engine.wire.messages import Capture, Error, Forward, Logits, Message, Release, Restore, Tokens
from engine.wire.transport import Connection

__all__ = ["RingPath", "return_frame_bound"]


class RingPath(RingEnds):
    """Steps through remote stage workers; optionally runs stage 0 in this process."""

    def __init__(self, fingerprint: str, num_stages: int, first_remote: Address, return_listen: Address, *,
                 local_stage0: Stage | None = None, capture_bytes: int = 256 << 20, **ends):
        super().__init__(fingerprint, num_stages, first_remote, return_listen, **ends)
        self.local_stage0 = local_stage0
        self.results: asyncio.Queue[StepResult] = asyncio.Queue()
        self._captures = CaptureStore(capture_bytes)
        self._local_streams: dict[StreamId, StageStream] = {}
        self._executor = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deskfleet-stage0")
                          if local_stage0 else None)

    @property
    def hosts_stage0(self) -> bool:
        return self.local_stage0 is not None

    async def _on_return(self, conn: Connection, msg: Message) -> None:
        match msg:
            case Tokens():
                self._deliver(StepResult(msg.stream_id, msg.seq, ids=msg.ids.reshape(-1),
                                         probs=msg.probs.reshape(-1), stage_ms=msg.stage_ms))
            case Logits():
                logits = msg.logits.reshape(-1, msg.logits.shape[-1])
                self._deliver(StepResult(msg.stream_id, msg.seq, logits=logits, stage_ms=msg.stage_ms))
            case Capture() | Restore():
                self._deliver(StepResult(msg.stream_id, msg.seq, ack=True))
            case Error() if msg.stream_id:
                self._deliver(StepResult(msg.stream_id, msg.seq, error=msg.message))
            case _:
                await super()._on_return(conn, msg)

    def _deliver(self, result: StepResult) -> None:
        self._answered((result.stream_id, result.seq), result.stage_ms)
        self.results.put_nowait(result)

    async def _cache_step(self, step: CacheStep, out: Connection) -> None:
        loop = asyncio.get_running_loop()
        if step.is_capture:
            assert step.keep is not None
            if self.local_stage0 is not None:
                stream = self._local_streams.get(step.stream_id)
                if stream is None:
                    self._deliver(StepResult(step.stream_id, step.seq, error="capture of an unknown stream"))
                    return
                await loop.run_in_executor(self._executor, self._captures.capture, stream, step.capture_id,
                                           step.keep)
            await out.async_send(Capture(step.stream_id, step.seq, step.capture_id, step.keep))
            return
        if self.local_stage0 is not None:
            stream = await loop.run_in_executor(self._executor, self._captures.restore, self.local_stage0,
                                                step.capture_id, step.length)
            if stream is None:
                self._deliver(StepResult(step.stream_id, step.seq, error=f"capture {step.capture_id} is gone"))
                return
            self._local_streams[step.stream_id] = stream
        await out.async_send(Restore(step.stream_id, step.seq, step.capture_id, step.length))

    async def async_submit(self, step: StepRequest | CacheStep) -> None:
        if self._out is None:
            raise DeskfleetError("the ring is not connected; start the path first")
        if isinstance(step, CacheStep):
            await self._cache_step(step, self._out)
            return
        x = step.inputs.x
        self._sent((step.stream_id, step.seq))
        times: tuple[float, ...] = ()
        if self.local_stage0 is not None:  # its time travels with the step like a remote stage's
            stream = self._local_streams.get(step.stream_id)
            if stream is None:
                stream = self._local_streams[step.stream_id] = self.local_stage0.new_stream()
            x, ms = await asyncio.get_running_loop().run_in_executor(self._executor, _timed_forward, stream,
                                                                     step.inputs)
            times = (ms,)
        await self._out.async_send(Forward(step.stream_id, step.seq, x, step.inputs.attention_mask,
                                           step.inputs.position_ids, step.want_logits, step.reply_last, times))

    async def async_reconnect(self, first_remote: Address | None = None, peers=None) -> None:
        """After a failover: also drop every stream's local stage-0 state (the coordinator replays)."""
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._local_streams.clear)
        await super().async_reconnect(first_remote, peers)

    async def async_release(self, stream_id: StreamId) -> None:
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._local_streams.pop, stream_id, None)
        if self._out is not None and not self._out.closed:
            await self._out.async_send(Release(stream_id))

    async def async_close(self) -> None:
        await super().async_close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._local_streams.clear()


def _timed_forward(stream, inputs) -> tuple[np.ndarray, float]:
    """A hosted stage 0's forward on the compute thread, and its ms."""
    started = time.perf_counter()
    x = stream.forward(inputs)
    return x, 1000 * (time.perf_counter() - started)
