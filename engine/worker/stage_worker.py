"""A stage worker: one verified, compiled shard serving its place in the ring.

It listens for its upstream neighbour (the coordinator for stage 0), keeps one KV state per
stream (each bound to the upstream connection that opened it, at most ``max_streams``), and
forwards each step's output to its successor, which it dials with retry so that the order in
which a ring is brought up does not matter. The last stage sends its reply (top-1 ids, or logits
on request) straight back to the coordinator, not hop by hop.

On SIGTERM it drains: the frame in hand finishes, frames for new streams are refused, and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from ssl import SSLContext
from typing import Any, TextIO

import numpy as np

from engine.errors import DeskfleetError
from engine.shards.kv_pool import DEFAULT_KV_POOL_BYTES
from engine.shards.manifest import load_manifest
from engine.shards.paged_stage import PagedStage
from engine.shards.prefix_cache import CaptureStore
from engine.shards.stage import Stage, StageStream, StepInputs
from engine.shards.step_path import last_stage_logits, last_stage_top1
from engine.static.packed_worker import PackedStageWorker
from engine.trust.peer_policy import PeerPolicy, PeerPolicyError, parse_policy_update
from engine.wire.address import Address
from engine.wire.format import ErrorCode, StreamId
from engine.wire.messages import (
    Capture,
    Error,
    Forward,
    Logits,
    Message,
    Packed,
    Release,
    Restore,
    Step,
    Tokens,
)
from engine.wire.stage_server import MAX_STREAMS, StageServer, stage_frame_bound
from engine.wire.transport import Connection
from engine.worker.paged_worker import PagedStageWorker
from engine.worker.spare import (
    SPARE_PREFIX,
    Activation,
    ActivationError,
    is_activation,
    parse_activation,
    timing_line,
    warm_up,
)
from engine.worker.status_lines import PEERS_PREFIX, READY_PREFIX, STATS_PREFIX

log = logging.getLogger(__name__)



class StageWorker(StageServer):
    """Serves one stage; ``next_address`` is the next stage, or the coordinator's return port."""

    def __init__(self, stage: Stage, listen: Address, next_address: Address, *,
                 server_ssl: SSLContext | None = None, client_ssl: SSLContext | None = None,
                 dial_deadline: float = 120.0, capture_bytes: int = 256 << 20, peers: PeerPolicy | None = None,
                 max_streams: int = MAX_STREAMS, **listener_options):
        self.stage = stage
        model = stage.manifest.model
        super().__init__(stage.index, stage.is_last, model.fingerprint, listen, next_address,
                         server_ssl=server_ssl, client_ssl=client_ssl, dial_deadline=dial_deadline,
                         thread_name=f"deskfleet-stage{stage.index}", peers=peers,
                         max_frame_bytes=stage_frame_bound(model.hidden_size, model.max_position_embeddings),
                         **listener_options)
        self.captures = CaptureStore(capture_bytes)
        self.max_streams = max_streams
        self._streams: dict[StreamId, StageStream] = {}
        self._owners: dict[StreamId, Connection] = {}  # the upstream connection that opened each stream

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    async def _handle(self, conn: Connection, msg: Message) -> None:
        if isinstance(msg, Forward | Release | Capture | Restore | Error) and not await self._owned_by(conn, msg):
            return
        match msg:
            case Forward():
                await self._forward(conn, msg)
            case Release():
                await self._release(msg.stream_id)
                if not self.stage.is_last:
                    await self._send(msg)
            case Capture():
                await self._capture(msg)
            case Restore():
                await self._restore(conn, msg)
            case Packed():
                await self._send(Error(ErrorCode.STREAM_FAILED, f"stage {self.stage.index} serves a stateful export: "
                                       "Packed frames need a static (NPU-target) export", msg.stream_id, msg.seq))
            case Step():
                await self._send(Error(ErrorCode.STREAM_FAILED, f"stage {self.stage.index} runs stateful: Step frames "
                                       "need a paged worker (`deskfleet worker --paged`)", msg.session, msg.seq))
            case Error() if msg.stream_id:
                await self._send(msg)  # a stream failed upstream: pass it on toward the coordinator
            case _:
                log.debug("stage %d ignoring %r", self.stage.index, msg)

    async def _owned_by(self, conn: Connection, msg: Forward | Release | Capture | Restore | Error) -> bool:
        """A stream belongs to the connection that opened it: a frame naming it from another one is
        refused to that connection (never passed on, so it cannot reach the coordinator)."""
        owner = self._owners.get(msg.stream_id)
        if owner is None or owner is conn:
            return True
        log.warning("stage %d: refused %s for stream %s from %s: another connection owns that stream",
                    self.stage.index, type(msg).__name__, msg.stream_id, conn.peername)
        await conn.async_send(Error(ErrorCode.UNKNOWN_STREAM, f"this connection holds no stream {msg.stream_id}",
                                    msg.stream_id, msg.seq))
        return False

    def _full(self, msg: Forward | Restore) -> Error | None:
        if len(self._streams) < self.max_streams:
            return None
        return Error(ErrorCode.STREAM_LIMIT, f"stage {self.stage.index} already holds its maximum of "
                     f"{self.max_streams} streams; retry when one ends, or add stages", msg.stream_id, msg.seq)

    async def _on_close(self, conn: Connection) -> None:
        """The streams an upstream connection opened end with it, here and on the later stages
        (the coordinator replays them under new ids after it reconnects), so a vanished dialer
        leaves no KV state behind."""
        orphans = [stream_id for stream_id, owner in self._owners.items() if owner is conn]
        for stream_id in orphans:
            await self._release(stream_id)
            if not self.stage.is_last:  # the later stages hold the same streams: release them too
                with contextlib.suppress(DeskfleetError):
                    await self.downstream.async_send_if_connected(Release(stream_id))
        if orphans:
            log.info("stage %d: dropped %d stream(s) of the closed connection from %s", self.stage.index,
                     len(orphans), conn.peername)

    async def _forward(self, conn: Connection, msg: Forward) -> None:
        stream = self._streams.get(msg.stream_id)
        if stream is None:
            if self.draining:
                await self._send(Error(ErrorCode.SHUTTING_DOWN, f"stage {self.stage.index} is shutting down",
                                       msg.stream_id, msg.seq))
                return
            if msg.attention_mask.shape[-1] != msg.tensor.shape[1]:
                # a later step of a stream this stage does not hold: a frame still in flight when the
                # ring failed over. Computed on empty state it gives garbage (and can leave the stage
                # answering empty tensors), so it is refused; the coordinator drops the reply.
                await self._send(Error(ErrorCode.UNKNOWN_STREAM, f"stage {self.stage.index} holds no stream "
                                       f"{msg.stream_id} for this step", msg.stream_id, msg.seq))
                return
            full = self._full(msg)
            if full is not None:
                await self._send(full)  # the coordinator ends this stream; the others go on
                return
            stream = self._streams[msg.stream_id] = self.stage.new_stream()
            self._owners[msg.stream_id] = conn
        x = msg.tensor if msg.tensor.dtype != np.float16 else msg.tensor.astype(np.float32)
        step = StepInputs(x, msg.attention_mask, msg.position_ids, msg.reply_last)
        try:
            out, ms = await self._timed_compute(stream.forward, step)
        except Exception as exc:  # OpenVINO failure on one stream must not take the worker down
            log.error("stage %d failed on stream %s: %s", self.stage.index, msg.stream_id, exc)
            await self._send(Error(ErrorCode.STREAM_FAILED, f"stage {self.stage.index}: {exc}",
                                   msg.stream_id, msg.seq))
            return
        reply: Message
        times = (*msg.stage_ms, ms)  # every stage passed reports its own inference time
        if self.stage.is_last:
            if msg.want_logits:
                reply = Logits(msg.stream_id, msg.seq, last_stage_logits(out, msg.reply_last), times)
            else:
                ids, probs = last_stage_top1(out, msg.reply_last)
                reply = Tokens(msg.stream_id, msg.seq, ids, probs, times)
        else:
            reply = Forward(msg.stream_id, msg.seq, out, msg.attention_mask, msg.position_ids,
                            msg.want_logits, msg.reply_last, times)
        await self._send(reply)

    async def _capture(self, msg: Capture) -> None:
        """Keep the stream's compacted KV; pass the frame on (the last stage's copy is the ack)."""
        stream = self._streams.get(msg.stream_id)
        if stream is None:
            await self._send(Error(ErrorCode.UNKNOWN_STREAM, f"stage {self.stage.index} holds no stream "
                                   f"{msg.stream_id} to capture", msg.stream_id, msg.seq))
            return
        await self._run(self.captures.capture, stream, msg.capture_id, msg.keep)
        await self._send(msg)

    async def _restore(self, conn: Connection, msg: Restore) -> None:
        full = self._full(msg) if msg.stream_id not in self._streams else None
        if full is not None:
            await self._send(full)
            return
        stream = await self._run(self.captures.restore, self.stage, msg.capture_id, msg.length)
        if stream is None:
            await self._send(Error(ErrorCode.CAPTURE_MISSING, f"stage {self.stage.index} no longer holds capture "
                                   f"{msg.capture_id}", msg.stream_id, msg.seq))
            return
        self._streams[msg.stream_id] = stream
        self._owners[msg.stream_id] = conn
        await self._send(msg)

    async def _release(self, stream_id: StreamId) -> None:
        self._owners.pop(stream_id, None)
        await self._run(self._streams.pop, stream_id, None)

    async def async_close(self) -> None:
        await super().async_close()
        self._streams.clear()
        self._owners.clear()


