"""Placement's inputs, measured: device calibration (cached), device and PC profiles.

`console.fleet.placement_inputs` puts them together: refresh the agents' status, measure the
links, build (once) the model's calibration export, calibrate every approved agent's devices that
have no cached profile, and hand `engine.placement.planner.solve` the model, PCs, devices and links.
Calibrated numbers are cached in the fleet service state dir by (model key, node id, device, threads),
so the next placement of the same model measures nothing again.

Device kinds calibrated here are CPU and GPU, which run the stateful export; an NPU runs static
shards (`deskfleet export --target npu`) and needs its own calibration export (not done yet).
A device's head time is estimated, not measured, as its per-layer time scaled by the head's
weight bytes over a layer's: decode is bound by reading weights (the embedding is one row read).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from console.fleet.calibration_export import CalibrationSet
from console.fleet.errors import FleetStateError
from console.fleet.fleet import FleetModel
from console.fleet.fleet_state import fleet_db, state_errors
from console.fleet_api.agent_record import AgentRecord
from engine.control.client import ControlClient, ControlError
from engine.control.hub import FleetHub
from engine.placement.types import DeviceKind, DeviceProfile, ModelProfile, PcInfo
from engine.shards.calibration import StageTiming, fit_layer_time

log = logging.getLogger(__name__)

PROFILES_SETTING = "device_profiles"
CALIBRATED_KINDS: tuple[DeviceKind, ...] = ("CPU", "GPU")
_WHAT = "the device calibration cache"


@dataclass(frozen=True)
class Calibration:
    """One device's fitted timings for one model; ``cached`` when no measurement was needed."""

    node_id: str
    device: str
    kind: DeviceKind
    layer_ms: float
    overhead_ms: float
    cached: bool


@dataclass(frozen=True)
class Calibrations:
    """Every device profiled, and why the others are not (``failures[(node_id, device)]``)."""

    done: tuple[Calibration, ...]
    failures: Mapping[tuple[str, str], str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "failures", MappingProxyType(dict(self.failures)))


class ProfileCache:
    """Fitted (layer_ms, overhead_ms) by (model key, node id, device), in the state database."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        with state_errors():
            profiles = fleet_db(self.state_dir).setting(PROFILES_SETTING) or {}
        if not isinstance(profiles, dict):
            raise FleetStateError(f"{_WHAT} in the state database of {self.state_dir} is not an object; "
                                  "restore the database from a backup")
        self._profiles: dict[str, dict] = profiles

    @staticmethod
    def _key(model_key: str, node_id: str, device: str) -> str:
        return f"{model_key}|{node_id}|{device}"

    def get(self, model_key: str, node_id: str, device: str) -> tuple[float, float] | None:
        entry = self._profiles.get(self._key(model_key, node_id, device))
        if entry is None:
            return None
        try:
            return float(entry["layer_ms"]), float(entry["overhead_ms"])
        except (TypeError, KeyError, ValueError):
            return None  # absent, or an entry this build cannot read: calibrate again

    def put(self, model_key: str, node_id: str, device: str, layer_ms: float, overhead_ms: float,
            timings: Sequence[StageTiming]) -> None:
        self._profiles[self._key(model_key, node_id, device)] = {
            "layer_ms": layer_ms, "overhead_ms": overhead_ms,
            "timings": [dataclasses.asdict(t) for t in timings],
            "measured": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        with state_errors():
            fleet_db(self.state_dir).set_setting(PROFILES_SETTING, self._profiles)


def _calibrated_devices(record: AgentRecord) -> list[tuple[str, DeviceKind]]:
    """(name, kind) of the record's devices that this module calibrates."""
    devices = record.status.inventory.get("devices", ()) if record.status else ()
    return [(d["name"], kind) for d in devices if isinstance(d, dict) and isinstance(d.get("name"), str)
            for kind in CALIBRATED_KINDS if d.get("kind") == kind]


def cache_device(device: str, threads: int | None) -> str:
    """The cache's name for ``device`` profiled with ``threads`` inference threads."""
    return device if threads is None else f"{device}@{threads}t"


