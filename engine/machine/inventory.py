"""What one PC can lend: its OpenVINO devices, memory, cores, power and shard-store space.

The agent collects an `Inventory` and sends it to the console (``to_dict``), which feeds
placement. The console checks what it receives (``from_dict``): an agent may run another
version, or be someone else's machine, so every field is type- and range-checked and a bad one
raises `InventoryError` naming the field.

Device properties differ by plugin (the CPU plugin has no ``GPU_DEVICE_TOTAL_MEM_SIZE``, a
driver may lack one the docs promise), so they are looked up from a table and only asked of a
plugin that lists them in ``SUPPORTED_PROPERTIES``; a failing query leaves the field None.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, overload

import psutil

from engine.errors import InventoryError

log = logging.getLogger(__name__)

FORMAT = 1   # bumped only for an incompatible change of to_dict's shape


class DeviceKind(StrEnum):
    CPU = "CPU"
    GPU = "GPU"
    NPU = "NPU"


# OpenVINO device name prefix ("GPU" of "GPU.1") -> kind. Devices of other kinds (virtual
# plugins, unknown accelerators) are left out: placement cannot reason about them.
DEVICE_KINDS: Mapping[str, DeviceKind] = {"CPU": DeviceKind.CPU, "GPU": DeviceKind.GPU,
                                          "NPU": DeviceKind.NPU}

# Kind -> the read-only property reporting the device's own memory, where it has one. A CPU
# has none: it uses system RAM, reported once in `Inventory`.
MEMORY_PROPERTIES: Mapping[DeviceKind, str] = {DeviceKind.GPU: "GPU_DEVICE_TOTAL_MEM_SIZE",
                                               DeviceKind.NPU: "NPU_DEVICE_TOTAL_MEM_SIZE"}


@dataclass(frozen=True)
class Device:
    """One OpenVINO device: ``name`` as OpenVINO spells it (``CPU``, ``GPU.0``, ``NPU``)."""

    name: str
    kind: DeviceKind
    full_name: str
    memory_bytes: int | None = None


@dataclass(frozen=True)
class CpuCores:
    """``physical`` is None where the OS does not say (some VMs, some BSDs)."""

    physical: int | None
    logical: int


@dataclass(frozen=True)
class Inventory:
    """One PC's resources at one moment. Sizes in bytes; ``battery_percent``/``on_ac`` are None
    on a PC without a battery (or whose OS does not report it)."""

    devices: tuple[Device, ...]
    ram_total: int
    ram_available: int
    os: str
    cpu_cores: CpuCores
    battery_percent: float | None
    on_ac: bool | None
    disk_free: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; `from_dict` is its inverse."""
        return {
            "format": FORMAT,
            "devices": [{"name": d.name, "kind": d.kind.value, "full_name": d.full_name,
                         "memory_bytes": d.memory_bytes} for d in self.devices],
            "ram_total": self.ram_total, "ram_available": self.ram_available, "os": self.os,
            "cpu_cores": {"physical": self.cpu_cores.physical, "logical": self.cpu_cores.logical},
            "battery_percent": self.battery_percent, "on_ac": self.on_ac,
            "disk_free": self.disk_free,
        }

    @classmethod
    def from_dict(cls, data: object) -> Inventory:
        """Check and read an inventory received from an agent. Raises `InventoryError`."""
        d = _Fields(data, "inventory")
        if d.get("format", int) != FORMAT:
            raise InventoryError(f"inventory format {d.data['format']!r} is not {FORMAT}; "
                                 "the agent and the console run incompatible Deskfleet versions")
        raw_devices = d.get("devices", list)
        if len(raw_devices) > 64:
            raise InventoryError(f"inventory lists {len(raw_devices)} devices; at most 64 expected")
        devices = []
        for i, raw in enumerate(raw_devices):
            f = _Fields(raw, f"devices[{i}]")
            kind = f.get("kind", str)
            if kind not in DeviceKind.__members__:
                raise InventoryError(f"inventory devices[{i}].kind {kind!r} is not one of "
                                     f"{list(DeviceKind.__members__)}")
            devices.append(Device(name=f.text("name", 64), kind=DeviceKind(kind),
                                  full_name=f.text("full_name", 256, empty=True),
                                  memory_bytes=f.size("memory_bytes", optional=True)))
        if len({dev.name for dev in devices}) != len(devices):
            raise InventoryError("inventory names one device twice")
        cores = _Fields(d.get("cpu_cores", dict), "cpu_cores")
        inventory = cls(
            devices=tuple(devices), ram_total=d.size("ram_total"),
            ram_available=d.size("ram_available"), os=d.text("os", 256, empty=True),
            cpu_cores=CpuCores(physical=cores.count("physical", optional=True),
                               logical=cores.count("logical")),
            battery_percent=d.percent("battery_percent"), on_ac=d.flag("on_ac"),
            disk_free=d.size("disk_free"))
        if inventory.ram_available > inventory.ram_total:
            raise InventoryError(f"inventory ram_available {inventory.ram_available} exceeds "
                                 f"ram_total {inventory.ram_total}")
        return inventory


