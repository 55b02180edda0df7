"""The paged ring over real worker processes on loopback: seeded sampling repeats, start order does
not matter and SIGTERM drains, and a malformed-frame barrage against a live worker spares the
streams it serves. (Identity with the unsplit run and failover: tests/coordinator/test_paged_ring.py.)"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import numpy as np
import pytest

from engine.generation.generator import ModelCard
from engine.generation.request import GenerationRequest, SamplingParams
from engine.paged.coordinator import BatchCoordinator, paged_scheduler
from engine.paged.kv_pool import pool_blocks_for
from engine.paged.ring_path import PagedRingPath
from engine.shards.manifest import load_manifest
from engine.tools.local_fleet import paged_local_fleet
from engine.wire.address import Address
from engine.wire.codec import encode
from engine.wire.format import Role, StreamId
from engine.wire.messages import Error, Hello, Step
from engine.wire.step_plan import CPU_BLOCK_SIZE, SCRATCH_BLOCKS, PlanRow, plan
from engine.wire.transport import async_connect
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect, run
from tests.support.loopback import free_port

N = 20
POOL = 16 << 20  # the tiny model's blocks are small: a few hundred fit


def test_seeded_sampling_over_the_ring_is_reproducible(tiny_export):
    req = GenerationRequest(PROMPT_IDS, 16, SamplingParams(temperature=0.9, top_p=0.95, seed=1234), ignore_eos=True)

    async def main():
        async with paged_local_fleet(tiny_export("llama", 2), exact=True, kv_pool_bytes=POOL) as c:
            return await collect(c, req), await collect(c, req)

    a, b = run(main())
    assert a == b and len(set(a)) > 1


def test_start_order_does_not_matter_and_sigterm_drains(tiny_export, unsplit_greedy):
    """Start stage 0 first (its successor does not exist yet), then stage 1; SIGTERM exits 0. The
    workers are started as before the stateful runtime was retired (no --paged): they serve paged."""
    export = tiny_export("llama", 2)
    manifest = load_manifest(export)
    p0, p1, ret = free_port(), free_port(), free_port()

    def worker(stage, listen, nxt):
        return subprocess.Popen([sys.executable, "-m", "engine.cli.main", "worker", "--shard", str(export), "--stage",
                                 str(stage), "--listen", f"127.0.0.1:{listen}", "--next", f"127.0.0.1:{nxt}",
                                 "--exact", "--kv-pool-mb", "16"], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)

    async def main(procs):
        path = PagedRingPath(manifest.model.fingerprint, 2, Address("127.0.0.1", p0), Address("127.0.0.1", ret),
                             block_size=CPU_BLOCK_SIZE)
        scheduler = paged_scheduler(manifest, pool_blocks_for(manifest, POOL, CPU_BLOCK_SIZE, precision="f32"),
                                    CPU_BLOCK_SIZE)
        async with BatchCoordinator(path, ModelCard.from_manifest(manifest), scheduler) as c:
            procs.append(worker(1, p1, ret))  # the last stage comes up after the first
            return await collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))

    procs = [worker(0, p0, p1)]
    try:
        tokens = run(main(procs))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    assert tuple(tokens) == unsplit_greedy(PROMPT_IDS, N)
    assert codes == [0, 0]


@pytest.mark.slow
def test_malformed_frames_against_a_live_worker_spare_other_streams(tiny_export, unsplit_greedy):
    """1,000 generated bad frames on their own connections while a real stream keeps decoding."""
    export = tiny_export("llama", 2)
    fingerprint = load_manifest(export).model.fingerprint
    rng = np.random.default_rng(0)
    one = plan(CPU_BLOCK_SIZE, SCRATCH_BLOCKS + 1, [PlanRow(99, 0, 2, (SCRATCH_BLOCKS,))])
    good = encode(Step(StreamId(99), 1, one, np.array([5, 6] + [0] * (one.padded_tokens - 2), dtype=np.int64)))

    def mutate(i: int) -> bytes:
        frame = bytearray(good)
        kind = i % 4
        if kind == 0:
            return bytes(rng.integers(0, 256, int(rng.integers(1, 120)), dtype=np.uint8))
        if kind == 1:
            return bytes(frame[: int(rng.integers(1, len(frame)))])  # truncated
        if kind == 2:
            for _ in range(3):
                frame[int(rng.integers(0, 56))] ^= int(rng.integers(1, 256))
            return bytes(frame)
        frame[48:56] = (2**40).to_bytes(8, "little")  # payload length far beyond the bound
        return bytes(frame)

    async def attack(address, outcomes):
        for i in range(1000):
            conn = await async_connect(address.host, address.port, Hello(fingerprint, 0, Role.COORDINATOR))
            writer = conn._writer  # raw bytes on purpose: these frames cannot be built legally
            writer.write(mutate(i))
            writer.write_eof()  # half-close: a truncated frame is then known to be truncated
            await writer.drain()
            try:
                reply = await asyncio.wait_for(conn.async_recv(), 10)
                outcomes.append(type(reply).__name__ if not isinstance(reply, Error) else "Error")
            except Exception as exc:  # noqa: BLE001 - a closed connection is an acceptable answer
                outcomes.append(type(exc).__name__)
            await conn.async_close()

    async def main():
        async with paged_local_fleet(export, exact=True, kv_pool_bytes=POOL) as c:
            assert isinstance(c.path, PagedRingPath)
            outcomes: list[str] = []
            tokens, _ = await asyncio.gather(collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True)),
                                             attack(c.path.first_remote, outcomes))
            after = await collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))
            return tokens, after, outcomes

    tokens, after, outcomes = run(main(), timeout=900)
    assert tuple(tokens) == unsplit_greedy(PROMPT_IDS, N) and tuple(after) == unsplit_greedy(PROMPT_IDS, N)
    assert len(outcomes) == 1000
    assert outcomes.count("Error") > 500, {o: outcomes.count(o) for o in set(outcomes)}
