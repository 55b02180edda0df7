"""``deskfleet worker``: serve one stage of an export in a ring."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from engine.cli import Command
from engine.worker import Address, async_serve_worker


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shard", required=True, type=Path,
                   help="export directory holding manifest.json and this stage's files")
    p.add_argument("--stage", type=int, default=0, help="stage index to serve (default 0)")
    p.add_argument("--listen", required=True, type=Address.parse, help="HOST:PORT to accept the upstream hop on")
    p.add_argument("--next", required=True, type=Address.parse,
                   help="HOST:PORT of the next stage, or of the coordinator's return port for the last stage")
    p.add_argument("--device", default="CPU", help="OpenVINO device (default CPU)")
    p.add_argument("--threads", type=int, default=None, help="inference threads (default: all cores)")
    p.add_argument("--exact", action="store_true", help="f32 compute and KV cache (bit-exact settings)")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(async_serve_worker(args.shard, args.stage, args.listen, args.next, device=args.device,
                                          exact=args.exact, num_threads=args.threads))


COMMAND = Command(name="worker", help="serve one stage of an export in a ring of workers",
                  configure=configure, run=run)
