"""A whole fleet on this machine: one paged worker process per stage on loopback
(:class:`~engine.tools.worker_processes.LocalFleet`) plus the paged coordinator in front of them.
(A static NPU-target export's local fleet is :func:`engine.tools.packed_fleet.local_static_fleet`.)

Used by ``deskfleet serve --workers``, ``deskfleet demo``, the benchmarks and the multi-process
tests. With ``failover`` a :class:`~engine.tools.local_supervisor.LocalSupervisor` restarts a
worker that dies, in place (or hands its place to its warm spare).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import psutil

from engine.coordinator.ring_factory import RingOptions, open_ring, ring_path
from engine.paged.constraints import GrammarVocabulary
from engine.paged.coordinator import BatchCoordinator
from engine.paged.kv_pool import DEFAULT_KV_POOL_BYTES
from engine.paged.speculation import Speculator
from engine.paged.step import PagedPath
from engine.shards.manifest import load_manifest
from engine.tools.local_supervisor import LocalSupervisor, Restart
from engine.tools.restart_policy import RestartPolicy, spares_fit
from engine.tools.worker_processes import Hop, LocalFleet
from engine.wire.address import Address

log = logging.getLogger(__name__)

@contextlib.contextmanager
def _compile_cache(cache_dir: Path | str | None, wanted: bool) -> Iterator[Path | None]:
    """The workers' shared OpenVINO CACHE_DIR: ``cache_dir``, else (when ``wanted``) a temporary
    one for the fleet's lifetime (a restart's compile is then a cache hit), else none."""
    if cache_dir is not None or not wanted:
        yield Path(cache_dir) if cache_dir is not None else None
        return
    with tempfile.TemporaryDirectory(prefix="deskfleet-compiled-") as tmp:
        yield Path(tmp)


def want_spares(spares: bool | None, manifest, pool_bytes_per_stage: int) -> bool:
    """``spares`` None (auto): warm spares when this PC's free memory holds them (see spares_fit)."""
    if spares is not None:
        return spares
    weights = sum(f.size for stage in manifest.stages for f in stage.files)
    fits = spares_fit(weights, pool_bytes_per_stage * len(manifest.stages), psutil.virtual_memory().available)
    log.info("local fleet: warm spares %s (the weights are %.0f MiB; free memory %s them twice over)",
             "on" if fits else "off", weights / 2**20, "holds" if fits else "does not hold")
    return fits


def _supervise(fleet: LocalFleet, failover: bool, policy: RestartPolicy | None,
               on_restart: Callable[[Restart], None] | None, spares: bool = False,
               on_spare: Callable[[int], None] | None = None) -> LocalSupervisor | None:
    if not failover:
        return None
    return LocalSupervisor(fleet, policy, on_restart, spares=spares, on_spare=on_spare)


@contextlib.asynccontextmanager
async def paged_local_fleet(export_dir: Path | str, *, exact: bool = False, threads: int | None = None,
                            hop: Hop | None = None, failover: bool = False, kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES,
                            lanes: int | None = 1, speculation: Speculator | None = None,
                            step_timeout_s: float | None = None, hold_timeout_s: float = 60.0,
                            cache_dir: Path | str | None = None, restart_policy: RestartPolicy | None = None,
                            on_restart: Callable[[Restart], None] | None = None, spares: bool | None = False,
                            on_spare: Callable[[int], None] | None = None,
                            **settings) -> AsyncIterator[BatchCoordinator]:
    """A running paged coordinator over a paged worker process for every stage (continuous
    batching in every stage).

    ``lanes``: micro-batches in flight. One by default: every stage runs on this machine, on one
    memory path, where a second micro-batch costs each stage another weight pass and gains no
    bandwidth (measured: 0.84x the aggregate of one at 8 users, 2 stages, 1 thread each). A ring of
    separate PCs keeps one per stage (BatchCoordinator's default).

    ``settings`` go to the scheduler (slots, max_waiting, token_budget, prefill_chunk,
    prefix_cache). With ``failover`` the workers are supervised (:mod:`engine.tools.local_supervisor`):
    one that dies is restarted on its address as ``restart_policy`` allows (``on_restart`` hears
    each, with its times) and the coordinator replays its streams there; the workers then share a
    compile cache (``cache_dir``, else a temporary one). ``spares``: keep a warm spare per stage
    (compiled, not listening) that takes a dead worker's place without a start; None: when the
    free memory holds them (``on_spare`` hears each stage whose spare is ready). Pass
    ``step_timeout_s`` so that a stage that is alive but silent is noticed too."""
    with _compile_cache(cache_dir, failover) as cache:
        async with _paged_local_fleet(export_dir, exact, threads, hop, failover, kv_pool_bytes, lanes, speculation,
                                      step_timeout_s, hold_timeout_s, cache, restart_policy, on_restart,
                                      spares, on_spare, settings) as coordinator:
            yield coordinator


@contextlib.asynccontextmanager
async def _paged_local_fleet(export_dir, exact, threads, hop, failover, kv_pool_bytes, lanes, speculation,
                             step_timeout_s, hold_timeout_s, cache, restart_policy, on_restart,
                             spares, on_spare, settings) -> AsyncIterator[BatchCoordinator]:
    manifest = load_manifest(export_dir)
    fleet = LocalFleet(export_dir, exact=exact, threads=threads, cache_dir=cache,
                       extra_args=("--kv-pool-mb", f"{kv_pool_bytes / 2**20:.6g}"))
    supervisor = _supervise(fleet, failover, restart_policy, on_restart,
                            failover and want_spares(spares, manifest, kv_pool_bytes), on_spare)
    recover = None
    if supervisor is not None:
        async def recover(broken: PagedPath, reason: str) -> PagedPath:
            await supervisor.async_recover(path, reason)  # ``broken`` is the ring's own path, redialled
            return broken

    options = RingOptions(exact=exact, kv_pool_bytes=kv_pool_bytes, lanes=lanes, step_timeout_s=step_timeout_s,
                          hold_timeout_s=hold_timeout_s, **settings)
    coordinator = open_ring(manifest, Address("127.0.0.1", 0), Address("127.0.0.1", 0), options=options,
                            grammar=GrammarVocabulary.of_export(export_dir, manifest), speculation=speculation,
                            recover=recover)
    assert isinstance(coordinator, BatchCoordinator), "paged_local_fleet serves a CPU/GPU export"
    path = ring_path(coordinator)
    try:
        return_address = await path.async_listen()
        path.first_remote = await fleet.async_start(return_address, hop)
        async with coordinator:
            if supervisor is not None:
                supervisor.attach(coordinator)
            try:
                yield coordinator
            finally:  # no restart from here on: the coordinator and the fleet are being stopped
                if supervisor is not None:
                    supervisor.close()
    finally:
        if supervisor is not None:
            supervisor.close()
        await path.async_close()
        await fleet.async_stop()
