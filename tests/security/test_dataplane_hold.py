"""A dialer's hold on its next hop (ring first hop, a stage's next stage) reads only what a ring
hop sends back — Pong, or an Error — so a next hop cannot make it read or allocate a tensor-sized
frame: the hold closes the connection after the frame's header. And the coordinator's open
connection to its first stage is cut as soon as a policy update no longer names (or denies) that
stage, as a stage's next-hop connection is."""

from __future__ import annotations

import asyncio

import numpy as np

from engine.trust.peer_policy import PeerPolicy
from engine.wire.codec import encode
from engine.wire.format import Role, StreamId
from engine.wire.messages import Hello, HelloAck, Pong, StepReply
from engine.wire.transport import async_connect, async_hold, async_read_frame
from tests.security.dataplane_helpers import make_fleet, ring_path, worker
from tests.support.asyncutil import run

FP = "ab" * 32


def test_a_next_hop_that_answers_with_a_tensor_frame_is_dropped_unread():
    ids = np.array([7], np.int64)  # one answered row with its logits, 4 MiB: a real frame, not a Pong
    big = encode(StepReply(StreamId(1), 1, ids, np.ones(1, np.float32), np.zeros((1, 1 << 20), np.float32), ()))

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


def test_the_rings_open_link_to_a_revoked_first_stage_is_cut_at_the_policy_update(stage, export):
    fleet = make_fleet()
    console, desk = fleet["console"], fleet["desk"]

    async def main():
        path = ring_path(export, server_ssl=console.server_context(), client_ssl=console.client_context(),
                         peers=PeerPolicy.of([desk.node_id], desk.node_id), dial_deadline=10)
        ret = await path.async_listen()
        w = worker(stage, ret, server_ssl=desk.server_context(), client_ssl=desk.client_context(),
                   peers=PeerPolicy.of([console.node_id], console.node_id))
        path.first_remote = await w.async_start()
        try:
            await path.async_start()
            before = path.connected
            # the admin removed the desk: the console's deny list reaches the ring
            await path.async_set_peers(PeerPolicy.of([desk.node_id], desk.node_id, deny=[desk.node_id]))
            for _ in range(100):  # the stage's side sees the close shortly after ours
                if w.listener.open_connections == 0:
                    break
                await asyncio.sleep(0.05)
            return before, path.connected, w.listener.open_connections
        finally:
            await w.async_close()
            await path.async_close()

    before, after, stage_side = run(main(), 60)
    assert before is True
    assert after is False  # no further prompt goes to the revoked member over the old connection
    assert stage_side == 0
