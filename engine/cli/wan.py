"""``deskfleet wan``: put an emulated WAN link (delay, jitter, bandwidth cap) on one hop.

Example, slowing the hop from stage 0 to stage 1 (stage 1 listens on 7002)::

    deskfleet wan --listen 127.0.0.1:7102 --target 127.0.0.1:7002 --delay-ms 20 --bandwidth-mbit 100
    deskfleet worker --stage 0 --listen 127.0.0.1:7001 --next 127.0.0.1:7102 ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from engine.cli.main import Command
from engine.tools.wan_emulator import WanProxy
from engine.wire.address import Address


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, type=Address.parse,
                   help="HOST:PORT to accept on (port 0: any free port, printed at start)")
    p.add_argument("--target", required=True, type=Address.parse,
                   help="HOST:PORT to forward each connection to (e.g. the next stage's --listen)")
    p.add_argument("--delay-ms", required=True, type=float, help="one-way delay in milliseconds")
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="spread the delay uniformly by ± this much (default 0); data never reorders")
    p.add_argument("--bandwidth-mbit", type=float, default=None,
                   help="cap each direction at this many Mbit/s (default: no cap)")
    p.add_argument("--seed", type=int, default=None, help="seed the jitter, for reproducible runs")


async def async_serve_wan(args: argparse.Namespace) -> int:
    """Run the proxy until SIGTERM/SIGINT, then print what it carried."""
    proxy = WanProxy(args.listen, args.target, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms,
                     bandwidth_mbit=args.bandwidth_mbit, seed=args.seed)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows has no signal handlers
            loop.add_signal_handler(sig, stop.set)
    async with proxy:
        print(f"deskfleet wan: on {proxy.address}, target {args.target}", flush=True)
        await stop.wait()
    s = proxy.stats
    print(f"deskfleet wan: {s.connections} connections, {s.up.bytes} bytes up, {s.down.bytes} bytes down",
          flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(async_serve_wan(args))


COMMAND = Command(name="wan", help="emulate a WAN link (delay, jitter, bandwidth cap) on one hop of the ring",
                  configure=configure, run=run)
