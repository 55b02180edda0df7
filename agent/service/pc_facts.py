"""What the agent reads about its PC: the inventory it advertises, and whether it runs on mains power.

The inventory (devices, memory, disk) is collected once at start in a short-lived subprocess:
OpenVINO costs ~50 MB of RSS that an idle agent should not carry (only the worker needs it).
The facts that change between polls are :mod:`agent.service.machine_load`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import psutil

from engine.suppress import logged_suppress

log = logging.getLogger(__name__)

INVENTORY_TIMEOUT_S = 120.0


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
    return json.loads(out)
