"""``deskfleet console``: the admin console (Qt). Qt is imported only when the command runs, so
``deskfleet --help`` works on a machine without the gui extra."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.cli.main import Command


def configure(p: argparse.ArgumentParser) -> None:
    from console.fleet_api.fleet_settings import add_listen_arguments

    p.add_argument("--state-dir", type=Path, default=None,
                   help="where the fleet CA, approvals, models and exports live (default: the per-user data "
                        "directory); the CA is created there on the first run")
    add_listen_arguments(p)
    p.add_argument("--service", default=None, metavar="https://HOST:PORT",
                   help="the admin API of a fleet service on another PC (with --admin-cert); default: the local "
                        "service over --state-dir, started in the background when none runs (it keeps serving after "
                        "the console closes)")
    p.add_argument("--admin-cert", type=Path, default=None, metavar="DIR",
                   help="the admin credentials folder `deskfleet fleet admin-cert NAME --out DIR` wrote")
    p.add_argument("--service-node-id", default=None, metavar="HEX",
                   help="pin the service's certificate (its node id) on top of the fleet CA and its role")
    p.add_argument("--admin-port", type=int, default=7222,
                   help="a local service this console starts: its admin API's mutual-TLS port, for admins on other "
                        "PCs (default 7222; 0: any free; -1: none, the local socket only)")
    p.add_argument("--data-port", type=int, default=None,
                   help="port agents' stage workers listen on (default 7211; 0: free ports, agents on this PC only)")
    p.add_argument("--runtime", choices=("paged", "stateful"), default="paged",
                   help="how the ring serves a CPU/GPU export: paged (the default and only choice; every user's "
                        "tokens batched into one step per PC, each PC's KV pool its agent's kv_pool_mb; an NPU-target "
                        "export serves static). stateful was retired and is refused with the reason")


def run(args: argparse.Namespace) -> int:
    from console.qt.app import run_console
    from engine.errors import StatefulRuntimeRetiredError

    if args.runtime == "stateful":
        raise StatefulRuntimeRetiredError()

    return run_console(args)


COMMAND = Command(name="console", help="the Deskfleet admin console: fleet, models, placement, distribution, "
                  "chat and metrics", configure=configure, run=run)
