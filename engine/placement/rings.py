"""Several rings of one model on one fleet: how many the approved agents allow, with standbys aside.

Pure decision code over the same frozen inputs as :func:`engine.placement.planner.solve`, which
prices every ring as it prices one. Rings are solved one after another, each on the PCs that no
earlier ring (and no ring already serving) holds, so adding a ring never moves another: a ring
placed before keeps its PCs whatever is asked later.

Standbys: the ``standbys`` usable PCs with the most memory (ties by id) are kept out of every ring,
so that a failed stage has somewhere to move that can hold it (the largest stage fits on the
largest PC if anywhere). They are chosen before the rings and stay the same as rings are added.

The rings stop when ``rings`` were placed, or when the PCs left cannot hold another (the
solver's own reason is kept: the memory shortfall, or no agent left).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import Exclusion, PlacementInfeasible, PlacementInputError, PlacementTimeout
from engine.placement.planner import exclusion_reason, solve
from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo, Plan, RingsPlan, RingsRequest

NO_LIMIT = 1 << 16  # rings: "as many as the agents allow" is bounded by the PCs anyway


def plan_rings(request: RingsRequest, *, model: ModelProfile, pcs: Sequence[PcInfo],
               devices: Sequence[DeviceProfile], links: Links) -> RingsPlan:
    """Propose rings of ``model`` on the agents' PCs, each solved by :func:`solve` on the PCs left.

    Raises :class:`PlacementInfeasible` when not even one new ring fits (with the solver's reason,
    the standbys named), and :class:`PlacementInputError` for inconsistent inputs."""
    excluded = tuple(Exclusion(pc.pc_id, why) for pc in pcs
                     if (why := exclusion_reason(pc, request.placement.allow_battery)))
    with_devices = {d.pc_id for d in devices}
    excluded += tuple(Exclusion(pc.pc_id, "no device profile") for pc in pcs
                      if pc.pc_id not in with_devices and pc.pc_id not in {e.pc_id for e in excluded})
    out = {e.pc_id for e in excluded}
    usable = [pc for pc in pcs if pc.pc_id not in out]
    held = {st.pc_id for plan in request.existing for st in plan.stages}
    unknown = held - {pc.pc_id for pc in pcs}
    if unknown:
        raise PlacementInputError(f"a serving ring holds PCs the fleet does not list ({', '.join(sorted(unknown))}); "
                                  "refresh the agent list")
    free = [pc for pc in usable if pc.pc_id not in held]
    standbys = tuple(pc.pc_id for pc in sorted(free, key=lambda p: (-p.memory_bytes, p.pc_id))[:request.standbys])
    free = [pc for pc in free if pc.pc_id not in standbys]

    wanted = request.rings if request.rings is not None else NO_LIMIT
    rings: list[Plan] = []
    limit = f"asked for {wanted}" if request.rings is not None else ""
    first_error: PlacementInfeasible | PlacementTimeout | None = None
    while len(rings) < wanted:
        if not free:
            limit = "every usable PC is in a ring or kept as a standby"
            break
        ids = {pc.pc_id for pc in free}
        try:
            plan = solve(request.placement, model=model, pcs=free, devices=[d for d in devices if d.pc_id in ids],
                         links=links)
        except (PlacementInfeasible, PlacementTimeout) as exc:
            first_error = exc
            limit = f"the PCs left ({', '.join(sorted(ids))}) cannot hold another ring: {exc}"
            break
        rings.append(plan)
        taken = {st.pc_id for st in plan.stages}
        free = [pc for pc in free if pc.pc_id not in taken]
    if not rings:
        aside = f" ({len(standbys)} kept as standbys: {', '.join(standbys)})" if standbys else ""
        message = f"no new ring fits on the free PCs{aside}: {limit or 'none is free'}"
        raise PlacementInfeasible(message, excluded=excluded,
                                  shortfall_bytes=getattr(first_error, "shortfall_bytes", None))
    return RingsPlan(tuple(rings), standbys, tuple(pc.pc_id for pc in free), limit, excluded,
                     _standby_gaps((*request.existing, *rings), standbys, pcs, request.placement.headroom))


def _standby_gaps(rings: Sequence[Plan], standbys: Sequence[str], pcs: Sequence[PcInfo],
                  headroom: float) -> tuple[str, ...]:
    """Every stage no standby has the memory to take over (the PC's memory, within the headroom)."""
    room = max((headroom * pc.memory_bytes for pc in pcs if pc.pc_id in standbys), default=0.0)
    return tuple(f"ring {r} stage {k} ({st.memory_bytes / 1e9:.2f} GB on {st.pc_id})"
                 for r, plan in enumerate(rings) for k, st in enumerate(plan.stages) if st.memory_bytes > room)
