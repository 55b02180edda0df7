"""Text held back while it may still become a marker: a stop string, ``<tool_call>``, ``</think>``.

A streamed answer must never send text it would have to take back; the tail that could be the
start of a marker waits for the next token to tell.
"""

from __future__ import annotations

from collections.abc import Iterable


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    markers = tuple(m for m in markers if m)
    for k in range(min(len(text), max((len(m) for m in markers), default=0) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0
