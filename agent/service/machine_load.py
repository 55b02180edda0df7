"""How busy this PC is right now, for the agent's status: the facts that change between polls.

`fresh_inventory` refreshes the changing entries of the inventory (free memory, power, disk);
`LoadMeter` measures the whole PC's CPU use between two status reads and its memory in use, so
the fleet service can draw per-agent CPU and memory sparklines (docs/CONTROL_API.md, ``GET /v1/status``).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from agent.service.pc_facts import own_cgroup_memory
from engine.suppress import logged_suppress

MIN_WINDOW_S = 1.0  # reads closer together than this answer the last figure (a busy tray, many polls)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSample:
    """``cpu_percent``: the whole PC's CPU use (0-100, all cores together) since the previous
    window, None before a first window has passed; ``memory_used_bytes``: RAM in use (total
    minus available)."""

    cpu_percent: float | None
    memory_used_bytes: int | None


class LoadMeter:
    """CPU use over windows of at least ``min_window_s`` between calls of `sample` (thread-safe:
    the control API and the tray may both read the status)."""

    def __init__(self, min_window_s: float = MIN_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._min_window_s = min_window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_times: tuple[float, float] | None = self._cpu_times()  # (busy, total) seconds
        self._last_at = clock()
        self._last_percent: float | None = None

    @staticmethod
    def _cpu_times() -> tuple[float, float] | None:
        try:
            t = psutil.cpu_times()
        except Exception as exc:  # psutil unavailable on this platform build
            log.debug("no CPU times from psutil: %s: %s", type(exc).__name__, exc)
            return None
        total = sum(t)
        idle = t.idle + getattr(t, "iowait", 0.0)
        return total - idle, total

    def cpu_percent(self) -> float | None:
        with self._lock:
            now = self._clock()
            if now - self._last_at < self._min_window_s:
                return self._last_percent
            times = self._cpu_times()
            if times is not None and self._last_times is not None:
                busy, total = times[0] - self._last_times[0], times[1] - self._last_times[1]
                if total > 0:
                    self._last_percent = round(max(0.0, min(100.0, 100.0 * busy / total)), 1)
            self._last_times, self._last_at = times, now
            return self._last_percent

    def sample(self) -> LoadSample:
        used = None
        with logged_suppress(log, "reading the memory in use"):
            memory = psutil.virtual_memory()
            used = int(memory.total - memory.available)
        return LoadSample(self.cpu_percent(), used)


def fresh_inventory(inventory: dict, store_root: Path) -> dict:
    """``inventory`` with the facts that change (free memory, power, disk) read now; memory within
    this process's cgroup limit (`agent.service.pc_facts.cgroup_memory`)."""
    inventory = dict(inventory)
    with logged_suppress(log, "reading free memory, power and disk for the inventory"):
        memory = psutil.virtual_memory()
        inventory["ram_total"], inventory["ram_available"] = own_cgroup_memory().cap(
            int(inventory.get("ram_total") or memory.total), int(memory.available))
        battery = psutil.sensors_battery()
        inventory["battery_percent"] = None if battery is None else battery.percent
        inventory["on_ac"] = None if battery is None else bool(battery.power_plugged)
        if store_root.is_dir():
            inventory["disk_free"] = shutil.disk_usage(store_root).free
    return inventory
