"""Shared by the data-plane insider, bound and hold tests: one fleet CA with the console, the desk
serving a stage and two fellow members, and the pieces of a paged ring (a PagedRingPath, a
PagedStageWorker, a BatchCoordinator over them) the files build their rings from: every stage
remote, so a test holds the path before the ring starts (tests/support/paged_ring.py's ring runs
stage 0 in process)."""

from __future__ import annotations

from pathlib import Path

from engine.paged.coordinator import BatchCoordinator, paged_scheduler
from engine.paged.kv_pool import pool_blocks_for
from engine.paged.ring_path import PagedRingPath
from engine.paged.stage import PagedStage
from engine.paged.worker import PagedStageWorker
from engine.shards.manifest import load_manifest
from engine.trust.fleet_ca import Credentials, FleetAuthority, Role
from engine.wire.address import Address
from engine.wire.step_codec import step_reply_bound
from engine.wire.step_plan import CPU_BLOCK_SIZE
from tests.support.paged_ring import card_of

N = 12  # tokens per test request
LOOP = Address("127.0.0.1", 0)
POOL = 16 << 20  # the KV pool of the ring's coordinator and of each worker: the tiny model's blocks are small
TOKEN_BUDGET = 64  # new tokens per step: the rows a StepReply can answer at most


def make_fleet() -> dict[str, Credentials]:
    """The console, the desk serving the stage, and two fellow members (mallory, bob), one CA."""
    authority = FleetAuthority.create("insider test fleet")
    return {name: authority.issue_credentials(name, role=role) for name, role in
            (("console", Role.CONSOLE), ("desk", Role.AGENT), ("mallory", Role.AGENT), ("bob", Role.AGENT))}


def fp_of(export) -> str:
    """The model fingerprint a Hello to this export's stages must name."""
    return load_manifest(export).model.fingerprint


def reply_bound(export: Path) -> int:
    """What the coordinator's return port takes (as ``deskfleet serve`` sizes it): a StepReply of
    up to :data:`TOKEN_BUDGET` answered rows, each with logits."""
    vocab = load_manifest(export).model.vocab_size
    return step_reply_bound(vocab, TOKEN_BUDGET, TOKEN_BUDGET)


def ring_path(export: Path, first_remote: Address = LOOP, **options) -> PagedRingPath:
    """The coordinator's end of a paged ring over ``export``'s stages (all remote), its return
    port on loopback; ``options``: RingPath's (TLS contexts, peers, timeouts, dial deadline)."""
    manifest = load_manifest(export)
    options.setdefault("max_frame_bytes", reply_bound(export))
    return PagedRingPath(manifest.model.fingerprint, len(manifest.stages), first_remote, LOOP,
                         block_size=CPU_BLOCK_SIZE, **options)


def worker(stage: PagedStage, next_address: Address, **options) -> PagedStageWorker:
    """A paged worker for ``stage`` listening on loopback (a :data:`POOL` budget); ``options``:
    PagedStageWorker's and its listener's (TLS, peers, caps, timeouts)."""
    return PagedStageWorker(stage, LOOP, next_address, kv_pool_bytes=POOL, **options)


def coordinator(path: PagedRingPath, export: Path, **options) -> BatchCoordinator:
    """A paged coordinator over ``path`` (exact f32 pool of :data:`POOL`), as ``deskfleet serve
    --first-stage`` builds one; ``options``: BatchCoordinator's (recover, timeouts)."""
    manifest = load_manifest(export)
    pool = pool_blocks_for(manifest, POOL, CPU_BLOCK_SIZE, precision="f32")
    scheduler = paged_scheduler(manifest, pool, CPU_BLOCK_SIZE, slots=4, token_budget=TOKEN_BUDGET,
                                prefill_chunk=TOKEN_BUDGET)
    return BatchCoordinator(path, card_of(manifest), scheduler, **options)
