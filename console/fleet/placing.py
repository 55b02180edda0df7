"""The fleet service's placements made and solved again, with the agents' tags and the context's
choice: what ``POST /admin/v1/placements`` and ``…/solve`` run (`FleetService.place` and
``async_solve`` call these and keep the result in the `PlacementStore`).

Tags are read from the agents' records when the placement is made or solved (an agent tagged
since then counts from the next solve); the agents they leave out are not counted for the
context's memory cap either.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection, Iterable
from pathlib import Path

from console.fleet.fleet import FleetModel
from console.fleet.placement_inputs import LEFT_OUT, async_placement_inputs, solve_inputs, tagged_out
from console.fleet.placement_store import Placement
from console.fleet_api.agent_record import AgentRecord
from console.fleet_api.exports import ExportSpec
from engine.control.hub import FleetHub
from engine.control.tags import parse_tags
from engine.placement.types import PcInfo, PlacementRequest, Plan


def checked_tags(include: Collection[str], exclude: Collection[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(include, exclude) as tags; TagError naming the field for a bad one (before any job starts)."""
    return parse_tags(list(include), "include_tags"), parse_tags(list(exclude), "exclude_tags")


async def async_new_placement(fleet: FleetModel, hub: FleetHub, checkpoint: Path, *, placement_id: str, model: str,
                              spec: ExportSpec, request: PlacementRequest, context: int | None,
                              leave_out: Collection[str], include: tuple[str, ...], exclude: tuple[str, ...],
                              steps: int, threads: int | None) -> Placement:
    """Measure, calibrate and solve ``model`` (``checkpoint``) into placement ``placement_id``."""
    from export.exporter import ExportOptions

    out = tagged_out(fleet.records(), include, exclude)
    inputs = await async_placement_inputs(
        fleet, hub, checkpoint, options=ExportOptions(**spec.options_kwargs()), context=context,
        streams=request.n_streams, allow_battery=request.allow_battery, steps=steps, threads=threads,
        headroom=request.headroom, not_for_context=set(out) | set(leave_out))
    plan = await asyncio.to_thread(solve_inputs, inputs, request, frozenset(leave_out), out)
    auto = inputs.context
    if context is None and auto is not None:
        tokens, reason = auto.tokens, auto.reason
    else:
        tokens = int(context or 0)
        reason = "as given" + ("" if auto is None else f"; auto would be {auto.tokens:,} tokens ({auto.reason})")
    return Placement(placement_id, model, tokens, spec, inputs, plan, context_reason=reason, include_tags=include,
                     exclude_tags=exclude)


async def async_solve_again(fleet: FleetModel, placement: Placement, request: PlacementRequest,
                            leave_out: Collection[str], include: Collection[str] | None = None,
                            exclude: Collection[str] | None = None) -> Plan:
    """``placement`` solved again over its inputs (tags None: the placement's own), the plan and
    the tags used kept on it; the caller saves it."""
    include = placement.include_tags if include is None else parse_tags(list(include), "include_tags")
    exclude = placement.exclude_tags if exclude is None else parse_tags(list(exclude), "exclude_tags")
    out = tagged_out(fleet.records(), include, exclude)
    plan = await asyncio.wait_for(asyncio.to_thread(solve_inputs, placement.inputs, request, frozenset(leave_out),
                                                    out), request.time_limit_s + 30)
    placement.plan, placement.include_tags, placement.exclude_tags = plan, include, exclude
    return plan


def ring_pcs(placement: Placement, records: Iterable[AgentRecord], leave_out: Collection[str],
             include: Collection[str] | None = None,
             exclude: Collection[str] | None = None) -> tuple[list[PcInfo], dict[str, str]]:
    """The placement's PCs for proposing rings (``POST …/rings``): those the admin left out or
    the tags (None: the placement's own) keep out marked unapproved, and {node id: why} for the
    proposal's list of agents left out."""
    include = placement.include_tags if include is None else parse_tags(list(include), "include_tags")
    exclude = placement.exclude_tags if exclude is None else parse_tags(list(exclude), "exclude_tags")
    approved = {pc.pc_id for pc in placement.inputs.pcs if pc.approved}
    reasons = {n: why for n, why in tagged_out(records, include, exclude).items() if n in approved}
    reasons.update({n: LEFT_OUT for n in leave_out})
    pcs = [dataclasses.replace(pc, approved=False) if pc.pc_id in reasons else pc for pc in placement.inputs.pcs]
    return pcs, reasons
