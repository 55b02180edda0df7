"""The coordinator's end of a paged ring whose later stages run elsewhere (an agent's worker, a
worker process): stage 0 paged in this process, the others behind ``first_remote``, answers on
``return_listen``. What the fleet service's distribution builds, without the service, for the tests
and benchmarks that drive an agent's worker directly."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from engine.generation.generator import ModelCard
from engine.paged.coordinator import BatchCoordinator, paged_scheduler
from engine.paged.kv_pool import pool_blocks_for
from engine.paged.ring_path import PagedRingPath
from engine.paged.stage import PagedStage
from engine.shards.manifest import Manifest, load_manifest
from engine.wire.address import Address
from engine.wire.step_codec import step_reply_bound
from engine.wire.step_plan import CPU_BLOCK_SIZE

POOL_BYTES = 16 << 20  # per stage: the tiny model's blocks are small, a few hundred fit
TOKEN_BUDGET = 256  # the paged scheduler's default: new tokens per step


def card_of(manifest: Manifest) -> ModelCard:
    """The model card a ring of ``manifest``'s export serves under (what the API lists)."""
    m = manifest.model
    return ModelCard(name=m.name, context_length=m.max_position_embeddings, eos_token_ids=m.eos_token_ids,
                     stages=len(manifest.stages), fingerprint=m.fingerprint, vocab_size=m.vocab_size)


def paged_stage0(export: Path, *, pool_bytes: int = POOL_BYTES, exact: bool = False,
                 num_threads: int | None = None) -> PagedStage:
    """Stage 0 of ``export`` paged in this process, its pool allocated: the most blocks
    ``pool_bytes`` holds on every stage (the remote stages get the same count in each plan)."""
    manifest = load_manifest(export)
    stage = PagedStage(export, 0, exact=exact, num_threads=num_threads, manifest=manifest)
    blocks = pool_blocks_for(manifest, pool_bytes, CPU_BLOCK_SIZE, precision="f32" if exact else None)
    stage.allocate(blocks, pool_bytes)
    return stage


@contextlib.asynccontextmanager
async def paged_ring(export: Path, stage0: PagedStage, first_remote: Address, return_listen: Address,
                     **ends) -> AsyncIterator[BatchCoordinator]:
    """A started paged coordinator over ``stage0`` (see :func:`paged_stage0`) and the remote
    stages; ``ends``: the ring's TLS contexts, ``peers`` and ``dial_deadline`` (PagedRingPath's)."""
    manifest = load_manifest(export)
    model = manifest.model
    path = PagedRingPath(model.fingerprint, len(manifest.stages), first_remote, return_listen,
                         block_size=CPU_BLOCK_SIZE, local_stage0=stage0,
                         max_frame_bytes=step_reply_bound(model.vocab_size, TOKEN_BUDGET, TOKEN_BUDGET), **ends)
    scheduler = paged_scheduler(manifest, stage0.pool_blocks, CPU_BLOCK_SIZE, token_budget=TOKEN_BUDGET)
    try:
        async with BatchCoordinator(path, card_of(manifest), scheduler) as coordinator:
            yield coordinator
    finally:  # a start that failed (the first hop refused) leaves the return port open
        await path.async_close()
