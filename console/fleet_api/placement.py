"""A placement the admin can adjust, as the admin API carries it: the solver's inputs kept after
a placement (:class:`PlacementInputs`), and the pure arithmetic the Placement page does over them
(moving a split point re-times the plan at once, :func:`retime`; :func:`memory_warnings` says why
an adjusted plan would not fit). The fleet service measures and solves
(:mod:`console.fleet.placement_inputs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from console.fleet_api.context_choice import ContextChoice
from console.fleet_api.link_report import LinkReport
from engine.errors import PlacementInputError
from engine.placement.types import DeviceProfile, ModelProfile, PcInfo, Plan, PlannedStage


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


def moe_note(inputs: PlacementInputs | None) -> str:
    """What the Placement page says of a MoE model's memory and reads; "" for a dense one."""
    moe = inputs.model.moe if inputs is not None else None
    return "" if moe is None else moe.describe()


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
