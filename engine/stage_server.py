"""What every stage worker shares, stateful or static: the port it listens on for its upstream
neighbour (the coordinator for stage 0), its next hop (:class:`~engine.downstream.Downstream`),
one compute thread, the step counters the supervising agent reads, and draining."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

from engine.address import Address
from engine.downstream import Downstream
from engine.handshake import LocalIdentity
from engine.messages import Message
from engine.transport import Connection, FrameServer
from engine.wire import Role

log = logging.getLogger(__name__)


class StageServer:
    """The plumbing of one stage; a subclass handles the frames (``_handle``)."""

    def __init__(self, index: int, is_last: bool, fingerprint: str, listen: Address, next_address: Address, *,
                 server_ssl: SSLContext | None, client_ssl: SSLContext | None, dial_deadline: float,
                 thread_name: str):
        self.index = index
        self.listen = listen
        self.next_address = next_address
        self.fingerprint = fingerprint
        upstream_role = Role.COORDINATOR if index == 0 else Role.STAGE
        self._server = FrameServer(self._handle, LocalIdentity(fingerprint, index, frozenset({upstream_role})),
                                   ssl=server_ssl, idle_timeout=None)
        self.downstream = Downstream(fingerprint, index, is_last, next_address, client_ssl=client_ssl,
                                     dial_deadline=dial_deadline)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.steps = 0
        self.compute_s = 0.0

    async def _handle(self, conn: Connection, msg: Message) -> None:
        raise NotImplementedError

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

    async def async_drain(self) -> None:
        """Refuse new streams (or sessions) and wait for the inference in hand to finish."""
        self.draining = True
        await self._idle.wait()

    async def async_close(self) -> None:
        await self._server.async_close()
        await self.downstream.async_close()
        self._executor.shutdown(wait=True)
