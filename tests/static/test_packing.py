"""Slot regions, the KV ring, plan frames, masks and the slot scheduler (pure, no OpenVINO)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import GenerationError
from engine.static.kv_ring import KVRing, SlotRing
from engine.static.packing import (
    LockstepError,
    SlotGeometry,
    additive_bias,
    layout_step,
    shared_mask,
)
from engine.static.slot_scheduler import (
    PromptTooLong,
    Slot,
    SlotRequest,
    admit,
    empty_slots,
    plan,
    update,
)
from engine.wire.plan_frame import IDLE, PlanFrame

# --- the ring ---------------------------------------------------------------------------------


def test_ring_fills_in_order_then_slides_past_the_pinned_sinks():
    ring = SlotRing(start=10, length=6, sinks=2)
    assert ring.columns(6).tolist() == [10, 11, 12, 13, 14, 15]
    full = ring.advanced(6)
    # Tokens 6, 7, 8, 9, 10 overwrite the oldest non-sink columns, cycling over 12..15.
    assert full.columns(5).tolist() == [12, 13, 14, 15, 12]
    assert full.visible().tolist() == [10, 11, 12, 13, 14, 15]
    assert full.advanced(3).wrapped and full.advanced(3).visible().size == 6
    # The sinks are never handed to a new token, however long the sequence grows.
    assert not set(full.advanced(100).columns(50).tolist()) & {10, 11}


def test_ring_reusable_prefix_is_everything_until_it_wraps_then_the_sinks():
    ring = SlotRing(start=0, length=5, sinks=2)
    assert ring.advanced(5).reusable() == 5
    assert ring.advanced(6).reusable() == 2
    with pytest.raises(GenerationError, match="out of step"):
        ring.advanced(6).restarted(3)
    assert ring.advanced(4).restarted(3).count == 3


def test_sinks_are_clamped_so_that_one_column_always_slides():
    assert SlotRing(start=0, length=3, sinks=8).sinks == 2
    assert SlotRing(start=0, length=3, sinks=8).advanced(3).columns(2).tolist() == [2, 2]


def test_kv_ring_writes_rows_into_columns_of_every_layer():
    ring = KVRing([3, 4], kv_heads=2, head_dim=4, window=8)
    new = {f"new_{k}_{i}": np.arange(2 * 3 * 4, dtype=np.float32).reshape(1, 2, 3, 4) + i
           for i in (3, 4) for k in ("key", "value")}
    ring.write(new, rows=np.array([0, 2]), columns=np.array([5, 1]))
    k3 = ring.arrays["past_key_3"]
    assert (k3[0, :, 5] == new["new_key_3"][0, :, 0]).all() and (k3[0, :, 1] == new["new_key_3"][0, :, 2]).all()
    assert (ring.arrays["past_value_4"][0, :, 5] == new["new_value_4"][0, :, 0]).all()
    assert not k3[0, :, [0, 2, 3, 4, 6, 7]].any()


# --- frames and layouts -------------------------------------------------------------------------


def _frame(*rows, total):
    return PlanFrame.of(list(rows), total)


def test_decode_rows_of_different_slots_are_block_diagonal():
    geo = SlotGeometry(window=12, slots=4, sinks=1)  # regions of 3: [0-2] [3-5] [6-8] [9-11]
    rings = tuple(r.advanced(2) for r in geo.rings())
    lay = layout_step(rings, _frame((0, 2, 0), (2, 2, 0), total=4), 12)
    m = lay.mask.astype(int)
    assert m[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0] + [1, 0, 0, 0]
    assert m[1].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0] + [0, 1, 0, 0]
    # idle rows see only their own query column
    assert m[2].tolist() == [0] * 12 + [0, 0, 1, 0] and m[3].tolist() == [0] * 12 + [0, 0, 0, 1]
    assert lay.write_rows.tolist() == [0, 1] and lay.write_columns.tolist() == [2, 8]
    assert [r.count for r in lay.rings] == [3, 2, 3, 2]


def test_rows_of_one_slot_form_a_causal_chunk_next_to_a_decode_row():
    geo = SlotGeometry(window=16, slots=4, sinks=1)  # regions of 4
    rings = list(geo.rings())
    rings[1] = rings[1].advanced(3)
    lay = layout_step(tuple(rings), _frame((1, 3, 0), (2, 0, 0), (2, 1, 0), (2, 2, 0), total=4), 16)
    q = lay.mask[:, 16:].astype(int)
    assert q.tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    assert lay.mask[0, :16].nonzero()[0].tolist() == [4, 5, 6]
    assert not lay.mask[1:, :16].any(), "a fresh slot sees no past"
    assert lay.write_columns.tolist() == [7, 8, 9, 10]


def test_a_row_at_its_reuse_length_restarts_the_slot_keeping_the_prefix():
    geo = SlotGeometry(window=8, slots=2, sinks=1)
    rings = (geo.rings()[0].advanced(4), geo.rings()[1])
    lay = layout_step(rings, _frame((0, 2, 2), (0, 3, 2), total=2), 8)
    assert lay.mask[0, :8].nonzero()[0].tolist() == [0, 1]  # kept 2 of the old 4
    assert lay.write_columns.tolist() == [2, 3] and lay.rings[0].count == 4
    restart_fresh = layout_step(rings, _frame((0, 0, 0), total=2), 8)
    assert not restart_fresh.mask[0, :8].any()


def test_out_of_step_frames_are_refused():
    geo = SlotGeometry(window=8, slots=2)
    with pytest.raises(LockstepError, match="out of step"):
        layout_step(geo.rings(), _frame((0, 5, 0), total=2), 8)
    with pytest.raises(LockstepError, match="reusable"):
        layout_step(geo.rings(), _frame((0, 3, 3), total=2), 8)
    with pytest.raises(LockstepError, match="slot 5"):
        layout_step(geo.rings(), _frame((5, 0, 0), total=2), 8)


@pytest.mark.parametrize("rows, why", [
    ([(0, 1, 0), (0, 3, 0)], "consecutive"),
    ([(0, 1, 2)], "reuse length exceeds"),
    ([(0, 1, 0), (0, 2, 1)], "one reuse"),
])
def test_malformed_frames_are_refused(rows, why):
    with pytest.raises(GenerationError, match=why):
        PlanFrame.of(rows, 4)
    with pytest.raises(GenerationError, match="idle rows"):
        PlanFrame(np.array([IDLE]), np.array([3]), np.array([0]))
    with pytest.raises(GenerationError, match="int64"):
        PlanFrame(np.array([0], np.int32), np.array([0]), np.array([0]))


def test_chunk_longer_than_the_sliding_part_keeps_the_latest_token_per_column():
    ring = SlotRing(start=0, length=3, sinks=1).advanced(3)
    lay = layout_step((ring,), _frame((0, 3, 0), (0, 4, 0), (0, 5, 0), total=3), 3)
    assert sorted(lay.write_columns.tolist()) == [1, 2]
    assert dict(zip(lay.write_columns.tolist(), lay.write_rows.tolist(), strict=True)) == {1: 2, 2: 1}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_row_opens_a_column_and_slots_never_see_each_other(data):
    slots = data.draw(st.integers(1, 6))
    region = data.draw(st.integers(2, 6))
    geo = SlotGeometry(window=slots * region + data.draw(st.integers(0, 2)), slots=slots,
                       sinks=data.draw(st.integers(0, 3)))
    counts = data.draw(st.lists(st.integers(0, 12), min_size=slots, max_size=slots))
    rings = tuple(r.advanced(c) for r, c in zip(geo.rings(), counts, strict=True))
    rows, live = slots, []
    order = data.draw(st.permutations(range(slots)))
    for k in order:
        n = data.draw(st.integers(0, rows - len(live)))
        live += [(k, counts[k] + j, 0) for j in range(n)]
    frame = PlanFrame.of(live, rows)
    lay = layout_step(rings, frame, geo.window)
    assert lay.mask.any(axis=1).all(), "a fully masked row would poison the inference"
    for r in range(rows):
        k = frame.slot[r]
        cols = set(lay.mask[r, : geo.window].nonzero()[0].tolist())
        if k == IDLE:
            assert not cols and lay.mask[r, geo.window:].nonzero()[0].tolist() == [r]
            continue
        region_cols = set(range(k * geo.region, (k + 1) * geo.region))
        assert cols <= region_cols
        assert len(cols) == min(counts[k], geo.region)
        seen = lay.mask[r, geo.window:].nonzero()[0]
        assert all(frame.slot[c] == k and c <= r for c in seen) and r in seen
    assert set(lay.write_columns.tolist()) <= set(range(geo.slots * geo.region))
    assert len(set(lay.write_columns.tolist())) == lay.write_columns.size


def test_additive_bias_and_shared_mask_shapes():
    geo = SlotGeometry(window=6, slots=1)
    lay = layout_step((geo.rings()[0].advanced(2),), _frame((0, 2, 0), (0, 3, 0), total=3), 6)
    bias = additive_bias(lay.mask)
    assert bias.shape == (1, 1, 3, 9) and bias.dtype == np.float32
    assert set(np.unique(bias).tolist()) == {0.0, float(np.finfo(np.float32).min)}
    frame = _frame((0, 2, 0), (0, 3, 0), total=3)
    assert shared_mask(lay, frame, 6).tolist() == [[1, 1, 0, 0, 0, 0, 1, 1, 1]]
    two = SlotGeometry(window=6, slots=2)
    frame2 = _frame((0, 0, 0), (1, 0, 0), total=2)
    with pytest.raises(GenerationError, match="one slot"):
        shared_mask(layout_step(two.rings(), frame2, 6), frame2, 6)


# --- the scheduler ------------------------------------------------------------------------------


def _req(rid, prompt, n=3, **kw):
    return SlotRequest(rid, tuple(prompt), n, **kw)


def test_a_prompt_that_cannot_fit_its_region_is_refused_with_the_numbers():
    geo = SlotGeometry(window=20, slots=4)
    with pytest.raises(PromptTooLong, match="6 tokens but a slot holds 5.*--context"):
        admit(empty_slots(geo), _req(1, range(6)), geo)
    slots, k = admit(empty_slots(geo), _req(1, range(5)), geo)
    assert k == 0 and slots[0].request.request_id == 1


def test_decode_rows_first_then_prefill_chunks_in_admission_order():
    geo = SlotGeometry(window=40, slots=4)
    slots = empty_slots(geo)
    for rid, prompt in ((1, [5, 6, 7, 8, 9]), (2, [1, 2, 3])):
        slots, _ = admit(slots, _req(rid, prompt), geo)
    s = plan(slots, [4])
    assert s.take == {0: 4} and s.sample == {}
    assert s.frame.slot.tolist() == [0, 0, 0, 0] and s.tokens.tolist() == [5, 6, 7, 8]
    slots, events = update(slots, s, {}, geo)
    assert events == []
    s = plan(slots, [4])  # slot 0 has one prompt token left; slot 1 takes the other rows
    assert s.take == {0: 1, 1: 3} and s.sample == {0: 0, 1: 3}
    assert s.frame.position.tolist() == [4, 0, 1, 2] and s.tokens.tolist() == [9, 1, 2, 3]
    slots, events = update(slots, s, {0: 42, 3: 43}, geo)
    assert [(e.request_id, e.token) for e in events] == [(1, 42), (2, 43)]
    s = plan(slots, [4])  # both decode now
    assert s.frame.slot.tolist() == [0, 1, IDLE, IDLE] and s.tokens.tolist() == [42, 43, 0, 0]


def test_early_finishers_free_their_slot_for_the_next_admission():
    geo = SlotGeometry(window=8, slots=2)
    slots = empty_slots(geo)
    slots, _ = admit(slots, _req(1, [1, 2], n=1), geo)
    slots, _ = admit(slots, _req(2, [3, 4], n=5), geo)
    slots, k = admit(slots, _req(3, [5]), geo)
    assert k is None, "both slots are busy"
    s = plan(slots, [2])  # slot 0's whole prompt: 2 rows, sampled
    slots, events = update(slots, s, {1: 9}, geo)
    assert [(e.request_id, e.finished) for e in events] == [(1, True)] and slots[0].request is None
    s = plan(slots, [2])
    assert s.frame.slot.tolist() == [1, 1]
    slots, k = admit(slots, _req(3, [5]), geo)
    assert k == 0, "the finisher's region goes to the next admission"
    s = plan(slots, [2])
    assert s.frame.slot.tolist() == [0, 1] and s.frame.position.tolist() == [0, 0]


def test_eos_finishes_unless_ignored():
    geo = SlotGeometry(window=8, slots=1)
    for ignore, finished in ((False, True), (True, False)):
        slots, _ = admit(empty_slots(geo), _req(1, [1], n=5, eos_ids=frozenset({2}), ignore_eos=ignore), geo)
        s = plan(slots, [1])
        _, events = update(slots, s, {0: 2}, geo)
        assert events[0].finished is finished


def test_admission_prefers_the_slot_holding_the_longest_prefix():
    geo = SlotGeometry(window=20, slots=2, sinks=1)
    slots = (Slot(), Slot(fed=6, kept=(1, 2, 3, 4, 5, 6)))
    slots, k = admit(slots, _req(1, [1, 2, 3, 9]), geo)
    assert k == 1 and slots[1].reuse == 3 and slots[1].fed == 3
    s = plan(slots, [2])
    assert s.frame.position.tolist() == [3, 0] and s.frame.reuse.tolist() == [3, 0]
    # the whole prompt cached: one token is still fed, for its logits
    again, k = admit((Slot(fed=4, kept=(1, 2, 3, 4)),), _req(2, [1, 2, 3, 4]), SlotGeometry(8, 1))
    assert again[0].reuse == 3
    # a wrapped region keeps only its sinks
    wrapped = (Slot(fed=30, kept=tuple(range(10))),)
    assert admit(wrapped, _req(3, range(9)), SlotGeometry(10, 1, sinks=2))[0][0].reuse == 2


def test_unpacked_graphs_pick_prefill_rows_while_the_prompt_lasts():
    geo = SlotGeometry(window=63, slots=1)
    slots, _ = admit(empty_slots(geo), _req(1, range(11), n=2), geo)
    sizes = []
    while (s := plan(slots, [1, 4])) is not None:
        sizes.append((s.frame.rows, int((s.frame.slot != IDLE).sum())))
        slots, _ = update(slots, s, {r: 7 for r in s.sample.values()}, geo)
    assert sizes == [(4, 4), (4, 4), (4, 3), (1, 1)]