AnyWorker = StageWorker | PackedStageWorker | PagedStageWorker


def stats_line(worker: AnyWorker) -> str:
    """One machine-readable line for the supervising agent (see ``agent.service.supervisor``)."""
    stats = {"steps": worker.steps, "compute_s": round(worker.compute_s, 6), "streams": worker.stream_count,
             "draining": worker.draining}
    return STATS_PREFIX + json.dumps(stats, separators=(",", ":"))


async def _async_report(worker: AnyWorker, interval: float) -> None:
    while True:
        print(stats_line(worker), flush=True)
        await asyncio.sleep(interval)


async def _async_watch_parent(stop: asyncio.Event, parent: int, interval: float = 0.5) -> None:
    """Stop when the process that started us is gone (re-parented), so a SIGKILLed agent or
    coordinator does not leave its workers holding cores and ports."""
    while os.getppid() == parent:
        await asyncio.sleep(interval)
    log.warning("parent process %d is gone: stopping", parent)
    stop.set()


def _open_worker(shard_dir: Path, stage_index: int, listen: Address, next_address: Address, *, device: str,
                 exact: bool, num_threads: int | None, server_ssl: SSLContext | None,
                 client_ssl: SSLContext | None, cache_dir: Path | None,
                 peers: PeerPolicy | None, paged: bool = False,
                 kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES) -> AnyWorker:
    """The worker the export calls for: stateful (KV per stream), static (a packed host KV ring),
    or with ``paged`` for a CPU/GPU export, paged (a block pool of at most ``kv_pool_bytes``)."""
    manifest = load_manifest(shard_dir)
    if manifest.target == "npu":
        from engine.static.packed_stage import StaticStage

        properties = {"CACHE_DIR": str(cache_dir)} if cache_dir is not None else None
        static = StaticStage(shard_dir, stage_index, device=device, exact=exact, num_threads=num_threads,
                             properties=properties, manifest=manifest)
        return PackedStageWorker(static, listen, next_address, server_ssl=server_ssl, client_ssl=client_ssl,
                                 peers=peers)
    if paged:
        paged_stage = PagedStage(shard_dir, stage_index, manifest=manifest, device=device, exact=exact,
                                 num_threads=num_threads, cache_dir=cache_dir)
        return PagedStageWorker(paged_stage, listen, next_address, kv_pool_bytes=kv_pool_bytes,
                                server_ssl=server_ssl, client_ssl=client_ssl, peers=peers)
    stage = Stage(shard_dir, stage_index, manifest=manifest, device=device, exact=exact, num_threads=num_threads,
                  cache_dir=cache_dir)
    return StageWorker(stage, listen, next_address, server_ssl=server_ssl, client_ssl=client_ssl, peers=peers)


