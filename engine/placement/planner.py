"""Stage placement: how many stages, which contiguous layers each holds, and on which device.

Pure decision code over frozen inputs (no sockets, no OpenVINO, no Qt): the console feeds it the
agents' calibrated device profiles and measured links and shows the returned `Plan` (the value
types are in `engine.placement.types`).

The MILP, its formulation and the bottleneck search for throughput live in
`engine.placement.milp`; this module validates the inputs, turns them into a numeric fleet for
it, and turns the stages it finds into a `Plan` (or an error that says what to change).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from engine.errors import Exclusion, PlacementInfeasible, PlacementInputError
from engine.machine.inventory import Inventory
from engine.placement.fleet import GB, Fleet, Stage, Timing, time_stages
from engine.placement.milp import build_milp, extract_stages, run_milp
from engine.placement.search import Formulation, Search, best_cycle, least_latency, relative_gap
from engine.placement.types import (
    Calibration,
    DeviceProfile,
    Links,
    ModelProfile,
    PcInfo,
    PlacementRequest,
    Plan,
    PlannedStage,
)

__all__ = ["device_candidates", "exclusion_reason", "format_plan", "plan_quality", "solve"]


def device_candidates(pc_id: str, inventory: Inventory,
                      calibrations: Mapping[str, Calibration]) -> tuple[DeviceProfile, ...]:
    """One placement candidate per device of an agent's inventory that has been calibrated.

    Every kind is a candidate - CPU and NPU as well as GPU - each with its own latency and
    memory profile; keys of ``calibrations`` are OpenVINO device names (``CPU``, ``GPU.0``,
    ``NPU``). A device that reports no memory of its own (the CPU, some drivers) is offered the
    PC's available RAM, which the PC-wide limit then shares among its devices.
    """
    out = []
    for dev in inventory.devices:
        cal = calibrations.get(dev.name)
        if cal is None:
            continue
        memory = dev.memory_bytes if dev.memory_bytes is not None else inventory.ram_available
        out.append(DeviceProfile(device_id=f"{pc_id}/{dev.name}", pc_id=pc_id, kind=dev.kind.value,
                                 layer_ms=cal.layer_ms, overhead_ms=cal.overhead_ms,
                                 memory_bytes=int(memory), model=cal.model))
    return tuple(out)


def solve(request: PlacementRequest, *, model: ModelProfile, pcs: Sequence[PcInfo],
          devices: Sequence[DeviceProfile], links: Links, break_symmetry: bool = False,
          formulation: Formulation = "auto") -> Plan:
    """Choose the number of stages, their layer ranges and devices; return the optimal `Plan`,
    or when ``request.time_limit_s`` ran out first the best plan found with its proven gap.

    ``formulation`` "auto" picks the MILP by the layer sizes (`engine.placement.search`);
    "cuts" forces the general layer-range model (for comparisons).

    ``break_symmetry`` adds explicit order constraints between interchangeable devices and PCs.
    It is off by default because HiGHS detects these symmetries itself: on a benchmark set of
    30-layer fleets of 6-12 devices (half of them clones) the extra rows tripled the CPU time.

    Raises `PlacementInfeasible` (with the memory shortfall or the exclusion counts),
    `PlacementTimeout` if no plan was found in time, `PlacementInputError` for bad profiles.
    """
    if formulation not in ("auto", "cuts"):
        raise PlacementInputError(f"formulation must be 'auto' or 'cuts', not {formulation!r}")
    fleet, excluded = _prepare(request, model, pcs, devices, links)
    search = Search(max_stages=request.max_stages, min_stages=request.min_stages, n_streams=request.n_streams,
                    time_limit_s=request.time_limit_s,
                    deadline=time.monotonic() + request.time_limit_s,
                    break_symmetry=break_symmetry, formulation=formulation)
    found = least_latency(fleet, search)
    if found.stages is None:
        raise _explain_infeasible(fleet, excluded, request, search.deadline)
    timing = time_stages(fleet, found.stages, request.n_streams, found.optimal)
    timing = replace(timing, gap=0.0 if found.optimal else relative_gap(timing.per_token_ms, found.bound_ms))
    if request.objective == "throughput":
        timing = best_cycle(fleet, search, timing, found.bound_ms)
    return _plan(fleet, request, timing, excluded)


def format_plan(plan: Plan) -> str:
    """Render a plan for the CLI and logs: one line per stage and hop, then the predictions."""
    lines = [f"{len(plan.stages)} stage(s), {plan.per_token_ms:.2f} ms/token = "
             f"{plan.tok_s:.1f} tok/s for one stream ({plan_quality(plan)})",
             f"  coordinator -> {plan.stages[0].pc_id}: {plan.hop_ms[0]:.2f} ms"]
    for k, st in enumerate(plan.stages):
        lines.append(f"  stage {k}: {st.device_id:<16} layers {st.first_layer}-{st.last_layer} "
                     f"({st.n_layers})  {st.compute_ms:.2f} ms  {st.memory_bytes / GB:.2f} GB")
        dst = plan.stages[k + 1].pc_id if k + 1 < len(plan.stages) else "coordinator"
        lines.append(f"  {st.pc_id} -> {dst}: {plan.hop_ms[k + 1]:.2f} ms")
    lines.append(f"  bottleneck {plan.bottleneck_ms:.2f} ms; {plan.n_streams} stream(s): "
                 f"{plan.aggregate_tok_s:.1f} tok/s aggregate")
    lines += [f"  excluded {ex.pc_id}: {ex.reason}" for ex in plan.excluded]
    return "\n".join(lines)


def plan_quality(plan: Plan) -> str:
    """'optimal', 'best found, within 2.3 % of the optimum' (the proven gap of the minimised
    value, latency or cycle), or 'best found' when no gap is known."""
    if plan.optimal:
        return "optimal"
    if plan.gap is None:
        return "best found"
    what = "latency" if plan.objective == "latency" else "cycle"
    return f"best found, {what} within {100 * plan.gap:.2g} % of the optimum"


# --- fleet preparation ---------------------------------------------------------------------

def exclusion_reason(pc: PcInfo, allow_battery: bool) -> str | None:
    """Why ``pc`` takes no stage (not approved, paused, on battery unless allowed); None if it may."""
    if not pc.approved:
        return "not approved"
    if pc.paused:
        return "paused"
    if pc.on_battery and not allow_battery:
        return "on battery"
    return None


def _prepare(request: PlacementRequest, model: ModelProfile, pcs: Sequence[PcInfo],
             devices: Sequence[DeviceProfile], links: Links,
             ) -> tuple[Fleet, tuple[Exclusion, ...]]:
    """The numeric fleet for the MILP, and the agents left out of it."""
    for m in (model, *(d.model for d in devices if d.model is not None)):
        if m.n_layers == 0 or min(m.layer_bytes) < 0 or min(m.embed_bytes, m.head_bytes) < 0:
            raise PlacementInputError("the model profile needs at least one layer and no negative "
                                      "sizes; re-run the model's memory profiling")
    for d in devices:
        if d.model is not None and d.model.n_layers != model.n_layers:
            raise PlacementInputError(f"device {d.device_id} profiles the model with {d.model.n_layers} "
                                      f"layers, not {model.n_layers}; recalibrate it for this model")
    pc_by_id = {pc.pc_id: pc for pc in pcs}
    if len(pc_by_id) != len(pcs):
        raise PlacementInputError("two agents report the same pc_id; remove the stale entry")
    if len({d.device_id for d in devices}) != len(devices):
        raise PlacementInputError("two device profiles share a device_id; recalibrate the agent")
    for d in devices:
        if d.pc_id not in pc_by_id:
            raise PlacementInputError(f"device {d.device_id} names unknown PC {d.pc_id}; "
                                      "refresh the agent list")
        if not (d.layer_ms > 0 and d.overhead_ms >= 0 and d.memory_bytes >= 0):
            raise PlacementInputError(f"device {d.device_id} has an invalid profile (layer_ms "
                                      "must be > 0, overhead and memory >= 0); recalibrate it")

    excluded = [Exclusion(pc.pc_id, r) for pc in pcs
                if (r := exclusion_reason(pc, request.allow_battery))]
    out = {e.pc_id for e in excluded}
    with_devices = {d.pc_id for d in devices}
    excluded += [Exclusion(pc.pc_id, "no device profile") for pc in pcs
                 if pc.pc_id not in out and pc.pc_id not in with_devices]
    pc_ids = tuple(pc.pc_id for pc in pcs if pc.pc_id not in out and pc.pc_id in with_devices)
    if not pc_ids:
        raise PlacementInfeasible(_no_agent_message(excluded), excluded=tuple(excluded))

    index = {p: k for k, p in enumerate(pc_ids)}
    # Canonical order (PC, then profile) puts identical devices next to each other.
    chosen = tuple(sorted((d for d in devices if d.pc_id in index),
                          key=lambda d: (index[d.pc_id], d.layer_ms, d.overhead_ms,
                                         d.memory_bytes, d.device_id)))
    if request.min_stages > min(len(chosen), model.n_layers):
        raise PlacementInfeasible(
            f"at least {request.min_stages} stage(s) were asked for, but the model has "
            f"{model.n_layers} layer(s) and the usable agents {len(chosen)} device(s); lower the minimum "
            "or approve or resume more agents", excluded=tuple(excluded))
    mem_pre, ms_pre = np.array([_prefix_sums(d.model or model) for d in chosen]).transpose(1, 0, 2)
    lat = np.array([[links.between(p, q) for q in pc_ids] for p in pc_ids])
    coord = np.array([links.coordinator(p) for p in pc_ids])
    if lat.min() < 0 or coord.min() < 0:
        raise PlacementInputError("a measured latency is negative; re-run the link probe")
    fleet = Fleet(
        device_ids=tuple(d.device_id for d in chosen), pc_ids=pc_ids,
        layer_ms=np.asarray([d.layer_ms for d in chosen]),
        overhead_ms=np.asarray([d.overhead_ms for d in chosen]),
        dev_pc=np.array([index[d.pc_id] for d in chosen]),
        dev_cap=np.array([request.headroom * d.memory_bytes for d in chosen]),
        pc_cap=np.array([request.headroom * pc_by_id[p].memory_bytes for p in pc_ids]),
        lat=lat, coord=coord, mem_pre=mem_pre, ms_pre=ms_pre)
    return fleet, tuple(excluded)


def _prefix_sums(model: ModelProfile) -> tuple[np.ndarray, np.ndarray]:
    """(L+1,) prefix sums of bytes and of extra ms per layer, embedding on layer 0, head on the last."""
    mem = np.array(model.layer_bytes, dtype=np.float64)
    extra = np.zeros(model.n_layers)
    mem[0] += model.embed_bytes
    mem[-1] += model.head_bytes
    extra[0] += model.embed_ms
    extra[-1] += model.head_ms
    return np.concatenate(([0.0], np.cumsum(mem))), np.concatenate(([0.0], np.cumsum(extra)))


def _no_agent_message(excluded: Sequence[Exclusion]) -> str:
    counts: dict[str, int] = {}
    for e in excluded:
        counts[e.reason] = counts.get(e.reason, 0) + 1
    why = ", ".join(f"{n} {reason}" for reason, n in counts.items()) or "no agents known"
    return (f"no approved agent is available ({why}); approve agents in the console, resume "
            "paused ones, calibrate their devices, or allow agents on battery")


def _plan(f: Fleet, request: PlacementRequest, timing: Timing,
          excluded: tuple[Exclusion, ...]) -> Plan:
    """The `Plan` for a timed chain of stages: who holds what, and the predictions."""
    planned = tuple(
        PlannedStage(f.device_ids[d], f.pc_ids[f.dev_pc[d]], first, last, compute_ms,
                     int(f.stage_bytes(d, first, last)))
        for (d, first, last), compute_ms in zip(timing.stages, timing.compute_ms, strict=True))
    return Plan(stages=planned, hop_ms=timing.hop_ms, per_token_ms=timing.per_token_ms,
                tok_s=1000.0 / timing.per_token_ms, bottleneck_ms=timing.bottleneck_ms,
                n_streams=request.n_streams, cycle_ms=timing.cycle_ms,
                aggregate_tok_s=1000.0 / timing.cycle_ms, objective=request.objective,
                optimal=timing.optimal, excluded=excluded, gap=timing.gap)


# --- explaining a failure -------------------------------------------------------------------

def _explain_infeasible(f: Fleet, excluded: tuple[Exclusion, ...], req: PlacementRequest,
                        deadline: float) -> PlacementInfeasible:
    """Re-solve with memory slack per PC; the least total slack is the shortfall to report."""
    need = int(f.mem_pre[:, -1].min())  # the model in its smallest form
    offer = float(sum(min(f.pc_cap[p], f.dev_cap[f.dev_pc == p].sum())
                      for p in range(len(f.pc_ids))))
    m = build_milp(f, req.max_stages, min_stages=req.min_stages, slack=True)
    res = run_milp(m, max(deadline, time.monotonic() + 1.0))  # an explanation is worth a second
    shortfall = (_shortfall(f, extract_stages(m, res.x)) if res.x is not None
                 else max(need - offer, 0))
    limits = f"{req.headroom:.0%} headroom"
    if req.min_stages > 1:
        limits += f", at least {req.min_stages} stage(s)"
    if req.max_stages is not None:
        limits += f", at most {req.max_stages} stage(s)"
    why = (f"the model needs {_gb_up(shortfall)} GB more memory than the approved agents offer "
           f"(model {need / GB:.1f} GB; {offer / GB:.1f} GB usable on {len(f.device_ids)} "
           f"device(s) of {len(f.pc_ids)} agent(s) at {limits}")
    if offer >= need:
        why += "; a layer cannot be split across devices"
    why += ")"
    if excluded:
        why += f"; {len(excluded)} more agent(s) left out (" + ", ".join(
            f"{e.pc_id}: {e.reason}" for e in excluded) + ")"
    why += (". Free memory on the agents, approve or resume more agents, lower the context "
            "length or slot count, or use a more compressed model.")
    return PlacementInfeasible(why, shortfall_bytes=shortfall, excluded=excluded)


def _shortfall(f: Fleet, stages: Sequence[Stage]) -> float:
    """Extra bytes a plan's PCs would need: per PC, its worst device or its shared limit."""
    need = np.zeros(len(f.pc_ids))
    used = np.zeros(len(f.pc_ids))
    for d, first, last in stages:
        p, m = f.dev_pc[d], float(f.stage_bytes(d, first, last))
        used[p] += m
        need[p] = max(need[p], m - f.dev_cap[d])
    return float(np.maximum(np.maximum(need, used - f.pc_cap), 0.0).sum())


def _gb_up(nbytes: float) -> str:
    """Round up to 0.1 GB, so that adding the reported amount is always enough."""
    return f"{max(math.ceil(nbytes / 1e8 - 1e-6), 1) / 10:.1f}"
