"""Copies or a ring, chosen for the admin (engine.placement.layouts): copies where the model fits one
PC, rings where it does not, mixed where the PCs differ; each alternative's predicted tok/s at 1 and
N users; a refusal naming the memory needed when nothing holds the model."""

from __future__ import annotations

import pytest

from engine.placement.layouts import (
    DEFAULT_USERS,
    LayoutKind,
    LayoutPc,
    choose_layout,
    expected_users,
    layout_pcs,
)
from engine.placement.types import DeviceProfile, ModelProfile, PcInfo

GB = 10**9
LAYERS = 16


def model(total_gb: float) -> ModelProfile:
    """``total_gb`` of weights: 16 equal layers and an embedding and head of 1/16 each."""
    part = int(total_gb * GB / (LAYERS + 2))
    return ModelProfile(layer_bytes=(part,) * LAYERS, embed_bytes=part, embed_ms=0.1, head_bytes=part, head_ms=2.0)


def pcs(*memory_gb: float, layer_ms: float = 2.0) -> list[LayoutPc]:
    return [LayoutPc(f"pc{k}", int(m * GB), layer_ms, 4.0, f"desk-{k}") for k, m in enumerate(memory_gb)]


def test_a_model_that_fits_every_pc_is_served_as_copies():
    choice = choose_layout(model(1.0), pcs(4, 4, 4, 4), users=8)
    best = choice.chosen
    assert best is not None and best.kind is LayoutKind.COPIES and len(best.rings) == 4, best
    ring = choice.best_of(LayoutKind.RINGS)
    assert ring is not None and ring.tok_s_users < best.tok_s_users
    assert best.name == "4 copies"
    assert all(r.layers == ((0, LAYERS - 1),) for r in best.rings)


def test_a_model_that_fits_no_pc_is_served_as_rings_each_stage_within_its_pc():
    m = model(3.0)
    choice = choose_layout(m, pcs(2, 2, 2, 2), users=8, headroom=0.8)
    best = choice.chosen
    assert best is not None and best.kind is LayoutKind.RINGS, choice.alternatives
    assert choice.best_of(LayoutKind.COPIES) is None  # no PC holds it alone
    assert best.name == "2 rings of 2"
    for ring in best.rings:
        for first, last in ring.layers:
            held = sum(m.layer_bytes[first:last + 1]) + (m.embed_bytes if first == 0 else 0) + (
                m.head_bytes if last == LAYERS - 1 else 0)
            assert held <= 0.8 * 2 * GB


def test_pcs_that_differ_hold_a_copy_on_a_big_one_and_a_ring_with_the_small():
    """Two PCs hold the model, a third does not: copies would leave it idle, one ring of three
    pays hops on every token; a copy beside a ring of the others serves the most."""
    choice = choose_layout(model(3.0), pcs(8, 8, 2), users=16)
    best = choice.chosen
    assert best is not None and best.kind is LayoutKind.MIXED, [a.name for a in choice.alternatives]
    assert best.name == "1 copy + 1 ring of 2"
    assert sorted(len(r.pcs) for r in best.rings) == [1, 2] and "pc2" in best.rings[1].pcs + best.rings[0].pcs
    copies = choice.best_of(LayoutKind.COPIES)
    assert copies is not None and copies.unused == ("pc2",) and copies.tok_s_users < best.tok_s_users
    assert [a.name for a in choose_layout(model(3.0), pcs(8, 2, 2), users=8).alternatives][0] == "1 copy + 1 ring of 2"


def test_one_user_is_served_fastest_by_one_copy_and_every_alternative_says_both_figures():
    choice = choose_layout(model(1.0), pcs(4, 4), users=1)
    assert choice.chosen is not None and choice.chosen.tok_s_one == pytest.approx(choice.chosen.tok_s_users)
    ring = choice.best_of(LayoutKind.RINGS)
    assert ring is not None and ring.tok_s_one < choice.chosen.tok_s_one  # hops cost one stream time
    many = choose_layout(model(1.0), pcs(4, 4), users=8)
    assert all(a.tok_s_users > a.tok_s_one for a in many.alternatives)  # batching and more PCs pay


