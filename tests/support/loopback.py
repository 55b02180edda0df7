"""A free TCP port on 127.0.0.1, for processes that must be told their port before they start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on right now (the OS's pick; free until someone else takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
