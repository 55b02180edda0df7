"""Connection caps and read deadlines for the fleet's aiohttp listeners.

aiohttp bounds the size of headers and bodies but not how long a client may take to send them, nor
how many connections a listener holds: a host trickling one header byte every 20 s held a
listener's every connection for minutes. :class:`LimitedAppRunner` is an ``aiohttp.web.AppRunner``
that every HTTP listener of the fleet uses (the OpenAI API, enrolment, the hub, the agent's control
API, the admin API). Per connection it enforces:

- a **header deadline**: a request's line and headers must all arrive within ``header_timeout_s``
  of its first byte (of the connection, for the first request); else the connection is closed;
- a **body deadline**: the whole body must arrive within ``body_timeout_s`` of the headers (past
  it the handler's read of the body raises 408 ``Request Timeout``);
- an **idle deadline**: a keep-alive connection without a request is closed after
  ``idle_timeout_s`` (aiohttp's ``keepalive_timeout``);
- **caps** of ``per_ip`` connections per peer address and ``total`` in all, that **reclaim**: a
  connection that has no request running (idle, or still sending its headers or body) is
  reclaimable. A new connection past a cap closes the longest-waiting reclaimable connection of
  its own address (per-address cap) or of the address holding the most (total cap); only when
  every connection in the way is running a request is the newcomer closed at once.

So a slow or silent client can delay nobody: its connections go first when someone else needs a
slot, and go anyway after the deadline. The policy is :class:`ConnectionCounter` (pure, no
sockets); :class:`_Counted` wraps aiohttp's per-connection protocol and carries it out. Over TLS
the count applies once the handshake is done (asyncio hands the connection to the protocol then);
the handshake itself must end within ``header_timeout_s`` (:class:`LimitedSite`, every listener's
site; asyncio's default would be 60 s), so a silent TLS client holds a file descriptor no longer
than a trickling HTTP one.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from aiohttp import web

log = logging.getLogger(__name__)

MAX_PER_IP = 32
MAX_TOTAL = 256
HEADER_TIMEOUT_S = 10.0  # a request line and headers are one packet from any honest client
BODY_TIMEOUT_S = 30.0  # the largest body (4 MiB, the control API's) in 30 s is ~1 Mbit/s
IDLE_TIMEOUT_S = 75.0  # keep-alive without a request


@dataclass(frozen=True)
class ConnectionLimits:
    """At most ``per_ip`` connections from one peer address and ``total`` in all, and the read
    deadlines (seconds) of the module docstring."""

    per_ip: int = MAX_PER_IP
    total: int = MAX_TOTAL
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 < self.per_ip <= self.total:
            raise ValueError(f"connection limits need 0 < per_ip ({self.per_ip}) <= total ({self.total})")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"connection limits need a finite positive {name}, not {getattr(self, name)}")


DEFAULT_LIMITS = ConnectionLimits()


class Phase(enum.Enum):
    """Where a connection is: only RUNNING (its request's handler runs) holds its slot firmly."""

    WAITING = "waiting"  # idle, or sending a request line, headers or body
    RUNNING = "running"


C = TypeVar("C", bound=Hashable)


@dataclass
class _Slot:
    ip: str
    phase: Phase
    since: float  # when it last became WAITING: the longest-waiting is reclaimed first


@dataclass(frozen=True)
class Admission(Generic[C]):
    """``admitted``: the newcomer takes a slot; ``reclaim``: the connection to close for it."""

    admitted: bool
    reclaim: C | None = None


class ConnectionCounter(Generic[C]):
    """The policy: who holds which slot and in what phase; ``refused`` counts the newcomers turned
    away, ``reclaimed`` the waiting connections closed to make room."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.by_ip: collections.Counter[str] = collections.Counter()
        self._slots: dict[C, _Slot] = {}
        self.refused = 0
        self.reclaimed = 0

    @property
    def total(self) -> int:
        return len(self._slots)

    def admit(self, conn: C, ip: str, now: float) -> Admission[C]:
        victim: C | None = None
        if self.by_ip[ip] >= self.limits.per_ip:
            victim = self._longest_waiting(lambda slot: slot.ip == ip)
        elif self.total >= self.limits.total:
            most = max(self.by_ip.values())
            crowded = {a for a, n in self.by_ip.items() if n == most}
            victim = self._longest_waiting(lambda slot: slot.ip in crowded)
            if victim is None:
                victim = self._longest_waiting(lambda slot: True)
        full = self.by_ip[ip] >= self.limits.per_ip or self.total >= self.limits.total
        if full and victim is None:
            self.refused += 1
            return Admission(False)
        if victim is not None:
            self.release(victim)
            self.reclaimed += 1
        self._slots[conn] = _Slot(ip, Phase.WAITING, now)
        self.by_ip[ip] += 1
        return Admission(True, victim)

    def _longest_waiting(self, among: Callable[[_Slot], bool]) -> C | None:
        waiting = [(slot.since, n, conn) for n, (conn, slot) in enumerate(self._slots.items())
                   if slot.phase is Phase.WAITING and among(slot)]
        return min(waiting)[2] if waiting else None

    def running(self, conn: C) -> None:
        if (slot := self._slots.get(conn)) is not None:
            slot.phase = Phase.RUNNING

    def waiting(self, conn: C, now: float) -> None:
        if (slot := self._slots.get(conn)) is not None:
            slot.phase, slot.since = Phase.WAITING, now

    def release(self, conn: C) -> None:
        """Forget ``conn`` (closed, or reclaimed); a second release is a no-op."""
        slot = self._slots.pop(conn, None)
        if slot is None:
            return
        self.by_ip[slot.ip] -= 1
        if self.by_ip[slot.ip] <= 0:
            del self.by_ip[slot.ip]


class _Counted(asyncio.Protocol):
    """aiohttp's request handler behind the gate: admitted connections pass straight through; the
    header deadline runs while the connection waits for a request's headers."""

    def __init__(self, inner: asyncio.Protocol, runner: LimitedAppRunner) -> None:
        self._inner = inner
        self._runner = runner
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None  # the header deadline
        self._body_deadline: asyncio.TimerHandle | None = None
        self._phase: Phase | None = None  # None: refused, or gone
        self._in_request = False  # its headers are in: the body deadline, not the header deadline, runs
        self._body_read = False  # the running request's body is in: bytes now start the next request
        self._pending = False  # bytes of a next request arrived while one ran

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        loop = asyncio.get_running_loop()
        counter, limits = self._runner.connections, self._runner.connections.limits
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
        admission = counter.admit(self, ip, loop.time())
        if not admission.admitted:
            if counter.refused in (1, 10, 100) or counter.refused % 1000 == 0:
                log.warning("%s: connection from %s refused: every slot is running a request (cap %d per address, "
                            "%d in all; %d refused so far)", self._runner.what, ip, limits.per_ip, limits.total,
                            counter.refused)
            cast(asyncio.Transport, transport).abort()  # a listening socket's transports are Transports
            return
        if admission.reclaim is not None:
            if counter.reclaimed in (1, 10, 100) or counter.reclaimed % 1000 == 0:
                log.warning("%s: a waiting connection was closed to admit one from %s (cap %d per address, %d in "
                            "all; %d reclaimed so far)", self._runner.what, ip, limits.per_ip, limits.total,
                            counter.reclaimed)
            admission.reclaim.expire()
        self._transport = cast(asyncio.Transport, transport)
        self._phase = Phase.WAITING
        self._runner.by_transport[transport] = self
        self._inner.connection_made(transport)
        self._arm()  # the first request is due from the connection's start

    def _arm(self) -> None:
        if self._deadline is None and self._phase is Phase.WAITING and not self._in_request:
            self._deadline = asyncio.get_running_loop().call_later(
                self._runner.connections.limits.header_timeout_s, self.expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def expire(self) -> None:
        """Close the connection: past its header deadline, or reclaimed for a newcomer."""
        self._deadline = None
        self._runner.connections.release(self)
        if self._transport is not None:
            self._transport.abort()

    def request_started(self, request: web.Request) -> None:
        """The request's headers are in: the body deadline replaces the header deadline; the
        connection runs once the whole body is in (at once for a request without one)."""
        self._disarm()
        self._in_request, self._body_read = True, False
        limits = self._runner.connections.limits
        self._body_deadline = asyncio.get_running_loop().call_later(
            limits.body_timeout_s, self._body_late, request.content, limits.body_timeout_s)
        request.content.on_eof(self._body_in)

    def _body_in(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None
        if self._phase is Phase.WAITING and self._in_request:
            self._body_read = True
            self._phase = Phase.RUNNING
            self._runner.connections.running(self)

    def _body_late(self, body: Any, timeout_s: float) -> None:
        """Past the body deadline: the handler's read of the body raises 408 (the connection is then
        waiting, and closed by the header deadline if it keeps sending)."""
        self._body_deadline = None
        body.set_exception(web.HTTPRequestTimeout(text=f"the request body did not arrive within {timeout_s:g} s",
                                                  headers={"Connection": "close"}))

    def request_done(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None
        if self._phase is None:
            return
        self._phase, self._in_request, self._body_read = Phase.WAITING, False, False
        self._runner.connections.waiting(self, asyncio.get_running_loop().time())
        if self._pending:  # a pipelined request began while this one ran: its deadline runs now
            self._pending = False
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if (transport := self._transport) is None:
            return  # refused: the handler never saw it
        self.request_done()
        self._disarm()
        self._phase = None
        self._runner.connections.release(self)
        self._runner.by_transport.pop(transport, None)
        self._transport = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
        if data and not self._in_request:
            self._arm()
        elif data and self._body_read:
            self._pending = True
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._transport is not None else None

    def pause_writing(self) -> None:
        if self._transport is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._inner.resume_writing()


class LimitedAppRunner(web.AppRunner):
    """An AppRunner whose sites enforce ``limits`` (see the module docstring). It adds one
    middleware, outermost, to ``app``: it ends the header deadline when a request's headers are in,
    starts the body deadline, and marks the connection running once the body is in."""

    def __init__(self, app: web.Application, *, limits: ConnectionLimits = DEFAULT_LIMITS,
                 what: str = "listener", **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", limits.idle_timeout_s)
        super().__init__(app, **kwargs)
        self.connections: ConnectionCounter[_Counted] = ConnectionCounter(limits)
        self.by_transport: dict[asyncio.BaseTransport, _Counted] = {}
        self.what = what
        app.middlewares.insert(0, self._deadlines)

    @web.middleware
    async def _deadlines(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        conn = self.by_transport.get(request.transport) if request.transport is not None else None
        if conn is None:
            return await handler(request)
        conn.request_started(request)
        try:
            return await handler(request)
        finally:
            conn.request_done()

    # aiohttp annotates ``server`` as its Server, but TCPSite only hands it to create_server as a
    # protocol factory, which is what this returns.
    @property
    def server(self) -> Callable[[], asyncio.Protocol] | None:  # type: ignore[override]
        inner = super().server
        if inner is None:
            return None
        return lambda: _Counted(inner(), self)


class LimitedSite(web.TCPSite):
    """A TCP site of a :class:`LimitedAppRunner` whose TLS handshakes end within the runner's header
    deadline: a peer that opens a connection and never finishes its handshake is dropped then."""

    def __init__(self, runner: LimitedAppRunner, host: str | None, port: int | None, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self._handshake_timeout_s = runner.connections.limits.header_timeout_s

    async def start(self) -> None:
        if self._ssl_context is None:
            await super().start()
            return
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port,
            ssl_handshake_timeout=self._handshake_timeout_s)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port
