"""Inventory: collected from the real OpenVINO CPU plugin and psutil; plugins that lack a
property (faked) do not crash it; from_dict refuses malformed input with InventoryError."""

from __future__ import annotations

import json
import math
import os
import shutil

import openvino
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InventoryError
from engine.machine.inventory import (
    CpuCores,
    Device,
    DeviceKind,
    Inventory,
    _device_property,
    collect_devices,
    collect_inventory,
)


@pytest.fixture(scope="module")
def core():
    return openvino.Core()


def test_collects_the_real_cpu_plugin_and_this_machine(core, tmp_path):
    inv = collect_inventory(tmp_path, core=core)
    cpu = next(d for d in inv.devices if d.name == "CPU")
    assert cpu.kind is DeviceKind.CPU
    assert cpu.full_name == core.get_property("CPU", "FULL_DEVICE_NAME") != ""
    assert cpu.memory_bytes is None          # a CPU uses system RAM, reported once below
    assert inv.ram_total == psutil.virtual_memory().total
    assert 0 < inv.ram_available <= inv.ram_total
    assert inv.cpu_cores.logical == os.cpu_count()
    assert inv.cpu_cores.physical is None or 1 <= inv.cpu_cores.physical <= inv.cpu_cores.logical
    assert abs(inv.disk_free - shutil.disk_usage(tmp_path).free) < 2**30
    assert inv.os and (inv.battery_percent is None) == (psutil.sensors_battery() is None)


def test_store_dir_that_does_not_exist_yet_is_measured_on_its_disk(core, tmp_path):
    inv = collect_inventory(tmp_path / "not" / "yet", core=core)
    assert abs(inv.disk_free - shutil.disk_usage(tmp_path).free) < 2**30


def test_an_unsupported_property_on_the_real_plugin_reads_as_none(core):
    """The CPU plugin raises for GPU_DEVICE_TOTAL_MEM_SIZE; even when wrongly listed as
    supported, the query is answered with None rather than an exception."""
    with pytest.raises(RuntimeError):
        core.get_property("CPU", "GPU_DEVICE_TOTAL_MEM_SIZE")
    assert _device_property(core, "CPU", "GPU_DEVICE_TOTAL_MEM_SIZE",
                            frozenset({"GPU_DEVICE_TOTAL_MEM_SIZE"})) is None


class FakeCore:
    """Plugins as a table: device -> {property: value or an exception to raise}."""

    def __init__(self, devices):
        self.devices = devices
        self.asked: list[tuple[str, str]] = []

    @property
    def available_devices(self):
        return list(self.devices)

    def get_property(self, device, prop):
        self.asked.append((device, prop))
        props = self.devices[device]
        if prop == "SUPPORTED_PROPERTIES" and isinstance(props, Exception):
            raise props
        if prop == "SUPPORTED_PROPERTIES":
            return {name: "RO" for name in props}
        value = props[prop]
        if isinstance(value, Exception):
            raise value
        return value


def test_device_table_reads_memory_where_supported_and_survives_the_rest():
    fake = FakeCore({
        "CPU": {"FULL_DEVICE_NAME": "Core Ultra 7"},
        "GPU.0": {"FULL_DEVICE_NAME": "Arc iGPU", "GPU_DEVICE_TOTAL_MEM_SIZE": 2**33},
        "GPU.1": {"FULL_DEVICE_NAME": "Arc dGPU",
                  "GPU_DEVICE_TOTAL_MEM_SIZE": RuntimeError("driver too old")},
        "NPU": {"FULL_DEVICE_NAME": "Intel AI Boost"},   # does not list the memory property
        "FPGA": {"FULL_DEVICE_NAME": "an accelerator Deskfleet does not place on"},
        "GPU.2": RuntimeError("plugin crashed"),
        "NPU.1": {},                                         # no FULL_DEVICE_NAME listed
    })
    devices = {d.name: d for d in collect_devices(fake)}
    assert devices == {
        "CPU": Device("CPU", DeviceKind.CPU, "Core Ultra 7", None),
        "GPU.0": Device("GPU.0", DeviceKind.GPU, "Arc iGPU", 2**33),
        "GPU.1": Device("GPU.1", DeviceKind.GPU, "Arc dGPU", None),
        "NPU": Device("NPU", DeviceKind.NPU, "Intel AI Boost", None),
        "NPU.1": Device("NPU.1", DeviceKind.NPU, "NPU.1", None),
    }
    assert ("NPU", "NPU_DEVICE_TOTAL_MEM_SIZE") not in fake.asked   # unlisted: never asked
    assert ("CPU", "GPU_DEVICE_TOTAL_MEM_SIZE") not in fake.asked