class _Fields:
    """Typed reads from one untrusted JSON object; every failure names the field."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, dict):
            raise InventoryError(f"{where} is {type(data).__name__}, expected an object")
        self.data, self.where = data, where

    def get(self, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        if key not in self.data:
            raise InventoryError(f"{self.where} lacks the field {key!r}")
        value = self.data[key]
        if value is None and optional:
            return None
        # bool is an int in Python, but never a valid count or size here.
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise InventoryError(f"{self.where}.{key} is {value!r}, expected {names}"
                                 + (" or null" if optional else ""))
        return value

    @overload
    def size(self, key: str, optional: Literal[False] = False) -> int: ...
    @overload
    def size(self, key: str, optional: bool) -> int | None: ...

    def size(self, key: str, optional: bool = False) -> int | None:
        value = self.get(key, int, optional)
        if value is not None and not 0 <= value < 2**63:
            raise InventoryError(f"{self.where}.{key} is {value}, expected a size in bytes")
        return value

    @overload
    def count(self, key: str, optional: Literal[False] = False) -> int: ...
    @overload
    def count(self, key: str, optional: bool) -> int | None: ...

    def count(self, key: str, optional: bool = False) -> int | None:
        value = self.get(key, int, optional)
        if value is not None and not 1 <= value <= 65536:
            raise InventoryError(f"{self.where}.{key} is {value}, expected a core count")
        return value

    def text(self, key: str, limit: int, empty: bool = False) -> str:
        value = self.get(key, str)
        if len(value) > limit or (not value and not empty) or not value.isprintable():
            raise InventoryError(f"{self.where}.{key} {value[:80]!r} is empty, too long or "
                                 "holds control characters")
        return value

    def percent(self, key: str) -> float | None:
        value = self.get(key, (int, float), optional=True)
        if value is not None and not 0.0 <= value <= 100.0:  # also refuses NaN
            raise InventoryError(f"{self.where}.{key} is {value}, expected 0..100 or null")
        return None if value is None else float(value)

    def flag(self, key: str) -> bool | None:
        return self.get(key, bool, optional=True)


def _device_property(core, device: str, prop: str, supported: frozenset[str]) -> Any:
    if prop not in supported:
        return None
    try:
        return core.get_property(device, prop)
    except Exception as e:  # the plugin listed it but its driver cannot answer
        log.debug("OpenVINO %s: %s unavailable: %s", device, prop, e)
        return None


def collect_devices(core) -> tuple[Device, ...]:
    """The OpenVINO devices of ``core`` (an ``openvino.Core``) that placement can use."""
    devices = []
    for name in core.available_devices:
        kind = DEVICE_KINDS.get(name.split(".", 1)[0])
        if kind is None:
            log.debug("OpenVINO device %s is of no kind Deskfleet places on; skipped", name)
            continue
        try:
            supported = frozenset(core.get_property(name, "SUPPORTED_PROPERTIES"))
        except Exception as e:
            log.warning("OpenVINO device %s does not answer property queries (%s); skipped",
                        name, e)
            continue
        full_name = _device_property(core, name, "FULL_DEVICE_NAME", supported)
        memory = (_device_property(core, name, MEMORY_PROPERTIES[kind], supported)
                  if kind in MEMORY_PROPERTIES else None)
        devices.append(Device(name=name, kind=kind, full_name=str(full_name or name),
                              memory_bytes=int(memory) if memory else None))
    return tuple(devices)


def _existing_parent(path: Path) -> Path:
    # The store directory may not exist before the first shard arrives: measure the disk it
    # will be created on.
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _battery():
    # psutil has no sensors_battery on some platforms, and reading it can fail on odd firmware.
    try:
        return getattr(psutil, "sensors_battery", lambda: None)()
    except (OSError, RuntimeError) as e:
        log.debug("battery state unavailable: %s", e)
        return None


def collect_inventory(store_dir: str | os.PathLike[str], *, core=None) -> Inventory:
    """This PC's inventory now. ``core`` defaults to a fresh ``openvino.Core()`` (creating one
    loads the plugins, ~0.1 s); pass the process's own to reuse it."""
    if core is None:
        # here: OpenVINO's runtime loads only to probe devices (the console reads inventories without it)
        import openvino

        core = openvino.Core()
    memory = psutil.virtual_memory()
    battery = _battery()
    return Inventory(
        devices=collect_devices(core),
        ram_total=int(memory.total), ram_available=int(memory.available),
        os=platform.platform(),
        cpu_cores=CpuCores(physical=psutil.cpu_count(logical=False),
                           logical=psutil.cpu_count(logical=True) or os.cpu_count() or 1),
        battery_percent=None if battery is None else float(battery.percent),
        on_ac=None if battery is None or battery.power_plugged is None
        else bool(battery.power_plugged),
        disk_free=shutil.disk_usage(_existing_parent(Path(store_dir))).free,
    )
