"""The fleet service's JSON (docs/ADMIN_API.md) read back into the objects the console's pages
draw: agent records, placement inputs, models, exports. Pure (no sockets, no Qt); the inverse of
:mod:`console.fleet_api.admin_shapes`, which the service writes with (plans, requests and specs
are decoded by that module's own ``*_from_json``).

What the service does not send is rebuilt conservatively and said so here: a record's
``last_seen`` is "now minus last_seen_s" on this PC's monotonic clock; placement inputs carry the
model's layer bytes, embedding and head (the service persists placements in this form), and from
a service that sent only ``n_layers`` and ``total_bytes`` the layer bytes are spread evenly.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from console.fleet_api.admin_shapes import ShapeError
from console.fleet_api.agent_record import AgentRecord, AgentSource, Membership
from console.fleet_api.exports import ExportInfo, ExportKey
from console.fleet_api.link_report import SERVICE, LinkReport
from console.fleet_api.model_entry import ModelEntry
from console.fleet_api.placement import PlacementInputs
from engine.control.links import LinkMeasurement
from engine.control.messages import AgentStatus
from engine.control.tags import reported_tags
from engine.errors import PlacementInputError
from engine.placement.moe import ExpertRouting, MoeWeights
from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo

SERVICE_END = "service"  # how docs/ADMIN_API.md names the service's end of a link; in `LinkReport` it is SERVICE


def _get(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    if not isinstance(body, Mapping):
        raise ShapeError(f"the service sent {where} as {type(body).__name__}, not an object")
    if name not in body or body[name] is None:
        if default is ...:
            raise ShapeError(f"the service's {where} lacks {name!r}: is it a newer or older version?")
        return default
    value = body[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ShapeError(f"the service's {where}.{name} is {type(value).__name__}, not {kind}")
    return value


def agent_from_json(body: Mapping[str, Any], *, now: float | None = None) -> AgentRecord:
    """An AgentRecord from the service's AGENT object."""
    now = time.monotonic() if now is None else now
    w = "agent"
    seen = _get(body, "last_seen_s", float, w, None)
    status = _get(body, "status", dict, w, None)
    try:
        membership = Membership(_get(body, "membership", str, w))
        sources = frozenset(AgentSource(s) for s in _get(body, "sources", list, w, []))
        parsed_status = None if status is None else AgentStatus.from_dict(status)
    except (ValueError, KeyError, TypeError) as exc:
        raise ShapeError(f"the service's agent {body.get('name')!r} does not read: {exc}") from exc
    return AgentRecord(
        node_id=_get(body, "node_id", str, w, ""), name=_get(body, "name", str, w),
        address=_get(body, "address", str, w, ""), control_port=_get(body, "control_port", int, w, 0),
        state=_get(body, "state", str, w), devices=tuple(_get(body, "devices", list, w, [])),
        memory_bytes=_get(body, "memory_bytes", int, w, 0), fleet_id=_get(body, "fleet_id", str, w, ""),
        membership=membership, last_seen=None if seen is None else now - seen, sources=sources,
        approved=_get(body, "approved", bool, w, False), status=parsed_status,
        reachable=_get(body, "reachable", bool, w, None), error=_get(body, "error", str, w, None),
        paused_reasons=tuple(_get(body, "paused_reasons", list, w, [])), version=_get(body, "version", str, w, ""),
        instance=_get(body, "instance", str, w, ""), verified=_get(body, "verified", bool, w, False),
        tags=reported_tags(_get(body, "tags", list, w, [])), tags_set_by=_get(body, "tags_set_by", str, w, "agent"))


def agents_from_json(body: Mapping[str, Any]) -> tuple[AgentRecord, ...]:
    now = time.monotonic()
    return tuple(agent_from_json(a, now=now) for a in _get(body, "agents", list, "answer"))


def links_from_json(body: Mapping[str, Any]) -> LinkReport:
    """A LinkReport from LINKS (``"service"`` or ``"console"`` stand for the service's end)."""
    w = "links"

    def end(x: object) -> str:
        return SERVICE if x == SERVICE_END else str(x)

    measured = {(end(m["a"]), end(m["b"])): LinkMeasurement(float(m["rtt_ms"]), float(m["mbit_s"]))
                for m in _get(body, "measured", list, w, [])}
    failures = {(end(f["a"]), end(f["b"])): str(f["error"]) for f in _get(body, "failures", list, w, [])}
    pc_ms = {(p["a"], p["b"]): float(p["ms"]) for p in _get(body, "pc_ms", list, w, [])}
    coordinator = {k: float(v) for k, v in _get(body, "coordinator_ms", dict, w, {}).items()}
    default = _get(body, "default_ms", (int, float), w, None)
    return LinkReport(Links(pc_ms=pc_ms, coordinator_ms=coordinator,
                            default_ms=None if default is None else float(default)), measured, failures)


