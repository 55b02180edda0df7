"""``deskfleet fleet``: the headless fleet service (no Qt), and its small local tools.

``deskfleet fleet`` (or ``deskfleet fleet run``) runs the service until SIGINT/SIGTERM: the fleet
CA, enrolment, hub, discovery, agent records, the model library, the rings it serves and the
OpenAI API, with its admin API on ``<state_dir>/admin.sock`` and over mutual TLS
(docs/ADMIN_API.md). ``admin-cert NAME --out DIR`` issues an admin certificate from the fleet CA
in the state dir (only whoever can read the state dir can do that) and records it; ``admin-cert
--list`` shows the recorded ones, ``admin-cert --revoke FINGERPRINT|NAME`` cuts one off. ``autostart enable|disable``
registers the service to start at this user's login on Windows (implemented, not run on Windows
here); Linux runs it under systemd (``installer/deskfleet-fleet.service``). ``tokens
list|issue|revoke`` manages the join tokens of the running service (:mod:`console.fleet.tokens_cli`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.cli.main import Command

ADMIN_PORT = 7222
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
RUN_VALUE_NAME = "Deskfleet fleet"


def configure(p: argparse.ArgumentParser) -> None:
    from console.fleet.tag_cli import add_arguments as add_tag_arguments
    from console.fleet.tokens_cli import add_arguments as add_token_arguments
    from console.fleet_api.fleet_settings import add_listen_arguments

    p.add_argument("action", nargs="?", default="run", choices=("run", "admin-cert", "autostart", "tokens", "tag"),
                   help="run (default): serve the fleet; admin-cert NAME --out DIR: issue an admin certificate "
                        "(--list: the recorded ones; --revoke FINGERPRINT|NAME: cut one off); "
                        "autostart enable|disable: start the service at login (Windows); "
                        "tokens list|issue|revoke ID: the running service's join tokens; "
                        "tag [AGENT] --tags T,T | --reset: list or set an agent's tags")
    p.add_argument("name", nargs="?", default=None,
                   help="admin-cert: the admin's name (in the certificate); autostart: enable or disable; "
                        "tokens: list, issue or revoke; tag: the agent's name or node id start")
    p.add_argument("more", nargs="*", default=[], help="tokens revoke: the token's id (from `tokens list`)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="where the fleet CA, approvals, models, exports and the served rings live (default: the "
                        "per-user data directory, the fleet service's)")
    add_listen_arguments(p)
    p.add_argument("--data-port", type=int, default=None,
                   help="port agents' stage workers listen on (default 7211; 0: free ports, agents on this PC only)")
    p.add_argument("--admin-port", type=int, default=ADMIN_PORT,
                   help=f"port of the admin API over mutual TLS, admin certificates only (default {ADMIN_PORT}; "
                        "0: any free; -1: none, the local socket only)")
    p.add_argument("--admin-host", default=None, metavar="ADDR",
                   help="address of the admin API's TLS listener (default: --interface)")
    p.add_argument("--runtime", choices=("paged", "stateful"), default="paged",
                   help="how a ring serves a CPU/GPU export: paged (the default and only choice; an NPU-target "
                        "export serves static). stateful was retired and is refused with the reason")
    p.add_argument("--threads", type=int, default=None, help="inference threads per stage worker (default: the "
                   "worker's own default)")
    p.add_argument("--exact", action="store_true",
                   help="workers use exact (f32, no fast-math) kernels: every ring answers the unsplit model's greedy "
                        "tokens (tests, identity checks; slower)")
    p.add_argument("--no-mdns", dest="mdns", action="store_false",
                   help="neither advertise nor browse over mDNS: PCs join with this service's address given "
                        "(--console HOST:PORT or console= in a join file), and are found as they register")
    p.add_argument("--out", type=Path, default=None, help="admin-cert: the directory to write the certificate to")
    p.add_argument("--days", type=int, default=365,
                   help="admin-cert: days the certificate is valid (default 365, at most 397)")
    p.add_argument("--list", dest="list_certs", action="store_true",
                   help="admin-cert --list: every admin certificate issued or seen (fingerprint, name, expiry, state)")
    p.add_argument("--revoke", default=None, metavar="FINGERPRINT|NAME",
                   help="admin-cert --revoke: refuse that admin certificate from its next connection and request")
    add_token_arguments(p)
    add_tag_arguments(p)


def service_settings(args: argparse.Namespace):
    """The service's settings for the parsed command line."""
    from dataclasses import replace

    from console.fleet.fleet_service import FleetServiceSettings
    from console.fleet_api.fleet_settings import FleetSettings, default_state_dir
    from engine.errors import StatefulRuntimeRetiredError

    if args.runtime == "stateful":
        raise StatefulRuntimeRetiredError()
    from engine.control.messages import WorkerSettings
    from engine.errors import DeskfleetError
    from engine.machine.this_pc import primary_ipv4

    for name in ("api_port", "enrollment_port", "hub_port", "data_port"):
        value = getattr(args, name, None)
        if value is not None and not 0 <= value < 65536:
            raise DeskfleetError(f"--{name.replace('_', '-')} must be a TCP port (0-65535), not {value}")
    if not -1 <= args.admin_port < 65536:
        raise DeskfleetError(f"--admin-port must be a TCP port (0-65535) or -1 for none, not {args.admin_port}")
    interface = args.interface or primary_ipv4()
    fleet = FleetSettings(state_dir=args.state_dir or default_state_dir(), interface=interface,
                          api_port=args.api_port, enrollment_port=args.enrollment_port, hub_port=args.hub_port,
                          runtime=args.runtime)
    if args.data_port is not None:
        fleet = replace(fleet, data_port=args.data_port)
    if args.threads is not None or args.exact:
        fleet = replace(fleet, worker=WorkerSettings(threads=args.threads, exact=args.exact))
    admin_port = None if args.admin_port == -1 else args.admin_port
    mdns = getattr(args, "mdns", True)
    return FleetServiceSettings(fleet=fleet, admin_host=args.admin_host or interface, admin_port=admin_port,
                                browse=mdns, advertise_api=mdns, advertise=mdns)


