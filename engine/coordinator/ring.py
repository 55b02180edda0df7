"""The coordinator's side of a ring of stage workers: a :class:`StepPath` over the network.

Steps go out to stage 0 (or, when the coordinator hosts stage 0 itself, are computed here and
their hidden states go to stage 1); replies come back from the last stage on a return port
that this path listens on. Each reply is matched to its stream by id and sequence number.

With TLS a :class:`~engine.trust.peer_policy.PeerPolicy` is required: its ``upstream`` is the node id
of the ring's last stage (the only member whose replies the return port takes) and its ``next``
the node id of the first remote stage (checked before a step is sent to it).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from ssl import SSLContext

import numpy as np

from engine.coordinator.stage_times import StageTimes
from engine.errors import DeskfleetError
from engine.shards.prefix_cache import CaptureStore
from engine.shards.stage import Stage, StageStream
from engine.shards.step_path import CacheStep, StepRequest, StepResult
from engine.trust.peer_policy import PeerPolicy, PeerPolicyError
from engine.wire.address import Address
from engine.wire.format import (
    COORDINATOR_STAGE,
    FORWARD_META,
    HEADER_SIZE,
    MAX_FRAME_BYTES,
    MAX_FRAME_STAGES,
    MIN_FRAME_BOUND,
    PACKED_META,
    Role,
    StreamId,
)
from engine.wire.frame_server import FrameServer
from engine.wire.handshake import LocalIdentity
from engine.wire.messages import (
    Capture,
    Error,
    Forward,
    Hello,
    Logits,
    Message,
    Packed,
    Release,
    Restore,
    Tokens,
)
from engine.wire.plan_frame import PlanFrame
from engine.wire.transport import IDLE_TIMEOUT, PING_INTERVAL, Connection, async_connect, async_hold

log = logging.getLogger(__name__)


def return_frame_bound(vocab_size: int, context: int) -> int:
    """The largest frame the last stage can legitimately send the return port: Logits of
    ``context`` rows of float32 over the vocabulary (a prefill that wanted every row), which is
    more than Tokens (12 bytes a row), a Packed answer or a Capture echo (8 bytes a kept position)
    of as many rows, plus the header and their row metadata."""
    meta = max(PACKED_META.size, FORWARD_META.size) + 3 * 8 * context + 4 * MAX_FRAME_STAGES
    bound = HEADER_SIZE + meta + 4 * max(vocab_size, 3) * context
    return min(MAX_FRAME_BYTES, max(MIN_FRAME_BOUND, bound))


class RingPath:
    """Steps through remote stage workers; optionally runs stage 0 in this process."""

    def __init__(self, fingerprint: str, num_stages: int, first_remote: Address, return_listen: Address, *,
                 local_stage0: Stage | None = None, server_ssl: SSLContext | None = None,
                 client_ssl: SSLContext | None = None, dial_deadline: float = 120.0,
                 capture_bytes: int = 256 << 20, peers: PeerPolicy | None = None,
                 ping_interval: float = PING_INTERVAL, idle_timeout: float = IDLE_TIMEOUT,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        if peers is None and (server_ssl is not None or client_ssl is not None):
            raise PeerPolicyError("a ring over TLS needs peers=PeerPolicy(upstream={the last stage's node id}, "
                                  "next=the first remote stage's node id): without them any fleet member could "
                                  "answer for the ring")
        self.peers = peers or PeerPolicy()
        self.fingerprint = fingerprint
        self.num_stages = num_stages
        self.first_remote = first_remote
        self.return_listen = return_listen
        self.local_stage0 = local_stage0
        self._client_ssl = client_ssl
        self._dial_deadline = dial_deadline
        self.results: asyncio.Queue[StepResult] = asyncio.Queue()
        identity = LocalIdentity(fingerprint, COORDINATOR_STAGE, frozenset({Role.STAGE}))
        # max_frame_bytes: return_frame_bound(...) when the caller knows the export; a larger frame
        # from the last stage is refused from its header, before its body is read
        self._returns = FrameServer(self._on_return, identity, ssl=server_ssl, idle_timeout=idle_timeout,
                                    max_frame_bytes=max_frame_bytes,
                                    peer_check=self._check_last if server_ssl is not None else None)
        self._ping_interval = ping_interval
        self._out: Connection | None = None
        self._hold: asyncio.Task | None = None
        self._listening = False
        self._captures = CaptureStore(capture_bytes)
        self._local_streams: dict[StreamId, StageStream] = {}
        self._executor = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deskfleet-stage0")
                          if local_stage0 else None)
        self._sent_at: dict[tuple[StreamId, int], float] = {}
        self._roundtrips: collections.deque[float] = collections.deque(maxlen=256)
        self.stage_times = StageTimes()  # every stage's compute ms, as the replies report them

    @property
    def return_address(self) -> Address:
        host, port = self._returns.address
        return Address(host, port)

    def _check_last(self, node_id: str | None) -> str | None:
        return self.peers.refuse_upstream(node_id)

    def _check_first(self, node_id: str | None) -> str | None:
        return self.peers.refuse_next(node_id)

    @property
    def returns(self) -> FrameServer:
        """The return port's listener (its ``stats`` count refusals)."""
        return self._returns

    async def async_set_peers(self, peers: PeerPolicy) -> None:
        """Replace who the ring's ends must be (a failover moved the last stage, the admin
        revoked a member): return-port connections it no longer admits are closed at once, and
        so is the open connection to the first stage if it no longer admits that stage (stage 0
        sees every prompt: a revoked one must not get the next). Later dials are checked against it."""
        self.peers = peers
        await self._returns.async_recheck()
        out = self._out
        if self._client_ssl is None or out is None or out.closed:
            return
        reason = peers.refuse_next(out.peer_node_id)
        if reason is not None:
            log.warning("ring: dropping the connection to %s: %s", self.first_remote, reason)
            self._stop_hold()
            with contextlib.suppress(Exception):
                await out.async_close()

    @property
    def connected(self) -> bool:
        """The connection to the first remote stage is up (as far as this side knows)."""
        return self._out is not None and not self._out.closed

    async def async_listen(self) -> Address:
        """Open the return port (idempotent): the last stage needs its address before it starts."""
        if not self._listening:
            await self._returns.async_start(self.return_listen.host, self.return_listen.port)
            self._listening = True
        return self.return_address

    @property
    def hosts_stage0(self) -> bool:
        """Stage 0 runs in this process: the first remote stage is stage 1, greeted as a stage."""
        return self.local_stage0 is not None

    async def async_start(self) -> None:
        await self.async_listen()
        first_index = 1 if self.hosts_stage0 else 0
        role = Role.STAGE if self.hosts_stage0 else Role.COORDINATOR
        hello = Hello(self.fingerprint, first_index, role)
        self._out = await async_connect(self.first_remote.host, self.first_remote.port, hello,
                                        ssl=self._client_ssl, deadline=self._dial_deadline,
                                        peer_check=self._check_first if self._client_ssl is not None else None)
        # Pings keep stage 0's idle timeout from closing the hop between requests; reading it
        # notices at once when stage 0 goes away (``connected`` turns False).
        self._hold = asyncio.create_task(async_hold(self._out, "ring first hop", self._ping_interval),
                                         name="deskfleet-ring-hold")
        log.info("ring: connected to stage %d at %s; replies on %s", first_index, self.first_remote,
                 self.return_address)

    async def _on_return(self, conn: Connection, msg: Message) -> None:
        match msg:
            case Tokens():
                self.stage_times.add(msg.stage_ms)
                self._deliver(StepResult(msg.stream_id, msg.seq, ids=msg.ids.reshape(-1),
                                         probs=msg.probs.reshape(-1), stage_ms=msg.stage_ms))
            case Logits():
                self.stage_times.add(msg.stage_ms)
                logits = msg.logits.reshape(-1, msg.logits.shape[-1])
                self._deliver(StepResult(msg.stream_id, msg.seq, logits=logits, stage_ms=msg.stage_ms))
            case Capture() | Restore():
                self._deliver(StepResult(msg.stream_id, msg.seq, ack=True))
            case Error() if msg.stream_id:
                self._deliver(StepResult(msg.stream_id, msg.seq, error=msg.message))
            case _:
                log.debug("ring: ignoring %r on the return port", msg)

    def _deliver(self, result: StepResult) -> None:
        sent = self._sent_at.pop((result.stream_id, result.seq), None)
        if sent is not None:
            self._roundtrips.append(time.perf_counter() - sent)
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
        self._sent_at[(step.stream_id, step.seq)] = time.perf_counter()
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

    async def async_submit_packed(self, stream_id: StreamId, seq: int, plan: PlanFrame, tokens: np.ndarray, *,
                                  want_logits: bool = False) -> None:
        """One inference of a static (NPU-target) ring: the plan and its rows' token ids [S]; the
        last stage's reply, each row's top-1 (or with ``want_logits`` every row's logits [S, V]),
        arrives on ``results`` like any step's."""
        if self._out is None:
            raise DeskfleetError("the ring is not connected; start the path first")
        if self.local_stage0 is not None:
            raise DeskfleetError("a static ring cannot host stage 0 in the coordinator; start every stage as a worker")
        self._sent_at[(stream_id, seq)] = time.perf_counter()
        await self._out.async_send(Packed(stream_id, seq, plan, tokens[None, :], want_logits))

    async def async_reconnect(self, first_remote: Address | None = None, peers: PeerPolicy | None = None) -> None:
        """After a failover: drop the connection to the first remote stage (and every stream's
        local stage-0 state, which the coordinator replays) and dial it again, at a new address
        if one is given (and with ``peers``, the node ids of the moved ends). Replies keep
        arriving on the same return port."""
        if peers is not None:
            await self.async_set_peers(peers)
        self._stop_hold()
        if self._out is not None:
            with contextlib.suppress(Exception):
                await self._out.async_close()
            self._out = None
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._local_streams.clear)
        self._sent_at.clear()
        if first_remote is not None:
            self.first_remote = first_remote
        await self.async_start()

    async def async_release(self, stream_id: StreamId) -> None:
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._local_streams.pop, stream_id, None)
        if self._out is not None and not self._out.closed:
            await self._out.async_send(Release(stream_id))

    def _stop_hold(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None

    async def async_close(self) -> None:
        self._stop_hold()
        if self._out is not None:
            await self._out.async_close()
        await self._returns.async_close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._local_streams.clear()

    def stage_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._roundtrips:
            out["ring_step_ms_avg"] = 1000 * sum(self._roundtrips) / len(self._roundtrips)
        out.update(self.stage_times.metrics())
        return out


def _timed_forward(stream, inputs) -> tuple[np.ndarray, float]:
    """A hosted stage 0's forward on the compute thread, and its ms."""
    started = time.perf_counter()
    x = stream.forward(inputs)
    return x, 1000 * (time.perf_counter() - started)
