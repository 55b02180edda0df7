"""A paged worker's first block pool is mapped, not written, so the step that opens it (a
failover's replay on a promoted spare) does not wait for a GiB of page writes; its pages are
committed behind it without a byte changing. Real OpenVINO (the tiny model), real kernel memory."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import psutil
import pytest

from engine.paged import worker as paged_worker
from engine.paged.stage import PagedStage, PoolBudgetError
from engine.paged.worker import PagedStageWorker, commit_pages, map_pool
from engine.wire.address import Address
from engine.wire.step_plan import SCRATCH_BLOCKS, PlanRow, StepPlan, blocks_needed
from tests.conftest import PROMPT_IDS

MIB = 1 << 20


def _rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def _steps(stage: PagedStage, pool: int) -> list[np.ndarray]:
    """A prefill of the test prompt in two chunks and two decode rows, on the pool's last blocks."""
    blocks = tuple(range(pool - 4, pool))
    out, past = [], 0
    for new, ids in ((7, PROMPT_IDS[:7]), (len(PROMPT_IDS) - 7, PROMPT_IDS[7:]), (1, (5,)), (1, (9,))):
        plan = StepPlan(stage.block_size, pool, (PlanRow(1, past, new, blocks[:blocks_needed(past + new, 32)]),))
        x = np.zeros(plan.padded_tokens, np.int64)
        x[:new] = ids
        out.append(stage.run(plan, x).copy())
        past += new
    return out


@pytest.fixture(scope="module")
def export(tiny_export):
    return tiny_export("llama", 1)


def test_a_mapped_pool_answers_exactly_as_an_allocated_one_and_keeps_the_budget(export):
    pool = SCRATCH_BLOCKS + 60
    allocated, mapped = PagedStage(export, 0, exact=True), PagedStage(export, 0, exact=True)
    allocated.allocate(pool, 1 << 30)
    arrays = map_pool(mapped, pool, 1 << 30)
    assert mapped.pool_blocks == pool and [a.shape for a in arrays] == [a.shape for a in allocated.caches]
    for want, got in zip(_steps(allocated, pool), _steps(mapped, pool), strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(PoolBudgetError, match="over its KV budget"):
        map_pool(mapped, pool, pool * mapped.block_bytes - 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_commit_pages_commits_every_page_without_changing_a_byte():
    arr = np.zeros((64, MIB // 2), np.float16)  # 64 MiB, mapped, not committed
    arr[3, 5], arr[40, -1] = 1.5, -2.0  # two pages written (and so committed) already
    before = _rss()
    if not commit_pages([arr]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux >= 5.14)")
    assert _rss() - before > 56 * MIB
    assert arr[3, 5] == 1.5 and arr[40, -1] == -2.0 and np.count_nonzero(arr) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_a_fresh_worker_maps_its_first_pool_commits_it_later_and_allocates_another_size(export, monkeypatch):
    monkeypatch.setattr(paged_worker, "POOL_COMMIT_DELAY_S", 0.3)
    stage = PagedStage(export, 0, exact=True)
    worker = PagedStageWorker(stage, Address("127.0.0.1", 0), Address("127.0.0.1", 9), kv_pool_bytes=1 << 30)
    pool = max(SCRATCH_BLOCKS + 8, (96 * MIB) // stage.block_bytes)  # ~96 MiB of pool
    size = pool * stage.block_bytes
    before = _rss()
    worker._open_pool(StepPlan(32, pool, (PlanRow(1, 0, 1, (SCRATCH_BLOCKS,)),)))
    opened = _rss()
    assert stage.pool_blocks == pool and opened - before < size // 4  # mapped: the pages are not written
    deadline = time.monotonic() + 30
    while _rss() - before < size * 3 // 4:
        assert time.monotonic() < deadline, "the first pool's pages were never committed"
        time.sleep(0.05)
    first = stage.caches[0]
    worker._open_pool(StepPlan(32, pool // 2, (PlanRow(1, 0, 1, (SCRATCH_BLOCKS,)),)))  # a session of another size
    assert stage.pool_blocks == pool // 2 and stage.caches[0] is not first
    assert worker._committer is not None and not worker._committer.is_alive()
