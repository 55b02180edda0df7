"""The data-plane listener: handshake each connection, check who it is, feed it to a handler.

Built on ``engine.wire.transport`` (frames, connections, the Hello exchange). Everything a stranger
or a fellow member can make it hold is bounded: connections per listener and per peer (IP
address before TLS, node id after), the first frame (at most a Hello, refused after its header
if it announces more), the frames after the handshake (``max_frame_bytes``: a stage passes its
real tensor sizes), and silence (the idle timeout; dialers Ping, see ``async_hold``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from ssl import SSLContext

from engine.trust.peer_policy import short
from engine.wire.format import MAX_FRAME_BYTES, ErrorCode, FrameError, UnexpectedFrameError
from engine.wire.handshake import LocalIdentity
from engine.wire.messages import Error, Hello, HelloAck, Message, Ping, Pong, error_frame
from engine.wire.transport import (
    FRAME_TIMEOUT,
    HANDSHAKE_TIMEOUT,
    IDLE_TIMEOUT,
    LINGER_BYTES,
    PRE_HANDSHAKE_LINGER_BYTES,
    Connection,
    ConnectionClosedError,
    FrameTimeoutError,
    PeerCheck,
    async_await_hello,
    configure_socket,
)

log = logging.getLogger("engine.wire.transport")  # one logger for the whole data plane

MAX_CONNECTIONS = 64  # per listener: a stage has one upstream, a return port one last stage
MAX_CONNECTIONS_PER_PEER = 8  # per remote IP address and per node id (a failover move briefly holds 2)

FrameHandler = Callable[[Connection, Message], Awaitable[None]]


class _HandlerFailed(Exception):
    """Carries the message a handler failed on; the handler's exception is ``__cause__``."""

    def __init__(self, msg: Message) -> None:
        super().__init__(f"handler failed on {msg!r}")
        self.msg = msg


