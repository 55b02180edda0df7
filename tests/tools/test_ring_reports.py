"""What a paged coordinator says about its ring through ``ring_reports()``, the
fact /health and the router read: ok while it serves; recovering, naming the stage, while a
failover holds its streams; down, naming the stage, when the failover failed, and then the next
request tries the repair first and fails at once with the same reason instead of hanging; ok
again once a repair works. In-process stages; the recover hook is the test's."""

from __future__ import annotations

import asyncio

import pytest

from engine.generation.generator import UnavailableError
from engine.generation.request import GenerationRequest
from engine.generation.ring_report import RingStatus
from engine.paged.coordinator import BatchCoordinator
from engine.tools.local_supervisor import StageDownError
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect, run

POOL = 16 << 20


def test_ring_reports_follow_a_failover_that_fails_and_a_repair_that_works(tiny_export, unsplit_greedy):
    export = tiny_export("llama", 1)
    request = GenerationRequest(PROMPT_IDS, 6, ignore_eos=True)
    gate = asyncio.Event()
    broken = True

    async def recover(path, reason):
        await gate.wait()
        if broken:
            raise StageDownError(1, "stage 1 cannot be brought back: its shard file is missing")
        return path

    async def main():
        c = BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL)
        c.recover = recover
        async with c:
            (report,) = c.ring_reports()
            assert (report.ring, report.status, report.stage) == ("default", RingStatus.OK, None)
            assert report.model == c.model.name
            c.request_failover("stage 1's worker was killed by SIGKILL", stage=1)
            (report,) = c.ring_reports()
            assert report.status is RingStatus.RECOVERING and report.stage == 1 and "SIGKILL" in report.detail
            gate.set()
            for _ in range(100):
                if c.ring_reports()[0].status is not RingStatus.RECOVERING:
                    break
                await asyncio.sleep(0.01)
            (report,) = c.ring_reports()
            assert report.status is RingStatus.DOWN and report.stage == 1
            assert "cannot be brought back" in report.detail and "SIGKILL" in report.detail
            # the next request asks for the repair first, which fails at once: a clear error, no hang
            with pytest.raises(UnavailableError, match="stage 1 cannot be brought back"):
                await asyncio.wait_for(collect(c, request), 10)
            assert c.ring_reports()[0].status is RingStatus.DOWN
            nonlocal broken
            broken = False
            tokens = await asyncio.wait_for(collect(c, request), 30)
            assert tuple(tokens) == unsplit_greedy(PROMPT_IDS, 6)
            assert c.ring_reports()[0].status is RingStatus.OK
        (report,) = c.ring_reports()
        assert report.status is RingStatus.DOWN and "not running" in report.detail

    run(main(), timeout=120)
