"""Failover mid-generation, the tools: kill a stage worker while streams decode.

The failover tests themselves run on the paged ring (tests/coordinator/test_paged_ring.py: a killed
stage is replaced and every answer is identical, or the streams fail clearly after the hold time;
tests/coordinator/test_batch_pipelining.py: the replay through pipelined chunks); the stateful
runtime's versions went with it."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil

from engine.generation.request import GenerationRequest

N = 40


def _kill_worker(stage: int) -> None:
    """SIGKILL this test's worker process for ``stage`` (no drain, no goodbye)."""
    for child in psutil.Process(os.getpid()).children(recursive=True):
        argv = child.cmdline()
        if "worker" in argv and "--stage" in argv and argv[argv.index("--stage") + 1] == str(stage):
            child.send_signal(signal.SIGKILL)
            return
    raise AssertionError(f"no worker process for stage {stage}")


async def _collect_with_kill(coordinator, prompts, *, kill_stage: int, after_tokens: int):
    got = {p: [] for p in prompts}
    killed = asyncio.Event()

    async def consume(prompt):
        async for event in coordinator.stream(GenerationRequest(prompt, N, ignore_eos=True)):
            got[prompt].append(event.token_id)
            if len(got[prompt]) == after_tokens and not killed.is_set():
                killed.set()
                _kill_worker(kill_stage)

    await asyncio.gather(*(consume(p) for p in prompts))
    return got
