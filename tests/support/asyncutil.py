"""Small helpers for tests that drive the coordinator from synchronous test functions."""

from __future__ import annotations

import asyncio


def run(coro, timeout: float = 600):
    """Run ``coro`` to completion on a fresh loop, failing (not hanging) after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(coordinator, request) -> list[int]:
    """Every token id of one request."""
    return [e.token_id async for e in coordinator.stream(request)]


async def collect_events(coordinator, request) -> list:
    """Every TokenEvent of one request."""
    return [e async for e in coordinator.stream(request)]