async def async_calibrate_devices(fleet: FleetModel, hub: FleetHub, calibration: CalibrationSet,
                                  node_ids: Sequence[str], cache: ProfileCache, *,
                                  steps: int = 16, threads: int | None = None) -> Calibrations:
    """Profile every CPU/GPU of the agents ``node_ids`` (polled records) for ``calibration``'s
    model, from the cache where it has them. Agents run their calibrations at the same time (they
    are different PCs); the devices of one agent one after another. ``threads``: the inference
    threads the workers will run with (None: OpenVINO's default), so the profile times what will
    serve; it is part of the cache key."""
    records = [fleet.get(n) for n in node_ids]
    todo = [(r, name, kind) for r in records for name, kind in _calibrated_devices(r)]
    if any(cache.get(calibration.key, r.node_id, cache_device(name, threads)) is None for r, name, _ in todo):
        for part in calibration.parts:
            hub.publish(part.export_id, part.path)
    failures: dict[tuple[str, str], str] = {}

    async def one_agent(record: AgentRecord) -> list[Calibration]:
        done = []
        for name, kind in _calibrated_devices(record):
            slot = cache_device(name, threads)
            if (hit := cache.get(calibration.key, record.node_id, slot)) is not None:
                done.append(Calibration(record.node_id, name, kind, *hit, cached=True))
                continue
            try:
                timings = await _async_time_stages(fleet, hub, calibration, record, name, steps, threads)
                layer_ms, overhead_ms = fit_layer_time(timings)
            except (ControlError, ValueError, TypeError, KeyError) as exc:
                log.warning("calibrating %s on %s failed: %s", name, record.name, exc)
                failures[(record.node_id, name)] = f"calibration on {record.name} failed: {exc}"
                continue
            cache.put(calibration.key, record.node_id, slot, layer_ms, overhead_ms, timings)
            done.append(Calibration(record.node_id, name, kind, layer_ms, overhead_ms, cached=False))
        return done

    results = await asyncio.gather(*(one_agent(r) for r in records))
    return Calibrations(tuple(c for batch in results for c in batch), failures)


async def _async_time_stages(fleet: FleetModel, hub: FleetHub, calibration: CalibrationSet,
                             record: AgentRecord, device: str, steps: int,
                             threads: int | None = None) -> list[StageTiming]:
    client = ControlClient(fleet.credentials, record.address, record.control_port, timeout=900,
                           node_id=record.node_id)
    timings = []
    for part in calibration.parts:
        manifest_json = (part.path / "manifest.json").read_text(encoding="utf-8")
        body = {"export_id": part.export_id, "manifest_json": manifest_json,
                "manifest_sha256": hashlib.sha256(manifest_json.encode()).hexdigest(),
                "source": hub.shard_url(part.export_id), "stages": list(part.stages),
                "device": device, "steps": steps}
        if threads is not None:
            body["threads"] = threads
        hub.grant(record.node_id, part.export_id, part.stages)  # the hub serves these stages to it alone
        try:
            timings += [StageTiming(**t) for t in await client.async_calibrate(body)]
        finally:
            hub.grant(record.node_id, part.export_id, ())
    return timings


def device_profiles(calibrations: Sequence[Calibration], records: Mapping[str, AgentRecord],
                    model: ModelProfile, layer_bytes: float) -> list[DeviceProfile]:
    """Placement's devices: the calibrated timings, the memory each can address now, and the
    model with this device's estimated head time (see the module docstring)."""
    profiles = []
    for c in calibrations:
        record = records[c.node_id]
        inventory = record.status.inventory if record.status else {}
        own = next((d.get("memory_bytes") for d in inventory.get("devices", ())
                    if isinstance(d, dict) and d.get("name") == c.device), None)
        memory = own if isinstance(own, int) and c.kind == "GPU" else _available(record)
        head_ms = c.layer_ms * model.head_bytes / layer_bytes if layer_bytes > 0 else 0.0
        profiles.append(DeviceProfile(f"{c.node_id}/{c.device}", c.node_id, c.kind, c.layer_ms, c.overhead_ms,
                                      memory, dataclasses.replace(model, head_ms=head_ms)))
    return profiles


def _available(record: AgentRecord) -> int:
    available = record.status.inventory.get("ram_available") if record.status else None
    return int(available) if isinstance(available, int) else record.memory_bytes


def pc_infos(records: Sequence[AgentRecord]) -> list[PcInfo]:
    """Placement's PCs: free memory now, approval, pause and power as the last poll said."""
    return [PcInfo(r.node_id, _available(r), r.approved, r.paused, r.on_battery) for r in records]
