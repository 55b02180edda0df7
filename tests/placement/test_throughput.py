"""The batched, micro-batched ring model (engine.placement.throughput) at its limits.

Every expected value is worked out here from the inputs by the formula in the module's
docstring, or is a property (monotone, linear, capped) over generated rings; none is a number
copied from the model's output.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import PlacementInputError
from engine.placement.throughput import (
    LinkSpec,
    ModelCost,
    PcSpec,
    RingSpec,
    StageCost,
    Workload,
    hop_ms,
    predict,
    predict_rings,
    split_rows,
    split_stages,
    stage_step_ms,
    uniform_ring,
)

LOCAL = LinkSpec(latency_ms=0.5)
LAN = LinkSpec(latency_ms=1.0, gbit_s=1.0)
PC = PcSpec(weight_gb_s=20.0)

costs = st.builds(StageCost, weight_bytes=st.floats(0, 4e9), row_ms=st.floats(0, 50),
                  context_ms=st.floats(0, 0.01), fixed_ms=st.floats(0, 10))
links = st.builds(LinkSpec, latency_ms=st.floats(0, 5), gbit_s=st.sampled_from([0.1, 1.0, 10.0, math.inf]))
pcs = st.builds(PcSpec, weight_gb_s=st.floats(0.5, 100))


@st.composite
def rings(draw, *, own_pcs: bool | None = None) -> RingSpec:
    stages = draw(st.lists(costs, min_size=1, max_size=5))
    n = len(stages)
    n_pcs = n if own_pcs else 1 if own_pcs is False else draw(st.integers(1, n))
    on = tuple(range(n)) if own_pcs else tuple(draw(st.integers(0, n_pcs - 1)) for _ in range(n))
    return RingSpec(stages=tuple(stages), stage_pcs=on, pcs=tuple(draw(pcs) for _ in range(n_pcs)),
                    hops=tuple(draw(links) for _ in range(n + 1)), hidden_size=draw(st.integers(1, 8192)),
                    coordinator_ms=draw(st.floats(0, 2)))


def _sum_ms(spec: RingSpec, rows: int, context: float) -> float:
    """One micro-batch alone: every stage, every hop and the coordinator in turn."""
    stages = sum(stage_step_ms(s, spec.pcs[p], rows, context) for s, p in zip(spec.stages, spec.stage_pcs, strict=True))
    return stages + sum(hop_ms(spec, k, rows) for k in range(len(spec.hops))) + spec.coordinator_ms


# --- the terms ------------------------------------------------------------------------------

def test_a_stage_step_is_fixed_plus_weight_pass_plus_rows_and_their_context():
    stage = StageCost(weight_bytes=3e9, row_ms=2.0, context_ms=0.01, fixed_ms=4.0)
    weight_ms = 3e9 / 20e9 * 1000
    assert stage_step_ms(stage, PC, 8, 100) == pytest.approx(4.0 + weight_ms + 8 * (2.0 + 100 * 0.01))


def test_a_middle_hop_carries_the_hidden_states_and_the_end_hops_only_frame_rows():
    spec = RingSpec(stages=(StageCost(1e6, 1.0),) * 2, stage_pcs=(0, 1), pcs=(PC, PC), hops=(LAN,) * 3,
                    hidden_size=4096, hidden_bytes=4, row_frame_bytes=64)
    bits_per_ms = 1.0e9 / 1000
    assert hop_ms(spec, 1, 8) == pytest.approx(1.0 + 8 * (4096 * 4 + 64) * 8 / bits_per_ms)
    assert hop_ms(spec, 0, 8) == hop_ms(spec, 2, 8) == pytest.approx(1.0 + 8 * 64 * 8 / bits_per_ms)


def test_users_are_split_as_evenly_as_possible_and_no_micro_batch_is_empty():
    assert split_rows(16, 2) == (8, 8)
    assert split_rows(7, 3) == (3, 2, 2)
    assert split_rows(1, 4) == (1,)
    assert predict(uniform_ring([StageCost(1e6, 1.0)] * 4, pc=PC, own_pcs=True, local=LOCAL, lan=LAN,
                                hidden_size=64, coordinator_ms=0.5), Workload(2, 4)).micro_batches == 2


# --- the limits -----------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(stage=costs, pc=pcs, hops=st.tuples(links, links), users=st.integers(1, 32),
       context=st.floats(0, 4096), coordinator=st.floats(0, 2))
def test_one_stage_one_micro_batch_is_the_sum_of_its_parts(stage, pc, hops, users, context, coordinator):
    spec = RingSpec(stages=(stage,), stage_pcs=(0,), pcs=(pc,), hops=hops, hidden_size=576,
                    coordinator_ms=coordinator)
    got = predict(spec, Workload(users, 1, context))
    expected = (stage_step_ms(stage, pc, users, context) + hop_ms(spec, 0, users) + hop_ms(spec, 1, users)
                + coordinator)
    assert got.period_ms == pytest.approx(expected) and got.bound == "round trip"
    assert got.aggregate_tok_s == pytest.approx(users * 1000 / expected)
    assert got.per_user_tok_s == pytest.approx(1000 / expected)


@settings(max_examples=60, deadline=None)
@given(spec=rings(), users=st.integers(1, 32), context=st.floats(0, 2048))
def test_one_micro_batch_on_any_ring_waits_for_everything_in_turn(spec, users, context):
    got = predict(spec, Workload(users, 1, context))
    assert got.period_ms == pytest.approx(_sum_ms(spec, users, context))


@settings(max_examples=80, deadline=None)
@given(spec=rings(), rows=st.integers(1, 16), context=st.floats(0, 2048))
def test_more_micro_batches_of_a_size_never_serve_fewer_tokens(spec, rows, context):
    """More micro-batches in flight fill the ring; past the busiest resource they only wait."""
    rates = [predict(spec, Workload(m * rows, m, context)).aggregate_tok_s for m in range(1, 7)]
    assert all(b >= a * (1 - 1e-9) for a, b in itertools.pairwise(rates)), rates


@settings(max_examples=80, deadline=None)
@given(stage=costs, n=st.integers(1, 5), pc=pcs, users=st.integers(1, 40), context=st.floats(0, 2048))
def test_up_to_one_micro_batch_per_stage_never_slows_balanced_stages_on_their_own_pcs(stage, n, pc, users,
                                                                                       context):
    coordinator = min(1.0, stage_step_ms(stage, pc, 1, context))  # no slower than a stage
    spec = uniform_ring([stage] * n, pc=pc, own_pcs=True, local=LOCAL, lan=LAN, hidden_size=2048,
                        coordinator_ms=coordinator)
    rates = [predict(spec, Workload(users, m, context)).aggregate_tok_s for m in range(1, n + 1)]
    assert all(b >= a * (1 - 1e-9) for a, b in itertools.pairwise(rates)), rates


def test_on_one_memory_path_every_extra_micro_batch_pays_another_weight_pass():
    stages = [StageCost(weight_bytes=2e8, row_ms=3.0, fixed_ms=4.0), StageCost(weight_bytes=4e8, row_ms=5.0)]
    box = uniform_ring(stages, pc=PC, own_pcs=False, local=LinkSpec(0.0), lan=LAN, hidden_size=576,
                       coordinator_ms=0.0)
    one, two = predict(box, Workload(8, 1)), predict(box, Workload(8, 2))
    passes = sum(s.fixed_ms + s.weight_bytes / (PC.weight_gb_s * 1e6) for s in stages)
    assert two.bound == "PC 0"
    assert two.period_ms == pytest.approx(one.period_ms + passes)
    assert two.aggregate_tok_s < one.aggregate_tok_s


def test_weight_bound_ring_serves_linearly_more_users_per_pc_until_the_link_caps_it():
    """Rows nearly free (the weights dominate): at the same rows per step, S PCs with S micro-batches
    serve S times one PC's users at about one PC's per-user speed; a slow link caps the gain at its
    bandwidth over the bytes of a row."""
    model = ModelCost(layers=32, layer_bytes=1.2e8, layer_row_ms=1e-4, layer_context_ms=0.0, head_bytes=0.0,
                      head_row_ms=0.0, hidden_size=4096)
    pc, rows = PcSpec(weight_gb_s=50.0), 4
    fast = LinkSpec(latency_ms=1.0, gbit_s=100.0)

    def aggregate(n: int, lan: LinkSpec, in_flight: int = 1) -> float:
        ring = uniform_ring(split_stages(model, n, pc, rows, 0.0), pc=pc, own_pcs=True, local=LOCAL, lan=lan,
                            hidden_size=4096, coordinator_ms=0.0)
        m = in_flight * n
        return predict(ring, Workload(m * rows, m, 0.0)).aggregate_tok_s

    base = aggregate(1, fast)
    for n in (2, 4, 8):
        assert 0.9 * n <= aggregate(n, fast) / base <= n
    slow = LinkSpec(latency_ms=1.0, gbit_s=0.025)
    cap = 0.025e9 / 8 / (4096 * 4 + 64)  # rows/s through one hop
    assert 2 * base < cap < 4 * base
    assert all(aggregate(n, slow, k) <= cap * (1 + 1e-9) for n in (2, 4, 8) for k in (1, 4))
    assert aggregate(8, slow, in_flight=4) == pytest.approx(cap)  # enough in flight: the link is the limit


def test_rows_that_cost_compute_make_pcs_pay_off_at_a_fixed_number_of_users():
    """Compute per row dominating: S PCs split every row's work, so N users get nearly S times
    the tokens; the weight pass is paid once per micro-batch on each PC either way."""
    model = ModelCost(layers=32, layer_bytes=1e6, layer_row_ms=1.0, layer_context_ms=0.0, head_bytes=0.0,
                      head_row_ms=0.0, hidden_size=576)
    pc = PcSpec(weight_gb_s=10.0)

    def aggregate(n: int) -> float:
        ring = uniform_ring(split_stages(model, n, pc, 16 // n, 0.0), pc=pc, own_pcs=True, local=LinkSpec(0.0),
                            lan=LinkSpec(0.0), hidden_size=576, coordinator_ms=0.0)
        return predict(ring, Workload(16, n, 0.0)).aggregate_tok_s

    assert aggregate(2) / aggregate(1) == pytest.approx(2.0, rel=0.02)
    assert aggregate(4) / aggregate(1) == pytest.approx(4.0, rel=0.05)


# --- rings side by side and stage splits ----------------------------------------------------

def test_two_rings_each_serve_half_the_users():
    spec = uniform_ring([StageCost(5e8, 2.0, 0.001, 1.0)] * 2, pc=PC, own_pcs=True, local=LOCAL, lan=LAN,
                        hidden_size=4096, coordinator_ms=0.7)
    both = predict_rings(spec, Workload(16, 2, 500), rings=2)
    half = predict(spec, Workload(8, 2, 500))
    assert both.aggregate_tok_s == pytest.approx(2 * half.aggregate_tok_s)
    assert both.per_user_tok_s == pytest.approx(half.per_user_tok_s)
    lone = predict_rings(spec, Workload(1, 2, 500), rings=2)
    assert len(lone.rings) == 1 and lone.aggregate_tok_s == pytest.approx(predict(spec, Workload(1, 2, 500))
                                                                          .aggregate_tok_s)


def _brute_force_best(model: ModelCost, n: int, pc: PcSpec, rows: int) -> float:
    """The least slowest-stage time over every contiguous split into n stages."""
    def splits(layers: int, parts: int):
        if parts == 1:
            yield (layers,)
            return
        for first in range(1, layers - parts + 2):
            for rest in splits(layers - first, parts - 1):
                yield (first, *rest)

    return min(max(stage_step_ms(model.stage(k, last=i == n - 1), pc, rows, 0.0) for i, k in enumerate(cut))
               for cut in splits(model.layers, n))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("head_bytes", [0.0, 3e7, 2e8])
def test_split_stages_keeps_every_layer_puts_the_head_last_and_balances_the_slowest(n, head_bytes):
    model = ModelCost(layers=9, layer_bytes=2e7, layer_row_ms=0.3, layer_context_ms=0.0, head_bytes=head_bytes,
                      head_row_ms=1.5, hidden_size=576, fixed_ms=2.0)
    pc = PcSpec(weight_gb_s=5.0)
    stages = split_stages(model, n, pc, 4, 0.0)
    assert len(stages) == n
    assert sum(s.weight_bytes for s in stages) == pytest.approx(9 * 2e7 + head_bytes)
    assert sum(s.row_ms for s in stages) == pytest.approx(9 * 0.3 + 1.5)
    assert all(s.weight_bytes >= 2e7 for s in stages)  # at least one layer each
    worst = max(stage_step_ms(s, pc, 4, 0.0) for s in stages)
    assert worst == pytest.approx(_brute_force_best(model, n, pc, 4))


# --- inputs that make no sense ---------------------------------------------------------------

@pytest.mark.parametrize("make, words", [
    (lambda: StageCost(weight_bytes=-1.0, row_ms=1.0), "weight_bytes -1.0"),
    (lambda: StageCost(weight_bytes=1.0, row_ms=math.nan), "row_ms nan"),
    (lambda: PcSpec(weight_gb_s=0.0), "weight rate must be positive"),
    (lambda: LinkSpec(latency_ms=1.0, gbit_s=0.0), "bandwidth must be positive"),
    (lambda: Workload(users=0, micro_batches=1), "at least one user"),
    (lambda: RingSpec(stages=(StageCost(1.0, 1.0),), stage_pcs=(0,), pcs=(PC,), hops=(LOCAL,), hidden_size=8),
     "has 2 hops, not 1"),
    (lambda: RingSpec(stages=(StageCost(1.0, 1.0),), stage_pcs=(1,), pcs=(PC,), hops=(LOCAL,) * 2, hidden_size=8),
     "names a PC outside"),
    (lambda: split_stages(ModelCost(2, 1.0, 1.0, 0.0, 0.0, 0.0, 8), 3, PC, 1, 0.0), "cannot split 2 layer"),
    (lambda: predict_rings(uniform_ring([StageCost(1.0, 1.0)], pc=PC, own_pcs=True, local=LOCAL, lan=LAN,
                                        hidden_size=8, coordinator_ms=0.0), Workload(1, 1), rings=0),
     "rings must be at least 1"),
])
def test_bad_inputs_are_refused_by_name(make, words):
    with pytest.raises(PlacementInputError, match=words):
        make()
