"""Several local fleets of one export behind one router: ``serve --workers --rings N``, the rings
benchmark and the multi-ring tests.

Each ring is a :func:`~engine.tools.local_fleet.paged_local_fleet` (a paged worker process per
stage on loopback, its own coordinator); the :class:`~engine.generation.router.Router` in front
sends each request to one of them (least loaded; a conversation to the ring holding its prefix).
Every ring's workers share one OpenVINO CACHE_DIR, so the second ring's compile, and any restart,
is a cache hit. On one machine the rings share its cores: N rings are N times the workers on the
same CPUs, which is what the benchmark measures, not N times the speed.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engine.errors import DeskfleetError
from engine.generation.router import Router
from engine.tools.local_fleet import paged_local_fleet
from engine.wire.step_plan import CPU_BLOCK_SIZE

log = logging.getLogger(__name__)

MAX_LOCAL_RINGS = 16


def ring_ids(rings: int) -> tuple[str, ...]:
    """The ids local rings are served under: ring-0, ring-1, ..."""
    return tuple(f"ring-{i}" for i in range(rings))


@contextlib.asynccontextmanager
async def local_rings(export_dir: Path | str, rings: int, *, model_name: str | None = None,
                      cache_dir: Path | str | None = None, **fleet_options: Any) -> AsyncIterator[Router]:
    """A Router over ``rings`` running paged local fleets of ``export_dir`` (started one after
    another, stopped together when the block ends).

    ``fleet_options`` go to every :func:`paged_local_fleet` (exact, threads, failover,
    kv_pool_bytes, slots, token_budget, ...); ``model_name`` is the name the router serves them as
    (default: the export's)."""
    if not 1 <= rings <= MAX_LOCAL_RINGS:
        raise DeskfleetError(f"--rings must be between 1 and {MAX_LOCAL_RINGS}, got {rings}")
    with contextlib.ExitStack() as files:
        cache = cache_dir if cache_dir is not None else files.enter_context(
            tempfile.TemporaryDirectory(prefix="deskfleet-compiled-"))
        async with contextlib.AsyncExitStack() as stack:
            router = Router(block_size=CPU_BLOCK_SIZE)
            for ring_id in ring_ids(rings):
                coordinator = await stack.enter_async_context(
                    paged_local_fleet(export_dir, cache_dir=cache, **fleet_options))
                router.add_ring(ring_id, coordinator, model_name=model_name)
                log.info("local ring %s is up (%d of %d)", ring_id, len(router.rings()), rings)
            yield router
