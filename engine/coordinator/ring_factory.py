"""One factory for a ring of stage workers: :func:`open_ring` picks the runtime from the export.

A CPU/GPU export is served **paged** (a :class:`~engine.paged.ring_path.PagedRingPath` under
a :class:`~engine.paged.coordinator.BatchCoordinator`, over a block pool); an
NPU-target export **static** (a :class:`~engine.static.packed_ring.PackedRingPath` under a
:class:`~engine.static.packed_generator.PackedGenerator`, over the export's slots). Both paths
stand on :class:`~engine.ring.ends.RingEnds`, so a caller treats the result alike: a
:class:`~engine.generation.generator.Generator` not yet started, whose ``path`` is the ring's
ends (listen on its return port before the last stage starts, set ``first_remote`` once the
first stage is known), started and stopped with ``async with`` or ``async_start``/``async_stop``.

``deskfleet serve --first-stage``, the local fleets (``serve --workers``) and the fleet service's
distribution open their rings here; nothing else branches on the runtime.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import DeskfleetError
from engine.generation.generator import ModelCard
from engine.paged.constraints import GrammarVocabulary, StreamConstraints
from engine.paged.coordinator import BatchCoordinator, block_size_for, paged_scheduler
from engine.paged.kv_pool import DEFAULT_KV_POOL_BYTES, pool_blocks_for
from engine.paged.ring_path import PagedRingPath
from engine.paged.speculation import Speculator
from engine.paged.stage import PagedStage
from engine.paged.step import PagedPath
from engine.ring.ends import RingEnds, return_frame_bound
from engine.shards.manifest import Manifest, serving_runtime
from engine.static.packed_generator import PackedGenerator, RingStatic
from engine.static.packed_ring import PackedRingPath
from engine.static.packed_stage import export_row_options, geometry_of
from engine.wire.address import Address
from engine.wire.step_codec import step_reply_bound

RingGenerator = BatchCoordinator | PackedGenerator
Recover = Callable[[PagedPath, str], Awaitable[PagedPath]]


class StaticRingOptionError(DeskfleetError):
    """A serving option a static (NPU-target) ring cannot honour was asked for."""


@dataclass(frozen=True)
class RingOptions:
    """How a ring serves. The paged-only fields (``slots`` .. ``lanes``) are the paged scheduler's
    and pool's; a static ring's slots and rows are its export's.

    ``pool_blocks``: the ring's pool when already fixed (the fleet service sizes it from what every
    member gives); None: as many blocks as ``kv_pool_bytes`` holds for the tightest stage.
    ``step_timeout_s``: a step unanswered this long is a failure (paged: a failover; static: the
    session ends). ``hold_timeout_s``: how long a paged ring holds its streams while it recovers."""

    device: str = "CPU"
    exact: bool = False
    slots: int = 16
    token_budget: int = 256
    prefill_chunk: int | None = None  # None: the token budget
    kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES
    pool_blocks: int | None = None
    lanes: int | None = None  # micro-batches in flight; None: one per stage
    max_waiting: int = 64
    prefix_cache: bool = True
    step_timeout_s: float | None = None
    hold_timeout_s: float = 60.0


def open_ring(manifest: Manifest, first_remote: Address, return_listen: Address, *,
              options: RingOptions = RingOptions(), grammar: GrammarVocabulary | None = None,
              local_stage0: PagedStage | None = None, speculation: Speculator | None = None,
              recover: Recover | None = None, **ends: Any) -> RingGenerator:
    """The generator over a ring of workers serving ``manifest``'s export (not started): paged for
    a CPU/GPU export, static for an NPU-target one. ``ends``: :class:`~engine.ring.ends.RingEnds`'
    TLS options and peers (server_ssl, client_ssl, peers, dial_deadline, ...). ``grammar``: the
    model's vocabulary, for constrained output. ``local_stage0``, ``speculation`` and ``recover``
    (failover) are the paged runtime's; a static ring refuses the first two."""
    if serving_runtime(manifest) == "static":
        return _static_ring(manifest, first_remote, return_listen, options, grammar, local_stage0, speculation, ends)
    return _paged_ring(manifest, first_remote, return_listen, options, grammar, local_stage0, speculation, recover,
                       ends)


def ring_path(generator: RingGenerator) -> RingEnds:
    """The ring's ends of a generator :func:`open_ring` made."""
    if isinstance(generator, BatchCoordinator):
        assert isinstance(generator.path, PagedRingPath)
        return generator.path
    assert isinstance(generator.backend, RingStatic)
    return generator.backend.path


def _paged_ring(manifest: Manifest, first_remote: Address, return_listen: Address, options: RingOptions,
                grammar: GrammarVocabulary | None, local_stage0: PagedStage | None, speculation: Speculator | None,
                recover: Recover | None, ends: dict[str, Any]) -> BatchCoordinator:
    block_size = block_size_for(options.device)
    pool = options.pool_blocks
    if pool is None:
        pool = pool_blocks_for(manifest, options.kv_pool_bytes, block_size,
                               precision="f32" if options.exact else None)
    budget = options.token_budget
    chunk = options.prefill_chunk or budget
    # no step answers (or wants the logits of) more rows than it has tokens
    ends.setdefault("max_frame_bytes", step_reply_bound(manifest.model.vocab_size, budget, budget))
    path = PagedRingPath(manifest.model.fingerprint, len(manifest.stages), first_remote, return_listen,
                         block_size=block_size, local_stage0=local_stage0, **ends)
    scheduler = paged_scheduler(manifest, pool, block_size, slots=options.slots, max_waiting=options.max_waiting,
                                token_budget=budget, prefill_chunk=chunk, prefix_cache=options.prefix_cache)
    return BatchCoordinator(path, ModelCard.from_manifest(manifest), scheduler, lanes=options.lanes,
                            speculation=speculation, recover=recover, step_timeout_s=options.step_timeout_s,
                            hold_timeout_s=options.hold_timeout_s, grammar=grammar)


def _static_ring(manifest: Manifest, first_remote: Address, return_listen: Address, options: RingOptions,
                 grammar: GrammarVocabulary | None, local_stage0: PagedStage | None, speculation: Speculator | None,
                 ends: dict[str, Any]) -> PackedGenerator:
    refuse_static_options(speculation=speculation is not None, host_stage0=local_stage0 is not None)
    model = manifest.model
    ends.setdefault("max_frame_bytes", return_frame_bound(model.vocab_size, model.max_position_embeddings))
    path = PackedRingPath(model.fingerprint, len(manifest.stages), first_remote, return_listen, **ends)
    backend = RingStatic(path, step_timeout_s=options.step_timeout_s or 120.0)
    return PackedGenerator(backend, ModelCard.from_manifest(manifest), geometry_of(manifest),
                           export_row_options(manifest), grammar=StreamConstraints(grammar))


def refuse_static_options(*, speculation: bool, host_stage0: bool) -> None:
    """The serving options a static (NPU-target) export cannot honour, refused with the reason."""
    if speculation:
        raise StaticRingOptionError("speculative decoding needs a CPU/GPU export served paged (KV rewind); a static "
                                    "(NPU-target) export serves packed greedy decoding: drop --speculation")
    if host_stage0:
        raise StaticRingOptionError("a static (NPU-target) ring runs every stage as a worker: drop --host-stage0 "
                                    "(or host no stage 0 in the fleet service)")
