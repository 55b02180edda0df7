"""The coordinator's two ends of a ring of stage workers, whatever the runtime: :class:`RingEnds`.

Steps go out on one connection to the first remote stage (dialled with retry, kept open by
pings, checked against the peer policy); replies come back from the last stage on a return port
this side listens on, not hop by hop. A runtime's path (paged:
:class:`~engine.paged.ring_path.PagedRingPath`; static:
:class:`~engine.static.packed_ring.PackedRingPath`) adds only its frames: what it sends, and what
``_on_return`` makes of a reply.

With TLS a :class:`~engine.trust.peer_policy.PeerPolicy` is required: its ``upstream`` is the node id
of the ring's last stage (the only member whose replies the return port takes) and its ``next``
the node id of the first remote stage (checked before a step is sent to it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from ssl import SSLContext

from engine.ring.stage_times import STEP_BUCKETS, StageTimes, bucket_of, histogram_metrics
from engine.suppress import logged_suppress
from engine.tasks import start_task
from engine.trust.peer_policy import PeerPolicy, PeerPolicyError
from engine.wire.address import Address
from engine.wire.format import (
    COORDINATOR_STAGE,
    HEADER_SIZE,
    MAX_FRAME_BYTES,
    MAX_FRAME_STAGES,
    MIN_FRAME_BOUND,
    PACKED_META,
    Role,
)
from engine.wire.frame_server import FrameServer
from engine.wire.handshake import LocalIdentity
from engine.wire.messages import Hello, Message
from engine.wire.transport import IDLE_TIMEOUT, PING_INTERVAL, Connection, async_connect, async_hold

log = logging.getLogger(__name__)


def return_frame_bound(vocab_size: int, context: int) -> int:
    """The largest frame the last stage of a static ring can legitimately send the return port:
    Logits of ``context`` rows of float32 over the vocabulary (a step that wanted every row), which
    is more than Tokens (12 bytes a row) of as many rows, plus the header and their row metadata.
    (A paged ring's bound is :func:`engine.wire.step_codec.step_reply_bound`.)"""
    meta = PACKED_META.size + 3 * 8 * context + 4 * MAX_FRAME_STAGES
    bound = HEADER_SIZE + meta + 4 * max(vocab_size, 3) * context
    return min(MAX_FRAME_BYTES, max(MIN_FRAME_BOUND, bound))


class RingEnds:
    """The return port, the first hop, the peer policy, pings and the stages' reported times.

    Subclasses send their runtime's frames on ``_out`` and turn replies into results in
    :meth:`_on_return`; :attr:`hosts_stage0` says whether stage 0 runs in this process (the first
    remote stage is then stage 1, greeted as a stage).
    """

    def __init__(self, fingerprint: str, num_stages: int, first_remote: Address, return_listen: Address, *,
                 server_ssl: SSLContext | None = None, client_ssl: SSLContext | None = None,
                 dial_deadline: float = 120.0, peers: PeerPolicy | None = None,
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
        self._client_ssl = client_ssl
        self._dial_deadline = dial_deadline
        identity = LocalIdentity(fingerprint, COORDINATOR_STAGE, frozenset({Role.STAGE}))
        # max_frame_bytes: the runtime's reply bound when the caller knows the export; a larger frame
        # from the last stage is refused from its header, before its body is read
        self._returns = FrameServer(self._on_return, identity, ssl=server_ssl, idle_timeout=idle_timeout,
                                    max_frame_bytes=max_frame_bytes,
                                    peer_check=self._check_last if server_ssl is not None else None)
        self._ping_interval = ping_interval
        self._out: Connection | None = None
        self._hold: asyncio.Task | None = None
        self._listening = False
        self._sent_at: dict[object, float] = {}
        self._roundtrips: collections.deque[float] = collections.deque(maxlen=256)
        self.stage_times = StageTimes()  # every stage's compute ms, as the replies report them
        self._roundtrip_counts = [0] * (len(STEP_BUCKETS) + 1)  # every round trip, for ring_step_seconds
        self._roundtrip_sum = 0.0
        self._sent_before = 0  # bytes sent to the first stage over connections closed since

    # -- who may be at either end --------------------------------------------------------------

    def _check_last(self, node_id: str | None) -> str | None:
        return self.peers.refuse_upstream(node_id)

    def _check_first(self, node_id: str | None) -> str | None:
        return self.peers.refuse_next(node_id)

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
            with logged_suppress(log, "closing the connection to a refused first stage"):
                await out.async_close()

    # -- the return port -----------------------------------------------------------------------

    @property
    def return_address(self) -> Address:
        host, port = self._returns.address
        return Address(host, port)

    @property
    def returns(self) -> FrameServer:
        """The return port's listener (its ``stats`` count refusals)."""
        return self._returns

    async def async_listen(self) -> Address:
        """Open the return port (idempotent): the last stage needs its address before it starts."""
        if not self._listening:
            await self._returns.async_start(self.return_listen.host, self.return_listen.port)
            self._listening = True
        return self.return_address

    async def _on_return(self, conn: Connection, msg: Message) -> None:
        """A frame from the last stage; each runtime reads its own replies."""
        log.debug("ring: ignoring %r on the return port", msg)

    # -- the first hop -------------------------------------------------------------------------

    @property
    def hosts_stage0(self) -> bool:
        """Stage 0 runs in this process: the first remote stage is stage 1, greeted as a stage."""
        return False

    @property
    def connected(self) -> bool:
        """The connection to the first remote stage is up (as far as this side knows)."""
        return self._out is not None and not self._out.closed

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
        self._hold = start_task(async_hold(self._out, "ring first hop", self._ping_interval),
                                name="deskfleet-ring-hold", logger=log)
        log.info("ring: connected to stage %d at %s; replies on %s", first_index, self.first_remote,
                 self.return_address)

    async def async_reconnect(self, first_remote: Address | None = None, peers: PeerPolicy | None = None) -> None:
        """After a failover: drop the connection to the first remote stage and dial it again, at a
        new address if one is given (and with ``peers``, the node ids of the moved ends). Replies
        keep arriving on the same return port."""
        if peers is not None:
            await self.async_set_peers(peers)
        self._stop_hold()
        if self._out is not None:
            self._sent_before += self._out.bytes_sent
            with logged_suppress(log, "closing the old connection to the first stage"):
                await self._out.async_close()
            self._out = None
        self._sent_at.clear()
        if first_remote is not None:
            self.first_remote = first_remote
        await self.async_start()

    def _stop_hold(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None

    async def async_close(self) -> None:
        self._stop_hold()
        if self._out is not None:
            await self._out.async_close()
        await self._returns.async_close()

    # -- what the replies say about the ring ---------------------------------------------------

    def _sent(self, key: object) -> None:
        """A step keyed ``key`` left for the first stage now (its round trip ends in :meth:`_answered`)."""
        self._sent_at[key] = time.perf_counter()

    def _answered(self, key: object, stage_ms: tuple[float, ...]) -> None:
        """The reply to the step keyed ``key`` arrived, reporting ``stage_ms`` (every stage passed)."""
        sent = self._sent_at.pop(key, None)
        if sent is not None:
            took = time.perf_counter() - sent
            self._roundtrips.append(took)
            self._roundtrip_counts[bucket_of(took)] += 1
            self._roundtrip_sum += took
        self.stage_times.add(stage_ms)

    def stage_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "first_hop_sent_bytes_total": float(self._sent_before + (self._out.bytes_sent if self._out else 0))}
        if self._roundtrips:
            out["ring_step_ms_avg"] = 1000 * sum(self._roundtrips) / len(self._roundtrips)
            out.update(histogram_metrics("ring_step_seconds", "", self._roundtrip_counts, self._roundtrip_sum))
        out.update(self.stage_times.metrics())
        return out
