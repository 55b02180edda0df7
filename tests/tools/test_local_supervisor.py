"""Supervision of a local fleet (what ``serve --workers`` and ``demo --serve`` run on): a worker
SIGKILLed mid-answer is noticed from its exit (no step timeout), replaced at once by its warm
spare (compiled, waiting) on its address, the ring re-dialled and every held stream replayed, so
the answers equal an undisturbed greedy run; ``ring_reports()`` says *recovering* meanwhile,
naming the stage (the cold restart in place is tests/cli/test_serve_workers.py's). A stage that
cannot come back (its shard file gone) is given up after the policy's crashes, and its held
request fails within the hold time with an error naming it; the ring then reports *down*, and
the next request fails at once instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest

from engine.generation.request import GenerationRequest
from engine.generation.ring_report import RingStatus
from engine.shards.manifest import load_manifest
from engine.tools.local_fleet import paged_local_fleet
from engine.tools.local_supervisor import describe_exit
from engine.tools.restart_policy import RestartPolicy, spares_fit
from tests.conftest import PROMPT_IDS
from tests.coordinator.test_failover import _kill_worker
from tests.support.asyncutil import run
from tests.support.shared_loop import SharedLoop

N = 40
POOL = 16 << 20
HOLD_S = 45.0
# A back-off no restart here should wait: a first crash that waited for it would show, a loaded machine would not.
SLOW_BACKOFF = RestartPolicy(first_backoff_s=30.0, max_backoff_s=30.0)


def test_a_first_crash_restarts_at_once_and_a_crash_loop_backs_off_then_gives_up():
    policy = RestartPolicy(window_s=60.0, first_backoff_s=1.0, max_backoff_s=3.0, max_crashes=4)
    assert policy.delay([100.0], 100.0) == 0.0
    assert policy.delay([100.0, 110.0], 110.0) == 1.0
    assert policy.delay([100.0, 110.0, 111.0], 112.0) == 2.0
    assert policy.delay([100.0, 110.0, 111.0, 112.0], 113.0) == 3.0  # capped
    assert policy.delay([100.0, 110.0, 111.0, 112.0, 113.0], 114.0) is None
    # crashes older than the window no longer count: a stage given up is tried again later
    assert policy.delay([100.0, 110.0, 111.0, 112.0, 113.0], 113.0 + 61.0) == 0.0
    assert policy.delay([0.0, 100.0], 100.0) == 0.0
    with pytest.raises(ValueError):
        RestartPolicy(max_crashes=0)


def _children(stage: int, spare: bool) -> list[int]:
    found = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            argv = child.cmdline()
            if ("worker" in argv and "--stage" in argv and argv[argv.index("--stage") + 1] == str(stage)
                    and ("--spare" in argv) == spare):
                found.append(child.pid)
    return found


def _spare_pid(stage: int) -> int:
    (pid,) = _children(stage, spare=True)
    return pid


def _serving_pid(stage: int) -> int:
    """The pid serving ``stage``: a worker started as such, or a spare that took over (then a
    second spare, started later, may be waiting: the older of the spares is the one serving)."""
    plain = [p for p in _children(stage, spare=False) if psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    spares = sorted(_children(stage, spare=True), key=lambda p: psutil.Process(p).create_time())
    return (plain or spares)[0]


def test_warm_spares_are_kept_only_when_the_free_memory_holds_them_twice():
    gib = 1 << 30
    assert spares_fit(2 * gib, gib, 6 * gib)
    assert not spares_fit(2 * gib, gib, 5 * gib)


def test_an_exit_is_described_by_its_signal_or_code():
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(None) == "stopped answering"


@pytest.mark.slow
def test_a_worker_killed_mid_answer_is_replaced_by_its_warm_spare_and_answers_are_identical(tiny_export,
                                                                                            unsplit_greedy):
    export = tiny_export("llama", 2)
    prompts = (PROMPT_IDS, PROMPT_IDS[:7], tuple(range(40, 60)))
    restarts = []
    spares: set[int] = set()
    seen = []  # the ring's report while the spare took over (the coordinator still holding its streams)
    ring = []

    def restarted(restart):
        restarts.append(restart)
        seen.append(ring[0].ring_reports()[0])

    async def main():
        # no step timeout: the supervisor notices the exit itself
        async with paged_local_fleet(export, exact=True, kv_pool_bytes=POOL, failover=True, prefill_chunk=5,
                                     on_restart=restarted, spares=True, on_spare=spares.add,
                                     restart_policy=SLOW_BACKOFF) as c:
            ring.append(c)
            assert c.ring_reports()[0].status is RingStatus.OK
            for _ in range(600):
                if spares == {0, 1}:
                    break
                await asyncio.sleep(0.1)
            spare_pid = _spare_pid(1)
            got = {p: [] for p in prompts}
            killed = asyncio.Event()

            async def consume(prompt):
                async for event in c.stream(GenerationRequest(prompt, N, ignore_eos=True)):
                    got[prompt].append(event.token_id)
                    if len(got[prompt]) == N // 2 and not killed.is_set():
                        killed.set()
                        _kill_worker(1)

            await asyncio.gather(*(consume(p) for p in prompts))
            return got, c.ring_reports()[0], c.metrics(), spare_pid, _serving_pid(1)

    got, after, metrics, spare_pid, serving_pid = run(main(), timeout=240)
    for prompt in prompts:
        assert tuple(got[prompt]) == unsplit_greedy(prompt, N)
    assert metrics["requests_failed_total"] == 0 and metrics["failovers_total"] == 1
    (during,) = seen
    assert during.status is RingStatus.RECOVERING and during.stage == 1 and "SIGKILL" in during.detail
    assert after.status is RingStatus.OK
    (restart,) = restarts
    assert restart.stage == 1 and restart.exit_code == -9 and restart.attempts == 1 and restart.spare
    assert serving_pid == spare_pid  # the spare serves stage 1 now
    breakdown = restart.breakdown()
    assert breakdown["backoff_s"] < SLOW_BACKOFF.first_backoff_s  # a first crash is restarted at once, not backed off
    assert "activate_s" in breakdown and "open_compile_s" not in breakdown  # no start on the clock


class SupervisedFleet:
    """The module's supervised fleet without spares (on a copy of the tiny export that a test may
    break), run on a loop thread shared by its tests; ``restarts`` hears the current test's."""

    def __init__(self, export: Path, loop: SharedLoop) -> None:
        self.export, self.loop = export, loop
        self.coordinator = None
        self.restarts: list = []
        self._stack = contextlib.AsyncExitStack()

    async def async_start(self) -> None:
        policy = RestartPolicy(first_backoff_s=0.2, max_backoff_s=0.2, max_crashes=2)
        self.coordinator = await self._stack.enter_async_context(paged_local_fleet(
            self.export, exact=True, kv_pool_bytes=POOL, failover=True, step_timeout_s=2.0, restart_policy=policy,
            hold_timeout_s=HOLD_S, on_restart=lambda r: self.restarts.append(r)))

    async def async_close(self) -> None:
        await self._stack.aclose()


