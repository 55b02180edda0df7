"""The ring over real worker processes on loopback: identity with the unsplit run, isolation,
start order, draining, and a malformed-frame barrage against a live worker."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import numpy as np
import pytest

from engine.generation.generator import ModelCard
from engine.generation.in_process import greedy_generate
from engine.generation.request import GenerationRequest, SamplingParams
from engine.shards.manifest import load_manifest
from engine.shards.stage import LocalChain
from engine.tools.local_fleet import local_fleet
from engine.wire.codec import encode
from engine.wire.format import Role, StreamId
from engine.wire.messages import Error, Forward, Hello
from engine.wire.transport import async_connect
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect, run
from tests.support.loopback import free_port

N = 20




@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_ring_greedy_equals_the_unsplit_run(stages, tiny_export, unsplit_greedy):
    async def main():
        async with local_fleet(tiny_export("llama", stages), exact=True, prefill_chunk=7) as c:
            return await collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))

    assert tuple(run(main())) == unsplit_greedy(PROMPT_IDS, N)


@pytest.mark.slow
def test_coordinator_hosting_stage0_and_micro_batched_streams(tiny_export, unsplit_greedy):
    prompts = [PROMPT_IDS, PROMPT_IDS[2:], PROMPT_IDS[::-1]]

    async def main():
        async with local_fleet(tiny_export("llama", 3), exact=True, host_stage0=True, slots=3) as c:
            solo = [await collect(c, GenerationRequest(p, N, ignore_eos=True)) for p in prompts]
            together = await asyncio.gather(*(collect(c, GenerationRequest(p, N, ignore_eos=True)) for p in prompts))
            await c.async_wait_idle()
            return solo, together, c.metrics()

    solo, together, metrics = run(main())
    assert tuple(solo[0]) == unsplit_greedy(PROMPT_IDS, N)
    assert together == solo
    assert metrics["active_streams"] == 0 and metrics["ring_step_ms_avg"] > 0


def test_seeded_sampling_over_the_ring_is_reproducible(tiny_export):
    req = GenerationRequest(PROMPT_IDS, 16, SamplingParams(temperature=0.9, top_p=0.95, seed=1234), ignore_eos=True)

    async def main():
        async with local_fleet(tiny_export("llama", 2), exact=True) as c:
            return await collect(c, req), await collect(c, req)

    a, b = run(main())
    assert a == b and len(set(a)) > 1


def test_start_order_does_not_matter_and_sigterm_drains(tiny_export, unsplit_greedy):
    """Start stage 0 first (its successor does not exist yet), then stage 1; SIGTERM exits 0."""
    export = tiny_export("llama", 2)
    fingerprint = load_manifest(export).model.fingerprint
    p0, p1, ret = free_port(), free_port(), free_port()

    def worker(stage, listen, nxt):
        return subprocess.Popen([sys.executable, "-m", "engine.cli.main", "worker", "--shard", str(export), "--stage",
                                 str(stage), "--listen", f"127.0.0.1:{listen}", "--next", f"127.0.0.1:{nxt}",
                                 "--exact"], stdout=subprocess.PIPE, text=True, start_new_session=True)

    async def main(procs):
        from engine.coordinator.coordinator import Coordinator
        from engine.coordinator.ring import RingPath
        from engine.wire.address import Address

        path = RingPath(fingerprint, 2, Address("127.0.0.1", p0), Address("127.0.0.1", ret))
        async with Coordinator(path, ModelCard.from_manifest(load_manifest(export))) as c:
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
    good = encode(Forward(StreamId(99), 1, np.array([[5, 6]], dtype=np.int64), np.ones((1, 2), dtype=np.int64),
                          np.array([[0, 1]], dtype=np.int64)))

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
        async with local_fleet(export, exact=True) as c:
            from engine.coordinator.ring import RingPath

            assert isinstance(c.path, RingPath)
            outcomes: list[str] = []
            tokens, _ = await asyncio.gather(collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True)),
                                             attack(c.path.first_remote, outcomes))
            after = await collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))
            return tokens, after, outcomes

    tokens, after, outcomes = run(main(), timeout=900)
    assert tuple(tokens) == unsplit_greedy(PROMPT_IDS, N) and tuple(after) == unsplit_greedy(PROMPT_IDS, N)
    assert len(outcomes) == 1000
    assert outcomes.count("Error") > 500, {o: outcomes.count(o) for o in set(outcomes)}


@pytest.mark.slow
def test_prefix_cache_over_the_ring_restores_on_every_stage(tiny_export):
    export = tiny_export("llama", 3)
    history = PROMPT_IDS + (44, 55, 66, 77, 88, 99)
    follow_up = history + (133, 144, 155)
    cold = greedy_generate(LocalChain.load(export, exact=True), follow_up, N, ignore_eos=True).tokens

    async def main():
        async with local_fleet(export, exact=True, host_stage0=True) as c:
            await collect(c, GenerationRequest(history, 8, ignore_eos=True))
            await c.async_wait_idle()
            warm = await collect(c, GenerationRequest(follow_up, N, ignore_eos=True))
            await c.async_wait_idle()
            return warm, c.metrics()

    warm, metrics = run(main())
    assert tuple(warm) == cold
    assert metrics["prefix_hits_total"] == 1 and metrics["prefix_fallbacks_total"] == 0
