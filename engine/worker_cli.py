"""``deskfleet worker``: serve one stage of an export in a ring."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from engine.cli import Command
from engine.errors import DeskfleetError
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
    p.add_argument("--tls-stdin", action="store_true",
                   help="read fleet credentials as JSON {ca_pem, cert_pem, key_pem} from stdin and require "
                        "mutual TLS on both hops (the agent passes them this way so keys never touch disk)")
    p.add_argument("--report-interval", type=float, default=None, metavar="SECONDS",
                   help="print a 'deskfleet-stats {json}' line this often (for the supervising agent)")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="keep compiled shards here so a restarted worker is ready sooner (OpenVINO CACHE_DIR)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="drain and exit when the parent process dies")


def read_tls_credentials(stream) -> tuple:
    """(server_ssl, client_ssl) from the JSON credentials on ``stream``; a clear error otherwise."""
    from engine.trust import Credentials

    try:
        blob = json.loads(stream.read())
        creds = Credentials(blob["ca_pem"].encode(), blob["cert_pem"].encode(), blob["key_pem"].encode())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DeskfleetError(f"--tls-stdin expects JSON with ca_pem, cert_pem and key_pem on stdin ({exc})") from exc
    return creds.server_context(), creds.client_context()


def run(args: argparse.Namespace) -> int:
    server_ssl = client_ssl = None
    if args.tls_stdin:
        server_ssl, client_ssl = read_tls_credentials(sys.stdin)
    return asyncio.run(async_serve_worker(args.shard, args.stage, args.listen, args.next, device=args.device,
                                          exact=args.exact, num_threads=args.threads, server_ssl=server_ssl,
                                          client_ssl=client_ssl, report_interval=args.report_interval,
                                          exit_with_parent=args.exit_with_parent, cache_dir=args.cache_dir))


COMMAND = Command(name="worker", help="serve one stage of an export in a ring of workers",
                  configure=configure, run=run)
