"""engine.suppress.logged_suppress: drops an Exception from a best-effort step and logs what it
dropped under the step's name; lets cancellation and exits through."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.suppress import logged_suppress

log = logging.getLogger("deskfleet.test.suppress")


def test_an_exception_is_dropped_and_logged_with_the_step(caplog: pytest.LogCaptureFixture) -> None:
    after: list[str] = []
    with caplog.at_level(logging.DEBUG, logger=log.name):
        with logged_suppress(log, "closing the first hop"):
            raise ConnectionResetError("peer went away")
        after.append("ran on")
    assert after == ["ran on"]
    [record] = caplog.records
    assert record.levelno == logging.DEBUG
    assert record.getMessage() == "closing the first hop failed (carrying on): ConnectionResetError: peer went away"
    assert record.exc_info is not None


def test_the_level_can_be_raised(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=log.name):
        with logged_suppress(log, "withdrawing the advertisement", level=logging.WARNING):
            raise RuntimeError("zeroconf closed")
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "withdrawing the advertisement" in record.getMessage()


def test_a_quiet_body_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=log.name):
        with logged_suppress(log, "nothing"):
            pass
    assert not caplog.records


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, asyncio.CancelledError])
def test_base_exceptions_pass_through(exc: type[BaseException]) -> None:
    with pytest.raises(exc):
        with logged_suppress(log, "a step"):
            raise exc()