class FrameServer:
    """A listener that handshakes each connection and feeds its frames to ``handler``.

    ``handler(conn, msg)`` is awaited for every Step/Packed/Tokens/Logits/Release/Error/Pong, in
    arrival order per connection; it answers through ``conn.async_send``. Ping is answered here.
    A connection that breaks the protocol gets an Error frame and is closed; a handler that
    raises gets its connection closed with INTERNAL. Neither affects any other connection.

    ``peer_check`` (with TLS) decides from the dialer's node id whether it may use this port at
    all; it is asked again for every open connection by :meth:`async_recheck` after the policy
    behind it changed. ``on_close(conn)`` is awaited after a handshaken connection ended (its
    owner drops what the connection held). ``stats`` counts how connections ended.
    """

    def __init__(
        self,
        handler: FrameHandler,
        local: LocalIdentity,
        *,
        ssl: SSLContext | None = None,
        peer_check: PeerCheck | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        frame_timeout: float = FRAME_TIMEOUT,
        idle_timeout: float | None = IDLE_TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        max_per_peer: int = MAX_CONNECTIONS_PER_PEER,
        on_close: Callable[[Connection], Awaitable[None]] | None = None,
    ) -> None:
        self._handler = handler
        self._local = local
        self._ssl = ssl
        self._peer_check = peer_check
        self._on_close = on_close
        self._max_frame_bytes = max_frame_bytes
        self._frame_timeout = frame_timeout
        self._idle_timeout = idle_timeout
        self._handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: dict[asyncio.Task[None], Connection] = {}  # past TLS, for async_recheck
        self._per_ip: Counter[str] = Counter()
        self._per_node: Counter[str] = Counter()
        self._warned: set[str] = set()
        self.stats: Counter[str] = Counter()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); valid between async_start and async_close."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("FrameServer.address is known only while it serves (after async_start(), "
                               "before async_close())")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed (TLS handshakes in progress included)."""
        return len(self._tasks)

    async def async_start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Start listening (port 0: any free port) and return the bound address."""
        # TLS is started per connection in _async_accept, after the caps, so a flood of
        # connections that never finish a TLS handshake is refused before it costs one.
        self._server = await asyncio.start_server(self._async_accept, host, port)
        return self.address

    async def async_close(self) -> None:
        """Stop listening and close every connection (peers see the stream end)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def async_recheck(self) -> int:
        """Ask ``peer_check`` again about every open connection and close those it now refuses
        (the policy changed: a revoked member, an upstream moved away). Returns how many."""
        if self._peer_check is None:
            return 0
        closed = 0
        for conn in list(self._conns.values()):
            reason = self._peer_check(conn.peer_node_id)
            if reason is not None and not conn.closed:
                self._end(conn, "peer_refused", f"member {short(conn.peer_node_id)}: {reason}")
                # Another task is reading this connection: no linger (it would read concurrently).
                await conn.async_close(Error(ErrorCode.PEER_REFUSED, f"peer refused: {reason}"), linger_bytes=0)
                closed += 1
        return closed

    def _over_cap(self, ip: str) -> str | None:
        if len(self._tasks) > self.max_connections:  # this connection's task is already counted
            return f"the listener holds its maximum of {self.max_connections} connections"
        if self._per_ip[ip] > self.max_per_peer:
            return f"{ip} already holds {self.max_per_peer} connections to this port"
        return None

    async def _async_accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        ip = peer[0] if isinstance(peer, tuple) else str(peer)
        self._per_ip[ip] += 1
        node: str | None = None
        conn: Connection | None = None
        try:
            full = self._over_cap(ip)
            if full is not None:
                # Before TLS there is no channel to explain on: a bare close, counted and logged.
                self._count("refused_cap", f"refused a connection from {ip}: {full}")
                writer.transport.abort()
                return
            configure_socket(writer.get_extra_info("socket"))
            if self._ssl is not None and not await self._async_start_tls(writer, ip, self._ssl):
                return
            conn = Connection(
                reader, writer, max_frame_bytes=self._max_frame_bytes, frame_timeout=self._frame_timeout
            )
            self._conns[task] = conn
            node = conn.peer_node_id
            if node is not None:
                self._per_node[node] += 1
            refusal = self._admit(conn)
            if refusal is not None:
                await conn.async_close(refusal, linger_bytes=PRE_HANDSHAKE_LINGER_BYTES)
                return
            await self._async_serve(conn)
        except asyncio.CancelledError:
            # async_close (or loop shutdown) cancels these tasks and nothing awaits them; ending
            # quietly keeps asyncio's stream callback, which calls task.exception() on them,
            # from logging a spurious traceback.
            pass
        except Exception:  # a bug in this module must cost one connection, never the listener
            log.exception("data-plane connection from %s failed", ip)
            self.stats["internal_error"] += 1
        finally:
            if conn is not None:
                await conn.async_close()
                if self._on_close is not None and conn.peer_hello is not None:
                    try:
                        await self._on_close(conn)
                    except Exception:  # the owner's cleanup failing must not cost the listener
                        log.exception("cleaning up after %s failed", conn.peername)
            else:
                writer.transport.abort()
            self._conns.pop(task, None)
            self._per_ip[ip] -= 1
            if node is not None:
                self._per_node[node] -= 1
            self._tasks.discard(task)

    async def _async_start_tls(self, writer: asyncio.StreamWriter, ip: str, ctx: SSLContext) -> bool:
        try:
            await writer.start_tls(ctx, ssl_handshake_timeout=self._handshake_timeout)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError; the trust module logged why
            self._count("tls_refused", f"TLS with {ip} failed: {exc}")
            return False
        return True

    def _admit(self, conn: Connection) -> Error | None:
        """The refusal for a connection that may not use this port (peer check, per-node cap)."""
        node = conn.peer_node_id
        if self._peer_check is not None:
            reason = self._peer_check(node)
            if reason is not None:
                self._end(conn, "peer_refused", f"member {short(node)}: {reason}")
                return Error(ErrorCode.PEER_REFUSED, f"peer refused: {reason}")
        if node is not None and self._per_node[node] > self.max_per_peer:
            self._end(conn, "refused_cap", f"member {short(node)} already holds {self.max_per_peer} connections")
            return Error(ErrorCode.PEER_REFUSED, f"peer refused: this member already holds {self.max_per_peer} "
                         "connections to this port; close the others first")
        return None

    async def _async_serve(self, conn: Connection) -> None:
        """Run one connection to its end; count how it ended in ``stats`` before closing it."""
        try:
            hello = await async_await_hello(conn, self._local, self._handshake_timeout)
            if isinstance(hello, Error):
                self._end(conn, "handshake_refused", hello.message)
                await conn.async_close(hello, linger_bytes=PRE_HANDSHAKE_LINGER_BYTES)
                return
            while True:
                msg = await conn.async_recv(idle_timeout=self._idle_timeout)
                if isinstance(msg, Ping):
                    await conn.async_send(Pong(msg.seq))
                elif isinstance(msg, Hello | HelloAck):
                    raise UnexpectedFrameError("a handshake frame arrived after the handshake")
                else:
                    try:
                        await self._handler(conn, msg)
                    except (ConnectionClosedError, FrameTimeoutError):
                        raise  # the peer went away or stopped reading: not the handler's fault
                    except Exception as exc:
                        raise _HandlerFailed(msg) from exc
        except ConnectionClosedError:
            self._end(conn, "closed", "")
        except (FrameError, FrameTimeoutError) as exc:
            kind = "timeout" if isinstance(exc, FrameTimeoutError) else "frame_error"
            self._end(conn, kind, str(exc))
            linger = PRE_HANDSHAKE_LINGER_BYTES if conn.peer_hello is None else LINGER_BYTES
            await conn.async_close(error_frame(exc), linger_bytes=linger)
        except _HandlerFailed as failed:
            cause = failed.__cause__ or failed
            log.error("handler failed on %s from %s", failed.msg, conn.peername, exc_info=cause)
            self._end(conn, "internal_error", "")
            stream = getattr(failed.msg, "stream_id", 0)
            await conn.async_close(error_frame(cause, stream, getattr(failed.msg, "seq", 0)))

    def _end(self, conn: Connection, outcome: str, reason: str) -> None:
        # Each refused member is named once at WARNING: one insider must not hide another.
        key = f"{outcome}:{conn.peer_node_id}" if outcome == "peer_refused" else outcome
        self._count(outcome, f"closing {conn.peername} ({outcome}): {reason}" if reason else "", key)

    def _count(self, outcome: str, text: str, key: str | None = None) -> None:
        self.stats[outcome] += 1
        if text:
            # A misconfigured peer redials forever: say it once at WARNING, then at DEBUG.
            key = key or outcome
            level = logging.DEBUG if key in self._warned else logging.WARNING
            if len(self._warned) < 1024:
                self._warned.add(key)
            log.log(level, "data plane: %s", text)
