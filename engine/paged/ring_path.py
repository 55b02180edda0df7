"""The coordinator's side of a paged ring: a :class:`~engine.paged.step.PagedPath` over the network.

Each step goes to stage 0 as one Step frame (the plan and every row's token id); each stage runs
it on its own block pool and passes its hidden states on in a Step of its own; the last stage
answers on this path's return port with a StepReply. All steps of one connection form a
*session*: the workers bind it to that connection, and a reconnect (failover) starts a new one,
so a late frame of the old ring can never be taken for an answer of the new one.

The ends of the ring (return port, the first hop, TLS and the peer policy, pings, stage times)
are :class:`~engine.ring.ends.RingEnds`', which the static runtime's path stands on too; only the
frames differ.

With ``local_stage0`` (a :class:`~engine.paged.stage.PagedStage` whose pool holds the
plans' ``pool_blocks``) stage 0 runs in this process, one step at a time on a thread of its own,
and its hidden states go to stage 1 in a Step carrying its compute time; its pool needs nothing
on a reconnect (a new session starts with the pool considered empty, and the scheduler replays).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import DeskfleetError
from engine.paged.step import PagedOutcome, PagedStep
from engine.ring.ends import RingEnds
from engine.wire.format import StreamId
from engine.wire.messages import Error, Message, Release, Step, StepReply

if TYPE_CHECKING:
    from engine.paged.stage import PagedStage

log = logging.getLogger(__name__)

_sessions = itertools.count(1)


class PagedRingPath(RingEnds):
    """Paged steps through remote stage workers, stage 0 optionally in this process."""

    def __init__(self, *args, block_size: int, local_stage0: PagedStage | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if local_stage0 is not None:
            if local_stage0.index != 0 or local_stage0.is_last:
                raise DeskfleetError("a paged ring's local stage must be stage 0 of a ring of two or more stages")
            if local_stage0.block_size != block_size or not local_stage0.pool_blocks:
                raise DeskfleetError(f"the local stage 0 must hold an allocated pool of {block_size}-token blocks")
        self.stage0 = local_stage0
        self._stage0_thread = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deskfleet-paged-stage0")
                               if local_stage0 is not None else None)
        self.block_size = block_size
        self.results: asyncio.Queue[PagedOutcome] = asyncio.Queue()
        self.session = StreamId(next(_sessions))

    async def _on_return(self, conn, msg: Message) -> None:
        match msg:
            case StepReply() if msg.session == self.session:
                self._answer(PagedOutcome(msg.seq, msg.ids, msg.probs, msg.logits, tuple(msg.stage_ms),
                                          top_ids=msg.top_ids, top_logprobs=msg.top_logprobs))
            case Error() if msg.stream_id == self.session:
                self._answer(PagedOutcome.failed(msg.seq, msg.message))
            case StepReply() | Error():
                log.debug("paged ring: dropping %r of an old session", msg)
            case _:
                log.debug("paged ring: ignoring %r on the return port", msg)

    def _answer(self, outcome: PagedOutcome) -> None:
        self._answered(outcome.seq, outcome.stage_ms)  # the moving medians stage_metrics reports
        self.results.put_nowait(outcome)

    @property
    def hosts_stage0(self) -> bool:
        return self.stage0 is not None

    async def async_submit(self, step: PagedStep) -> None:
        if self._out is None:
            raise DeskfleetError("the ring is not connected; start the path first")
        padded = np.zeros(step.plan.padded_tokens, dtype=np.int64)
        padded[: step.token_ids.shape[0]] = step.token_ids
        self._sent(step.seq)
        frame = Step(self.session, step.seq, step.plan, padded)
        if self.stage0 is not None:
            try:
                hidden, ms = await asyncio.get_running_loop().run_in_executor(self._stage0_thread, self._run_stage0,
                                                                              step, padded)
            except Exception as exc:  # a bad plan or an OpenVINO failure: the step failed, the path lives
                self._answer(PagedOutcome.failed(step.seq, f"stage 0 (in the coordinator): {exc}"))
                return
            frame = frame.passed_on(hidden, ms)
        out = self._out  # a failover may have replaced it while stage 0 computed
        if out is None or out.closed:
            raise DeskfleetError("the connection to the first remote stage is closed")
        try:
            await out.async_send(frame)
        except OSError as exc:
            raise DeskfleetError(f"sending step {step.seq} to the first remote stage failed: {exc}") from exc

    def _run_stage0(self, step: PagedStep, padded: np.ndarray) -> tuple[np.ndarray, float]:
        """Stage 0's infer for ``step`` (on its thread): hidden states float32 [Tb, H] and its ms."""
        assert self.stage0 is not None
        started = time.perf_counter()
        hidden = self.stage0.run(step.plan, padded)
        return hidden, 1000 * (time.perf_counter() - started)

    async def async_reconnect(self, first_remote=None, peers=None) -> None:
        """Dial the first stage again (after a failover) under a new session; the old session's
        pools are the workers' to drop when its connection closes."""
        self.session = StreamId(next(_sessions))
        await super().async_reconnect(first_remote, peers)

    async def async_release(self, stream_id: StreamId) -> None:
        """Streams hold no state on a paged worker (their blocks are the coordinator's): nothing to free."""
        return None

    async def async_close(self) -> None:
        if self._out is not None and not self._out.closed:
            with contextlib.suppress(DeskfleetError, OSError):
                await self._out.async_send(Release(self.session))
        await super().async_close()
        if self._stage0_thread is not None:
            self._stage0_thread.shutdown(wait=True)

