"""Placement with NPU (and CPU) candidates that run the model in their own form: their own
memory and latency profile per device, checked against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.errors import PlacementInfeasible, PlacementInputError
from engine.placement.planner import solve
from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo, PlacementRequest

GB = 10**9
# The stateful GPU/CPU form: weights + KV cache for a long context.
STATEFUL = ModelProfile((GB,) * 4, embed_bytes=GB // 2, embed_ms=0.2, head_bytes=GB // 2, head_ms=0.3)
# The static NPU form: same weights, a small fixed KV window, its own embedding/head costs.
STATIC = ModelProfile((GB // 2,) * 4, embed_bytes=GB // 4, embed_ms=0.5, head_bytes=GB // 4, head_ms=0.9)


def _pc(pid: str, mem_gb: float) -> PcInfo:
    return PcInfo(pid, int(mem_gb * GB), approved=True)


def _dev(pid, kind, t, o, mem_gb, model=None) -> DeviceProfile:
    return DeviceProfile(f"{pid}/{kind}", pid, kind, t, o, int(mem_gb * GB), model)


def test_an_npu_that_only_fits_in_its_own_form_is_chosen():
    # 5 GB for the stateful model, 2.5 GB for the static one; the NPU offers 4 GB usable and the
    # (faster) GPU less than one stateful layer.
    pcs = (_pc("a", 32),)
    devices = (_dev("a", "GPU", 1.0, 0.1, 1.2), _dev("a", "NPU", 4.0, 0.1, 5, STATIC))
    plan = solve(PlacementRequest(headroom=0.8), model=STATEFUL, pcs=pcs, devices=devices,
                 links=Links(default_ms=0.0))
    assert [(s.device_id, s.first_layer, s.last_layer) for s in plan.stages] == [("a/NPU", 0, 3)]
    assert plan.stages[0].memory_bytes == int(2.5 * GB)
    assert plan.per_token_ms == pytest.approx(4.0 * 4 + 0.1 + 0.5 + 0.9)


def test_the_npu_latency_profile_decides_against_a_faster_gpu():
    pcs = (_pc("a", 32),)
    gpu, npu = _dev("a", "GPU", 1.0, 0.1, 16), _dev("a", "NPU", 4.0, 0.1, 16, STATIC)
    plan = solve(PlacementRequest(), model=STATEFUL, pcs=pcs, devices=(gpu, npu), links=Links(default_ms=0.0))
    assert [s.device_id for s in plan.stages] == ["a/GPU"]
    # Packed over 16 slots an NPU stage costs ~1/6 per token (paper Table 20): now it wins.
    packed = _dev("a", "NPU", 4.0 / 6, 0.1, 16, STATIC)
    plan = solve(PlacementRequest(), model=STATEFUL, pcs=pcs, devices=(gpu, packed), links=Links(default_ms=0.0))
    npu_layers = sum(s.n_layers for s in plan.stages if s.device_id == "a/NPU")
    assert npu_layers >= 3, plan
    alone = solve(PlacementRequest(max_stages=1), model=STATEFUL, pcs=pcs, devices=(gpu, packed),
                  links=Links(default_ms=0.0))
    assert [s.device_id for s in alone.stages] == ["a/NPU"]


def test_npu_and_cpu_of_one_pc_split_the_model_and_share_its_memory():
    # Neither device alone fits; together they do, each holding its own form of its layers.
    pcs = (_pc("a", 8),)
    npu = _dev("a", "NPU", 3.0, 0.1, 2, STATIC)
    cpu = _dev("a", "CPU", 2.0, 0.1, 4)
    plan = solve(PlacementRequest(headroom=1.0), model=STATEFUL, pcs=pcs, devices=(npu, cpu),
                 links=Links(default_ms=0.0))
    assert {s.device_id for s in plan.stages} == {"a/NPU", "a/CPU"}
    by = {s.device_id: s for s in plan.stages}
    npu_layers = range(by["a/NPU"].first_layer, by["a/NPU"].last_layer + 1)
    expected = sum(STATIC.layer_bytes[i] for i in npu_layers) + (STATIC.embed_bytes if 0 in npu_layers else 0) \
        + (STATIC.head_bytes if 3 in npu_layers else 0)
    assert by["a/NPU"].memory_bytes == expected


def test_infeasible_fleets_report_the_shortfall_of_the_smallest_form():
    pcs = (_pc("a", 32),)
    devices = (_dev("a", "GPU", 1.0, 0.1, 1), _dev("a", "NPU", 4.0, 0.1, 1, STATIC))
    with pytest.raises(PlacementInfeasible, match=r"model 2\.5 GB") as info:
        solve(PlacementRequest(headroom=1.0), model=STATEFUL, pcs=pcs, devices=devices, links=Links(default_ms=0))
    assert info.value.shortfall_bytes > 0


def test_a_device_profile_for_another_model_is_refused():
    other = ModelProfile((GB,) * 3)
    with pytest.raises(PlacementInputError, match="3 layers, not 4"):
        solve(PlacementRequest(), model=STATEFUL, pcs=(_pc("a", 8),),
              devices=(_dev("a", "NPU", 1, 0, 8, other),), links=Links(default_ms=0))


def _brute_force(model, pcs, devices, links, headroom):
    """Least latency over every split into contiguous stages and every ordered device choice."""
    L = model.n_layers
    cap = {p.pc_id: headroom * p.memory_bytes for p in pcs}
    best = None
    for k in range(1, min(L, len(devices)) + 1):
        for cuts in itertools.combinations(range(1, L), k - 1):
            bounds = [0, *cuts, L]
            for order in itertools.permutations(devices, k):
                used: dict[str, float] = {}
                ms, ok = 0.0, True
                for dev, first, end in zip(order, bounds, bounds[1:], strict=False):
                    m = dev.model or model
                    mem = sum(m.layer_bytes[first:end]) + (m.embed_bytes if first == 0 else 0) \
                        + (m.head_bytes if end == L else 0)
                    ok &= mem <= headroom * dev.memory_bytes
                    used[dev.pc_id] = used.get(dev.pc_id, 0.0) + mem
                    ms += dev.layer_ms * (end - first) + dev.overhead_ms \
                        + (m.embed_ms if first == 0 else 0) + (m.head_ms if end == L else 0)
                if not ok or any(used[p] > cap[p] for p in used):
                    continue
                hop = [links.coordinator(order[0].pc_id), links.coordinator(order[-1].pc_id)]
                hop += [links.between(a.pc_id, b.pc_id) for a, b in itertools.pairwise(order)]
                if best is None or ms + sum(hop) < best:
                    best = ms + sum(hop)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_mixed_device_forms_match_brute_force(seed):
    rng = random.Random(seed)
    L = 4
    model = ModelProfile(tuple(rng.randint(1, 4) * GB // 2 for _ in range(L)), embed_bytes=GB // 4,
                         embed_ms=0.3, head_bytes=GB // 4, head_ms=0.4)
    pcs = tuple(_pc(f"p{i}", rng.choice([3, 5, 8])) for i in range(2))
    devices = []
    for pc in pcs:
        for kind in rng.sample(["GPU", "NPU", "CPU"], rng.randint(1, 3)):
            own = None
            if kind == "NPU":
                own = ModelProfile(tuple(rng.randint(1, 3) * GB // 4 for _ in range(L)), embed_bytes=GB // 8,
                                   embed_ms=rng.uniform(0, 1), head_bytes=GB // 8, head_ms=rng.uniform(0, 1))
            devices.append(_dev(pc.pc_id, kind, rng.uniform(0.5, 4), rng.uniform(0, 0.5), rng.choice([2, 3, 5]), own))
    links = Links({("p0", "p1"): rng.uniform(0.1, 3)}, {"p0": rng.uniform(0, 2), "p1": rng.uniform(0, 2)})
    expected = _brute_force(model, pcs, devices, links, 0.8)
    if expected is None:
        with pytest.raises(PlacementInfeasible):
            solve(PlacementRequest(), model=model, pcs=pcs, devices=tuple(devices), links=links)
        return
    plan = solve(PlacementRequest(), model=model, pcs=pcs, devices=tuple(devices), links=links)
    assert plan.optimal and plan.per_token_ms == pytest.approx(expected, rel=1e-9)


def test_an_agent_inventory_offers_cpu_gpu_and_npu_each_with_its_own_profile():
    from engine.machine.inventory import CpuCores, Device, DeviceKind, Inventory
    from engine.placement.planner import device_candidates
    from engine.placement.types import Calibration

    inventory = Inventory(
        devices=(Device("CPU", DeviceKind.CPU, "Intel Core Ultra"),
                 Device("GPU.0", DeviceKind.GPU, "Arc 140V", memory_bytes=int(1.2 * GB)),
                 Device("NPU", DeviceKind.NPU, "Intel AI Boost", memory_bytes=4 * GB),
                 Device("GPU.1", DeviceKind.GPU, "uncalibrated", memory_bytes=16 * GB)),
        ram_total=32 * GB, ram_available=3 * GB, os="test", cpu_cores=CpuCores(4, 8),
        battery_percent=None, on_ac=None, disk_free=100 * GB)
    calibrations = {"CPU": Calibration(3.0, 0.2), "GPU.0": Calibration(1.0, 0.1),
                    "NPU": Calibration(2.5, 0.1, STATIC)}
    devices = device_candidates("a", _as_received(inventory), calibrations)
    assert [(d.device_id, d.kind, d.memory_bytes) for d in devices] == [
        ("a/CPU", "CPU", 3 * GB), ("a/GPU.0", "GPU", int(1.2 * GB)), ("a/NPU", "NPU", 4 * GB)]
    assert devices[2].model is STATIC and devices[0].model is None
    plan = solve(PlacementRequest(headroom=1.0), model=STATEFUL, pcs=(_pc("a", 32),), devices=devices,
                 links=Links(default_ms=0.0))
    # The GPU holds one stateful layer at most, the CPU's RAM three: the NPU in its static form
    # is what makes the model fit, and it is used.
    assert "a/NPU" in {s.device_id for s in plan.stages}


def _as_received(inventory):
    """The inventory as the console gets it from an agent (through to_dict/from_dict)."""
    from engine.machine.inventory import Inventory

    return Inventory.from_dict(inventory.to_dict())
