"""Several rings of one model: as many as the agents allow, standbys kept aside, each ring priced by
the one-ring solver, and adding a ring never moves another."""

from __future__ import annotations

import pytest

from engine.errors import PlacementInfeasible, PlacementInputError
from engine.placement.planner import solve
from engine.placement.rings import plan_rings
from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo, PlacementRequest, RingsRequest

GB = 10**9
MODEL = ModelProfile(layer_bytes=(GB,) * 8)  # 8 GB: two 5 GB PCs (4 GB usable each) per ring
LINKS = Links(default_ms=0.5)


def fleet(n: int, memory: dict[str, int] | None = None, **pc_flags: dict) -> dict:
    """``n`` PCs pc-0..pc-n-1 with one CPU each (5 GB unless ``memory`` says otherwise)."""
    memory = memory or {}
    pcs = [PcInfo(f"pc-{i}", memory.get(f"pc-{i}", 5 * GB), approved=True, **pc_flags.get(f"pc-{i}", {}))
           for i in range(n)]
    devices = [DeviceProfile(f"{pc.pc_id}/CPU", pc.pc_id, "CPU", layer_ms=1.0, overhead_ms=0.5,
                             memory_bytes=pc.memory_bytes) for pc in pcs]
    return {"model": MODEL, "pcs": pcs, "devices": devices, "links": LINKS}


def pcs_of(plan) -> set[str]:
    return {st.pc_id for st in plan.stages}


def test_as_many_rings_as_fit_with_a_standby_aside():
    f = fleet(8, memory={"pc-5": 6 * GB})
    proposal = plan_rings(RingsRequest(standbys=1), **f)
    assert proposal.standbys == ("pc-5",)  # the PC with the most memory
    assert len(proposal.rings) == 3 and all(len(p.stages) == 2 for p in proposal.rings)
    used = [pcs_of(p) for p in proposal.rings]
    assert len(set().union(*used)) == 6 and "pc-5" not in set().union(*used)  # disjoint, standby untouched
    assert len(proposal.unused) == 1  # one PC left: half a ring
    assert "cannot hold another ring" in proposal.limit
    assert proposal.aggregate_tok_s == pytest.approx(sum(p.aggregate_tok_s for p in proposal.rings))
    assert proposal.standby_gaps == ()  # the standby holds any 4 GB stage


def test_each_ring_is_priced_as_the_one_ring_solver_prices_it():
    f = fleet(5)
    proposal = plan_rings(RingsRequest(standbys=1), **f)
    alone = solve(PlacementRequest(), model=MODEL, pcs=[pc for pc in f["pcs"] if pc.pc_id != "pc-0"],
                  devices=[d for d in f["devices"] if d.pc_id != "pc-0"], links=LINKS)
    assert proposal.standbys == ("pc-0",)  # equal memory: the first by id
    assert proposal.rings[0] == alone


def test_adding_a_ring_never_moves_another():
    f = fleet(7)
    one = plan_rings(RingsRequest(rings=1), **f)
    two = plan_rings(RingsRequest(rings=2), **f)
    assert two.rings[0] == one.rings[0]  # asking for more did not change the first
    added = plan_rings(RingsRequest(rings=1, existing=one.rings), **f)
    assert not pcs_of(added.rings[0]) & pcs_of(one.rings[0])
    assert added.standbys == one.standbys  # the standby stays the same PC as rings are added
    assert added.rings[0] == two.rings[1]


def test_fewer_rings_than_asked_say_why_and_none_is_an_error():
    proposal = plan_rings(RingsRequest(rings=4, standbys=1), **fleet(6))
    assert len(proposal.rings) == 2 and "cannot hold another ring" in proposal.limit
    assert plan_rings(RingsRequest(rings=4, standbys=1), **fleet(5)).limit == (
        "every usable PC is in a ring or kept as a standby")
    assert plan_rings(RingsRequest(rings=2, standbys=0), **fleet(4)).limit == "asked for 2"
    with pytest.raises(PlacementInfeasible, match=r"kept as standbys: pc-0") as info:
        plan_rings(RingsRequest(standbys=1), **fleet(2))  # one PC left beside the standby: half a ring
    assert info.value.shortfall_bytes and info.value.shortfall_bytes > 0
    full = fleet(6)
    first = plan_rings(RingsRequest(rings=2, standbys=2), **full).rings
    with pytest.raises(PlacementInfeasible, match="every usable PC is in a ring or kept as a standby"):
        plan_rings(RingsRequest(standbys=2, existing=first), **full)


def test_unapproved_paused_and_battery_pcs_are_in_no_ring():
    f = fleet(7, **{"pc-0": {"paused": True}, "pc-1": {"on_battery": True}})
    f["pcs"][2] = PcInfo("pc-2", 5 * GB, approved=False)
    proposal = plan_rings(RingsRequest(standbys=0), **f)
    assert {e.pc_id: e.reason for e in proposal.excluded} == {
        "pc-0": "paused", "pc-1": "on battery", "pc-2": "not approved"}
    assert len(proposal.rings) == 2 and not set().union(*map(pcs_of, proposal.rings)) & {"pc-0", "pc-1", "pc-2"}


def test_a_stage_no_standby_can_hold_is_named():
    """The standby is the largest free PC, so it holds any new ring's stage; a ring already serving
    on a bigger PC may have a stage it cannot take over."""
    f = fleet(5, memory={"pc-0": 11 * GB})
    big = plan_rings(RingsRequest(rings=1, standbys=0), **dict(f, pcs=f["pcs"][:1], devices=f["devices"][:1]))
    assert len(big.rings[0].stages) == 1  # the whole 8 GB model on the 11 GB PC
    proposal = plan_rings(RingsRequest(standbys=1, existing=big.rings), **f)
    assert proposal.standbys == ("pc-1",) and len(proposal.rings) == 1
    assert proposal.standby_gaps == ("ring 0 stage 0 (8.00 GB on pc-0)",)


def test_requests_are_checked():
    with pytest.raises(PlacementInputError):
        RingsRequest(rings=0)
    with pytest.raises(PlacementInputError):
        RingsRequest(standbys=-1)
    f = fleet(4)
    stray = plan_rings(RingsRequest(rings=1), **fleet(6)).rings
    with pytest.raises(PlacementInputError, match="does not list"):
        plan_rings(RingsRequest(existing=stray), **dict(f, pcs=f["pcs"][:1], devices=f["devices"][:1]))