def test_a_faster_pc_takes_more_layers_of_a_ring():
    fast_slow = [LayoutPc("fast", 2 * GB, 1.0, 4.0), LayoutPc("slow", 2 * GB, 3.0, 4.0)]
    choice = choose_layout(model(2.5), fast_slow, users=2)
    ring = choice.chosen
    assert ring is not None and ring.kind is LayoutKind.RINGS
    layers = {pc: last - first + 1 for pc, (first, last) in zip(ring.rings[0].pcs, ring.rings[0].layers, strict=True)}
    assert layers["fast"] > layers["slow"], layers


def test_nothing_holds_the_model_refused_naming_the_memory_it_needs_and_the_pcs_have():
    choice = choose_layout(model(10.0), pcs(2, 3), users=4)
    assert choice.chosen is None and choice.alternatives == ()
    assert choice.refused is not None
    assert "needs 10.00 GB" in choice.refused and "desk-1" in choice.refused and "3.00 GB" in choice.refused
    assert "2.40 GB" in choice.refused  # what it offers at 80 % headroom
    assert "no usable PC" in (choose_layout(model(1.0), [], users=1).refused or "")


def test_users_expected_the_admins_setting_first_then_the_load_seen():
    assert expected_users(4, 12) == (4, "the admin's setting")
    assert expected_users(None, 12) == (12, "the most users seen at once")
    assert expected_users(None, 0)[0] == DEFAULT_USERS
    assert expected_users(0, None)[0] == DEFAULT_USERS


def test_layout_pcs_keeps_the_usable_pcs_with_their_fastest_device():
    infos = [PcInfo("a", 8 * GB, True), PcInfo("b", 8 * GB, False), PcInfo("c", 8 * GB, True, paused=True),
             PcInfo("d", 8 * GB, True, on_battery=True), PcInfo("e", 8 * GB, True)]
    devices = [DeviceProfile(f"{p}/CPU", p, "CPU", 3.0, 1.0, 8 * GB) for p in "abcde"]
    devices.append(DeviceProfile("a/GPU.0", "a", "GPU", 1.0, 2.0, 4 * GB))
    got = layout_pcs(infos, devices, {"a": "desk-a"})
    assert [(p.pc_id, p.layer_ms, p.memory_bytes, p.label) for p in got] == [
        ("a", 1.0, 4 * GB, "desk-a"), ("e", 3.0, 8 * GB, "e")]
    assert [p.pc_id for p in layout_pcs(infos, devices, allow_battery=True)] == ["a", "d", "e"]


def test_eight_pcs_are_arranged_without_blowing_up():
    choice = choose_layout(model(1.5), pcs(*([2.0] * 4 + [1.0] * 4)), users=16)
    assert choice.chosen is not None and len(choice.alternatives) > 3


def test_placement_refuses_a_model_one_pc_cannot_hold_naming_the_memory_it_needs_and_the_pc_has():
    """The same model and PC through the solver (engine.placement.planner) and the layouts: both refuse
    before anything is exported or loaded, with the model's memory and the PC's."""
    from engine.errors import PlacementInfeasible
    from engine.placement.planner import solve
    from engine.placement.types import Links, PlacementRequest

    m = model(3.0)
    pc = PcInfo("pc0", 2 * GB, True)
    device = DeviceProfile("pc0/CPU", "pc0", "CPU", 2.0, 4.0, 2 * GB)
    with pytest.raises(PlacementInfeasible) as info:
        solve(PlacementRequest(), model=m, pcs=[pc], devices=[device], links=Links(default_ms=1.0))
    assert "(model 3.0 GB; 1.6 GB usable on 1 device(s) of 1 agent(s)" in str(info.value), info.value
    refused = choose_layout(m, layout_pcs([pc], [device], {"pc0": "desk-0"}), users=1).refused
    assert refused is not None and "needs 3.00 GB" in refused and "desk-0" in refused and "1.60 GB" in refused
