"""A stage worker for a static (NPU-target) export: packed serving across PCs.

Where the stateful worker keeps a KV state per stream, a static stage owns one host KV ring whose
slots are shared by many requests. Every inference arrives as a **Packed** frame: stage 0's
:class:`~engine.packing.PlanFrame` plus the rows' inputs. The stage derives its mask and KV writes
from the plan alone (:func:`~engine.packing.layout_step`), runs its graph, and passes the plan on
with its hidden states; the last stage answers the coordinator with each row's top-1
(**Tokens** [S]). So every stage's ring stays in lockstep with no control message of its own.

One stream id is one packed session: a Packed frame for a new stream id, or a Release of the
current one, empties every slot. A plan that does not follow from the stage's ring (a lost
frame, a restarted stage) is refused with a stream-level Error that travels to the coordinator.
"""

from __future__ import annotations

import logging
from ssl import SSLContext

import numpy as np

from engine.address import Address
from engine.messages import Error, Forward, Message, Packed, Release, Tokens
from engine.packed_stage import StaticStage
from engine.path import last_stage_reply
from engine.stage_server import StageServer
from engine.transport import Connection
from engine.wire import ErrorCode, StreamId

log = logging.getLogger(__name__)


class PackedStageWorker(StageServer):
    """Serves one static stage; ``next_address`` is the next stage, or the coordinator's return port."""

    def __init__(self, stage: StaticStage, listen: Address, next_address: Address, *,
                 server_ssl: SSLContext | None = None, client_ssl: SSLContext | None = None,
                 dial_deadline: float = 120.0):
        self.stage = stage
        super().__init__(stage.spec.index, stage.is_last, stage.manifest.model.fingerprint, listen, next_address,
                         server_ssl=server_ssl, client_ssl=client_ssl, dial_deadline=dial_deadline,
                         thread_name=f"deskfleet-static{stage.spec.index}")
        self.session: StreamId | None = None

    @property
    def stream_count(self) -> int:
        return int(self.session is not None)

    async def _handle(self, conn: Connection, msg: Message) -> None:
        match msg:
            case Packed():
                await self._step(msg)
            case Release():
                if msg.stream_id == self.session:
                    await self._run(self._reset)
                if not self.stage.is_last:
                    await self._send(msg)
            case Forward():
                await self._send(Error(
                    ErrorCode.STREAM_FAILED, f"stage {self.index} serves a static (NPU-target) export: it takes "
                    "Packed frames, not Forward", msg.stream_id, msg.seq))
            case Error() if msg.stream_id:
                await self._send(msg)  # a step failed upstream: on toward the coordinator
            case _:
                log.debug("static stage %d ignoring %r", self.index, msg)

    def _reset(self) -> None:
        self.stage.reset()
        self.session = None

    async def _step(self, msg: Packed) -> None:
        if msg.stream_id != self.session:
            if self.draining:
                await self._send(Error(ErrorCode.SHUTTING_DOWN, f"stage {self.index} is shutting "
                                                       "down", msg.stream_id, msg.seq))
                return
            await self._run(self._reset)  # a new session starts on empty slots
            self.session = msg.stream_id
        x = msg.tensor if msg.tensor.dtype != np.float16 else msg.tensor.astype(np.float32)
        try:
            out = await self._compute(self.stage.step, msg.plan, x)
        except Exception as exc:  # a lockstep break or an OpenVINO failure: the session is over here
            log.error("static stage %d failed on step %d of session %s: %s", self.index, msg.seq, msg.stream_id, exc)
            await self._run(self._reset)
            await self._send(Error(ErrorCode.STREAM_FAILED, f"stage {self.index}: {exc}",
                                                   msg.stream_id, msg.seq))
            return
        if self.stage.is_last:
            ids, probs = last_stage_reply(out, 0, False)
            reply: Message = Tokens(msg.stream_id, msg.seq, ids, probs)
        else:
            reply = Packed(msg.stream_id, msg.seq, msg.plan, out)
        await self._send(reply)