def inputs_from_json(body: Mapping[str, Any]) -> PlacementInputs:
    """PlacementInputs from INPUTS (the model's layer bytes spread evenly: see the module doc)."""
    w = "inputs"
    profile = _profile(_get(body, "model", dict, w), "inputs.model")
    try:
        pcs = tuple(PcInfo(p["pc_id"], int(p["memory_bytes"]), bool(p["approved"]), bool(p.get("paused", False)),
                           bool(p.get("on_battery", False))) for p in _get(body, "pcs", list, w))
        devices = tuple(DeviceProfile(d["device_id"], d["pc_id"], d["kind"], float(d["layer_ms"]),
                                      float(d["overhead_ms"]), int(d["memory_bytes"]),
                                      None if d.get("model") is None else _profile(d["model"], "inputs.devices.model"))
                        for d in _get(body, "devices", list, w))
        failures = {(f["node_id"], f["device_id"]): str(f["error"]) for f in _get(body, "failures", list, w, [])}
    except (KeyError, TypeError, ValueError) as exc:
        raise ShapeError(f"the service's placement inputs do not read: {exc!r}") from exc
    return PlacementInputs(model=profile, pcs=pcs, devices=devices,
                           links=links_from_json(_get(body, "links", dict, w, {})),
                           unreachable=tuple(_get(body, "unreachable", list, w, [])),
                           names=dict(_get(body, "names", dict, w, {})), failures=failures)


def _profile(model: Mapping[str, Any], where: str) -> ModelProfile:
    n_layers = _get(model, "n_layers", int, where)
    total = _get(model, "total_bytes", int, where, 0)
    if n_layers < 1:
        raise ShapeError("the service's placement inputs name a model of no layers")
    even = [total // n_layers] * n_layers  # an older service sent only the total
    layer_bytes = tuple(int(b) for b in _get(model, "layer_bytes", list, where, even))
    if len(layer_bytes) != n_layers:
        raise ShapeError(f"the placement inputs' model has {n_layers} layers but {len(layer_bytes)} layer sizes")
    return ModelProfile(layer_bytes=layer_bytes, embed_bytes=_get(model, "embed_bytes", int, where, 0),
                        embed_ms=float(_get(model, "embed_ms", (int, float), where, 0.0)),
                        head_bytes=_get(model, "head_bytes", int, where, 0),
                        head_ms=float(_get(model, "head_ms", (int, float), where, 0.0)),
                        moe=_moe(_get(model, "moe", dict, where, None), f"{where}.moe"))


def _moe(body: Mapping[str, Any] | None, where: str) -> MoeWeights | None:
    """A MoE model's experts (an older service, or a dense model, sends none)."""
    if body is None:
        return None
    try:
        return MoeWeights(ExpertRouting(_get(body, "experts", int, where), _get(body, "per_token", int, where)),
                          expert_bytes=_get(body, "expert_bytes", int, where),
                          dense_bytes=_get(body, "dense_bytes", int, where))
    except PlacementInputError as exc:
        raise ShapeError(f"the placement inputs' {where} does not read: {exc}") from exc


def model_from_json(body: Mapping[str, Any]) -> ModelEntry:
    path = _get(body, "path", str, "model", None)
    return ModelEntry(_get(body, "name", str, "model"), _get(body, "kind", str, "model"),
                      None if path is None else Path(path), _get(body, "available", bool, "model", True))


def export_from_json(body: Mapping[str, Any]) -> ExportInfo:
    """An ExportInfo from EXPORT; ``path`` is the export's id (it lives on the service's PC)."""
    w = "export"
    layers = tuple((int(a), int(b)) for a, b in _get(body, "layers", list, w))
    weights, target = _get(body, "weights", str, w), _get(body, "target", str, w, "")
    fingerprint = _get(body, "fingerprint", str, w)
    key = ExportKey(fingerprint, weights, tuple(a for a, _ in layers[1:]), kv_cache_precision="", target=target)
    export_id = _get(body, "export_id", str, w)
    return ExportInfo(export_id=export_id, path=Path(export_id), name=_get(body, "name", str, w),
                      fingerprint=fingerprint, weights=weights, stages=_get(body, "stages", int, w), layers=layers,
                      size_bytes=_get(body, "size_bytes", int, w, 0), created=_get(body, "created", str, w, ""),
                      key=key)
