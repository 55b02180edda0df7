"""``deskfleet worker``: serve one stage of an export in a ring.

With ``--tls-stdin`` the first stdin line is the credentials JSON (plus, optionally, the peer
policy: docs/PROTOCOL.md "Peer identity"); stdin then stays open and every further line is a
policy update applied without a restart. Without TLS the worker serves loopback only. A
``--spare`` worker compiles its shard and waits for an activation line on stdin before it
listens (engine.worker.spare).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import sys
from pathlib import Path
from typing import TextIO

from engine.cli.main import Command
from engine.errors import DeskfleetError, StatefulRuntimeRetiredError
from engine.paged.kv_pool import DEFAULT_KV_POOL_BYTES
from engine.shards.manifest import load_manifest
from engine.trust.fleet_ca import Credentials
from engine.trust.peer_policy import PeerPolicy, PeerPolicyError, parse_policy_update
from engine.wire.address import Address
from engine.worker.serve_worker import async_serve_worker

RUNTIME_CHOICES = ("paged", "static", "stateful")  # stateful only to refuse it with the reason


def check_runtime(runtime: str | None, shard: Path) -> None:
    """Refuse ``--runtime`` when it is not what the export at ``shard`` is served by."""
    if runtime is None:
        return
    if runtime == "stateful":
        raise StatefulRuntimeRetiredError()
    wanted = "static" if load_manifest(shard).target == "npu" else "paged"
    if runtime != wanted:
        raise DeskfleetError(f"--runtime {runtime}: {shard} is served by the {wanted} runtime (paged serves "
                             f"CPU/GPU exports, static NPU-target ones); drop --runtime or pass --runtime {wanted}")


class PlaintextExposureError(DeskfleetError):
    """A data-plane port would be reachable from the network without TLS (a non-loopback
    listen or dial address and no credentials)."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"; False for anything reachable from the network."""
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


def refuse_plaintext_exposure(address: Address, *, tls: bool, flag: str, tls_flag: str) -> None:
    """Raise PlaintextExposureError if ``address`` (given with ``flag``) leaves loopback without TLS."""
    if not tls and not is_loopback(address.host):
        raise PlaintextExposureError(
            f"{flag} {address} would carry the data plane across the network without TLS, where any host "
            f"could inject or read steps; add {tls_flag} with the fleet credentials, or use 127.0.0.1")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shard", required=True, type=Path,
                   help="export directory holding manifest.json and this stage's files")
    p.add_argument("--stage", type=int, default=0, help="stage index to serve (default 0)")
    p.add_argument("--listen", type=Address.parse, default=Address("127.0.0.1", 7101),
                   help="HOST:PORT to accept the upstream hop on (default 127.0.0.1:7101; a non-loopback "
                        "address needs --tls-stdin)")
    p.add_argument("--next", required=True, type=Address.parse,
                   help="HOST:PORT of the next stage, or of the coordinator's return port for the last stage")
    p.add_argument("--device", default="CPU", help="OpenVINO device (default CPU)")
    p.add_argument("--threads", type=int, default=None, help="inference threads (default: all cores)")
    p.add_argument("--exact", action="store_true", help="f32 compute and KV cache (bit-exact settings)")
    p.add_argument("--tls-stdin", action="store_true",
                   help="read fleet credentials as one JSON line {ca_pem, cert_pem, key_pem[, expect_upstream, "
                        "expect_next, deny]} from stdin and require mutual TLS on both hops (the agent passes "
                        "them this way so keys never touch disk); later lines replace the peer policy")
    p.add_argument("--expect-upstream", action="append", default=[], metavar="NODE_ID",
                   help="with TLS: a node id allowed to dial this stage (repeatable; stage 0: the coordinator's)")
    p.add_argument("--expect-next", default=None, metavar="NODE_ID",
                   help="with TLS: the node id the next hop must present (the last stage: the coordinator's)")
    p.add_argument("--report-interval", type=float, default=None, metavar="SECONDS",
                   help="print a 'deskfleet-stats {json}' line this often (for the supervising agent)")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="keep compiled shards here so a restarted worker is ready sooner (OpenVINO CACHE_DIR)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="drain and exit when the parent process dies")
    p.add_argument("--paged", action="store_true",
                   help="accepted for old command lines: a CPU/GPU export is always served paged (continuous "
                        "batching on PagedAttention), an NPU-target export static")
    p.add_argument("--runtime", choices=RUNTIME_CHOICES, default=None,
                   help="paged (CPU/GPU exports) or static (NPU-target exports); default and only choice: the one "
                        "the export's target calls for (stateful was retired)")
    p.add_argument("--kv-pool-mb", type=float, default=None, metavar="MIB",
                   help="paged: the most memory this stage's KV block pool may take (default 1024 MiB); "
                        "it is allocated once, when the ring's first step says the pool size")
    p.add_argument("--spare", action="store_true",
                   help="a warm spare: open and compile the shard, print 'deskfleet-spare', then wait for an "
                        'activation line on stdin ({"activate": {"listen": ..., "next": ...}, ...peer policy}) '
                        "before listening (the agent keeps one beside its worker: engine.worker.spare)")


def read_tls_credentials(stream: TextIO) -> tuple:
    """(server_ssl, client_ssl, peer policy or None) from the credentials JSON on ``stream``.

    The JSON is one line (so that the stream can carry policy updates after it); a writer that
    sends several lines and closes the stream is read to its end. Raises DeskfleetError saying
    what is wrong.
    """
    first = stream.readline()
    try:
        try:
            blob = json.loads(first)
        except ValueError:
            blob = json.loads(first + stream.read())
        creds = Credentials(blob["ca_pem"].encode(), blob["cert_pem"].encode(), blob["key_pem"].encode())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DeskfleetError(f"--tls-stdin expects JSON with ca_pem, cert_pem and key_pem on stdin ({exc})") from exc
    peers = None
    if any(key in blob for key in ("expect_upstream", "expect_next", "deny")):
        peers = parse_policy_update(blob, allow_credentials=True)
    return creds.server_context(), creds.client_context(), peers


def policy_from_args(args: argparse.Namespace, from_stdin: PeerPolicy | None) -> PeerPolicy | None:
    """The starting peer policy: the credentials JSON's if it carries one, else the flags'."""
    if from_stdin is not None:
        return from_stdin
    if args.expect_upstream or args.expect_next:
        try:
            return PeerPolicy.of(args.expect_upstream, args.expect_next)
        except PeerPolicyError as exc:
            raise DeskfleetError(f"--expect-upstream/--expect-next: {exc}") from exc
    return None


def run(args: argparse.Namespace) -> int:
    server_ssl = client_ssl = stdin_peers = None
    tls = bool(args.tls_stdin)
    check_runtime(args.runtime, args.shard)
    if args.kv_pool_mb is not None and args.kv_pool_mb <= 0:
        raise DeskfleetError(f"--kv-pool-mb must be positive, got {args.kv_pool_mb}")
    if not tls and (args.expect_upstream or args.expect_next):
        raise DeskfleetError("--expect-upstream/--expect-next need --tls-stdin: without certificates there is "
                             "no node id to check")
    refuse_plaintext_exposure(args.listen, tls=tls, flag="--listen", tls_flag="--tls-stdin")
    refuse_plaintext_exposure(args.next, tls=tls, flag="--next", tls_flag="--tls-stdin")
    if tls:
        server_ssl, client_ssl, stdin_peers = read_tls_credentials(sys.stdin)
    pool_bytes = int(args.kv_pool_mb * 2**20) if args.kv_pool_mb is not None else DEFAULT_KV_POOL_BYTES
    return asyncio.run(async_serve_worker(args.shard, args.stage, args.listen, args.next, device=args.device,
                                          exact=args.exact, num_threads=args.threads, server_ssl=server_ssl,
                                          client_ssl=client_ssl, report_interval=args.report_interval,
                                          exit_with_parent=args.exit_with_parent, cache_dir=args.cache_dir,
                                          peers=policy_from_args(args, stdin_peers),
                                          policy_updates=sys.stdin if tls or args.spare else None,
                                          kv_pool_bytes=pool_bytes, spare=args.spare))


COMMAND = Command(name="worker", help="serve one stage of an export in a ring of workers",
                  configure=configure, run=run)
