"""The coordinator's side of a static (NPU-target) ring: Packed frames out, each row's answer back.

Each inference goes to stage 0 as one Packed frame (stage 0's plan and the rows' token ids); the
last stage answers on the return port with each row's top-1 (Tokens [S]) or, when the frame
wanted them, every row's logits (Logits [S, V]). One stream id is one packed session
(:class:`~engine.static.packed_generator.RingStatic` opens the next after a failure).

The ends of the ring (return port, first hop, TLS and the peer policy, pings, stage times) are
:class:`~engine.ring.ends.RingEnds`'; only the frames are this runtime's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import DeskfleetError
from engine.ring.ends import RingEnds
from engine.wire.format import StreamId
from engine.wire.messages import Error, Logits, Message, Packed, Release, Tokens
from engine.wire.plan_frame import PlanFrame
from engine.wire.transport import Connection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedReply:
    """The last stage's answer to one Packed step: top-1 ``ids``/``probs`` [S], or ``logits``
    [S, V]; or an ``error``. ``stage_ms``: every stage's compute ms, in ring order."""

    stream_id: StreamId
    seq: int
    ids: np.ndarray | None = None
    probs: np.ndarray | None = None
    logits: np.ndarray | None = None
    error: str | None = None
    stage_ms: tuple[float, ...] = ()


class PackedRingPath(RingEnds):
    """Packed inferences through a ring of static stage workers (every stage a worker)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.results: asyncio.Queue[PackedReply] = asyncio.Queue()

    async def _on_return(self, conn: Connection, msg: Message) -> None:
        match msg:
            case Tokens():
                self._deliver(PackedReply(msg.stream_id, msg.seq, ids=msg.ids.reshape(-1),
                                          probs=msg.probs.reshape(-1), stage_ms=msg.stage_ms))
            case Logits():
                logits = msg.logits.reshape(-1, msg.logits.shape[-1])
                self._deliver(PackedReply(msg.stream_id, msg.seq, logits=logits, stage_ms=msg.stage_ms))
            case Error() if msg.stream_id:
                self._deliver(PackedReply(msg.stream_id, msg.seq, error=msg.message))
            case _:
                log.debug("static ring: ignoring %r on the return port", msg)

    def _deliver(self, reply: PackedReply) -> None:
        self._answered((reply.stream_id, reply.seq), reply.stage_ms)
        self.results.put_nowait(reply)

    async def async_submit_packed(self, stream_id: StreamId, seq: int, plan: PlanFrame, tokens: np.ndarray, *,
                                  want_logits: bool = False) -> None:
        """One inference: the plan and its rows' token ids [S]; the last stage's reply, each row's
        top-1 (or with ``want_logits`` every row's logits [S, V]), arrives on ``results``."""
        if self._out is None:
            raise DeskfleetError("the ring is not connected; start the path first")
        self._sent((stream_id, seq))
        await self._out.async_send(Packed(stream_id, seq, plan, tokens[None, :], want_logits))

    async def async_release(self, stream_id: StreamId) -> None:
        """End packed session ``stream_id`` on every stage (their slots empty)."""
        if self._out is not None and not self._out.closed:
            await self._out.async_send(Release(stream_id))
