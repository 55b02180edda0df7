"""What the agent reads about its PC: the inventory it advertises, and whether it runs on mains power.

The inventory (devices, memory, disk) is collected once at start in a short-lived subprocess:
OpenVINO costs ~50 MB of RSS that an idle agent should not carry (only the worker needs it).
The facts that change between polls are :mod:`agent.service.machine_load`'s.

The memory it reports is what its processes may really use: the machine's RAM, capped by the
memory limit of the agent's own cgroup (a container's, a systemd slice's, an emulated PC's) and of
every cgroup above it, v1 or v2 (:func:`cgroup_memory`, read from /proc/self/cgroup). Its stage
worker runs in the same cgroup, so a model that fits the machine but not the limit would be
OOM-killed there; placement and the worker's launch check against this figure instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from engine.suppress import logged_suppress

log = logging.getLogger(__name__)

INVENTORY_TIMEOUT_S = 120.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
# v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712); anything this large is none
NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class CgroupMemory:
    """A process's cgroup memory: ``limit_bytes`` the least limit over its cgroup and its ancestors
    (None: none), ``in_use_bytes`` what its cgroup holds less its files' page cache, which the kernel
    drops before it OOM-kills (None: unknown)."""

    limit_bytes: int | None = None
    in_use_bytes: int | None = None

    def cap(self, total: int, available: int) -> tuple[int, int]:
        """(total, available) memory of a machine with ``total`` RAM, ``available`` of it free, as seen
        from inside this cgroup."""
        if self.limit_bytes is None:
            return total, available
        free_here = self.limit_bytes - (self.in_use_bytes or 0)
        return min(total, self.limit_bytes), max(0, min(available, free_here))


# the files of one hierarchy: (limit, usage, the page-cache lines of memory.stat). The page cache of
# files (a shard just fetched is all of it, and active) is dropped before the limit's OOM killer acts.
_FILES: Mapping[str, tuple[str, str, tuple[str, ...]]] = {
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "total_active_file")),
    "v2": ("memory.max", "memory.current", ("inactive_file", "active_file")),
}


def cgroup_memory(proc_cgroup: str, root: Path = CGROUP_ROOT) -> CgroupMemory:
    """The memory limit and use of the cgroup ``proc_cgroup`` (a /proc/<pid>/cgroup's text) names,
    under the cgroup mount ``root``: the v1 memory hierarchy's where one is listed, else the v2
    unified one's. A cgroup path that is not under ``root`` (a cgroup namespace) is read at the
    hierarchy's top. No readable limit: ``CgroupMemory()``."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, names, path = parts
        if "memory" in names.split(","):
            v1 = (root / names, path)
        elif names == "" and (root / "cgroup.controllers").is_file():
            v2 = (root, path)
        elif names == "" and (root / "unified" / "cgroup.controllers").is_file():
            v2 = (root / "unified", path)
    if v1 is not None:
        return _read_hierarchy(*v1, _FILES["v1"])
    if v2 is not None:
        return _read_hierarchy(*v2, _FILES["v2"])
    return CgroupMemory()


def _read_hierarchy(top: Path, path: str, files: tuple[str, str, tuple[str, ...]]) -> CgroupMemory:
    limit_file, usage_file, cache_keys = files
    leaf = top / path.strip("/")
    if not leaf.is_dir():
        leaf = top
    limits = []
    here = leaf
    while True:
        limit = _read_int(here / limit_file)
        if limit is not None and limit < NO_LIMIT:
            limits.append(limit)
        if here == top or top not in here.parents:
            break
        here = here.parent
    usage = _read_int(leaf / usage_file)
    if usage is not None:
        usage -= sum(_stat_value(leaf / "memory.stat", key) for key in cache_keys)
    return CgroupMemory(min(limits) if limits else None, None if usage is None else max(usage, 0))


def _read_int(path: Path) -> int | None:
    """An integer file's value; None when it is absent, unreadable or "max" (v2's no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def own_cgroup_memory() -> CgroupMemory:
    """This process's cgroup memory (none where /proc/self/cgroup cannot be read: not Linux)."""
    with logged_suppress(log, "reading this process's cgroup memory limit"):
        if Path("/proc/self/cgroup").is_file():
            return cgroup_memory(Path("/proc/self/cgroup").read_text())
    return CgroupMemory()


def capped_memory(inventory: dict, cgroup: CgroupMemory | None = None) -> dict:
    """``inventory`` with its RAM (``ram_total``, ``ram_available``) capped by the memory limit of
    this process's cgroup (``cgroup``; None: read now)."""
    cgroup = own_cgroup_memory() if cgroup is None else cgroup
    if cgroup.limit_bytes is None or "ram_total" not in inventory:
        return inventory
    total, available = cgroup.cap(int(inventory["ram_total"]), int(inventory.get("ram_available", 0)))
    return {**inventory, "ram_total": total, "ram_available": available}


def battery_on_ac() -> bool | None:
    """True on mains power, False on battery, None for a PC without a battery."""
    with logged_suppress(log, "reading the battery state"):
        battery = psutil.sensors_battery()
        return None if battery is None else bool(battery.power_plugged)
    return None


async def async_collect_inventory(store_root: Path) -> dict:
    """The PC's inventory (``store_root``: where the shards go, for its free disk), collected in a
    subprocess; the CPU alone when that fails (logged)."""
    store_root.mkdir(parents=True, exist_ok=True)
    code = ("import json, sys; from pathlib import Path; from engine.machine.inventory import collect_inventory; "
            "print(json.dumps(collect_inventory(Path(sys.argv[1])).to_dict()))")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, str(store_root),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), INVENTORY_TIMEOUT_S)
    if proc.returncode != 0:
        log.warning("inventory failed (%s); reporting the CPU only", err.decode(errors="replace")[-300:])
        return {"devices": [{"name": "CPU", "kind": "CPU", "full_name": "", "memory_bytes": None}]}
    inventory = capped_memory(json.loads(out))
    if inventory.get("ram_total") is not None:
        log.info("this PC offers %d MiB of memory", int(inventory["ram_total"]) >> 20)
    return inventory
