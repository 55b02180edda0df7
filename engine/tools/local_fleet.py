"""A whole fleet on this machine: one worker process per stage on loopback plus the coordinator.

Used by ``deskfleet demo``, the benchmarks and the multi-process tests. Workers start from the
last stage backwards, each on a free port it reports on stdout, so every worker knows its next
hop when it starts (the ring also copes with any start order; that is tested separately).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

from engine.coordinator.batch_coordinator import BatchCoordinator, paged_scheduler
from engine.coordinator.coordinator import Coordinator, model_card
from engine.coordinator.paged_ring import PagedRingPath
from engine.coordinator.ring import RingPath
from engine.coordinator.speculation import Speculator
from engine.errors import DeskfleetError
from engine.shards.kv_pool import DEFAULT_KV_POOL_BYTES, pool_blocks_for
from engine.shards.manifest import load_manifest
from engine.shards.paged_step import PagedPath
from engine.shards.stage import Stage
from engine.wire.address import Address
from engine.wire.step_codec import step_reply_bound
from engine.wire.step_plan import CPU_BLOCK_SIZE

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


Hop = Callable[[Address], Awaitable[Address]]


async def _direct(address: Address) -> Address:
    return address


class WorkerStartError(DeskfleetError):
    """A worker process exited or stayed silent before reporting its address."""


class LocalFleet:
    """Worker subprocesses for stages ``first_stage..N-1`` of one export."""

    def __init__(self, export_dir: Path | str, *, first_stage: int = 0, host: str = "127.0.0.1",
                 exact: bool = False, threads: int | None = None, extra_args: Sequence[str] = ()):
        self.export_dir = Path(export_dir)
        self.manifest = load_manifest(self.export_dir)
        self.first_stage = first_stage
        self.host = host
        self.exact = exact
        self.threads = threads
        self.extra_args = tuple(extra_args)
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.addresses: dict[int, Address] = {}
        self.next_hops: dict[int, Address] = {}

    def _argv(self, stage: int, next_address: Address) -> list[str]:
        argv = [sys.executable, "-m", "engine.cli.main", "worker", "--shard", str(self.export_dir),
                "--stage", str(stage), "--listen", f"{self.host}:0", "--next", str(next_address)]
        if self.exact:
            argv.append("--exact")
        if self.threads:
            argv += ["--threads", str(self.threads)]
        return argv + list(self.extra_args)

    async def async_start(self, return_address: Address, hop: Hop | None = None) -> Address:
        """Start every worker (last stage first); returns the address to dial the first one on.

        ``hop(address)`` may put something in front of every hop (a WAN emulator) and return the
        address to use instead; it is applied to the return hop and to each worker.
        """
        hop = hop or _direct
        next_address = await hop(return_address)
        for stage in reversed(range(self.first_stage, len(self.manifest.stages))):
            proc = await asyncio.create_subprocess_exec(
                *self._argv(stage, next_address), stdout=asyncio.subprocess.PIPE, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self.processes[stage] = proc
            self.next_hops[stage] = next_address
            self.addresses[stage] = await self._await_ready(stage, proc)
            next_address = await hop(self.addresses[stage])
        return next_address

    async def _await_ready(self, stage: int, proc: asyncio.subprocess.Process) -> Address:
        assert proc.stdout is not None
        try:
            while True:
                line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
                if not line:
                    code = await proc.wait()
                    raise WorkerStartError(f"worker for stage {stage} exited with code {code} before it was ready; "
                                           "see its error output above")
                text = line.decode(errors="replace")
                if text.startswith("deskfleet worker:") and " on " in text:
                    return Address.parse(text.split(" on ", 1)[1].split(",", 1)[0].strip())
        except TimeoutError:
            raise WorkerStartError(f"worker for stage {stage} did not report ready within "
                                   f"{READY_TIMEOUT_S:.0f} s") from None

    async def async_restart_dead(self) -> list[int]:
        """Start again, on the same address and next hop, every worker whose process has exited
        (the coordinator's failover hook for a local fleet); returns the restarted stages."""
        restarted = []
        for stage, proc in sorted(self.processes.items()):
            if proc.returncode is None:
                continue
            address = self.addresses[stage]
            argv = self._argv(stage, self.next_hops[stage])
            argv[argv.index("--listen") + 1] = str(address)
            new = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, start_new_session=True,
                                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self.processes[stage] = new
            await self._await_ready(stage, new)
            restarted.append(stage)
        return restarted

    async def async_stop(self) -> dict[int, int]:
        """SIGTERM every worker (they drain and exit 0); kill any that outstays the timeout."""
        codes: dict[int, int] = {}
        for proc in self.processes.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for stage, proc in self.processes.items():
            try:
                codes[stage] = await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("worker for stage %d did not stop in %.0f s; killing it", stage, STOP_TIMEOUT_S)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                codes[stage] = await proc.wait()
        return codes


@contextlib.asynccontextmanager
async def paged_local_fleet(export_dir: Path | str, *, exact: bool = False, threads: int | None = None,
                            hop: Hop | None = None, failover: bool = False, kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES,
                            lanes: int | None = 1, speculation: Speculator | None = None,
                            step_timeout_s: float | None = None, hold_timeout_s: float = 60.0,
                            **settings) -> AsyncIterator[BatchCoordinator]:
    """A running paged coordinator over a paged worker process for every stage (continuous
    batching in every stage).

    ``lanes``: micro-batches in flight. One by default: every stage runs on this machine, on one
    memory path, where a second micro-batch costs each stage another weight pass and gains no
    bandwidth (measured: 0.84x the aggregate of one at 8 users, 2 stages, 1 thread each). A ring of
    separate PCs keeps one per stage (BatchCoordinator's default).

    ``settings`` go to the scheduler (slots, max_waiting, token_budget, prefill_chunk,
    prefix_cache). With ``failover`` a worker that dies is restarted on its address and the
    coordinator replays its streams there (pass ``step_timeout_s`` so a silent stage is noticed)."""
    manifest = load_manifest(export_dir)
    block_size = CPU_BLOCK_SIZE
    pool = pool_blocks_for(manifest, kv_pool_bytes, block_size, precision="f32" if exact else None)
    fleet = LocalFleet(export_dir, exact=exact, threads=threads,
                       extra_args=("--paged", "--kv-pool-mb", f"{kv_pool_bytes / 2**20:.6g}"))
    budget = settings.get("token_budget", 256)  # no step answers more rows than it has tokens
    path = PagedRingPath(manifest.model.fingerprint, len(manifest.stages), Address("127.0.0.1", 0),
                         Address("127.0.0.1", 0), block_size=block_size,
                         max_frame_bytes=step_reply_bound(manifest.model.vocab_size, budget, budget))
    try:
        return_address = await path.async_listen()
        path.first_remote = await fleet.async_start(return_address, hop)
        recover = None
        if failover:
            async def recover(broken: PagedPath, reason: str) -> PagedPath:
                restarted = await fleet.async_restart_dead()
                log.warning("local fleet: restarted stage(s) %s after: %s", restarted, reason)
                await path.async_reconnect()
                return path

        scheduler = paged_scheduler(manifest, pool, block_size, **settings)
        coordinator = BatchCoordinator(path, model_card(manifest), scheduler, lanes=lanes, speculation=speculation,
                                       recover=recover, step_timeout_s=step_timeout_s, hold_timeout_s=hold_timeout_s)
        async with coordinator:
            yield coordinator
    finally:
        await path.async_close()
        await fleet.async_stop()


@contextlib.asynccontextmanager
async def local_fleet(export_dir: Path | str, *, slots: int = 4, exact: bool = False, threads: int | None = None,
                      host_stage0: bool = False, hop: Hop | None = None, failover: bool = False,
                      **coordinator_options) -> AsyncIterator[Coordinator]:
    """A running coordinator over worker processes for every stage (stage 0 in-process if asked).

    With ``failover`` a worker that dies is restarted on its address and the coordinator replays
    its streams there (pass ``step_timeout_s`` so a silent stage is noticed)."""
    manifest = load_manifest(export_dir)
    local0 = Stage(export_dir, 0, manifest=manifest, exact=exact, num_threads=threads) if host_stage0 else None
    if host_stage0 and len(manifest.stages) < 2:
        raise DeskfleetError("hosting stage 0 in the coordinator needs an export with at least 2 stages")
    fleet = LocalFleet(export_dir, first_stage=1 if host_stage0 else 0, exact=exact, threads=threads)
    path = RingPath(manifest.model.fingerprint, len(manifest.stages), Address("127.0.0.1", 0),
                    Address("127.0.0.1", 0), local_stage0=local0)
    try:
        return_address = await path.async_listen()
        path.first_remote = await fleet.async_start(return_address, hop)
        if failover:
            async def recover(broken: RingPath, reason: str) -> RingPath:
                restarted = await fleet.async_restart_dead()
                log.warning("local fleet: restarted stage(s) %s after: %s", restarted, reason)
                await broken.async_reconnect()
                return broken

            coordinator_options["recover"] = recover
        coordinator = Coordinator(path, model_card(manifest), slots=slots, **coordinator_options)
        async with coordinator:
            yield coordinator
    finally:
        await path.async_close()
        await fleet.async_stop()
