"""``deskfleet serve``: the OpenAI-compatible API over a coordinator, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from engine.api.server import ApiSettings, async_run_api
from engine.cli.main import Command
from engine.errors import DeskfleetError, StatefulRuntimeRetiredError, TokenizerError
from engine.generation.tokenizer import ChatTokenizer
from engine.paged.constraints import GrammarVocabulary
from engine.paged.kv_pool import DEFAULT_KV_POOL_BYTES
from engine.shards.manifest import load_manifest, serving_runtime
from engine.trust.peer_policy import PeerPolicy, PeerPolicyError
from engine.wire.address import Address

log = logging.getLogger("deskfleet.serve")

_DEFAULTS = ApiSettings()


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", required=True, type=Path, help="export directory (from `deskfleet export`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key-env", metavar="VAR", default=None,
                   help="name of the environment variable holding the API key clients must send as a bearer "
                        "token (the key itself never goes on the command line); without it, no auth, and "
                        "only a loopback --host is accepted")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a host name clients may address the server by, besides its --host address and "
                        "localhost (repeatable); requests naming any other host are refused (DNS rebinding)")
    p.add_argument("--max-concurrent", type=int, default=_DEFAULTS.max_concurrent,
                   help=f"requests in flight before answering 429 (default {_DEFAULTS.max_concurrent})")
    p.add_argument("--key-streams", type=int, default=None, metavar="N",
                   help="answers (an n-choice request counts n) one API key may have in progress at once; past it "
                        "429 (default: half of --max-concurrent; applies where keys are required)")
    p.add_argument("--slots", type=int, default=None,
                   help="streams generated at once (default 16; a static NPU-target export has its own, from export)")
    p.add_argument("--runtime", choices=("paged", "stateful"), default="paged",
                   help="paged (the default and only choice for a CPU/GPU export; an NPU-target export serves "
                        "static): continuous batching on PagedAttention, every stream's tokens in one infer per "
                        "stage per step. stateful was retired and is refused with the reason")
    p.add_argument("--kv-pool-mb", type=float, default=None, metavar="MIB",
                   help="paged: KV block pool per stage (default 1024 MiB; the only memory that grows with users)")
    p.add_argument("--token-budget", type=int, default=256, metavar="N",
                   help="paged: new tokens per step over all streams, so a long prompt is prefilled in chunks "
                        "beside the others' decoding (default 256)")
    p.add_argument("--max-prompt-tokens", type=int, default=_DEFAULTS.max_prompt_tokens,
                   help=f"longest prompt accepted (default {_DEFAULTS.max_prompt_tokens})")
    p.add_argument("--model-name", default=None, help="model id the API serves (default: the export's name)")
    p.add_argument("--device", default="CPU", help="OpenVINO device for every stage (default CPU)")
    p.add_argument("--exact", action="store_true", help="f32 compute and KV cache (bit-exact settings; slower)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", action="store_true",
                       help="run every stage in its own worker process on loopback (a local fleet), supervised: a "
                            "worker that dies is restarted in place and its held requests replayed")
    where.add_argument("--first-stage", type=Address.parse, default=None, metavar="HOST:PORT",
                       help="serve through a ring of `deskfleet worker`s whose first stage listens here")
    p.add_argument("--hold-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="with --workers: how long requests are held while a lost worker is brought back before "
                        "they fail with 503 naming the stage (default 60)")
    p.add_argument("--step-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a step unanswered this long means a stage stopped answering: with --workers it is "
                        "failed over like a dead worker (which is noticed at once); with --first-stage (nothing "
                        "to restart) the requests fail with 503 naming the wait instead of hanging (default 30)")
    p.add_argument("--spares", choices=("auto", "on", "off"), default="auto",
                   help="with --workers: keep a warm spare per stage (its shard compiled, not listening) that takes "
                        "a dead worker's place without a restart; it holds another copy of the weights. auto "
                        "(default): when the free memory holds the weights twice over with the KV pools")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="with --workers: the workers' OpenVINO compile cache, so that a restart (and the next "
                        "start) compiles from cache (default: a temporary directory for this run)")
    p.add_argument("--rings", type=int, default=1, metavar="N",
                   help="with --workers (paged): N local fleets of the export behind one router, each request to "
                        "the least loaded (a conversation to the ring holding its prefix); they share this PC's cores")
    p.add_argument("--return-listen", type=Address.parse, default=Address("127.0.0.1", 7100), metavar="HOST:PORT",
                   help="with --first-stage: where the last stage sends replies (default 127.0.0.1:7100; a "
                        "non-loopback address needs TLS)")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--tls-credentials", type=Path, default=None, metavar="FILE",
                     help="with --first-stage: mutual TLS on the ring, credentials from this JSON file (the "
                          "worker's --tls-stdin format: ca_pem, cert_pem, key_pem[, expect_upstream, expect_next])")
    tls.add_argument("--tls-stdin", action="store_true",
                     help="with --first-stage: the same credentials JSON, read from stdin")
    p.add_argument("--expect-first", default=None, metavar="NODE_ID",
                   help="with TLS: the node id the ring's first remote stage must present")
    p.add_argument("--expect-last", action="append", default=[], metavar="NODE_ID",
                   help="with TLS: the node id of the ring's last stage, the only member whose replies the "
                        "return port takes (repeatable)")
    p.add_argument("--speculation", choices=("off", "lookup", "draft"), default="off",
                   help="speculative decoding: prompt lookup (no model) or a draft model (default off)")
    p.add_argument("--draft", type=Path, default=None, metavar="DIR",
                   help="with --speculation draft: a 1-stage export of a small model with the same tokenizer")
    p.add_argument("--spec-k", type=int, default=None, metavar="K",
                   help="drafts per step (default: chosen per stream from measured acceptance and latency)")
    p.add_argument("--host-stage0", action="store_true",
                   help="with --first-stage: run stage 0 in this process (the ring starts at stage 1)")


def api_key_from_env(var: str | None, environ: Mapping[str, str]) -> str | None:
    """The API key held by environment variable ``var`` (None: no auth); refuse an unset or empty one."""
    if var is None:
        return None
    key = environ.get(var, "").strip()
    if not key:
        raise DeskfleetError(f"--api-key-env names {var}, but that environment variable is unset or empty; "
                             f"export {var}=<key> before starting the server, or drop --api-key-env")
    return key


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ApiSettings:
    """The API settings for the parsed command line."""
    try:
        return ApiSettings(model_name=args.model_name, api_key=api_key_from_env(args.api_key_env, environ),
                           max_concurrent=args.max_concurrent, max_prompt_tokens=args.max_prompt_tokens,
                           allowed_hosts=tuple(args.allow_host), key_streams=args.key_streams)
    except ValueError as exc:
        raise DeskfleetError(f"invalid server limits: {exc}") from exc


def _is_loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


def ring_options(args: argparse.Namespace, stdin=None) -> dict:
    """RingPath's TLS options (server_ssl, client_ssl, peers) for ``--first-stage``; empty without
    TLS, which only a loopback ring may do. Raises DeskfleetError naming the flag to add."""
    from engine.cli.worker import read_tls_credentials, refuse_plaintext_exposure  # loads OpenVINO: TLS rings only

    tls = args.tls_stdin or args.tls_credentials is not None
    if args.first_stage is None:
        if tls or args.expect_first or args.expect_last:
            raise DeskfleetError("--tls-credentials, --tls-stdin and --expect-* are for a remote ring: add "
                                 "--first-stage HOST:PORT (in-process stages and --workers stay on loopback)")
        return {}
    if not tls:
        if args.expect_first or args.expect_last:
            raise DeskfleetError("--expect-first/--expect-last need TLS (--tls-credentials FILE or --tls-stdin)")
        for flag, address in (("--return-listen", args.return_listen), ("--first-stage", args.first_stage)):
            refuse_plaintext_exposure(address, tls=False, flag=flag, tls_flag="--tls-credentials FILE")
        return {}
    if args.tls_stdin:
        server_ssl, client_ssl, peers = read_tls_credentials(stdin or sys.stdin)
    else:
        try:
            with args.tls_credentials.open(encoding="utf-8") as f:
                server_ssl, client_ssl, peers = read_tls_credentials(f)
        except OSError as exc:
            raise DeskfleetError(f"cannot read --tls-credentials {args.tls_credentials}: {exc}") from exc
    if peers is None:
        try:
            peers = PeerPolicy.of(args.expect_last, args.expect_first)
        except PeerPolicyError as exc:
            raise DeskfleetError(f"--expect-first/--expect-last: {exc}") from exc
    if not peers.upstream or peers.next is None:
        raise DeskfleetError("a TLS ring needs the node ids of its ends: pass --expect-first NODE_ID (the first "
                             "remote stage) and --expect-last NODE_ID (the last stage), as the console lists them")
    return {"server_ssl": server_ssl, "client_ssl": client_ssl, "peers": peers}


def supervision(args: argparse.Namespace) -> dict:
    """The local fleet's supervision options for ``--workers``: restart in place (or a warm spare),
    hold and step timeouts, the compile cache."""
    for flag, value in (("--hold-timeout", args.hold_timeout), ("--step-timeout", args.step_timeout)):
        if value <= 0:
            raise DeskfleetError(f"{flag} must be positive, got {value}")
    spares = {"auto": None, "on": True, "off": False}[getattr(args, "spares", "auto")]
    return {"failover": True, "hold_timeout_s": args.hold_timeout, "step_timeout_s": args.step_timeout,
            "cache_dir": args.cache_dir, "spares": spares}


@contextlib.contextmanager
def _stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {}
    try:
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
    except NotImplementedError:  # Windows: no loop signal handlers
        previous = {sig: signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set)) for sig in signals}
    try:
        yield
    finally:
        for sig in signals:
            if previous:
                signal.signal(sig, previous[sig])
            else:
                loop.remove_signal_handler(sig)


async def async_serve_until_interrupted(generator, tokenizer: ChatTokenizer, settings: ApiSettings | None = None,
                                        host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve the API over a running generator, print the URL, return on SIGINT or SIGTERM."""
    settings = settings or ApiSettings()
    stop = asyncio.Event()
    with _stop_on_signals(stop):
        api = await async_run_api(generator, tokenizer, settings, host, port)
        try:
            card = generator.model
            print(f"deskfleet: serving {settings.model_name or card.name} ({card.stages} "
                  f"stage{'s' if card.stages != 1 else ''}) at {api.url}  (Ctrl-C to stop)", flush=True)
            await stop.wait()
            log.info("stopping: finishing in-flight requests")
        finally:
            await api.async_stop()


