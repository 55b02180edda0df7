"""A stage worker's connection to its next hop: the next stage, or the coordinator's return port.

It is dialled on first use (with retry, so the order in which a ring comes up does not matter),
watched so that a next stage that goes away is noticed at once, and redialled once when a send
finds it gone (the next stage came back on its address). Stateful and static workers share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from ssl import SSLContext

from engine.address import Address
from engine.messages import Hello, Message
from engine.transport import Connection, ConnectionClosedError, async_connect
from engine.wire import COORDINATOR_STAGE, Role

log = logging.getLogger(__name__)


class Downstream:
    """The hop from stage ``stage_index`` to ``address`` (the return port when ``is_last``)."""

    def __init__(self, fingerprint: str, stage_index: int, is_last: bool, address: Address, *,
                 client_ssl: SSLContext | None = None, dial_deadline: float = 120.0):
        self.fingerprint = fingerprint
        self.stage_index = stage_index
        self.is_last = is_last
        self.address = address
        self._client_ssl = client_ssl
        self._dial_deadline = dial_deadline
        self._conn: Connection | None = None
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task | None = None

    async def _connection(self) -> Connection:
        async with self._lock:
            if self._conn is None or self._conn.closed:
                next_index = COORDINATOR_STAGE if self.is_last else self.stage_index + 1
                hello = Hello(self.fingerprint, next_index, Role.STAGE)
                self._conn = await async_connect(self.address.host, self.address.port, hello,
                                                 ssl=self._client_ssl, deadline=self._dial_deadline)
                self._watch = asyncio.create_task(self._watch_connection(self._conn))
                log.info("stage %d connected to %s", self.stage_index, self.address)
            return self._conn

    async def _watch_connection(self, conn: Connection) -> None:
        """Nothing flows back on the downstream hop, so read it only to learn at once when the
        next stage goes away (crash, kill, pause): the next frame then dials it afresh instead of
        vanishing into a dead socket."""
        try:
            while True:
                msg = await conn.async_recv(idle_timeout=None)
                log.debug("stage %d: %r from downstream", self.stage_index, msg)
        except Exception:  # closed, reset, or garbage: in every case this connection is done
            with contextlib.suppress(Exception):
                await conn.async_close()
            log.info("stage %d: the connection to %s is gone", self.stage_index, self.address)

    async def async_send(self, msg: Message) -> None:
        conn = await self._connection()
        try:
            await conn.async_send(msg)
        except (ConnectionClosedError, OSError):
            with contextlib.suppress(Exception):
                await conn.async_close()
            conn = await self._connection()  # the next stage came back on its address: one redial
            await conn.async_send(msg)

    async def async_close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._conn is not None:
            await self._conn.async_close()
