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
from pathlib import Path
from typing import TYPE_CHECKING

from console.fleet.calibration_export import (
    CalibrationSet,
    async_build_calibration_set,
    model_profile,
)
from console.fleet.fleet import FleetModel
from console.fleet.links import async_measure_links
from console.fleet.profiling import (
    ProfileCache,
    async_calibrate_devices,
    device_profiles,
    pc_infos,
)
from console.fleet_api.agent_record import AgentRecord, Membership
from console.fleet_api.context_choice import ContextChoice, choose_context
from console.fleet_api.link_report import LinkReport
from console.fleet_api.placement import PlacementInputs
from engine.control.hub import FleetHub
from engine.control.tags import tag_exclusions
from engine.errors import Exclusion
from engine.placement.moe import ExpertRouting, moe_weights, streamed_bytes
from engine.placement.planner import solve
from engine.placement.types import ModelProfile, PlacementRequest, Plan
from engine.shards.kv_precision import KV_BYTES_PER_VALUE

if TYPE_CHECKING:
    from export.exporter import ExportOptions

LEFT_OUT = "left out by the admin"
UNREACHABLE = "unreachable"


async def async_placement_inputs(fleet: FleetModel, hub: FleetHub, checkpoint: Path, *,
                                 options: ExportOptions, context: int | None = 4096, streams: int = 1,
                                 allow_battery: bool = False, steps: int = 16, threads: int | None = None,
                                 links: LinkReport | None = None, headroom: float = 0.8,
                                 not_for_context: Collection[str] = ()) -> PlacementInputs:
    """Refresh the agents, measure the links (unless given), calibrate (cached, on ``threads``
    inference threads: the workers'), profile the model. ``context`` None: the model's maximum,
    capped by the calibrated agents' free memory at ``headroom``, less the agents
    ``not_for_context`` (left out of the plan by the admin or their tags); the inputs' ``context``
    says which and why (what it would be, when ``context`` is given). Runs on the fleet service's loop
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
    total: float
    for stage in (s for part in calibration.parts for s in part.manifest.stages):
        if stage.has_embedding or stage.has_head:
            continue
        total, moe = sum(f.size for f in stage.files), stage.moe
        if moe is not None:
            total = streamed_bytes(total - moe.expert_bytes, moe.expert_bytes,
                                   ExpertRouting(moe.experts, moe.per_token), 1)
        read, layers = read + total, layers + stage.num_layers
    return read / layers


def context_for(calibration: CalibrationSet, kv_precision: str, *, free: Sequence[tuple[str, int]],
                streams: int = 1, headroom: float = 0.8) -> ContextChoice:
    """The model's maximum context (its manifest), capped by ``free`` = [(agent name, free
    bytes)]: `console.fleet_api.context_choice.choose_context` over this model's weights and KV."""
    info = calibration.parts[0].manifest.model
    weights = model_profile(calibration, context=0, streams=1, kv_precision=kv_precision)
    kv_per_token = 2 * info.num_kv_heads * info.head_dim * KV_BYTES_PER_VALUE[kv_precision] * info.num_layers
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


