"""``deskfleet generate``: answer one prompt with every stage of an export chained in-process."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.cli.main import Command
from engine.errors import TokenizerError
from engine.generation.in_process import greedy_generate
from engine.generation.tokenizer import ChatTokenizer
from engine.shards.manifest import load_manifest
from engine.shards.stage import LocalChain
from engine.static.packed_stage import PackedServer, StaticChain


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", required=True, type=Path, help="export directory (from `deskfleet export`)")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-new-tokens", type=int, default=128, help="upper bound on the answer (default 128)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--device", default="CPU", help="OpenVINO device for every stage (default CPU)")
    p.add_argument("--exact", action="store_true",
                   help="f32 compute and KV cache (bit-exact settings; slower)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")


def load_prompt_ids(tokenizer: ChatTokenizer, prompt: str, system: str | None, raw: bool) -> list[int]:
    if raw:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.encode_chat(messages)


def run(args: argparse.Namespace) -> int:
    static = load_manifest(args.shards).target == "npu"  # also the clear error for a missing export
    tok_dir = args.shards / "tokenizer"
    if not tok_dir.is_dir():
        raise TokenizerError(f"{args.shards} has no tokenizer/ directory; re-export the model with its tokenizer")
    tokenizer = ChatTokenizer(tok_dir)
    ids = load_prompt_ids(tokenizer, args.prompt, args.system, args.raw)

    def on_token(token: int) -> None:
        if args.stream:
            sys.stdout.write(tokenizer.decode([token]))
            sys.stdout.flush()

    answer = (_answer_static if static else _answer_stateful)(args, ids, on_token)
    if args.stream:
        print()
    else:
        print(tokenizer.decode(answer.tokens).strip())
    print(f"[{len(answer.tokens)} tokens, {answer.tok_per_s:.1f} tok/s decode, TTFT {answer.ttft_s * 1000:.0f} ms, "
          f"{answer.stages} stage{'s' if answer.stages > 1 else ''}, {args.device}{answer.note}]", file=sys.stderr)
    return 0


@dataclass(frozen=True)
class _Answer:
    tokens: list[int]
    tok_per_s: float
    ttft_s: float
    stages: int
    note: str = ""


def _answer_stateful(args: argparse.Namespace, ids: list[int], on_token: Callable[[int], None]) -> _Answer:
    chain = LocalChain.load(args.shards, device=args.device, exact=args.exact)
    result = greedy_generate(chain, ids, args.max_new_tokens, eos_ids=chain.manifest.model.eos_token_ids,
                             on_token=on_token)
    return _Answer(list(result.tokens), result.decode_tok_per_s, result.ttft_s, len(chain.stages))


def _answer_static(args: argparse.Namespace, ids: list[int], on_token: Callable[[int], None]) -> _Answer:
    """A static (NPU-target) export: its stages chained in-process, decoding greedily in one slot."""
    chain = StaticChain.load(args.shards, device=args.device, exact=args.exact)
    server = PackedServer(chain)
    rid = server.submit(ids, args.max_new_tokens, eos_ids=chain.manifest.model.eos_token_ids)
    while server.busy:
        for event in server.step():
            on_token(event.token)
    done = server.completions[rid]
    decode_s = (done.finished or time.perf_counter()) - (done.first_token or done.submitted)
    rate = (len(done.tokens) - 1) / decode_s if decode_s > 0 and len(done.tokens) > 1 else 0.0
    return _Answer(done.tokens, rate, done.ttft_s, len(chain.stages), f", static {chain.geometry.slots}-slot export")


COMMAND = Command(name="generate", help="answer one prompt with an export's stages chained in-process",
                  configure=configure, run=run)
