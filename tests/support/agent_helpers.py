"""Helpers for agent tests: the fake idle source and the console's headless half."""

from __future__ import annotations

from agent.service.idle import FakeIdle
from engine.control.fleet_services import fleet_host as console

__all__ = ["FakeIdle", "console"]

