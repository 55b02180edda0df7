"""``python -m tests.support.sim_fleet``: a simulated fleet against a running ``deskfleet fleet``
until Ctrl-C (or ``--duration``), with a progress line every few seconds."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

from tests.support.sim_fleet.fleet import REGISTER_INTERVAL_S, SimFleet, SimFleetError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.support.sim_fleet", description=__doc__)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--state-dir", type=Path, help="the service's state dir (its admin socket is admin.sock there)")
    where.add_argument("--admin-socket", type=Path, help="the service's admin socket")
    p.add_argument("--agents", type=int, default=100, help="how many fake agents (default 100)")
    p.add_argument("--processes", type=int, default=None, help="worker processes (default one per 250 agents)")
    p.add_argument("--flap-per-s", type=float, default=1.0,
                   help="pauses + resumes per second across the whole fleet (default 1)")
    p.add_argument("--register-s", type=float, default=REGISTER_INTERVAL_S,
                   help=f"seconds between an agent's registrations (default {REGISTER_INTERVAL_S:g}, the real agent's)")
    p.add_argument("--tokens", choices=("single", "reusable"), default="single",
                   help="one single-use join token per agent (default) or one reusable token for all")
    p.add_argument("--no-approve", action="store_true", help="leave the agents unapproved")
    p.add_argument("--prefix", default=f"sim{int(time.time()) % 100000}", help="agent name prefix (default unique)")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: Ctrl-C)")
    return p


async def _async_main(args: argparse.Namespace) -> int:
    sim = SimFleet(args.state_dir or args.admin_socket, agents=args.agents, flap_per_s=args.flap_per_s,
                   processes=args.processes, register_s=args.register_s, approve=not args.no_approve,
                   tokens=args.tokens, prefix=args.prefix, on_progress=lambda line: print(line, flush=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await sim.async_start()
    except SimFleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    started = time.monotonic()
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 5.0)
            s = sim.stats
            print(f"{time.monotonic() - started:6.0f} s: {len(s.joined)} agents, {len(s.registered)} registrations, "
                  f"{s.total_polls} polls answered, {s.total_flaps} pauses/resumes, {s.total_paused} paused now, "
                  f"{len(s.errors)} errors", flush=True)
            if args.duration is not None and time.monotonic() - started >= args.duration:
                break
    finally:
        await sim.async_stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.agents < 1:
        build_parser().error("--agents must be at least 1")
    return asyncio.run(_async_main(args))


if __name__ == "__main__":
    sys.exit(main())
