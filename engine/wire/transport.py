"""The data-plane transport: wire frames over persistent TCP (optionally mutual TLS), on asyncio.

Everything here runs on the process's one event loop (hence the ``async_`` prefix). Every wait
is bounded and raises a named WireError subclass; nothing in this module blocks forever. A
connection that receives a malformed, truncated, oversized or stalled frame gets an Error frame
and is closed: the byte stream can no longer be trusted to be in step, so no later frame on it
could be. Other connections, and so other users' streams, are never touched.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from contextlib import suppress
from ssl import SSLContext, SSLError

from engine.suppress import logged_suppress
from engine.trust.fleet_ca import peer_node_id
from engine.wire.codec import decode_body, decode_header, encode_parts
from engine.wire.format import (
    HANDSHAKE_REPLY_BYTES,
    HEADER_SIZE,
    HELLO_FRAME_BYTES,
    MAX_FRAME_BYTES,
    ErrorCode,
    FrameError,
    FrameTooLargeError,
    TruncatedFrameError,
    UnexpectedFrameError,
    WireError,
)
from engine.wire.handshake import (
    HandshakeError,
    LocalIdentity,
    check_hello,
    check_hello_ack,
    handshake_error_from,
)
from engine.wire.messages import Error, Hello, HelloAck, Message, Ping, error_frame

log = logging.getLogger(__name__)

FRAME_TIMEOUT = 60.0  # seconds for the rest of a frame once its first byte arrived
IDLE_TIMEOUT = 300.0  # seconds a link may stay silent; idle peers send Ping to stay under it
WRITE_TIMEOUT = 60.0  # seconds for the peer to take a frame off our send buffer
HANDSHAKE_TIMEOUT = 10.0  # seconds for TLS + Hello/HelloAck
DIAL_DEADLINE = 60.0  # seconds async_dial_with_retry keeps trying by default
CLOSE_TIMEOUT = 2.0  # seconds for an orderly (TLS close_notify) shutdown before we abort
LINGER_SECONDS = 1.0  # after an Error frame: how long we drain the peer's input before closing
LINGER_BYTES = 16 << 20
PRE_HANDSHAKE_LINGER_BYTES = 64 << 10  # a peer that never handshook gets no more of our time
PING_INTERVAL = 60.0  # seconds between a dialer's Pings, well inside the listener's IDLE_TIMEOUT
# Dead-peer detection below the protocol: first probe after 30 s idle, then every 10 s, 3 misses.
_KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


class FrameTimeoutError(WireError):
    """A frame, a write, a handshake or an idle link exceeded its deadline."""

    code = ErrorCode.TIMEOUT


class IdleTimeoutError(FrameTimeoutError):
    """No frame started within the idle timeout (the link is silent, not mid-frame)."""


class ConnectionClosedError(WireError):
    """The peer closed (or reset) the connection, or it was already closed on our side."""


class DialError(WireError):
    """No connection could be opened within the attempts/deadline, or TLS refused the peer."""


# A peer check takes the peer's node id (None without a certificate) and returns why the peer is
# refused, or None to admit it: ``PeerPolicy.refuse_upstream`` / ``refuse_next`` (engine.trust.peer_policy).
PeerCheck = Callable[[str | None], str | None]


def configure_socket(sock: socket.socket | None) -> None:
    """Set TCP_NODELAY and SO_KEEPALIVE (plus keepalive timing where the OS exposes it).

    NODELAY because a decode step writes one small frame and waits for the answer: Nagle would
    hold it for up to a round trip. Keepalive so a PC that vanished (lid closed, cable pulled)
    surfaces as a closed connection instead of a silent one.
    """
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # in-memory or unix transports in tests: no TCP options to set
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        option = getattr(socket, name, None)
        if option is not None:
            with suppress(OSError):  # older Windows builds lack some of these; defaults then apply
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


async def async_read_frame(
    reader: asyncio.StreamReader,
    max_bytes: int = MAX_FRAME_BYTES,
    *,
    timeout: float = FRAME_TIMEOUT,
    idle_timeout: float | None = IDLE_TIMEOUT,
) -> Message:
    """Read, validate and decode the next frame.

    ``idle_timeout`` bounds the wait for the frame's first byte (None: rely on TCP keepalive);
    ``timeout`` bounds the rest, so a peer that stalls mid-frame cannot hold us. Raises
    ConnectionClosedError at a clean end of stream, TruncatedFrameError if the stream ends
    mid-frame, FrameTimeoutError, or a FrameError subclass for a frame that breaks the rules.
    """
    try:
        try:
            async with asyncio.timeout(idle_timeout):
                first = await reader.readexactly(1)
        except TimeoutError:
            raise IdleTimeoutError(
                f"no frame for {idle_timeout:g} s on an idle link; the peer should send Ping "
                "while it has nothing else to say"
            ) from None
        except asyncio.IncompleteReadError:
            raise ConnectionClosedError("the peer closed the connection") from None
        got = 1
        try:
            async with asyncio.timeout(timeout):
                rest = await reader.readexactly(HEADER_SIZE - 1)
                got = HEADER_SIZE
                header = decode_header(first + rest, max_frame_bytes=max_bytes)
                body = await reader.readexactly(header.body_len)
        except TimeoutError:
            raise FrameTimeoutError(
                f"the peer stalled mid-frame: the frame was not complete {timeout:g} s after "
                "its first byte; check the network between the two nodes"
            ) from None
        except asyncio.IncompleteReadError as exc:
            raise TruncatedFrameError(
                f"the peer closed the connection mid-frame after {got + len(exc.partial)} bytes"
            ) from None
        return decode_body(header, body)
    except OSError as exc:  # reset, TLS alert (ssl.SSLError is an OSError): the link is gone
        raise ConnectionClosedError(f"connection lost while reading: {exc}") from exc


async def async_write_frame(
    writer: asyncio.StreamWriter,
    msg: Message,
    *,
    max_bytes: int = MAX_FRAME_BYTES,
    timeout: float = WRITE_TIMEOUT,
) -> int:
    """Encode ``msg`` and write it, waiting at most ``timeout`` for the peer to accept it; the
    frame's size in bytes.

    ``max_bytes`` is the bound the *peer* announced. Raises FrameTooLargeError before anything
    is written, FrameTimeoutError for a peer that stopped reading, ConnectionClosedError.
    """
    parts = encode_parts(msg, max_frame_bytes=max_bytes)
    try:
        writer.writelines(parts)  # synchronous: frames from concurrent senders never interleave
        async with asyncio.timeout(timeout):
            await writer.drain()
    except TimeoutError:
        raise FrameTimeoutError(
            f"the peer did not take a frame within {timeout:g} s; it is overloaded or gone"
        ) from None
    except OSError as exc:
        raise ConnectionClosedError(f"connection lost while writing: {exc}") from exc
    return sum(memoryview(p).nbytes for p in parts)


class Connection:
    """One persistent data-plane connection (either end): send/receive whole messages.

    Sends are serialised by a lock and receives by another, so several tasks may share it.
    ``peer_max_frame_bytes`` starts at our own bound and becomes the peer's after the handshake.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        frame_timeout: float = FRAME_TIMEOUT,
        write_timeout: float = WRITE_TIMEOUT,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.max_frame_bytes = max_frame_bytes
        self.peer_max_frame_bytes = max_frame_bytes
        self.frame_timeout = frame_timeout
        self.write_timeout = write_timeout
        self.peer_hello: Hello | None = None  # listener side: what the dialer announced
        # Cached now: asyncio's TLS transport cannot answer get_extra_info once it is closed.
        peer = writer.get_extra_info("peername")
        self.peername = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        ssl_object = writer.get_extra_info("ssl_object")
        self._peer_cert = ssl_object.getpeercert(binary_form=True) if ssl_object else None
        self._send_lock = asyncio.Lock()
        self._recv_lock = asyncio.Lock()
        self.bytes_sent = 0  # frames written, in bytes (a stage's figure for its hop)
        self._closed = False
        self._closed_event = asyncio.Event()

    @property
    def closed(self) -> bool:
        """True once async_close started; no frame is sent after that."""
        return self._closed

    async def async_wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for this connection to close (from any task); True if it has."""
        with suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._closed_event.wait()
        return self._closed

    def get_extra_info(self, name: str) -> object:
        """Transport details (``socket``, ``ssl_object``, ...) as asyncio names them; None once
        the connection is closed."""
        if self._closed:
            return None
        try:
            return self._writer.get_extra_info(name)
        except AttributeError:  # asyncio's TLS transport after the peer dropped the connection
            return None

    def peer_certificate(self) -> bytes | None:
        """The peer's TLS certificate (DER), whose fingerprint is its node id; None without TLS."""
        return self._peer_cert

    @property
    def peer_node_id(self) -> str | None:
        """sha256 of the peer's certificate (its node id, ``engine.trust.fleet_ca.peer_node_id``); None without TLS."""
        return peer_node_id(self._peer_cert) if self._peer_cert else None

    async def async_send(self, msg: Message) -> None:
        """Send one message, bounded by the peer's announced frame size."""
        if self._closed:
            raise ConnectionClosedError(f"connection to {self.peername} is closed; dial again")
        async with self._send_lock:
            self.bytes_sent += await async_write_frame(
                self._writer, msg, max_bytes=self.peer_max_frame_bytes, timeout=self.write_timeout
            )

    async def async_recv(
        self,
        *,
        idle_timeout: float | None = IDLE_TIMEOUT,
        frame_timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> Message:
        """Receive the next message (an Error frame is returned as data, not raised).

        ``max_bytes`` bounds this one frame below ``max_frame_bytes`` (the handshake's frames).
        """
        if self._closed:
            raise ConnectionClosedError(f"connection to {self.peername} is closed; dial again")
        async with self._recv_lock:
            return await async_read_frame(
                self._reader,
                self.max_frame_bytes if max_bytes is None else min(max_bytes, self.max_frame_bytes),
                timeout=self.frame_timeout if frame_timeout is None else frame_timeout,
                idle_timeout=idle_timeout,
            )

    async def async_close(self, error: Error | None = None, *, linger_bytes: int = LINGER_BYTES) -> None:
        """Close the connection, first telling the peer why if ``error`` is given. Idempotent.

        After an Error the peer's input is drained (up to ``linger_bytes``; 0: not at all, for a
        close from another task than the one reading) so that our Error reaches it.
        """
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        try:
            if error is not None:
                with suppress(WireError):
                    await async_write_frame(
                        self._writer, error, max_bytes=MAX_FRAME_BYTES, timeout=LINGER_SECONDS
                    )
                if self._writer.can_write_eof():
                    with suppress(OSError):
                        self._writer.write_eof()
                if linger_bytes:
                    await self._async_linger(linger_bytes)
        finally:
            self._writer.close()
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await self._writer.wait_closed()
            except OSError:  # includes TimeoutError (peer ignored close_notify) and SSLError
                self._writer.transport.abort()

    async def _async_linger(self, limit: int) -> None:
        # Closing a socket whose receive buffer still holds the rest of a bad frame makes the
        # kernel send RST, which can destroy our Error frame before the peer reads it. So drain
        # the peer's input for a moment; a well-behaved peer closes once it read our Error.
        discarded = 0
        with suppress(OSError):  # TimeoutError and SSLError are OSErrors too
            async with asyncio.timeout(LINGER_SECONDS):
                while discarded < limit:
                    chunk = await self._reader.read(64 * 1024)
                    if not chunk:
                        return
                    discarded += len(chunk)


def _wrap(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_bytes: int
) -> Connection:
    configure_socket(writer.get_extra_info("socket"))
    return Connection(reader, writer, max_frame_bytes=max_frame_bytes)


async def async_dial_with_retry(
    host: str,
    port: int,
    ssl: SSLContext | None = None,
    *,
    attempts: int | None = None,
    deadline: float = DIAL_DEADLINE,
    server_hostname: str | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    first_delay: float = 0.05,
    max_delay: float = 2.0,
) -> Connection:
    """Open a TCP (TLS if ``ssl``) connection, retrying with backoff until it succeeds.

    Retries refused/unreachable/timed-out attempts until ``attempts`` (None: unlimited) or
    ``deadline`` seconds run out, so stages may start in any order. A TLS failure is not
    retried: certificates do not fix themselves. Raises DialError naming host, port and cause.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    delay = first_delay
    attempt = 0
    last: OSError | None = None
    while True:
        attempt += 1
        remaining = start + deadline - loop.time()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                reader, writer = await asyncio.open_connection(
                    host,
                    port,
                    ssl=ssl,
                    server_hostname=server_hostname if ssl is not None else None,
                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT if ssl is not None else None,
                )
            return _wrap(reader, writer, max_frame_bytes)
        except SSLError as exc:
            raise DialError(
                f"TLS with {host}:{port} failed: {exc}; check that both nodes hold certificates "
                "signed by the same fleet CA (re-join the node from the console)"
            ) from exc
        except OSError as exc:  # includes TimeoutError and ConnectionRefusedError
            level = logging.WARNING if attempt == 1 else logging.DEBUG
            log.log(level, "dial %s:%s attempt %d failed: %s; retrying", host, port, attempt, exc)
            last = exc
        elapsed = loop.time() - start
        if (attempts is not None and attempt >= attempts) or elapsed + delay >= deadline:
            raise DialError(
                f"could not connect to {host}:{port} after {attempt} attempts in {elapsed:.1f} s "
                f"({last}); check that the stage worker there is running and that its firewall "
                "allows the data port"
            )
        await asyncio.sleep(delay)  # backoff between attempts, not synchronisation
        delay = min(delay * 2, max_delay)


async def async_client_handshake(
    conn: Connection, hello: Hello, *, timeout: float = HANDSHAKE_TIMEOUT
) -> HelloAck:
    """Send ``hello`` and wait for the listener's HelloAck.

    On a refusal the connection is closed and HandshakeError is raised with ``field`` naming
    what did not match (protocol_version, model_fingerprint, stage_index, role).
    """
    try:
        await conn.async_send(hello)
        reply = await conn.async_recv(
            idle_timeout=timeout, frame_timeout=timeout, max_bytes=HANDSHAKE_REPLY_BYTES
        )
    except ConnectionClosedError as exc:
        await conn.async_close()
        raise HandshakeError(
            f"{conn.peername} closed the connection during the handshake ({exc}); with TLS this "
            "usually means it refused our certificate",
            "connection",
        ) from exc
    except WireError:
        await conn.async_close()
        raise
    if isinstance(reply, Error):
        await conn.async_close()
        raise handshake_error_from(reply)
    if not isinstance(reply, HelloAck):
        await conn.async_close(Error(ErrorCode.UNEXPECTED_FRAME, "expected HelloAck"))
        raise HandshakeError(f"expected HelloAck, got {type(reply).__name__}", "frame")
    try:
        check_hello_ack(hello, reply)
    except HandshakeError:
        await conn.async_close()
        raise
    conn.peer_max_frame_bytes = reply.max_frame_bytes
    return reply


async def async_await_hello(
    conn: Connection, local: LocalIdentity, timeout: float
) -> Hello | Error:
    """Read the dialer's Hello; accept it with a HelloAck, or return the refusal to send.

    Raises (without closing) the WireError of a first frame that is malformed or not a Hello.
    """
    # The frame timeout still applies inside the handshake: a stalled Hello is a stalled frame.
    # At most a Hello's size: a first frame announcing more is refused after its header, so a
    # dialer that has not said who it is cannot make us read (or allocate) more than that.
    try:
        msg = await conn.async_recv(
            idle_timeout=timeout,
            frame_timeout=min(timeout, conn.frame_timeout),
            max_bytes=HELLO_FRAME_BYTES,
        )
    except FrameTooLargeError as exc:
        raise UnexpectedFrameError(
            f"the first frame must be a Hello of at most {HELLO_FRAME_BYTES} bytes ({exc}); "
            "dial with async_connect()"
        ) from None
    if not isinstance(msg, Hello):
        raise UnexpectedFrameError(
            f"the first frame must be Hello, got {type(msg).__name__}; dial with async_connect()"
        )
    refusal = check_hello(msg, local)
    if refusal is not None:
        return refusal
    conn.peer_hello = msg
    conn.peer_max_frame_bytes = msg.max_frame_bytes
    await conn.async_send(
        HelloAck(local.model_fingerprint, local.stage_index, conn.max_frame_bytes)
    )
    return msg


async def async_server_handshake(
    conn: Connection, local: LocalIdentity, *, timeout: float = HANDSHAKE_TIMEOUT
) -> Hello:
    """Wait for the dialer's Hello and accept it with a HelloAck, or refuse it and close.

    A refusal sends an Error frame naming the mismatching field, closes, and raises
    HandshakeError; a malformed or unexpected first frame is answered the same way and its
    WireError raised.
    """
    try:
        outcome = await async_await_hello(conn, local, timeout)
    except (FrameError, FrameTimeoutError) as exc:
        await conn.async_close(error_frame(exc))
        raise
    if isinstance(outcome, Error):
        await conn.async_close(outcome)
        raise handshake_error_from(outcome, sent=True)
    return outcome


async def async_connect(
    host: str,
    port: int,
    hello: Hello,
    *,
    ssl: SSLContext | None = None,
    attempts: int | None = None,
    deadline: float = DIAL_DEADLINE,
    server_hostname: str | None = None,
    peer_check: PeerCheck | None = None,
) -> Connection:
    """Dial (with retry) and handshake: the one call a stage or the coordinator makes.

    With ``peer_check`` the listener's certificate is checked before anything is sent: a
    listener that is some other member (a taken-over address, a stale placement) gets no Hello
    and no step; HandshakeError with ``field`` "peer" is raised.
    """
    conn = await async_dial_with_retry(
        host,
        port,
        ssl,
        attempts=attempts,
        deadline=deadline,
        server_hostname=server_hostname,
        max_frame_bytes=hello.max_frame_bytes,
    )
    if peer_check is not None:
        reason = peer_check(conn.peer_node_id)
        if reason is not None:
            await conn.async_close()
            raise HandshakeError(
                f"refused to handshake with {host}:{port}: {reason}", "peer", ErrorCode.PEER_REFUSED
            )
    await async_client_handshake(conn, hello)
    return conn


async def async_hold(conn: Connection, name: str, interval: float = PING_INTERVAL) -> None:
    """Keep a dialled connection alive and watched until it ends (run it as a task).

    Nothing but Pong (or an Error before the listener closes) flows back on a ring hop, so read
    it only to learn at once when the listener goes away, and Ping after ``interval`` s of
    silence so the listener's idle timeout never closes a hop that is merely between requests.
    Returns (never raises) once the connection is closed (or sent a frame larger than an
    Error), having closed it.
    """
    seq = 0
    try:
        while True:
            try:
                # At most an Error's size: a next hop sends nothing bigger back, and one that
                # announces a tensor-sized frame is dropped after its header, not read.
                msg = await conn.async_recv(idle_timeout=interval, max_bytes=HANDSHAKE_REPLY_BYTES)
            except IdleTimeoutError:
                seq += 1
                await conn.async_send(Ping(seq))
                continue
            if isinstance(msg, Error):
                log.warning("%s: %s refused or closed the link: %s", name, conn.peername, msg.message)
            else:
                log.debug("%s: %r from %s", name, msg, conn.peername)
    except asyncio.CancelledError:
        raise
    except Exception:  # closed, reset, or garbage: in every case this connection is done
        with logged_suppress(log, f"{name}: closing the link to {conn.peername}"):
            await conn.async_close()
