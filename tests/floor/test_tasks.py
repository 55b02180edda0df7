"""engine.tasks.start_task: a named task held until it finishes, whose exception is logged with
its name the moment it ends (and never reported as "never retrieved"); cancellation logs nothing."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from engine.tasks import running_count, start_task


async def _fail() -> None:
    await asyncio.sleep(0)
    raise ValueError("the peer sent garbage")


def test_a_failing_task_is_logged_with_its_name(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> asyncio.Task[None]:
        task = start_task(_fail(), name="deskfleet-test-fail")
        await asyncio.wait([task])
        return task

    with caplog.at_level(logging.WARNING, logger="engine.tasks"):
        task = asyncio.run(main())
    assert isinstance(task.exception(), ValueError)
    [record] = [r for r in caplog.records if r.name == "engine.tasks"]
    assert record.levelno == logging.WARNING
    assert "deskfleet-test-fail" in record.getMessage()
    assert "the peer sent garbage" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is ValueError


def test_the_owners_logger_and_level_are_used(caplog: pytest.LogCaptureFixture) -> None:
    owner = logging.getLogger("deskfleet.test.owner")

    async def main() -> None:
        await asyncio.wait([start_task(_fail(), name="probe", logger=owner, level=logging.ERROR)])

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    [record] = [r for r in caplog.records if r.name == "deskfleet.test.owner"]
    assert record.levelno == logging.ERROR and "probe" in record.getMessage()


def test_a_cancelled_task_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> asyncio.Task[None]:
        task = start_task(asyncio.sleep(3600), name="deskfleet-test-sleeper")
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task])
        return task

    with caplog.at_level(logging.DEBUG):
        task = asyncio.run(main())
    assert task.cancelled()
    assert not [r for r in caplog.records if r.name == "engine.tasks"]


def test_a_task_is_held_until_it_finishes_then_released() -> None:
    started = running_count()

    async def main() -> None:
        gate = asyncio.Event()
        done: list[str] = []

        async def work() -> None:
            await gate.wait()
            done.append("ran")

        start_task(work(), name="deskfleet-test-unheld")  # nobody keeps the task but the helper
        await asyncio.sleep(0)
        gc.collect()
        assert running_count() == started + 1
        gate.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert done == ["ran"]
        assert running_count() == started

    asyncio.run(main())


def test_an_owners_set_holds_the_task_instead(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        mine: set[asyncio.Task[object]] = set()
        started = running_count()
        task = start_task(asyncio.sleep(0, result="ok"), name="deskfleet-test-owned", keep=mine)
        assert mine == {task} and running_count() == started
        assert await task == "ok"
        await asyncio.sleep(0)  # the done-callback runs after the awaiter wakes
        assert mine == set()

    asyncio.run(main())
    assert not caplog.records


def test_no_never_retrieved_report_for_a_failed_task(caplog: pytest.LogCaptureFixture) -> None:
    """Without the helper asyncio logs "Task exception was never retrieved" when the task is
    collected; with it the exception was retrieved (and logged once, by name)."""
    async def main() -> None:
        await asyncio.wait([start_task(_fail(), name="deskfleet-test-collected")])

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len([r for r in caplog.records if "deskfleet-test-collected" in r.getMessage()]) == 1
