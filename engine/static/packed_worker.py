"""A stage worker for a static (NPU-target) export: packed serving across PCs.

A static stage owns one host KV ring whose slots are shared by many requests. Every inference
arrives as a **Packed** frame: stage 0's
:class:`~engine.static.packing.PlanFrame` plus the rows' inputs. The stage derives its mask and KV writes
from the plan alone (:func:`~engine.static.packing.layout_step`), runs its graph, and passes the plan on
with its hidden states and its compute time appended to the frame's stage times; the last stage
answers the coordinator with each row's top-1 (**Tokens** [S]), or every row's logits (**Logits**
[S, V]) when the frame wants them. So every stage's ring stays in lockstep with no control message
of its own.

One stream id is one packed session: a Packed frame for a new stream id, or a Release of the
current one, empties every slot. The session belongs to the upstream connection that started it:
while that connection is open, no other one may step, start or release a session here. A plan
that does not follow from the stage's ring (a lost frame, a restarted stage) is refused with a
stream-level Error that travels to the coordinator.
"""

from __future__ import annotations

import logging
from ssl import SSLContext

import numpy as np

from engine.shards.step_answer import top1
from engine.static.packed_stage import StaticStage
from engine.trust.peer_policy import PeerPolicy
from engine.wire.address import Address
from engine.wire.format import ErrorCode
from engine.wire.messages import Error, Logits, Message, Packed, Release, Step, Tokens
from engine.wire.stage_server import SessionServer, stage_frame_bound
from engine.wire.transport import Connection

log = logging.getLogger(__name__)


class PackedStageWorker(SessionServer):
    """Serves one static stage; ``next_address`` is the next stage, or the coordinator's return port."""

    def __init__(self, stage: StaticStage, listen: Address, next_address: Address, *,
                 server_ssl: SSLContext | None = None, client_ssl: SSLContext | None = None,
                 dial_deadline: float = 120.0, peers: PeerPolicy | None = None, **listener_options):
        self.stage = stage
        model = stage.manifest.model
        super().__init__(stage.spec.index, stage.is_last, model.fingerprint, listen, next_address,
                         server_ssl=server_ssl, client_ssl=client_ssl, dial_deadline=dial_deadline,
                         thread_name=f"deskfleet-static{stage.spec.index}", peers=peers,
                         max_frame_bytes=stage_frame_bound(model.hidden_size, model.max_position_embeddings),
                         **listener_options)

    async def _handle(self, conn: Connection, msg: Message) -> None:
        if isinstance(msg, Packed | Release) and not await self._carried_by(conn, msg, msg.stream_id):
            return
        match msg:
            case Packed():
                self._owner = conn
                await self._step(msg)
            case Release():
                if msg.stream_id == self.session:
                    await self._run(self._reset)
                if not self.stage.is_last:
                    await self._send(msg)
            case Step():
                await self._send(Error(
                    ErrorCode.STREAM_FAILED, f"stage {self.index} serves a static (NPU-target) export: it takes "
                    "Packed frames, not Step (a paged ring needs a CPU or GPU export)", msg.session, msg.seq))
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
            out, ms = await self._timed_compute(self.stage.step, msg.plan, x)
        except Exception as exc:  # a lockstep break or an OpenVINO failure: the session is over here
            log.error("static stage %d failed on step %d of session %s: %s", self.index, msg.seq, msg.stream_id, exc)
            await self._run(self._reset)
            await self._send(Error(ErrorCode.STREAM_FAILED, f"stage {self.index}: {exc}",
                                                   msg.stream_id, msg.seq))
            return
        times = (*msg.stage_ms, ms)
        reply: Message
        if self.stage.is_last and msg.want_logits:
            reply = Logits(msg.stream_id, msg.seq, np.ascontiguousarray(out[0], dtype=np.float32), times)
        elif self.stage.is_last:
            ids, probs = top1(out[0])  # every row's, of logits [1, S, V]
            reply = Tokens(msg.stream_id, msg.seq, ids, probs, times)
        else:
            reply = Packed(msg.stream_id, msg.seq, msg.plan, out, msg.want_logits, times)
        await self._send(reply)
