"""Placement the admin can adjust: the solver's inputs kept after a placement, so that leaving an
agent out re-solves without measuring anything again, and moving a split point re-times the
plan at once (pure arithmetic over the same profiles the solver used).

`async_placement_inputs` measures and calibrates (:mod:`console.fleet.profiling`) and stops
before the solver: the console's Placement page keeps the inputs. :func:`async_place` solves over
them in one go and returns only the plan; :func:`solve_inputs` and :func:`retime` are pure.

A mixture-of-experts model's profile carries its experts (`engine.placement.moe.MoeWeights`, from
the calibration exports' manifest): memory counts every expert, a step reads the routed ones, and
the head's time is scaled from what one token's step of a layer reads (:func:`layer_read_bytes`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from console.fleet.calibration_export import (
    KV_BYTES,
    CalibrationSet,
    async_build_calibration_set,
    model_profile,
)
from console.fleet.context_choice import ContextChoice, choose_context
from console.fleet.fleet import FleetModel
from console.fleet.links import LinkReport, async_measure_links
from console.fleet.profiling import (
    ProfileCache,
    async_calibrate_devices,
    device_profiles,
    pc_infos,
)
from console.fleet_api.agent_record import AgentRecord, Membership
from engine.control.hub import FleetHub
from engine.control.tags import tag_exclusions
from engine.errors import Exclusion, PlacementInputError
from engine.placement.moe import ExpertRouting, moe_weights, streamed_bytes
from engine.placement.planner import (
    DeviceProfile,
    ModelProfile,
    PcInfo,
    PlacementRequest,
    Plan,
    PlannedStage,
    solve,
)

if TYPE_CHECKING:
    from export.exporter import ExportOptions

LEFT_OUT = "left out by the admin"
UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class PlacementInputs:
    """Everything the solver saw for one model and context. ``names`` maps node ids to agent
    names (for display); ``unreachable`` are approved agents that did not answer; ``failures``
    are devices whose calibration failed, and why."""

    model: ModelProfile
    pcs: tuple[PcInfo, ...]
    devices: tuple[DeviceProfile, ...]
    links: LinkReport
    unreachable: tuple[str, ...]
    names: Mapping[str, str]
    failures: Mapping[tuple[str, str], str]
    # the context the service would choose (and chose, when the caller left it open), and why;
    # kept on the placement (placement_store), not in the inputs' JSON; None: not measured here
    context: ContextChoice | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", MappingProxyType(dict(self.names)))
        object.__setattr__(self, "failures", MappingProxyType(dict(self.failures)))

    def name(self, node_id: str) -> str:
        return self.names.get(node_id) or node_id[:12]

    def device(self, device_id: str) -> DeviceProfile:
        for d in self.devices:
            if d.device_id == device_id:
                return d
        raise PlacementInputError(f"no device {device_id} was calibrated; place the model again")


async def async_placement_inputs(fleet: FleetModel, hub: FleetHub, checkpoint: Path, *,
                                 options: ExportOptions, context: int | None = 4096, streams: int = 1,
                                 allow_battery: bool = False, steps: int = 16, threads: int | None = None,
                                 links: LinkReport | None = None, headroom: float = 0.8,
                                 not_for_context: Collection[str] = ()) -> PlacementInputs:
    """Refresh the agents, measure the links (unless given), calibrate (cached, on ``threads``
    inference threads: the workers'), profile the model. ``context`` None: the model's maximum,
    capped by the calibrated agents' free memory at ``headroom``, less the agents
    ``not_for_context`` (left out of the plan by the admin or their tags); the inputs' ``context``
    says which and why (what it would be, when ``context`` is given). Runs on the console's loop
    (``fleet`` lives there)."""
    await fleet.async_refresh()
    members = [r for r in fleet.records() if r.membership is Membership.MEMBER]
    unreachable = [r.node_id for r in members if r.approved and r.status is None]
    polled = [r for r in members if r.status is not None]
    usable = [r.node_id for r in polled if r.approved and not r.paused and (allow_battery or not r.on_battery)]
    if links is None:
        links = await async_measure_links(fleet, usable)
    unreachable += sorted(links.unreachable & set(usable))
    usable = [n for n in usable if n not in links.unreachable]
    calibration = await async_build_calibration_set(checkpoint, fleet.state_dir, options)
    calibrations = await async_calibrate_devices(fleet, hub, calibration, usable, ProfileCache(fleet.state_dir),
                                                 steps=steps, threads=threads)
    by_id = {r.node_id: r for r in polled}
    reachable = [r for r in polled if r.node_id not in links.unreachable]
    pcs = tuple(pc_infos(reachable))
    calibrated = {c.node_id for c in calibrations.done} - set(not_for_context)
    choice = context_for(calibration, options.kv_cache_precision, streams=streams, headroom=headroom,
                         free=[(by_id[pc.pc_id].name, pc.memory_bytes) for pc in pcs if pc.pc_id in calibrated])
    if context is None:
        context = choice.tokens
    model = placement_model(calibration, context=context, streams=streams, kv_precision=options.kv_cache_precision)
    devices = device_profiles(calibrations.done, by_id, model, layer_read_bytes(calibration))
    return PlacementInputs(model, pcs, tuple(devices), links, tuple(unreachable),
                           {r.node_id: r.name for r in members}, calibrations.failures, choice)


def placement_model(calibration: CalibrationSet, *, context: int, streams: int = 1,
                    kv_precision: str = "f16") -> ModelProfile:
    """The model as placement sees it: the calibration exports' memory profile
    (`calibration_export.model_profile`), with the experts of a MoE model (None: dense)."""
    model = model_profile(calibration, context=context, streams=streams, kv_precision=kv_precision)
    return dataclasses.replace(model, moe=moe_weights(calibration.parts[0].manifest))


def layer_read_bytes(calibration: CalibrationSet) -> float:
    """Mean bytes one layer's decode step of one token reads (the calibration's middle stages):
    its weight files, less the experts a token is not routed to. The calibrated layer time was
    spent reading these, so the head's time is scaled from them; for a dense model this is
    `calibration_export.layer_weight_bytes`."""
    read, layers = 0.0, 0
    for stage in (s for part in calibration.parts for s in part.manifest.stages):
        if stage.has_embedding or stage.has_head:
            continue
        total, moe = sum(f.size for f in stage.files), stage.moe
        if moe is not None:
            total = streamed_bytes(total - moe.expert_bytes, moe.expert_bytes,
                                   ExpertRouting(moe.experts, moe.per_token), 1)
        read, layers = read + total, layers + stage.num_layers
    return read / layers


def moe_note(inputs: PlacementInputs | None) -> str:
    """What the Placement page says of a MoE model's memory and reads; "" for a dense one."""
    moe = inputs.model.moe if inputs is not None else None
    return "" if moe is None else moe.describe()


