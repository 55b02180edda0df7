"""A dialer's hold on its next hop (ring first hop, a stage's next stage) reads only what a ring
hop sends back — Pong, or an Error — so a next hop cannot make it read or allocate a tensor-sized
frame: the hold closes the connection after the frame's header."""

from __future__ import annotations

import asyncio

import numpy as np

from engine.codec import encode
from engine.messages import Hello, HelloAck, Logits, Pong
from engine.transport import async_connect, async_hold, async_read_frame
from engine.wire import Role
from tests.asyncutil import run

FP = "ab" * 32


def test_a_next_hop_that_answers_with_a_tensor_frame_is_dropped_unread():
    big = encode(Logits(1, 1, np.zeros((1, 1 << 20), np.float32)))  # 4 MiB: a real frame, not a Pong

    async def main():
        saw_eof = asyncio.Event()

        async def listener(reader, writer):
            hello = await async_read_frame(reader, timeout=10, idle_timeout=10)
            assert isinstance(hello, Hello)
            writer.write(encode(HelloAck(FP, 0)))
            writer.write(big)
            writer.write(encode(Pong(1)))
            try:
                await writer.drain()
                while await reader.read(65536):
                    pass
            except OSError:
                pass
            saw_eof.set()
            writer.close()

        server = await asyncio.start_server(listener, "127.0.0.1", 0)
        host, port = server.sockets[0].getsockname()[:2]
        try:
            conn = await async_connect(host, port, Hello(FP, 0, Role.COORDINATOR), attempts=1)
            # Without the bound the hold reads the 4 MiB frame, then the Pong, then waits out its
            # 30 s Ping interval: the wait below would time out.
            await asyncio.wait_for(async_hold(conn, "test hop", 30.0), 10)
            await asyncio.wait_for(saw_eof.wait(), 10)
            return conn.closed
        finally:
            server.close()
            await server.wait_closed()

    assert run(main(), 60) is True
