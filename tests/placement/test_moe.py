"""Mixture-of-experts pricing (engine.placement.moe, and its use in engine.placement.throughput).

The expected distinct experts are checked against brute force over every routing of a few rows;
the rest are properties (monotone, bounded, dense when every expert is active) and one behaviour
on the tiny qwen3_moe export: priced as routed, its ring serves more than the same bytes as dense.
"""

from __future__ import annotations

import dataclasses
import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import PlacementInputError
from engine.placement.moe import ExpertRouting, MoeWeights, expected_experts, moe_weights, streamed_bytes
from engine.placement.throughput import (
    LinkSpec,
    ModelCost,
    PcSpec,
    StageCost,
    Workload,
    export_stage_costs,
    predict,
    stage_step_ms,
    step_weight_bytes,
    uniform_ring,
)
from engine.shards.manifest import load_manifest

PC = PcSpec(weight_gb_s=20.0)


def _brute_force(experts: int, per_token: int, rows: int) -> Fraction:
    """Mean distinct experts over every way ``rows`` rows can each pick ``per_token`` distinct experts."""
    picks = list(itertools.combinations(range(experts), per_token))
    routings = list(itertools.product(picks, repeat=rows))
    return Fraction(sum(len(set().union(*r)) for r in routings), len(routings))


@pytest.mark.parametrize(("experts", "per_token", "rows"),
                         [(4, 1, 2), (4, 2, 2), (4, 2, 3), (5, 2, 3), (6, 3, 2), (8, 2, 1), (3, 1, 4)])
def test_expected_distinct_experts_equal_brute_force_over_every_routing(experts, per_token, rows):
    got = expected_experts(ExpertRouting(experts, per_token), rows)
    assert got == pytest.approx(float(_brute_force(experts, per_token, rows)), rel=1e-12)


def test_small_cases_by_hand():
    assert expected_experts(ExpertRouting(4, 1), 2) == pytest.approx(1.75)  # 4 · (1 − 9/16)
    assert expected_experts(ExpertRouting(4, 2), 2) == pytest.approx(3.0)  # 4 · (1 − 1/4)
    assert expected_experts(ExpertRouting(128, 8), 1) == pytest.approx(8.0)  # one row: its own k
    assert expected_experts(ExpertRouting(128, 8), 0) == 0.0


@settings(max_examples=80, deadline=None)
@given(experts=st.integers(1, 256), data=st.data(), rows=st.integers(1, 512))
def test_distinct_experts_grow_with_rows_and_never_pass_all_of_them(experts, data, rows):
    routing = ExpertRouting(experts, data.draw(st.integers(1, experts)))
    now, more = expected_experts(routing, rows), expected_experts(routing, rows + 1)
    assert routing.per_token - 1e-9 <= now <= more + 1e-9 and more <= experts + 1e-9


@settings(max_examples=40, deadline=None)
@given(experts=st.integers(1, 64), rows=st.integers(1, 64), dense=st.floats(0, 1e9), expert=st.floats(0, 1e9))
def test_every_expert_active_is_priced_as_dense(experts, rows, dense, expert):
    routing = ExpertRouting(experts, experts)
    assert streamed_bytes(dense, expert, routing, rows) == pytest.approx(dense + expert)
    moe = StageCost(weight_bytes=dense, row_ms=1.0, expert_bytes=expert, routing=routing)
    flat = StageCost(weight_bytes=dense + expert, row_ms=1.0)
    assert stage_step_ms(moe, PC, rows, 0.0) == pytest.approx(stage_step_ms(flat, PC, rows, 0.0))


def test_a_moe_step_reads_the_dense_bytes_and_the_routed_share_of_the_experts():
    stage = StageCost(weight_bytes=1e8, row_ms=0.0, expert_bytes=8e8, routing=ExpertRouting(8, 2))
    assert step_weight_bytes(stage, 1) == pytest.approx(1e8 + 8e8 * 2 / 8)
    assert step_weight_bytes(stage, 2) == pytest.approx(1e8 + 8e8 * (1 - 0.75 ** 2))
    assert step_weight_bytes(dataclasses.replace(stage, routing=None), 1) == pytest.approx(9e8)  # as dense
    model = ModelCost(layers=4, layer_bytes=1e7, layer_row_ms=0.1, layer_context_ms=0.0, head_bytes=5e6,
                      head_row_ms=0.1, hidden_size=64, layer_expert_bytes=2e7, routing=ExpertRouting(8, 2))
    last = model.stage(3, last=True)
    assert (last.weight_bytes, last.expert_bytes, last.routing) == (3e7 + 5e6, 6e7, ExpertRouting(8, 2))


@pytest.mark.parametrize(("routing", "why"), [(lambda: ExpertRouting(8, 0), "0 < experts per token"),
                                               (lambda: ExpertRouting(8, 9), "<= experts"),
                                               (lambda: MoeWeights(ExpertRouting(8, 2), -1, 0), "negative"),
                                               (lambda: StageCost(1.0, 1.0, expert_bytes=-1.0), "expert_bytes")])
def test_impossible_routings_are_refused_by_name(routing, why):
    with pytest.raises(PlacementInputError, match=why):
        routing()


def test_the_tiny_qwen3_moe_export_serves_more_priced_as_routed_than_as_dense(tiny_export):
    """Same export, same bytes in memory: priced by its manifest's routing (8 experts, 2 per
    token) a 2-stage ring predicts more tokens per second than with every weight read each step,
    and the two meet as the rows per step grow past touching every expert."""
    manifest = load_manifest(tiny_export("qwen3_moe", 2))
    routed = export_stage_costs(manifest, row_ms=0.01, fixed_ms=0.05)
    dense = tuple(dataclasses.replace(c, weight_bytes=c.weight_bytes + c.expert_bytes, expert_bytes=0.0, routing=None)
                  for c in routed)
    assert all(c.routing == ExpertRouting(8, 2) and c.expert_bytes > 0 for c in routed)
    pc = PcSpec(weight_gb_s=0.05)  # slow enough that the weights set the pace

    def rate(stages, users):
        ring = uniform_ring(stages, pc=pc, own_pcs=True, local=LinkSpec(0.1), lan=LinkSpec(0.5), hidden_size=64,
                            coordinator_ms=0.0)
        return predict(ring, Workload(users, 2)).aggregate_tok_s

    for users in (1, 2, 8):
        assert rate(routed, users) > rate(dense, users) * 1.2
    assert rate(routed, 400) == pytest.approx(rate(dense, 400), rel=1e-6)
    whole = moe_weights(manifest)
    assert whole is not None and whole.expert_bytes == sum(c.expert_bytes for c in routed)
    assert "8 experts, 2 active" in whole.describe()


def test_a_dense_export_is_priced_by_its_whole_weight_file(tiny_export):
    manifest = load_manifest(tiny_export("llama", 2))
    costs = export_stage_costs(manifest, row_ms=0.01)
    assert moe_weights(manifest) is None and all(c.routing is None and c.expert_bytes == 0 for c in costs)
    assert [c.weight_bytes for c in costs] == [next(f.size for f in s.files if f.path.endswith(".bin"))
                                               for s in manifest.stages]