def run(args: argparse.Namespace) -> int:
    from engine.errors import DeskfleetError

    if args.action == "admin-cert":
        return _admin_cert(args)
    if args.action == "tokens":
        from console.fleet.tokens_cli import run_tokens

        return run_tokens(args, args.name, list(args.more))
    if args.action == "tag":
        from console.fleet.tag_cli import run_tag

        return run_tag(args)
    if args.action == "autostart":
        if args.name not in ("enable", "disable"):
            raise DeskfleetError("say `deskfleet fleet autostart enable` or `deskfleet fleet autostart disable`")
        print(enable_windows_start(_service_command(args)) if args.name == "enable" else
              ("removed" if disable_windows_start() else "was not registered"))
        return 0
    if args.name is not None:
        raise DeskfleetError(f"`deskfleet fleet run` takes no name (got {args.name!r})")
    from console.fleet.fleet_service import run_fleet_service

    return run_fleet_service(service_settings(args))


def _admin_cert(args: argparse.Namespace) -> int:
    from console.fleet.admin_certs import write_admin_certificate
    from console.fleet_api.fleet_settings import default_state_dir
    from engine.errors import DeskfleetError

    state_dir = args.state_dir or default_state_dir()
    if args.list_certs or args.revoke:
        return _admin_cert_book(args, state_dir)
    if not args.name or args.out is None:
        raise DeskfleetError("say who the certificate is for and where to write it: "
                             "deskfleet fleet admin-cert NAME --out DIR")
    written = write_admin_certificate(state_dir, args.name, args.out, days=args.days)
    print(f"admin certificate for {args.name} written to {written}; copy that folder to the admin's PC "
          "(it holds a private key: keep it private)")
    return 0


def _admin_cert_book(args: argparse.Namespace, state_dir: Path) -> int:
    """``admin-cert --list`` / ``--revoke WHICH`` on the state dir's records (as its owner under sudo;
    the running service re-reads them, so a revocation holds from the next handshake)."""
    import json

    from console.fleet.admin_certs import AdminCertBook
    from engine.trust.state_owner import run_as_owner

    if args.revoke:
        revoked = run_as_owner(state_dir, lambda where: AdminCertBook(where).revoke(args.revoke))
        print(json.dumps(revoked, indent=1) if args.json else
              f"admin certificate {revoked['fingerprint'][:16]} ({revoked['name']}) revoked at {revoked['revoked_at']}")
        return 0
    rows = run_as_owner(state_dir, lambda where: AdminCertBook(where).listing())
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = [("FINGERPRINT", "NAME", "ISSUED", "EXPIRES", "STATE")] + [
        (r["fingerprint"][:16], r["name"], r.get("issued_at") or "-", r["not_after"], r["state"]) for r in rows]
    widths = [max(len(str(r[i])) for r in table) for i in range(5)]
    print("\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table)
          if rows else f"no admin certificates recorded in {state_dir}")
    return 0


# ---- Windows: start the service at this user's login (implemented; not run on Windows here) -----------

def _service_command(args: argparse.Namespace) -> list[str]:
    """The command the Run key starts: this Python (pythonw, no console window) running the service."""
    exe = Path(sys.executable)
    pythonw = exe.with_name("pythonw.exe")
    command = [str(pythonw if pythonw.exists() else exe), "-m", "engine.cli.main", "fleet"]
    if args.state_dir is not None:
        command += ["--state-dir", str(args.state_dir)]
    return command


def windows_run_value(command: Sequence[str]) -> str:
    """The Run key's value for ``command``: one command line, quoted as the C runtime splits it."""
    return subprocess.list2cmdline(list(command))


def enable_windows_start(command: Sequence[str], *, platform: str = sys.platform, winreg: Any = None) -> str:
    """Register ``command`` under HKCU's Run key (per user, no administrator rights); returns where."""
    reg = _registry(platform, winreg)
    with reg.CreateKey(reg.HKEY_CURRENT_USER, RUN_KEY) as key:
        reg.SetValueEx(key, RUN_VALUE_NAME, 0, reg.REG_SZ, windows_run_value(command))
    return rf"HKCU\{RUN_KEY}\{RUN_VALUE_NAME}"


def disable_windows_start(*, platform: str = sys.platform, winreg: Any = None) -> bool:
    """Remove the Run value; whether there was one."""
    reg = _registry(platform, winreg)
    try:
        with reg.OpenKey(reg.HKEY_CURRENT_USER, RUN_KEY, 0, reg.KEY_SET_VALUE) as key:
            reg.DeleteValue(key, RUN_VALUE_NAME)
    except FileNotFoundError:
        return False
    return True


def _registry(platform: str, winreg: Any) -> Any:
    from engine.errors import DeskfleetError

    if winreg is not None:
        return winreg
    if not platform.startswith("win32"):
        raise DeskfleetError("`deskfleet fleet autostart` is for Windows; on Linux enable the systemd unit: "
                             "sudo systemctl enable --now deskfleet-fleet")
    import winreg as real  # Windows only

    return real


COMMAND = Command(name="fleet", help="the headless fleet service: serves the fleet's rings and the OpenAI API "
                  "whether or not a console is open; consoles attach to its admin API",
                  configure=configure, run=run)