def make_inventory(**changes) -> Inventory:
    base = dict(devices=(Device("CPU", DeviceKind.CPU, "Core Ultra 7"),
                         Device("GPU.0", DeviceKind.GPU, "Arc", 2**33)),
                ram_total=32 * 2**30, ram_available=20 * 2**30, os="Windows-11-10.0.22631-SP0",
                cpu_cores=CpuCores(physical=8, logical=16), battery_percent=57.5, on_ac=False,
                disk_free=100 * 2**30)
    return Inventory(**{**base, **changes})


@pytest.mark.parametrize("inv", [
    make_inventory(),
    make_inventory(devices=(), battery_percent=None, on_ac=None,
                   cpu_cores=CpuCores(physical=None, logical=1)),
])
def test_dict_round_trip_through_json(inv):
    assert Inventory.from_dict(json.loads(json.dumps(inv.to_dict()))) == inv


def _mutated(path: str, value):
    return _edit(make_inventory().to_dict(), path, value)


@pytest.mark.parametrize(("path", "value", "says"), [
    ("ram_total", KeyError, "lacks the field 'ram_total'"),
    ("ram_total", "32G", "ram_total is '32G'"),
    ("ram_total", True, "expected int"),
    ("disk_free", -1, "disk_free is -1"),
    ("ram_available", 33 * 2**30, "exceeds ram_total"),
    ("battery_percent", math.nan, "battery_percent"),
    ("battery_percent", 140, "battery_percent"),
    ("on_ac", "yes", "on_ac"),
    ("cpu_cores.logical", 0, "core count"),
    ("cpu_cores", [8, 16], "cpu_cores"),
    ("devices.0.kind", "TPU", "kind 'TPU'"),
    ("devices.1.name", "CPU", "twice"),
    ("devices.0.name", "", "name"),
    ("devices.0.full_name", "x\n" * 3, "control characters"),
    ("devices.1.memory_bytes", 2.5, "memory_bytes"),
    ("devices", {"CPU": {}}, "devices"),
    ("format", 2, "incompatible"),
])
def test_malformed_dict_raises_a_named_inventory_error(path, value, says):
    with pytest.raises(InventoryError, match=says.replace("(", r"\(")):
        Inventory.from_dict(_mutated(path, value))


def test_not_an_object_at_all():
    for data in (None, [], "inventory", 3):
        with pytest.raises(InventoryError, match="expected an object"):
            Inventory.from_dict(data)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_paths = st.sampled_from(["ram_total", "ram_available", "os", "disk_free", "battery_percent",
                          "on_ac", "format", "cpu_cores", "cpu_cores.physical", "devices",
                          "devices.0", "devices.0.kind", "devices.1.memory_bytes"])


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(edits=st.lists(st.tuples(_paths, _json | st.just(KeyError)), max_size=3))
def test_fuzz_from_dict_raises_only_inventory_error(edits):
    data = make_inventory().to_dict()
    for path, value in edits:
        try:
            data = _edit(data, path, value)
        except (KeyError, IndexError, TypeError, AttributeError):  # an earlier edit removed or replaced the parent
            continue
    try:
        Inventory.from_dict(data)
    except InventoryError:
        pass


def _edit(data, path, value):
    *parents, leaf = path.split(".")
    target = data
    for p in parents:
        target = target[int(p)] if isinstance(target, list) else target[p]
    if isinstance(target, list):
        raise TypeError
    if value is KeyError:
        target.pop(leaf, None)
    else:
        target[leaf] = value
    return data
