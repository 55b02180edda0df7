"""``deskfleet agent``: the tray agent (Qt), or with ``--headless`` the agent service alone."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import TextIO

from engine.cli.main import Command
from engine.control.tags import tags_from_text
from engine.errors import DeskfleetError
from engine.tasks import start_task

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
    p.add_argument("--kv-pool-mb", type=int, default=None, metavar="MIB",
                   help="memory this PC gives its stage's KV block pool when the ring serves paged (default "
                        "1024; capped at a quarter of the RAM; more lets more people chat at once; saved)")
    p.add_argument("--tags", default=None, metavar="TAG,TAG",
                   help="labels the admin groups PCs by, e.g. floor-2,finance (comma-separated; placement can keep "
                        "to or avoid them; an admin may set others from the console, which win; '' clears; saved)")
    p.add_argument("--seed", action="append", default=None, metavar="HOST:PORT",
                   help="a console to register with by address, for networks that drop multicast (repeatable; saved)")
    join = p.add_mutually_exclusive_group()
    join.add_argument("--join", metavar="-", default=None,
                      help="join a fleet with a one-time token read from standard input ('--join -'); "
                           "never on the command line, where every user of this PC could read it")
    join.add_argument("--join-file", metavar="PATH", type=Path, default=None,
                      help="join a fleet with the token in this file (the silent install's, e.g. "
                           "/etc/deskfleet/join-token); with --headless the file is removed once joined, kept "
                           "and retried when the console is unreachable; default with --headless: join-token in "
                           "the state dir, if there is one")
    p.add_argument("--console", metavar="HOST:PORT", default=None,
                   help="with --join/--join-file: the console's enrollment address (shown next to the token); "
                        "default: found on the network over mDNS")
    p.add_argument("--leave", action="store_true", help="forget the fleet (delete this agent's credentials) and exit")


MAX_TOKEN_CHARS = 4096  # a join token is ~100 characters; more is not a token


def read_join_token(args: argparse.Namespace, stdin: TextIO) -> str | None:
    """The join token ``--join -`` (standard input) or ``--join-file PATH`` names; None without
    either. A token given on the command line itself is refused: any local user can read another
    process's arguments (``/proc/*/cmdline``) for its whole lifetime, and shells keep them."""
    if args.join_file is not None:
        try:
            text = args.join_file.read_text(encoding="utf-8", errors="replace")[:MAX_TOKEN_CHARS]
        except OSError as exc:
            raise DeskfleetError(f"cannot read the join token file {args.join_file} ({exc.strerror or exc})") from exc
        where = str(args.join_file)
    elif args.join == "-":
        text, where = stdin.readline(MAX_TOKEN_CHARS), "standard input"
    elif args.join is not None:
        raise DeskfleetError("--join takes '-' and reads the token from standard input (echo TOKEN | deskfleet "
                             "agent --join -), or use --join-file PATH: a token on the command line is readable "
                             "by every user of this PC")
    else:
        return None
    token = text.strip()
    if not token:
        raise DeskfleetError(f"no join token in {where}; paste the token the console shows")
    return token


def command_line_tags(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``--tags`` as tags (None: not given; '' gives none); TagError for a bad one."""
    return None if getattr(args, "tags", None) is None else tags_from_text(args.tags, "--tags")


async def async_run_headless(args: argparse.Namespace) -> int:
    # here: `deskfleet --help` lists the agent without loading the service (aiohttp, zeroconf, OpenVINO)
    from agent.service.idle import default_idle_source
    from agent.service.service import AgentService
    from agent.service.settings import resolve_settings

    state_dir, settings = resolve_settings(args.state_dir, interface=args.interface, control_port=args.control_port,
                                           data_port=args.data_port, seeds=args.seed, kv_pool_mb=args.kv_pool_mb,
                                           tags=command_line_tags(args))
    service = AgentService(state_dir, settings, idle_source=default_idle_source())
    if args.leave:
        await service.async_leave()
        print("deskfleet agent: left the fleet; credentials deleted", flush=True)
        return 0
    await service.async_start()
    retry: asyncio.Task | None = None
    try:
        retry = await _async_join_from_file(service, args, state_dir)
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
        if retry is not None:
            retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retry
        await service.async_close()
    return 0


async def _async_join_from_file(service, args: argparse.Namespace, state_dir: Path) -> asyncio.Task | None:
    """Join with the token file (``--join-file``, else ``join-token`` in the state dir) when not joined
    yet: one try now, then in the background while the console cannot be reached (the task, or None)."""
    # here: the enrollment client (aiohttp) loads only when the agent runs
    from agent.service.join_file import (
        JoinFileError,
        async_join_from_file,
        async_keep_joining,
        default_path,
        read_join_file,
    )

    path = args.join_file or default_path(state_dir)
    if service.joined or not path.exists():
        if args.join_file is not None and not service.joined:
            print(f"deskfleet agent: there is no join token file {path}; not joined", flush=True)
        return None
    with contextlib.suppress(JoinFileError):  # a bad file is reported by the join below
        content = read_join_file(path)
        if content is not None and not (content.console or args.console):
            print("deskfleet agent: looking for the fleet's console on the network ...", flush=True)
    outcome = await async_join_from_file(service, path, console=args.console)
    if outcome == "joined":
        print(f"deskfleet agent: joined fleet {service.status().fleet_id} with the token in {path} (removed)",
              flush=True)
    elif outcome == "unreachable":
        return start_task(async_keep_joining(service, path, console=args.console), name="deskfleet-join-file",
                          logger=log)
    elif outcome not in ("already_joined", "no_file"):
        print(f"deskfleet agent: could not join with the token in {path} ({outcome}; see the log); the file is kept",
              flush=True)
    return None


def run(args: argparse.Namespace) -> int:
    if not (args.headless and args.join_file is not None):  # headless: the join-file module reads it
        args.join = read_join_token(args, sys.stdin)  # the token itself from here on
    if args.headless or args.leave:
        return asyncio.run(async_run_headless(args))
    # here: Qt (the gui extra) loads only for the tray; --headless runs without it
    from agent.tray.app import run_tray

    return run_tray(args)


COMMAND = Command(name="agent", help="the Deskfleet agent: lend this PC to the fleet (tray icon, or --headless)",
                  configure=configure, run=run)
