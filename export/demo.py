"""``deskfleet demo``: a local fleet on this machine, from nothing.

Exports the embedded default model once (cached; straight from its GGUF, no torch), starts one
worker process per stage on loopback plus the coordinator, answers the prompt and prints the
answer and tok/s. With
``--serve`` it then keeps the OpenAI-compatible API up until interrupted, and every process
shuts down cleanly on Ctrl-C. The workers are supervised as under ``serve --workers``: one that
dies is replaced by its warm spare when the free memory holds one (``--serve`` only), else
restarted in place (compiling from the cache root's compile cache), and its held requests replayed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from engine.cli.main import Command

DEFAULT_PROMPT = "What is the capital of France?"
SERVE_STEP_TIMEOUT_S = 30.0  # a stuck (alive but silent) worker is failed over after this; a dead one at once


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the question (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--stages", type=int, default=2, help="number of stages (default 2)")
    p.add_argument("--weights", choices=("int4", "int8", "fp16", "fp32"), default="int4")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--slots", type=int, default=16,
                   help="streams the fleet serves at once, batched into one infer per stage per step (default 16)")
    p.add_argument("--serve", action="store_true", help="then keep the OpenAI-compatible API up until Ctrl-C")
    p.add_argument("--port", type=int, default=8000, help="API port with --serve (default 8000; 0 = any free)")


def ensure_default_export(weights: str, stages: int):
    """The embedded model's export under the cache root: verified if present, else made now."""
    # here, not at the top: `deskfleet --help` loads this module (the demo command) without the exporter and OpenVINO
    from engine.errors import ManifestError
    from engine.shards.manifest import load_manifest, verify_stage
    from export.cli import export_progress
    from export.exporter import export_model
    from export.options import ExportOptions
    from export.sources import default_cache_root, resolve_model

    source = resolve_model(None)
    out = default_cache_root() / "exports" / f"{source.name}-{weights}-{stages}"
    try:
        manifest = load_manifest(out)
        for i in range(len(manifest.stages)):
            verify_stage(out, manifest, i)
        return source, out
    except ManifestError:
        pass
    print(f"exporting {source.name} into {stages} {weights} stages (once) ...", file=sys.stderr)
    with export_progress() as progress:
        export_model(source.weights, out, stages=stages, options=ExportOptions(weights=weights, force=True),
                     name=source.name, progress=progress)
    return source, out


async def _async_demo(args: argparse.Namespace, source, out) -> int:
    # here, not at the top: `deskfleet --help` loads this module without the generator and OpenVINO
    from engine.generation.request import GenerationRequest
    from engine.generation.tokenizer import ChatTokenizer
    from engine.tools.local_fleet import paged_local_fleet
    from export.sources import default_cache_root

    tokenizer = ChatTokenizer(out / "tokenizer")
    print(f"starting a {args.stages}-node fleet on loopback ...", file=sys.stderr)
    async with paged_local_fleet(out, slots=args.slots, failover=True, step_timeout_s=SERVE_STEP_TIMEOUT_S,
                                 cache_dir=default_cache_root() / "compiled",
                                 spares=None if args.serve else False) as coordinator:
        ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        request = GenerationRequest(tuple(ids), args.max_new_tokens, stop_token_ids=coordinator.model.eos_token_ids)
        started = time.perf_counter()
        first = None
        tokens: list[int] = []
        async for event in coordinator.stream(request):
            first = first or time.perf_counter()
            tokens.append(event.token_id)
        done = time.perf_counter()
        rate = (len(tokens) - 1) / (done - first) if len(tokens) > 1 and first and done > first else 0.0
        print(f"Q: {args.prompt}")
        print(f"A: {tokenizer.decode(tokens).strip()}")
        print(f"[{rate:.1f} tok/s decode, TTFT {(first - started) * 1000:.0f} ms, {len(tokens)} tokens, "
              f"{args.stages} worker processes on loopback, {source.name} {args.weights}]", flush=True)
        if args.serve:
            # here: the API server (aiohttp) loads only for --serve
            from engine.cli.serve import async_serve_until_interrupted

            await async_serve_until_interrupted(coordinator, tokenizer, host="127.0.0.1", port=args.port)
    return 0


def run(args: argparse.Namespace) -> int:
    source, out = ensure_default_export(args.weights, args.stages)
    return asyncio.run(_async_demo(args, source, out))


COMMAND = Command(name="demo", help="answer a prompt with the embedded default model split into stages",
                  configure=configure, run=run)
