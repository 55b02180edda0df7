"""One factory opens every ring: open_ring picks the runtime from the export's target (paged for a
CPU/GPU export, static for an NPU-target one), both over the same neutral ring ends, and refuses
what a static ring cannot do by name."""

from __future__ import annotations

import pytest

from engine.coordinator.ring_factory import RingOptions, StaticRingOptionError, open_ring, ring_path
from engine.paged.coordinator import BatchCoordinator
from engine.paged.ring_path import PagedRingPath
from engine.paged.speculation import SpeculationConfig, Speculator
from engine.ring.ends import RingEnds
from engine.shards.manifest import load_manifest
from engine.static.packed_generator import PackedGenerator
from engine.static.packed_ring import PackedRingPath
from engine.wire.address import Address
from tests.support.npu_helpers import npu_export

FIRST, RETURNS = Address("127.0.0.1", 9), Address("127.0.0.1", 0)


def test_a_cpu_export_opens_a_paged_ring_and_an_npu_export_a_static_one(tmp_path_factory, tiny_checkpoint,
                                                                         tiny_export):
    paged = open_ring(load_manifest(tiny_export("llama", 2)), FIRST, RETURNS,
                      options=RingOptions(kv_pool_bytes=16 << 20, slots=3, token_budget=32))
    static = open_ring(load_manifest(npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=64)),
                       FIRST, RETURNS)
    assert isinstance(paged, BatchCoordinator) and isinstance(ring_path(paged), PagedRingPath)
    assert isinstance(static, PackedGenerator) and isinstance(ring_path(static), PackedRingPath)
    for generator in (paged, static):
        path = ring_path(generator)
        assert isinstance(path, RingEnds) and path.first_remote == FIRST and path.num_stages == 2
    assert paged.scheduler.config.max_streams == 3 and paged.scheduler.config.token_budget == 32
    assert paged.model.stages == static.model.stages == 2


def test_a_static_ring_refuses_speculation_by_name(tmp_path_factory, tiny_checkpoint):
    manifest = load_manifest(npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=64))
    with pytest.raises(StaticRingOptionError, match="speculative decoding needs a CPU/GPU export"):
        open_ring(manifest, FIRST, RETURNS, speculation=Speculator(SpeculationConfig("lookup")))
