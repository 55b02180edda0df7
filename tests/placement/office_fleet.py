"""Synthetic office fleets for placement at scale (the tests here and `placement-scale` benchmark).

An office buys PCs in a few models, so most PCs are clones of one of three kinds; every other PC
has a discrete GPU besides its CPU. Links are office LAN latencies (0.2-1.0 ms one way, drawn
per pair), the coordinator 0.1-0.8 ms from each PC. The model has ``n_layers`` decoder layers of
``layer_gb`` (0.45 GB: weights + KV), an embedding and a head of 1 GB each: large enough that no PC holds it
and the plan needs a dozen stages at 30 devices. ``spread`` > 0 draws each layer's bytes from
±spread around the mean (mixed quantisation, alternating attention windows): the counts model
is then no longer exact on its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo

GB = 10**9

# (PC memory GB, CPU ms per layer, GPU ms per layer, GPU memory GB)
_KINDS = ((16, 3.0, 0.8, 6), (32, 2.6, 1.2, 8), (16, 3.8, 0.9, 6))


@dataclass(frozen=True)
class OfficeFleet:
    model: ModelProfile
    pcs: tuple[PcInfo, ...]
    devices: tuple[DeviceProfile, ...]
    links: Links

    def kwargs(self) -> dict:
        return dict(model=self.model, pcs=self.pcs, devices=self.devices, links=self.links)


def office_fleet(n_devices: int, n_layers: int, *, seed: int = 1, spread: float = 0.0,
                 clones: bool = True, layer_gb: float = 0.45) -> OfficeFleet:
    """``n_devices`` candidate devices (CPUs, and a GPU on every other PC) over as many PCs as
    that takes; ``clones`` False draws every PC's figures on its own (no interchangeable PCs);
    ``layer_gb`` is the mean layer size (small fleets need larger layers to spread)."""
    rng = random.Random(seed)
    pcs: list[PcInfo] = []
    devices: list[DeviceProfile] = []
    while len(devices) < n_devices:
        p = len(pcs)
        pid = f"pc{p:02d}"
        mem, cpu_ms, gpu_ms, gpu_mem = _KINDS[p % 3]
        if not clones:
            mem, cpu_ms = rng.choice((16, 24, 32)), round(rng.uniform(2.5, 4.5), 3)
            gpu_ms, gpu_mem = round(rng.uniform(0.6, 1.5), 3), rng.choice((4, 6, 8))
        pcs.append(PcInfo(pid, mem * GB, approved=True))
        devices.append(DeviceProfile(f"{pid}/CPU", pid, "CPU", cpu_ms, 0.2, mem * GB))
        if len(devices) < n_devices and p % 2 == 0:
            devices.append(DeviceProfile(f"{pid}/GPU.0", pid, "GPU", gpu_ms, 0.5, gpu_mem * GB))
    pc_ms = {(a.pc_id, b.pc_id): round(rng.uniform(0.2, 1.0), 3)
             for i, a in enumerate(pcs) for b in pcs[i + 1:]}
    coord = {pc.pc_id: round(rng.uniform(0.1, 0.8), 3) for pc in pcs}
    mean = layer_gb * GB
    layer_bytes = tuple(int(mean * (1 + rng.uniform(-spread, spread))) for _ in range(n_layers))
    model = ModelProfile(layer_bytes, embed_bytes=GB, embed_ms=0.3, head_bytes=GB, head_ms=0.8)
    return OfficeFleet(model, tuple(pcs), tuple(devices), Links(pc_ms, coord, default_ms=0.5))
