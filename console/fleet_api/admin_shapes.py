"""The admin API's JSON shapes (docs/ADMIN_API.md), made and parsed in one place.

Pure: frozen objects to JSON dicts and back, for the service (`console.fleet.admin_api`) and
its clients (`console.fleet_api.admin_client`). A parse of what a client sent raises
:class:`ShapeError` naming the field, which the server answers with 400 ``bad_request``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from console.fleet_api.agent_record import AgentRecord
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.exports import ExportInfo, ExportSpec
from console.fleet_api.link_report import LinkReport
from console.fleet_api.model_entry import ModelEntry
from console.fleet_api.placement import PlacementInputs
from engine.errors import Exclusion
from engine.placement.types import ModelProfile, PlacementRequest, Plan, PlannedStage


class ShapeError(FleetServiceError):
    """A JSON body does not have the shape docs/ADMIN_API.md gives it (the message names the field)."""


# ---- reading what a client sent ------------------------------------------------------------------

def field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], *, where: str = "the body",
          default: Any = ..., optional: bool = False) -> Any:
    """``body[name]`` checked to be ``kind`` (None allowed when ``optional``); ``default`` when absent."""
    if not isinstance(body, Mapping):
        raise ShapeError(f"{where} must be a JSON object")
    if name not in body or (optional and body[name] is None):
        if default is ...:
            if optional:
                return None
            raise ShapeError(f"{where} needs {name!r}")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:  # JSON true is no number
        raise ShapeError(f"{where}: {name!r} must be {_kind_name(kinds)}, not {value!r}")
    if float in kinds and isinstance(value, int):
        return float(value)
    if not isinstance(value, kinds):
        raise ShapeError(f"{where}: {name!r} must be {_kind_name(kinds)}, not {type(value).__name__}")
    return value


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def strings(body: Mapping[str, Any], name: str, *, where: str = "the body") -> tuple[str, ...]:
    values = field(body, name, list, where=where, default=[])
    if not all(isinstance(v, str) for v in values):
        raise ShapeError(f"{where}: {name!r} must be a list of strings")
    return tuple(values)


# ---- placement -----------------------------------------------------------------------------------

def request_json(request: PlacementRequest) -> dict[str, Any]:
    return {"objective": request.objective, "n_streams": request.n_streams, "headroom": request.headroom,
            "allow_battery": request.allow_battery, "time_limit_s": request.time_limit_s,
            "max_stages": request.max_stages, "min_stages": request.min_stages}


def request_from_json(body: Mapping[str, Any] | None) -> PlacementRequest:
    body = body or {}
    w = "'request'"
    try:
        return PlacementRequest(
            objective=field(body, "objective", str, where=w, default="latency"),
            n_streams=field(body, "n_streams", int, where=w, default=1),
            headroom=field(body, "headroom", float, where=w, default=0.8),
            allow_battery=field(body, "allow_battery", bool, where=w, default=False),
            time_limit_s=field(body, "time_limit_s", float, where=w, default=10.0),
            max_stages=field(body, "max_stages", int, where=w, optional=True),
            min_stages=field(body, "min_stages", int, where=w, default=1))
    except FleetServiceError:
        raise
    except Exception as exc:  # PlacementInputError: the request's own rules
        raise ShapeError(str(exc)) from exc


def plan_json(plan: Plan) -> dict[str, Any]:
    return {"stages": [{"device_id": s.device_id, "pc_id": s.pc_id, "first_layer": s.first_layer,
                        "last_layer": s.last_layer, "compute_ms": s.compute_ms, "memory_bytes": s.memory_bytes}
                       for s in plan.stages],
            "hop_ms": list(plan.hop_ms), "per_token_ms": plan.per_token_ms, "tok_s": plan.tok_s,
            "bottleneck_ms": plan.bottleneck_ms, "n_streams": plan.n_streams, "cycle_ms": plan.cycle_ms,
            "aggregate_tok_s": plan.aggregate_tok_s, "objective": plan.objective, "optimal": plan.optimal,
            "gap": plan.gap, "excluded": [{"pc_id": e.pc_id, "reason": e.reason} for e in plan.excluded]}


def plan_from_json(body: Mapping[str, Any]) -> Plan:
    w = "'plan'"
    raw_stages = field(body, "stages", list, where=w)
    if not raw_stages:
        raise ShapeError("'plan' has no stages")
    stages = []
    for i, s in enumerate(raw_stages):
        ws = f"'plan.stages[{i}]'"
        stages.append(PlannedStage(field(s, "device_id", str, where=ws), field(s, "pc_id", str, where=ws),
                                   field(s, "first_layer", int, where=ws), field(s, "last_layer", int, where=ws),
                                   field(s, "compute_ms", float, where=ws, default=0.0),
                                   field(s, "memory_bytes", int, where=ws, default=0)))
    for a, b in zip(stages, stages[1:], strict=False):
        if b.first_layer != a.last_layer + 1:
            raise ShapeError(f"'plan': stage layers must follow each other ({a.last_layer} then {b.first_layer})")
    hop = field(body, "hop_ms", list, where=w, default=[0.0] * (len(stages) + 1))
    excluded = tuple(Exclusion(field(e, "pc_id", str, where="'plan.excluded'"),
                               field(e, "reason", str, where="'plan.excluded'"))
                     for e in field(body, "excluded", list, where=w, default=[]))
    return Plan(stages=tuple(stages), hop_ms=tuple(float(x) for x in hop),
                per_token_ms=field(body, "per_token_ms", float, where=w, default=0.0),
                tok_s=field(body, "tok_s", float, where=w, default=0.0),
                bottleneck_ms=field(body, "bottleneck_ms", float, where=w, default=0.0),
                n_streams=field(body, "n_streams", int, where=w, default=1),
                cycle_ms=field(body, "cycle_ms", float, where=w, default=0.0),
                aggregate_tok_s=field(body, "aggregate_tok_s", float, where=w, default=0.0),
                objective=field(body, "objective", str, where=w, default="latency"),
                optimal=field(body, "optimal", bool, where=w, default=False), excluded=excluded,
                gap=field(body, "gap", float, where=w, optional=True))


def export_plan_from_json(body: Mapping[str, Any]) -> Plan:
    """The split of ``POST /exports``: a whole ``plan`` (as a placement or ring holds it) or only
    its ``stages``; exactly one of the two."""
    has_plan, has_stages = body.get("plan") is not None, body.get("stages") is not None
    if has_plan == has_stages:
        raise ShapeError("give exactly one of 'plan' (a plan, as a placement holds it) or 'stages' "
                         "(its stages: device_id, pc_id, first_layer, last_layer each)")
    if has_plan:
        return plan_from_json(field(body, "plan", dict))
    return plan_from_json({"stages": field(body, "stages", list)})


def spec_json(spec: ExportSpec) -> dict[str, Any]:
    return {"weights": spec.weights, "group_size": spec.group_size, "symmetric": spec.symmetric,
            "kv_cache_precision": spec.kv_cache_precision}


def spec_from_json(body: Mapping[str, Any] | None) -> ExportSpec:
    body, w, d = body or {}, "'spec'", ExportSpec()
    return ExportSpec(weights=field(body, "weights", str, where=w, default=d.weights),
                      group_size=field(body, "group_size", int, where=w, default=d.group_size),
                      symmetric=field(body, "symmetric", bool, where=w, default=d.symmetric),
                      kv_cache_precision=field(body, "kv_cache_precision", str, where=w,
                                               default=d.kv_cache_precision))


def links_json(report: LinkReport) -> dict[str, Any]:
    return {"measured": [{"a": a, "b": b, "rtt_ms": m.rtt_ms, "mbit_s": m.mbit_s}
                         for (a, b), m in report.measured.items()],
            "failures": [{"a": a, "b": b, "error": e} for (a, b), e in report.failures.items()],
            "pc_ms": [{"a": a, "b": b, "ms": ms} for (a, b), ms in report.links.pc_ms.items()],
            "coordinator_ms": dict(report.links.coordinator_ms), "default_ms": report.links.default_ms}


def inputs_json(inputs: PlacementInputs) -> dict[str, Any]:
    return {"names": dict(inputs.names), "unreachable": list(inputs.unreachable),
            "failures": [{"node_id": n, "device_id": d, "error": e} for (n, d), e in inputs.failures.items()],
            "pcs": [{"pc_id": p.pc_id, "memory_bytes": p.memory_bytes, "approved": p.approved, "paused": p.paused,
                     "on_battery": p.on_battery} for p in inputs.pcs],
            "devices": [{"device_id": d.device_id, "pc_id": d.pc_id, "kind": str(d.kind), "layer_ms": d.layer_ms,
                         "overhead_ms": d.overhead_ms, "memory_bytes": d.memory_bytes,
                         "model": None if d.model is None else model_profile_json(d.model)} for d in inputs.devices],
            "model": model_profile_json(inputs.model),
            "links": links_json(inputs.links)}


def model_profile_json(m: ModelProfile) -> dict[str, Any]:
    """A ModelProfile: the request's, or a device's own (its head time, another weight format)."""
    moe = None if m.moe is None else {"experts": m.moe.routing.experts, "per_token": m.moe.routing.per_token,
                                      "expert_bytes": m.moe.expert_bytes, "dense_bytes": m.moe.dense_bytes}
    return {"n_layers": m.n_layers, "total_bytes": m.total_bytes, "layer_bytes": list(m.layer_bytes),
            "embed_bytes": m.embed_bytes, "embed_ms": m.embed_ms, "head_bytes": m.head_bytes, "head_ms": m.head_ms,
            "moe": moe}


# ---- fleet and library ---------------------------------------------------------------------------

def agent_json(record: AgentRecord, *, now: float | None = None) -> dict[str, Any]:
    now = time.monotonic() if now is None else now
    return {"key": record.key, "node_id": record.node_id, "name": record.name, "address": record.address,
            "control_port": record.control_port, "state": record.state, "devices": list(record.devices),
            "memory_bytes": record.memory_bytes, "fleet_id": record.fleet_id, "membership": str(record.membership),
            "last_seen_s": None if record.last_seen is None else round(max(0.0, now - record.last_seen), 3),
            "sources": sorted(str(s) for s in record.sources), "approved": record.approved,
            "reachable": record.reachable, "error": record.error, "paused_reasons": list(record.paused_reasons),
            "version": record.version, "instance": record.instance, "verified": record.verified,
            "tags": list(record.tags), "tags_set_by": record.tags_set_by,
            "status": None if record.status is None else record.status.to_dict()}


def model_json(entry: ModelEntry) -> dict[str, Any]:
    return {"name": entry.name, "kind": entry.kind, "path": None if entry.path is None else str(entry.path),
            "available": entry.available}


def export_json(info: ExportInfo) -> dict[str, Any]:
    return {"export_id": info.export_id, "name": info.name, "fingerprint": info.fingerprint, "weights": info.weights,
            "stages": info.stages, "layers": [list(r) for r in info.layers], "size_bytes": info.size_bytes,
            "created": info.created, "target": info.key.target}
