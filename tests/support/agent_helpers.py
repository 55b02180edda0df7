"""Helpers for agent tests: a free loopback port and the console's headless half."""

from __future__ import annotations

import socket

from agent.service.idle import FakeIdle
from engine.control.fleet_services import fleet_host as console

__all__ = ["FakeIdle", "console", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
