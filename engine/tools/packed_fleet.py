"""Open packed serving of a static (NPU-target) export: in this process, over local worker
processes, or over a ring of packed stage workers elsewhere. Each yields a running
:class:`~engine.static.packed_generator.PackedGenerator` (a Generator the OpenAI API serves)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from engine.coordinator.constrained import GrammarVocabulary, StreamConstraints
from engine.errors import DeskfleetError
from engine.generation.generator import ModelCard
from engine.shards.manifest import Manifest, load_manifest
from engine.static.packed_generator import LocalStatic, PackedGenerator, RingStatic
from engine.static.packed_ring import PackedRingPath
from engine.static.packed_stage import StaticChain, geometry_of, static_manifest
from engine.tools.worker_processes import Hop, LocalFleet
from engine.wire.address import Address


def export_row_options(manifest: Manifest) -> tuple[int, ...]:
    """The row counts of the graphs every stage of the export has (1 decode row, C prefill rows, or S)."""
    stages = static_manifest(manifest).stages
    return tuple(sorted(set.intersection(*({g.rows for g in st.graphs} for st in stages))))


@contextlib.asynccontextmanager
async def static_generator(export_dir: Path | str, *, device: str = "CPU", exact: bool = False,
                           num_threads: int | None = None) -> AsyncIterator[PackedGenerator]:
    """Every stage in this process."""
    chain = StaticChain.load(export_dir, device=device, exact=exact, num_threads=num_threads)
    generator = PackedGenerator(LocalStatic(chain), ModelCard.from_manifest(chain.manifest), chain.geometry,
                                chain.row_options,
                                grammar=StreamConstraints(GrammarVocabulary.of_export(export_dir, chain.manifest)))
    async with generator:
        yield generator


@contextlib.asynccontextmanager
async def ring_static_generator(manifest: Manifest, first_stage: Address, return_listen: Address, *,
                                grammar: GrammarVocabulary | None = None,
                                **path_options) -> AsyncIterator[PackedGenerator]:
    """Through packed stage workers: stage 0 listens at ``first_stage``, the last dials ``return_listen``
    (``grammar``: the model's vocabulary, for constrained output)."""
    path = PackedRingPath(static_manifest(manifest).model.fingerprint, len(manifest.stages), first_stage, return_listen,
                    **path_options)
    generator = PackedGenerator(RingStatic(path), ModelCard.from_manifest(manifest), geometry_of(manifest),
                                export_row_options(manifest), grammar=StreamConstraints(grammar))
    async with generator:
        yield generator


@contextlib.asynccontextmanager
async def local_static_fleet(export_dir: Path | str, *, exact: bool = False, threads: int | None = None,
                             hop: Hop | None = None) -> AsyncIterator[PackedGenerator]:
    """One packed worker process per stage on loopback, and the generator over their ring."""
    manifest = static_manifest(load_manifest(export_dir))
    fleet = LocalFleet(export_dir, exact=exact, threads=threads)
    path = PackedRingPath(manifest.model.fingerprint, len(manifest.stages), Address("127.0.0.1", 0),
                          Address("127.0.0.1", 0))
    try:
        path.first_remote = await fleet.async_start(await path.async_listen(), hop)
        generator = PackedGenerator(RingStatic(path), ModelCard.from_manifest(manifest), geometry_of(manifest),
                                    export_row_options(manifest),
                                    grammar=StreamConstraints(GrammarVocabulary.of_export(export_dir, manifest)))
        async with generator:
            yield generator
    finally:
        await path.async_close()
        await fleet.async_stop()


def refuse_stateful_options(*, speculation: str, host_stage0: bool) -> None:
    """The serving options a static export cannot honour, refused with the reason."""
    if speculation != "off":
        raise DeskfleetError("speculative decoding needs a stateful export (KV rewind); static "
                             "(NPU-target) exports serve packed greedy decoding: drop --speculation")
    if host_stage0:
        raise DeskfleetError("--host-stage0 is for stateful exports; start every static stage as a worker")