@contextlib.asynccontextmanager
async def _open_generator(args: argparse.Namespace):
    """The generator the command line asks for: a remote ring (:func:`open_ring`, whichever runtime
    the export calls for), local workers, or every stage in this process."""
    # Imported here, so `--help` (and every other command) does not load OpenVINO.
    from engine.coordinator.ring_factory import RingOptions, open_ring, refuse_static_options
    from engine.paged.speculation import SpeculationConfig, Speculator

    manifest = load_manifest(args.shards)
    static = serving_runtime(manifest) == "static"  # an NPU-target export: packed greedy serving over its slots
    if args.host_stage0:
        raise DeskfleetError("--host-stage0 was the retired stateful runtime's: a ring served by `deskfleet serve` "
                             "runs every stage as a worker (drop --host-stage0)")
    if static:
        refuse_static_options(speculation=args.speculation != "off", host_stage0=False)
    speculation = None
    if args.speculation != "off":
        config = SpeculationConfig(args.speculation, k=args.spec_k, draft_export=args.draft)
        speculation = Speculator(config, device=args.device, exact=args.exact)
    pool_bytes = int(args.kv_pool_mb * 2**20) if args.kv_pool_mb is not None else DEFAULT_KV_POOL_BYTES
    settings = {"slots": args.slots or 16, "token_budget": args.token_budget, "prefill_chunk": args.token_budget}
    grammar = GrammarVocabulary.of_export(args.shards, manifest)  # constrained output: the export's tokenizer
    if args.first_stage is not None:
        options = RingOptions(device=args.device, exact=args.exact, kv_pool_bytes=pool_bytes,
                              step_timeout_s=args.step_timeout, **settings)
        ring = open_ring(manifest, args.first_stage, args.return_listen, options=options, grammar=grammar,
                         speculation=speculation, **args.ring)
        async with ring as generator:
            yield generator
    elif static:
        from engine.tools.packed_fleet import local_static_fleet, static_generator  # OpenVINO: serving only

        opened = (local_static_fleet(args.shards, exact=args.exact) if args.workers
                  else static_generator(args.shards, device=args.device, exact=args.exact))
        async with opened as generator:
            yield generator
    else:
        async with _open_paged(args, pool_bytes, settings, speculation) as coordinator:
            yield coordinator


