"""Open packed serving of a static (NPU-target) export in this process, or over local worker
processes. Each yields a running :class:`~engine.static.packed_generator.PackedGenerator` (a
Generator the OpenAI API serves). A ring of packed stage workers elsewhere is opened by
:func:`engine.coordinator.ring_factory.open_ring`, as every ring is."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from engine.coordinator.ring_factory import RingOptions, open_ring, ring_path
from engine.generation.generator import ModelCard
from engine.paged.constraints import GrammarVocabulary, StreamConstraints
from engine.shards.manifest import load_manifest
from engine.static.packed_generator import LocalStatic, PackedGenerator
from engine.static.packed_stage import StaticChain, static_manifest
from engine.tools.worker_processes import Hop, LocalFleet
from engine.wire.address import Address


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
async def local_static_fleet(export_dir: Path | str, *, exact: bool = False, threads: int | None = None,
                             hop: Hop | None = None) -> AsyncIterator[PackedGenerator]:
    """One packed worker process per stage on loopback, and the generator over their ring."""
    manifest = static_manifest(load_manifest(export_dir))
    fleet = LocalFleet(export_dir, exact=exact, threads=threads)
    generator = open_ring(manifest, Address("127.0.0.1", 0), Address("127.0.0.1", 0), options=RingOptions(exact=exact),
                          grammar=GrammarVocabulary.of_export(export_dir, manifest))
    assert isinstance(generator, PackedGenerator), "an NPU-target export is served static"
    path = ring_path(generator)
    try:
        path.first_remote = await fleet.async_start(await path.async_listen(), hop)
        async with generator:
            yield generator
    finally:
        await path.async_close()
        await fleet.async_stop()