@pytest.fixture(scope="module")
def supervised_fleet(tmp_path_factory, tiny_export):
    """One fleet for the step-timeout test and then the stage-that-cannot-come-back test (which
    leaves it down, so it runs last): one start instead of two. Its policy gives a stage up after
    its third crash within the window: the first test's crash is its first, the second test's
    kill its second, whose start fails (the shard is gone) as the third."""
    export = tmp_path_factory.mktemp("supervised") / "export"
    shutil.copytree(tiny_export("llama", 2), export)
    fleet = SupervisedFleet(export, SharedLoop("test-supervised-fleet").start())
    try:
        fleet.loop.run(fleet.async_start(), 120, "the fleet's start")
        yield fleet
    finally:
        with contextlib.suppress(Exception):
            fleet.loop.run(fleet.async_close(), 60, "closing the fleet")
        fleet.loop.stop()


@pytest.fixture
def supervised(supervised_fleet) -> SupervisedFleet:
    """The module's fleet, serving, on a loop whose executor is this test's own."""
    fleet = supervised_fleet
    report = fleet.coordinator.ring_reports()[0]
    assert report.status is RingStatus.OK, f"the module's fleet is not serving (a test before left it so): {report}"
    fleet.restarts.clear()
    fleet.loop.new_executor()
    yield fleet
    fleet.loop.new_executor()


@pytest.mark.slow
def test_a_stopped_worker_is_noticed_by_the_step_timeout_killed_and_restarted(supervised, unsplit_greedy):
    c = supervised.coordinator

    async def main():
        tokens = []
        async for event in c.stream(GenerationRequest(PROMPT_IDS, N, ignore_eos=True)):
            tokens.append(event.token_id)
            if len(tokens) == 5:
                os.kill(_serving_pid(1), signal.SIGSTOP)  # alive, silent: no exit to notice
        return tokens

    assert tuple(supervised.loop.run(main(), 240)) == unsplit_greedy(PROMPT_IDS, N)
    (restart,) = supervised.restarts
    assert restart.stage == 1 and restart.exit_code == -9


@pytest.mark.slow
def test_a_stage_that_cannot_come_back_fails_within_the_hold_time_naming_it_503_from_the_api(supervised):
    """Last in the module: it leaves the shared fleet's stage 1 down for good."""
    import aiohttp

    from engine.api.server import ApiSettings, async_run_api
    from engine.generation.tokenizer import ChatTokenizer

    export, c = supervised.export, supervised.coordinator
    stage1 = load_manifest(export).stages[1]
    hold = HOLD_S
    auth = {"Authorization": "Bearer k-1"}

    async def main():
        api = await async_run_api(c, ChatTokenizer(export / "tokenizer"), ApiSettings(api_key="k-1"))
        base = api.url.removesuffix("/v1")
        try:
            async with aiohttp.ClientSession(headers=auth) as http:
                # a streamed answer in flight when the stage dies for good: it ends in band, naming it
                chunks, killed_at = [], None
                body = {"prompt": "Hello", "max_tokens": N, "stream": True}
                async with http.post(f"{base}/v1/completions", json=body) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            chunks.append(line[6:].decode().strip())
                        if len(chunks) == 3 and killed_at is None:
                            for f in stage1.files:  # the stage cannot start again
                                (export / f.path).unlink()
                            killed_at = time.monotonic()
                            _kill_worker(1)
                took = time.monotonic() - killed_at
                async with http.get(f"{base}/health") as r:
                    health = r.status, await r.json()
                started = time.monotonic()  # a request now: 503 at once, naming the stage
                async with http.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}) as r:
                    refused = r.status, await r.json(), time.monotonic() - started
        finally:
            await api.async_stop()
        return chunks, took, health, refused, c.ring_reports()[0]

    chunks, took, (health_status, health), (status, error, refused_in), report = supervised.loop.run(main(), 240)
    last = json.loads(chunks[-1])
    assert "error" in last and "stage 1" in last["error"]["message"]
    assert "cannot be brought back" in last["error"]["message"] and "missing" in last["error"]["message"]
    assert took < hold
    assert health_status == 503 and health["status"] == "down"
    (ring,) = health["rings"]
    assert ring["status"] == "down" and ring["stage"] == 1 and "stage 1" in ring["detail"]
    assert status == 503 and "stage 1" in error["error"]["message"] and refused_in < hold  # refused, not held
    assert report.status is RingStatus.DOWN and report.stage == 1