def context_for(calibration: CalibrationSet, kv_precision: str, *, free: Sequence[tuple[str, int]],
                streams: int = 1, headroom: float = 0.8) -> ContextChoice:
    """The model's maximum context (its manifest), capped by ``free`` = [(agent name, free
    bytes)]: `console.fleet.context_choice.choose_context` over this model's weights and KV."""
    info = calibration.parts[0].manifest.model
    weights = model_profile(calibration, context=0, streams=1, kv_precision=kv_precision)
    kv_per_token = 2 * info.num_kv_heads * info.head_dim * KV_BYTES[kv_precision] * info.num_layers
    return choose_context(info.max_position_embeddings, kv_bytes_per_token=kv_per_token,
                          weight_bytes=sum(weights.layer_bytes) + weights.embed_bytes + weights.head_bytes,
                          free=free, streams=streams, headroom=headroom)


async def async_place(fleet: FleetModel, hub: FleetHub, checkpoint: Path, *,
                      request: PlacementRequest | None = None, options: ExportOptions | None = None,
                      context: int = 4096, links: LinkReport | None = None, steps: int = 16,
                      threads: int | None = None) -> Plan:
    """Measure, calibrate and solve in one go: the plan for ``checkpoint`` over the approved,
    reachable, unpaused agents (on battery only if the request allows). Approved agents that did
    not answer are listed in the plan's ``excluded`` as "unreachable". Raises the solver's
    `PlacementInfeasible` (with its explanation) unchanged when no plan exists."""
    request = request or PlacementRequest()
    if options is None:
        from export.exporter import ExportOptions

        options = ExportOptions()
    inputs = await async_placement_inputs(fleet, hub, checkpoint, options=options, context=context,
                                          streams=request.n_streams, allow_battery=request.allow_battery,
                                          steps=steps, threads=threads, links=links)
    plan = await asyncio.to_thread(solve, request, model=inputs.model, pcs=inputs.pcs, devices=inputs.devices,
                                   links=inputs.links.links)
    extra = tuple(Exclusion(n, UNREACHABLE) for n in inputs.unreachable)
    return dataclasses.replace(plan, excluded=plan.excluded + extra) if extra else plan


def solve_inputs(inputs: PlacementInputs, request: PlacementRequest,
                 leave_out: Collection[str] = (), tagged_out: Mapping[str, str] | None = None) -> Plan:
    """Solve over ``inputs`` without the agents ``leave_out`` (node ids) and ``tagged_out``
    ({node id: reason}, from `engine.control.tags.tag_exclusions`). Raises the solver's
    `PlacementInfeasible` unchanged; an agent the admin left out is listed as `LEFT_OUT`, one
    its tags kept out with the tags' reason."""
    approved = {pc.pc_id for pc in inputs.pcs if pc.approved}  # "not approved" stays the reason for the rest
    reasons = {n: why for n, why in (tagged_out or {}).items() if n in approved}
    reasons.update({n: LEFT_OUT for n in leave_out})
    pcs = [dataclasses.replace(pc, approved=False) if pc.pc_id in reasons else pc for pc in inputs.pcs]
    plan = solve(request, model=inputs.model, pcs=pcs, devices=inputs.devices, links=inputs.links.links)
    excluded = tuple(Exclusion(e.pc_id, reasons[e.pc_id]) if e.pc_id in reasons else e for e in plan.excluded)
    excluded += tuple(Exclusion(n, UNREACHABLE) for n in inputs.unreachable)
    return dataclasses.replace(plan, excluded=excluded)