def _read_policy_updates(lines: TextIO, worker: AnyWorker, loop: asyncio.AbstractEventLoop,
                         activation: asyncio.Future[Activation] | None = None, *, tls: bool = True) -> None:
    """Apply each JSON line of ``lines`` as the worker's new peer policy (runs on its own daemon
    thread: a blocking read of stdin must not hold the loop, nor the exit). A bad line is logged
    and ignored; the policy in force stays. A spare's ``activation`` is resolved by the first
    good activation line (engine.worker.spare); without ``tls`` one off loopback is refused."""
    for line in lines:
        if not line.strip():
            continue
        try:
            blob = json.loads(line)
            if is_activation(blob):
                if activation is None:
                    log.warning("ignoring an activation on stdin: this worker is not a spare")
                    continue
                where = parse_activation(blob, tls=tls)
                loop.call_soon_threadsafe(_resolve, activation, where)
                continue
            peers = parse_policy_update(blob)
        except (ValueError, PeerPolicyError, ActivationError) as exc:  # json.JSONDecodeError is a ValueError
            log.warning("ignoring a peer-policy update or activation on stdin (the policy in force stays): %s", exc)
            continue
        except RuntimeError:  # the loop has closed
            return
        try:
            asyncio.run_coroutine_threadsafe(worker.async_set_peers(peers), loop).result(30)
        except RuntimeError:  # the loop has closed: the worker is gone, the update moot
            return
        except Exception as exc:  # noqa: BLE001 - reported; the thread must keep reading
            log.error("applying a peer-policy update failed: %r", exc)
            continue
        print(f"{PEERS_PREFIX} {len(peers.upstream)} upstream, next {'set' if peers.next else 'unset'}, "
                  f"{len(peers.deny)} denied", flush=True)


