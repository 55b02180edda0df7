"""The stage worker process: open the worker an export calls for and serve until told to stop.

A CPU/GPU export is served paged (:class:`~engine.paged.worker.PagedStageWorker`), an
NPU-target export static (:class:`~engine.static.packed_worker.PackedStageWorker`). The process
prints machine-readable lines for its supervising agent (ready, stats, peer-policy updates; a
warm spare's readiness and timings), takes peer-policy updates (and a spare's activation) as JSON
lines on stdin, and drains on SIGTERM: the frame in hand finishes, frames for new sessions are
refused, and the process exits 0.
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

from engine.errors import DeskfleetError, StatefulRuntimeRetiredError
from engine.paged.kv_pool import DEFAULT_KV_POOL_BYTES
from engine.paged.stage import PagedStage
from engine.paged.worker import PagedStageWorker
from engine.shards.manifest import load_manifest
from engine.static.packed_worker import PackedStageWorker
from engine.tasks import start_task
from engine.trust.peer_policy import PeerPolicy, PeerPolicyError, parse_policy_update
from engine.wire.address import Address
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


AnyWorker = PackedStageWorker | PagedStageWorker


def stats_line(worker: AnyWorker) -> str:
    """One machine-readable line for the supervising agent (see ``agent.service.supervisor``)."""
    stats = {"steps": worker.steps, "compute_s": round(worker.compute_s, 6), "streams": worker.stream_count,
             "draining": worker.draining, "bytes_out": worker.downstream.bytes_sent}
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
                 peers: PeerPolicy | None, paged: bool = True,
                 kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES) -> AnyWorker:
    """The worker the export calls for: static (a packed host KV ring) for an NPU-target export,
    paged (a block pool of at most ``kv_pool_bytes``) for a CPU/GPU one. ``paged`` is what old
    callers said to ask for the paged worker; it is the only one a CPU/GPU export has now, and
    ``paged=False`` (the retired stateful worker) is refused with the reason."""
    manifest = load_manifest(shard_dir)
    if manifest.target == "npu":
        from engine.static.packed_stage import StaticStage  # loaded only for a static export

        properties = {"CACHE_DIR": str(cache_dir)} if cache_dir is not None else None
        static = StaticStage(shard_dir, stage_index, device=device, exact=exact, num_threads=num_threads,
                             properties=properties, manifest=manifest)
        return PackedStageWorker(static, listen, next_address, server_ssl=server_ssl, client_ssl=client_ssl,
                                 peers=peers)
    if not paged:
        raise StatefulRuntimeRetiredError()
    paged_stage = PagedStage(shard_dir, stage_index, manifest=manifest, device=device, exact=exact,
                             num_threads=num_threads, cache_dir=cache_dir)
    return PagedStageWorker(paged_stage, listen, next_address, kv_pool_bytes=kv_pool_bytes,
                            server_ssl=server_ssl, client_ssl=client_ssl, peers=peers)


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
                             paged: bool = True, kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES,
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
    helpers: set[asyncio.Task[Any]] = set()  # held by start_task until they end; cancelled at the stop
    if exit_with_parent:
        start_task(_async_watch_parent(stop, parent), name="deskfleet-watch-parent", logger=log, keep=helpers)
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
            for task in list(helpers):
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
        loop.add_signal_handler(signal.SIGUSR1, lambda: start_task(drain_streams(), name="deskfleet-drain-streams",
                                                                   logger=log, keep=helpers))
    if report_interval:
        start_task(_async_report(worker, report_interval), name="deskfleet-worker-report", logger=log, keep=helpers)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        for task in list(helpers):
            task.cancel()
    log.info("stage %d draining", stage_index)
    await worker.async_drain()
    await worker.async_close()
    if report_interval:
        print(stats_line(worker), flush=True)
    return 0