@contextlib.asynccontextmanager
async def _open_paged(args: argparse.Namespace, pool_bytes: int, settings: dict, speculation):
    """The paged coordinator over this PC: paged local workers (one ring or several), or every stage
    in this process."""
    from engine.paged.coordinator import BatchCoordinator  # OpenVINO: serving only

    if getattr(args, "rings", 1) > 1:  # several local fleets behind one router
        from engine.tools.local_rings import local_rings  # OpenVINO and worker processes: --rings only

        if not args.workers or speculation is not None:
            raise DeskfleetError("--rings N serves N local fleets: add --workers (and drop --speculation)")
        async with local_rings(args.shards, args.rings, model_name=args.model_name, exact=args.exact,
                               kv_pool_bytes=pool_bytes, **supervision(args), **settings) as router:
            yield router  # every ring's coordinator has the export's grammar vocabulary (paged_local_fleet)
    elif args.workers:
        from engine.tools.local_fleet import paged_local_fleet  # OpenVINO and worker processes: --workers only

        async with paged_local_fleet(args.shards, exact=args.exact, kv_pool_bytes=pool_bytes,
                                     speculation=speculation, **supervision(args), **settings) as coordinator:
            yield coordinator
    else:
        async with BatchCoordinator.local(args.shards, exact=args.exact, device=args.device, kv_pool_bytes=pool_bytes,
                                          speculation=speculation, **settings) as coordinator:
            yield coordinator


