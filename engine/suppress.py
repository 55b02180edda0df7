"""Swallowing an exception on purpose, with a log line that says what was swallowed.

A best-effort step (closing a peer that may be gone, telling an advertiser to withdraw, reading a
counter that some platforms lack) must not stop what runs after it; but an exception dropped
without a trace hides the bug that makes the step fail every time. :func:`logged_suppress` is the
one ``suppress(Exception)``: it names the step and logs the exception (DEBUG unless told), so the
cause is one log level away. Narrow suppressions of an expected error (``suppress(OSError)`` on a
close) stay as they are: they drop nothing unexpected.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def logged_suppress(logger: logging.Logger, what: str, *, level: int = logging.DEBUG) -> Iterator[None]:
    """Run the ``with`` body; an ``Exception`` it raises is logged as "``what`` failed" and dropped.

    ``what`` names the step in words ("closing the ring's first hop"). Cancellation and other
    ``BaseException``s (KeyboardInterrupt, SystemExit) pass through.
    """
    try:
        yield
    except Exception as exc:
        logger.log(level, "%s failed (carrying on): %s: %s", what, type(exc).__name__, exc,
                   exc_info=logger.isEnabledFor(logging.DEBUG))
