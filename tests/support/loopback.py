"""A free TCP port on 127.0.0.1, for processes that must be told their port before they start."""

from __future__ import annotations

import socket

_handed_out: set[int] = set()  # the OS may pick a port it just picked again: never hand one out twice


def free_port() -> int:
    """A port nothing listens on right now and this process has not been given before (the OS's
    pick; free until someone else takes it). Two calls never return the same port, so a layout
    built from several calls has distinct ports."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