async def async_serve(args: argparse.Namespace, settings: ApiSettings, tokenizer: ChatTokenizer) -> int:
    """Start the coordinator and the API, print the URL, and serve until SIGINT or SIGTERM."""
    async with _open_generator(args) as coordinator:
        await async_serve_until_interrupted(coordinator, tokenizer, settings, args.host, args.port)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.runtime == "stateful":
        raise StatefulRuntimeRetiredError()
    settings = settings_from_args(args, os.environ)
    tok_dir = args.shards / "tokenizer"
    if not tok_dir.is_dir():
        raise TokenizerError(f"{args.shards} has no tokenizer/ directory; re-export the model with its tokenizer")
    tokenizer = ChatTokenizer(tok_dir)
    # Checked (and the credentials read) before any model is loaded: a refusal costs nothing.
    args.ring = ring_options(args)
    supervision(args)
    if settings.api_key is None and not _is_loopback(args.host):  # loopback: key-less, Host-checked
        raise DeskfleetError(f"refusing to serve on {args.host} without an API key: anyone on the network "
                             "could use it. Pass --api-key-env VAR (export VAR=<key> first), or serve on "
                             "127.0.0.1")
    return asyncio.run(async_serve(args, settings, tokenizer))


COMMAND = Command(name="serve", help="serve an export over the OpenAI-compatible HTTP API",
                  configure=configure, run=run)
