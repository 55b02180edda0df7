"""What every stage worker shares, paged or static: the port it listens on for its upstream
neighbour (the coordinator for stage 0), its next hop (:class:`~engine.wire.downstream.Downstream`),
who may be on either end (a :class:`~engine.trust.peer_policy.PeerPolicy`, with TLS), the frame and
stream bounds, one compute thread, the step counters the supervising agent reads, and draining."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

from engine.trust.peer_policy import PeerPolicy
from engine.wire.address import Address
from engine.wire.downstream import Downstream
from engine.wire.format import (
    HEADER_SIZE,
    MAX_FRAME_BYTES,
    MAX_FRAME_STAGES,
    MIN_FRAME_BOUND,
    PACKED_META,
    ErrorCode,
    Role,
    StreamId,
)
from engine.wire.frame_server import FrameServer
from engine.wire.handshake import LocalIdentity
from engine.wire.messages import Error, Message
from engine.wire.transport import PING_INTERVAL, Connection

log = logging.getLogger(__name__)

# How long a session's owner connection may take to be seen closed when another connection
# carries the session's frames: a coordinator that redials closes its old connection first, but
# the EOF can reach us after the new connection's first frame.
OWNER_CLOSE_GRACE_S = 2.0


def stage_frame_bound(hidden_size: int, context: int) -> int:
    """The largest frame a static stage's upstream can legitimately send it: one Packed of ``context``
    rows of float32 hidden states [1, S, H], with its plan and stage times."""
    meta = PACKED_META.size + 3 * 8 * context + 4 * MAX_FRAME_STAGES
    bound = HEADER_SIZE + meta + 4 * hidden_size * context
    return min(MAX_FRAME_BYTES, max(MIN_FRAME_BOUND, bound))


class StageServer:
    """The plumbing of one stage; a subclass handles the frames (``_handle``)."""

    def __init__(self, index: int, is_last: bool, fingerprint: str, listen: Address, next_address: Address, *,
                 server_ssl: SSLContext | None, client_ssl: SSLContext | None, dial_deadline: float,
                 thread_name: str, peers: PeerPolicy | None = None, max_frame_bytes: int = MAX_FRAME_BYTES,
                 ping_interval: float = PING_INTERVAL, **listener_options: Any):
        self.index = index
        self.listen = listen
        self.next_address = next_address
        self.fingerprint = fingerprint
        # With TLS the policy decides who is on either end; none given means nobody is expected
        # yet (every peer refused until async_set_peers), never "any member".
        self.peers = peers if peers is not None else PeerPolicy()
        upstream_role = Role.COORDINATOR if index == 0 else Role.STAGE
        self._server = FrameServer(self._handle, LocalIdentity(fingerprint, index, frozenset({upstream_role})),
                                   ssl=server_ssl, max_frame_bytes=max_frame_bytes, on_close=self._on_close,
                                   peer_check=self._check_upstream if server_ssl is not None else None,
                                   **listener_options)
        self.downstream = Downstream(fingerprint, index, is_last, next_address, client_ssl=client_ssl,
                                     dial_deadline=dial_deadline,
                                     peer_check=self._check_next if client_ssl is not None else None,
                                     ping_interval=ping_interval)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.steps = 0
        self.compute_s = 0.0

    async def _handle(self, conn: Connection, msg: Message) -> None:
        raise NotImplementedError

    async def _on_close(self, conn: Connection) -> None:
        """An upstream connection ended: what it owned is dropped (a subclass says what)."""

    def _check_upstream(self, node_id: str | None) -> str | None:
        return self.peers.refuse_upstream(node_id)

    def _check_next(self, node_id: str | None) -> str | None:
        return self.peers.refuse_next(node_id)

    @property
    def listener(self) -> FrameServer:
        """The upstream listener (its ``stats`` count refusals)."""
        return self._server

    async def async_set_peers(self, peers: PeerPolicy) -> None:
        """Replace the peer policy without a restart (a failover move): connections it no longer
        admits are closed at once, on both sides; later ones are checked against it."""
        self.peers = peers
        closed = await self._server.async_recheck()
        dropped = await self.downstream.async_recheck()
        log.info("stage %d: peer policy updated (%d upstream, next %s, %d denied); closed %d upstream and "
                 "%d next-hop connection(s)", self.index, len(peers.upstream), "set" if peers.next else "unset",
                 len(peers.deny), closed, int(dropped))

    @property
    def address(self) -> Address:
        host, port = self._server.address
        return Address(host, port)

    async def async_start(self) -> Address:
        await self._server.async_start(self.listen.host, self.listen.port)
        log.info("stage %d listening on %s, next hop %s", self.index, self.address, self.next_address)
        return self.address

    async def _send(self, msg: Message) -> None:
        await self.downstream.async_send(msg)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the compute thread (OpenVINO and the stage's state live there)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One inference on the compute thread, counted in ``steps``/``compute_s``; draining waits for it."""
        self._idle.clear()
        started = time.perf_counter()
        try:
            return await self._run(fn, *args)
        finally:
            self.compute_s += time.perf_counter() - started
            self.steps += 1
            self._idle.set()

    async def _timed_compute(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """:meth:`_compute`, and the inference's own ms measured on the compute thread (what the
        stage reports in the frame's stage times: no queueing, no event-loop delay)."""
        def timed() -> tuple[Any, float]:
            started = time.perf_counter()
            out = fn(*args)
            return out, 1000 * (time.perf_counter() - started)

        return await self._compute(timed)

    async def async_drain(self) -> None:
        """Refuse new streams (or sessions) and wait for the inference in hand to finish."""
        self.draining = True
        await self._idle.wait()

    async def async_close(self) -> None:
        await self._server.async_close()
        await self.downstream.async_close()
        self._executor.shutdown(wait=True)


class SessionServer(StageServer):
    """A stage whose state is one *session* at a time (the static and the paged workers): the
    session belongs to the upstream connection that opened it; another connection's frames are
    refused while that one is open, and once it has ended the next connection to carry frames
    takes the session over."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.session: StreamId | None = None
        self._owner: Connection | None = None  # the upstream connection whose session this is

    @property
    def stream_count(self) -> int:
        """Sessions held (0 or 1): what a draining worker waits to reach 0."""
        return int(self.session is not None)

    async def _carried_by(self, conn: Connection, msg: Message, session: StreamId) -> bool:
        """True when ``conn`` may carry ``msg`` (a frame of ``session``): it owns the session, nobody
        does, or the owner's connection has ended (``conn`` takes over). Otherwise the frame is
        refused to ``conn`` (never passed on, so it cannot reach the coordinator) and False.
        An open owner is given :data:`OWNER_CLOSE_GRACE_S` to be seen closed first (a redial)."""
        owner = self._owner
        if owner is None or owner is conn:
            return True
        if owner.closed or await owner.async_wait_closed(OWNER_CLOSE_GRACE_S):
            self._owner = conn
            return True
        log.warning("stage %d: refused %s from %s: another connection owns the session", self.index,
                    type(msg).__name__, conn.peername)
        await conn.async_send(Error(ErrorCode.UNKNOWN_STREAM, "this connection holds no session here", session,
                                    getattr(msg, "seq", 0)))
        return False
