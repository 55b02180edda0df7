"""``deskfleet doctor``: check this PC for what would keep the agent from lending it to the fleet."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from engine.cli.main import Command
from engine.doctor.checks import Facts, diagnose, exit_code, report
from engine.machine.this_pc import DEFAULT_CONTROL_PORT, DEFAULT_DATA_PORT, default_agent_dir, primary_ipv4

DEFAULT_MIN_FREE_GB = 4.0  # one shard of a 7-8B INT4 model split in four, its compiled cache, and room


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the agent's state directory (its settings give the defaults below)")
    p.add_argument("--interface", default=None, metavar="ADDR",
                   help="the IPv4 address the agent binds (default: its settings, else the default route's)")
    p.add_argument("--control-port", type=int, default=None, help=f"default: settings, else {DEFAULT_CONTROL_PORT}")
    p.add_argument("--data-port", type=int, default=None, help=f"default: settings, else {DEFAULT_DATA_PORT}")
    p.add_argument("--console", metavar="HOST:PORT", default=None,
                   help="the console's enrollment address, to compare clocks with it")
    p.add_argument("--min-free-gb", type=float, default=DEFAULT_MIN_FREE_GB,
                   help=f"disk space wanted for shards (default {DEFAULT_MIN_FREE_GB:g})")
    p.add_argument("--json", action="store_true", help="print the facts and findings as JSON")


def _saved_settings(state_dir: Path) -> dict:
    """The agent's settings.json as plain JSON (engine does not import the agent package)."""
    try:
        data = json.loads((state_dir / "settings.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


async def async_gather(args: argparse.Namespace) -> Facts:
    # here: `deskfleet --help` does not load the probes (zeroconf, aiohttp, keyring, OpenVINO)
    from engine.doctor import facts as g

    state_dir = args.state_dir or default_agent_dir()
    saved = _saved_settings(state_dir)
    interface = args.interface or saved.get("interface") or primary_ipv4()
    control = args.control_port if args.control_port is not None else saved.get("control_port",
                                                                                 DEFAULT_CONTROL_PORT)
    data = args.data_port if args.data_port is not None else saved.get("data_port", DEFAULT_DATA_PORT)
    multicast = asyncio.create_task(g.async_multicast_selftest(interface))
    clock = asyncio.create_task(g.async_console_clock(args.console))
    devices = await asyncio.to_thread(g.gather_devices)
    return Facts(devices=devices, multicast=await multicast,
                 ports=(g.probe_port("control", interface, int(control)), g.probe_port("data", interface, int(data))),
                 firewall=g.gather_firewall(), keyring=g.probe_keyring(),
                 disk=g.gather_disk(state_dir / "shards", int(args.min_free_gb * 2**30)), clock=await clock)


def run(args: argparse.Namespace) -> int:
    print("deskfleet doctor: checking this PC (a few seconds) ...", file=sys.stderr, flush=True)
    facts = asyncio.run(async_gather(args))
    findings = diagnose(facts)
    if args.json:
        print(json.dumps({"facts": asdict(facts), "findings": [asdict(f) for f in findings],
                          "ok": exit_code(findings) == 0}, indent=2, default=str))
    else:
        print(f"deskfleet doctor on {facts.multicast.interface}:")
        print(report(findings), flush=True)
    return exit_code(findings)


COMMAND = Command(name="doctor", help="check this PC for what would keep the agent from serving, with fixes",
                  configure=configure, run=run)
