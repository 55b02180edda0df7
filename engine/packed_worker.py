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

import asyncio
import concurrent.futures
import logging
import time
from ssl import SSLContext

import numpy as np

from engine.address import Address
from engine.downstream import Downstream
from engine.handshake import LocalIdentity
from engine.messages import Error, Forward, Message, Packed, Release, Tokens
from engine.packed_stage import StaticStage
from engine.path import last_stage_reply
from engine.transport import Connection, FrameServer
from engine.wire import ErrorCode, Role, StreamId

log = logging.getLogger(__name__)


class PackedStageWorker:
    """Serves one static stage; ``next_address`` is the next stage, or the coordinator's return port."""

    def __init__(self, stage: StaticStage, listen: Address, next_address: Address, *, server_ssl: SSLContext | None = None,
                 client_ssl: SSLContext | None = None, dial_deadline: float = 120.0):
        self.stage = stage
        self.index = stage.spec.index
        self.listen = listen
        self.next_address = next_address
        self.fingerprint = stage.manifest.model.fingerprint
        upstream_role = Role.COORDINATOR if self.index == 0 else Role.STAGE
        self._server = FrameServer(self._handle, LocalIdentity(self.fingerprint, self.index,
                                                                frozenset({upstream_role})), ssl=server_ssl,
                                   idle_timeout=None)
        self.downstream = Downstream(self.fingerprint, self.index, stage.is_last, next_address,
                                     client_ssl=client_ssl, dial_deadline=dial_deadline)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"deskfleet-static{self.index}")
        self.session: StreamId | None = None
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.steps = 0
        self.compute_s = 0.0

    @property
    def address(self) -> Address:
        host, port = self._server.address
        return Address(host, port)

    @property
    def stream_count(self) -> int:
        return int(self.session is not None)

    async def async_start(self) -> Address:
        await self._server.async_start(self.listen.host, self.listen.port)
        log.info("static stage %d listening on %s, next hop %s", self.index, self.address, self.next_address)
        return self.address

    async def _handle(self, conn: Connection, msg: Message) -> None:
        match msg:
            case Packed():
                await self._step(msg)
            case Release():
                if msg.stream_id == self.session:
                    await self._run(self._reset)
                if not self.stage.is_last:
                    await self.downstream.async_send(msg)
            case Forward():
                await self.downstream.async_send(Error(
                    ErrorCode.STREAM_FAILED, f"stage {self.index} serves a static (NPU-target) export: it takes "
                    "Packed frames, not Forward", msg.stream_id, msg.seq))
            case Error() if msg.stream_id:
                await self.downstream.async_send(msg)  # a step failed upstream: on toward the coordinator
            case _:
                log.debug("static stage %d ignoring %r", self.index, msg)

    def _reset(self) -> None:
        self.stage.reset()
        self.session = None

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _step(self, msg: Packed) -> None:
        if msg.stream_id != self.session:
            if self.draining:
                await self.downstream.async_send(Error(ErrorCode.SHUTTING_DOWN, f"stage {self.index} is shutting "
                                                       "down", msg.stream_id, msg.seq))
                return
            await self._run(self._reset)  # a new session starts on empty slots
            self.session = msg.stream_id
        x = msg.tensor if msg.tensor.dtype != np.float16 else msg.tensor.astype(np.float32)
        self._idle.clear()
        started = time.perf_counter()
        try:
            out = await self._run(self.stage.step, msg.plan, x)
        except Exception as exc:  # a lockstep break or an OpenVINO failure: the session is over here
            log.error("static stage %d failed on step %d of session %s: %s", self.index, msg.seq, msg.stream_id, exc)
            await self._run(self._reset)
            await self.downstream.async_send(Error(ErrorCode.STREAM_FAILED, f"stage {self.index}: {exc}",
                                                   msg.stream_id, msg.seq))
            return
        finally:
            self.compute_s += time.perf_counter() - started
            self.steps += 1
            self._idle.set()
        if self.stage.is_last:
            ids, probs = last_stage_reply(out, 0, False)
            reply: Message = Tokens(msg.stream_id, msg.seq, ids, probs)
        else:
            reply = Packed(msg.stream_id, msg.seq, msg.plan, out)
        await self.downstream.async_send(reply)

    async def async_drain(self) -> None:
        """Refuse new sessions and wait for the inference in hand to finish."""
        self.draining = True
        await self._idle.wait()

    async def async_close(self) -> None:
        await self._server.async_close()
        await self.downstream.async_close()
        self._executor.shutdown(wait=True)