def tagged_out(records: Iterable[AgentRecord], include: Iterable[str] = (),
               exclude: Iterable[str] = ()) -> dict[str, str]:
    """{node id: why} for the member agents a placement keeping to ``include`` and avoiding
    ``exclude`` leaves out, by their tags (`engine.control.tags.tag_exclusions`; TagError for a
    bad tag)."""
    return tag_exclusions({r.node_id: r.tags for r in records if r.node_id}, include, exclude)


def stage_firsts(plan: Plan) -> tuple[int, ...]:
    """The plan's split points: the first layer of every stage after the first."""
    return tuple(s.first_layer for s in plan.stages[1:])


def retime(inputs: PlacementInputs, plan: Plan, firsts: Sequence[int]) -> Plan:
    """``plan`` with its stages cut at ``firsts`` instead (same devices, same order), re-timed
    with the solver's own latency model: a stage costs layers x layer_ms + overhead (+ the
    embedding or head it carries), every hop its measured one-way latency. ``optimal`` is False
    and ``gap`` None: the admin chose the cuts, no solver stands behind them. Raises
    PlacementInputError for cuts that leave a stage empty."""
    n_layers = inputs.model.n_layers
    cuts = [0, *firsts, n_layers]
    if len(firsts) != len(plan.stages) - 1 or any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)):
        raise PlacementInputError(f"split points {list(firsts)} do not give {len(plan.stages)} non-empty "
                                  f"stages over {n_layers} layers; each must be above the previous one")
    stages = []
    for old, first, end in zip(plan.stages, cuts, cuts[1:], strict=False):
        device = inputs.device(old.device_id)
        compute, memory = _stage_cost(device.model or inputs.model, device, first, end - 1)
        stages.append(PlannedStage(old.device_id, old.pc_id, first, end - 1, compute, memory))
    links = inputs.links.links
    hops = ((links.coordinator(stages[0].pc_id),)
            + tuple(links.between(a.pc_id, b.pc_id) for a, b in zip(stages, stages[1:], strict=False))
            + (links.coordinator(stages[-1].pc_id),))
    per_token = sum(s.compute_ms for s in stages) + sum(hops)
    bottleneck = max(max(s.compute_ms for s in stages), max(hops))
    cycle = max(bottleneck, per_token / plan.n_streams)
    return dataclasses.replace(plan, stages=tuple(stages), hop_ms=hops, per_token_ms=per_token,
                               tok_s=1000.0 / per_token, bottleneck_ms=bottleneck, cycle_ms=cycle,
                               aggregate_tok_s=1000.0 / cycle, optimal=False, gap=None)


def _stage_cost(model: ModelProfile, device: DeviceProfile, first: int, last: int) -> tuple[float, int]:
    """(ms per token, bytes) of layers first..last on ``device``; embedding with layer 0, head
    with the last layer, as `engine.placement.planner` counts them."""
    ms = device.layer_ms * (last - first + 1) + device.overhead_ms
    memory = sum(model.layer_bytes[first:last + 1])
    if first == 0:
        ms, memory = ms + model.embed_ms, memory + model.embed_bytes
    if last == model.n_layers - 1:
        ms, memory = ms + model.head_ms, memory + model.head_bytes
    return ms, memory


def memory_warnings(inputs: PlacementInputs, plan: Plan, headroom: float) -> list[str]:
    """Why an adjusted plan would not fit: a stage over its device's share of memory, or a PC
    whose stages together exceed its own (both at ``headroom``, as the solver counts)."""
    warnings = []
    pc_memory = {pc.pc_id: pc.memory_bytes for pc in inputs.pcs}
    used: dict[str, int] = {}
    for k, stage in enumerate(plan.stages):
        cap = headroom * inputs.device(stage.device_id).memory_bytes
        if stage.memory_bytes > cap:
            warnings.append(f"stage {k} needs {stage.memory_bytes / 1e9:.2f} GB but {inputs.name(stage.pc_id)} "
                            f"offers {cap / 1e9:.2f} GB on {stage.device_id.rsplit('/', 1)[-1]}")
        used[stage.pc_id] = used.get(stage.pc_id, 0) + stage.memory_bytes
    for pc_id, total in used.items():
        cap = headroom * pc_memory.get(pc_id, 0)
        if total > cap:
            warnings.append(f"{inputs.name(pc_id)} would hold {total / 1e9:.2f} GB of {cap / 1e9:.2f} GB usable")
    return warnings