def _resolve(activation: asyncio.Future[Activation], where: Activation) -> None:
    if not activation.done():
        activation.set_result(where)


def _point(worker: AnyWorker, activation: Activation) -> None:
    """Aim a spare at its place in the ring before it listens (nothing is connected yet)."""
    worker.listen = activation.listen
    worker.next_address = activation.next_hop
    worker.downstream.address = activation.next_hop
    if activation.peers is not None:
        worker.peers = activation.peers


async def _async_wait_activation(activation: asyncio.Future[Activation], stop: asyncio.Event) -> Activation | None:
    """The spare's activation, or None if it was told to stop first."""
    stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    waits: set[asyncio.Future[Any]] = {activation, stopping}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    return activation.result() if activation.done() else None


async def async_serve_worker(shard_dir: Path, stage_index: int, listen: Address, next_address: Address, *,
                             device: str = "CPU", exact: bool = False, num_threads: int | None = None,
                             server_ssl: SSLContext | None = None, client_ssl: SSLContext | None = None,
                             ready: asyncio.Event | None = None, report_interval: float | None = None,
                             exit_with_parent: bool = False, cache_dir: Path | None = None,
                             peers: PeerPolicy | None = None, policy_updates: TextIO | None = None,
                             paged: bool = False, kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES,
                             spare: bool = False) -> int:
    """Run a worker until SIGTERM/SIGINT (finish the frame in hand, then exit 0) or SIGUSR1
    (refuse new streams, let those in flight finish, then exit 0).

    ``report_interval`` prints a stats line that often; ``exit_with_parent`` stops the worker
    (drained, like SIGTERM) when its parent process dies. With TLS, ``peers`` says who may be
    on either end (None: nobody yet) and each JSON line read from ``policy_updates`` replaces it.
    A ``spare`` opens and compiles its shard, then waits for an activation line on
    ``policy_updates`` (engine.worker.spare) before it listens.
    """
    parent = os.getppid()
    times = {"entered": time.time()}
    try:
        worker = _open_worker(shard_dir, stage_index, listen, next_address, device=device, exact=exact,
                              num_threads=num_threads, server_ssl=server_ssl, client_ssl=client_ssl,
                              cache_dir=cache_dir, peers=peers, paged=paged, kv_pool_bytes=kv_pool_bytes)
    except DeskfleetError as exc:  # a shard that fails its checks is never served: say so in the worker's log
        log.error("refusing to serve stage %d of %s: %s", stage_index, shard_dir, exc)
        raise
    times["opened"] = time.time()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    helpers = []
    if exit_with_parent:
        helpers.append(asyncio.create_task(_async_watch_parent(stop, parent)))
    activation: asyncio.Future[Activation] | None = loop.create_future() if spare else None
    if policy_updates is not None:
        threading.Thread(target=_read_policy_updates, args=(policy_updates, worker, loop, activation),
                         kwargs={"tls": server_ssl is not None}, daemon=True, name="deskfleet-peer-policy").start()
    if activation is not None:
        if policy_updates is None:
            raise DeskfleetError("a spare worker needs its stdin: it is activated by a line there")
        if isinstance(worker.stage, PagedStage):
            await asyncio.to_thread(warm_up, worker.stage)
            times["warmed"] = time.time()
        opened_s = round(times["opened"] - times["entered"], 3)
        print(SPARE_PREFIX + json.dumps({"stage": stage_index, "opened_s": opened_s}), flush=True)
        where = await _async_wait_activation(activation, stop)
        if where is None:
            for task in helpers:
                task.cancel()
            await worker.async_close()
            return 0
        times["activated"] = time.time()
        _point(worker, where)
    address = await worker.async_start()
    times["listening"] = time.time()
    print(timing_line(times), flush=True)
    print(f"{READY_PREFIX} {stage_index} ({worker.stage.spec.num_layers} layers) on {address}, "
          f"next hop {worker.next_address}", flush=True)

    async def drain_streams() -> None:  # SIGUSR1: let the streams in flight finish, take no new ones
        worker.draining = True
        while worker.stream_count:
            await asyncio.sleep(0.1)
        stop.set()

    with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
        loop.add_signal_handler(signal.SIGUSR1, lambda: helpers.append(asyncio.create_task(drain_streams())))
    if report_interval:
        helpers.append(asyncio.create_task(_async_report(worker, report_interval)))
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        for task in helpers:
            task.cancel()
    log.info("stage %d draining", stage_index)
    await worker.async_drain()
    await worker.async_close()
    if report_interval:
        print(stats_line(worker), flush=True)
    return 0
