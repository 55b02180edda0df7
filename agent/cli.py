"""``deskfleet agent``: the tray agent (Qt), or with ``--headless`` the agent service alone."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from dataclasses import replace
from pathlib import Path

from engine.cli import Command

log = logging.getLogger("deskfleet.agent")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--headless", action="store_true",
                   help="run the agent service without the tray icon (servers, tests)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="where settings, state and shards live (default: the per-user data directory; "
                        "several agents on one machine need one each)")
    p.add_argument("--interface", default=None, metavar="ADDR",
                   help="IP address to bind the control and data ports and mDNS to (default: all interfaces)")
    p.add_argument("--control-port", type=int, default=None, help="control API port (default 7210; 0: any free)")
    p.add_argument("--data-port", type=int, default=None, help="stage worker port (default 7211; 0: any free)")
    p.add_argument("--seed", action="append", default=None, metavar="HOST:PORT",
                   help="a console to register with by address, for networks that drop multicast (repeatable; saved)")
    p.add_argument("--join", metavar="TOKEN", default=None, help="join a fleet with this one-time token")
    p.add_argument("--console", metavar="HOST:PORT", default=None,
                   help="with --join: the console's enrollment address (shown next to the token); "
                        "default: found on the network over mDNS")
    p.add_argument("--leave", action="store_true", help="forget the fleet (delete this agent's credentials) and exit")


def _settings(args: argparse.Namespace):
    from agent.service.settings import default_state_dir, load_settings, save_settings

    state_dir = args.state_dir or default_state_dir()
    settings = load_settings(state_dir)
    overrides = {k: v for k, v in (("interface", args.interface), ("control_port", args.control_port),
                                   ("data_port", args.data_port)) if v is not None}
    if args.seed:
        from engine.control import parse_hostport

        for seed in args.seed:
            parse_hostport(seed, "--seed")
        overrides["seeds"] = tuple(args.seed)
    if overrides:
        settings = replace(settings, **overrides)
        save_settings(state_dir, settings)
    return state_dir, settings


async def async_run_headless(args: argparse.Namespace) -> int:
    from agent.service.idle import default_idle_source
    from agent.service.service import AgentService

    state_dir, settings = _settings(args)
    service = AgentService(state_dir, settings, idle_source=default_idle_source())
    if args.leave:
        await service.async_leave()
        print("deskfleet agent: left the fleet; credentials deleted", flush=True)
        return 0
    await service.async_start()
    try:
        if args.join and not service.joined:
            if not args.console:
                print("deskfleet agent: looking for the fleet's console on the network ...", flush=True)
            creds = await service.async_join(args.console, args.join)
            print(f"deskfleet agent: joined fleet {creds.fleet_id} as node {creds.node_id[:16]}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # before the status line: whoever reads it may stop us
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        status = service.status()
        print(f"deskfleet agent: {status.state}; control port {service.control_port}; state dir {state_dir}",
              flush=True)
        await stop.wait()
    finally:
        await service.async_close()
    return 0


def run(args: argparse.Namespace) -> int:
    if args.headless or args.leave:
        return asyncio.run(async_run_headless(args))
    from agent.tray.app import run_tray

    return run_tray(args)


COMMAND = Command(name="agent", help="the Deskfleet agent: lend this PC to the fleet (tray icon, or --headless)",
                  configure=configure, run=run)
