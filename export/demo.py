"""``deskfleet demo``: export the embedded default model (once) and answer a prompt through it.

Today the stages are chained in this process; the runtime issue turns this into a local
2-node fleet (two worker processes + the coordinator) behind the same command.
"""

from __future__ import annotations

import argparse
import sys

from engine.cli import Command

DEFAULT_PROMPT = "What is the capital of France?"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the question (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--stages", type=int, default=2, help="number of stages (default 2)")
    p.add_argument("--weights", choices=("int4", "int8", "fp16", "fp32"), default="int4")
    p.add_argument("--max-new-tokens", type=int, default=128)


def run(args: argparse.Namespace) -> int:
    from engine.errors import ManifestError
    from engine.generate import greedy_generate
    from engine.shard import LocalChain
    from engine.tokenizer import ChatTokenizer
    from export.cli import export_progress
    from export.exporter import ExportOptions, export_model
    from export.sources import default_cache_root, resolve_model

    source = resolve_model(None)
    out = default_cache_root() / "exports" / f"{source.name}-{args.weights}-{args.stages}"
    try:
        chain = LocalChain.load(out)  # verifies every file against the manifest
    except ManifestError:
        print(f"exporting {source.name} into {args.stages} {args.weights} stages (once) ...", file=sys.stderr)
        with export_progress() as progress:
            export_model(source.checkpoint_dir, out, stages=args.stages,
                         options=ExportOptions(weights=args.weights, force=True), name=source.name,
                         progress=progress)
        chain = LocalChain.load(out)
    tokenizer = ChatTokenizer(out / "tokenizer")
    ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    result = greedy_generate(chain, ids, args.max_new_tokens, eos_ids=chain.manifest.model.eos_token_ids)
    print(f"Q: {args.prompt}")
    print(f"A: {tokenizer.decode(result.tokens).strip()}")
    print(f"[{result.decode_tok_per_s:.1f} tok/s decode, TTFT {result.ttft_s * 1000:.0f} ms, "
          f"{len(chain.stages)} stages of {source.name} ({args.weights})]")
    return 0


COMMAND = Command(name="demo", help="answer a prompt with the embedded default model split into stages",
                  configure=configure, run=run)
