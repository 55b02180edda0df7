"""``python -m tests.benchmarks samplers``: what penalties cost a decode step (issue 35).

A penalised stream (``frequency_penalty``, ``presence_penalty``, ``repetition_penalty`` or
``logit_bias``) has its row's logits [V] float32 sent back by the last stage and its token chosen
by the coordinator (:func:`engine.paged.reply.decide` over
:func:`engine.generation.penalties.penalise_rows`); a greedy stream without them keeps the last
stage's top-1. This measures what that costs, on the default model (SmolLM2-135M-Instruct, 2 INT4
stages) over a worker process per stage on loopback (``paged_local_fleet``: the logits travel the
wire back from the last stage, as in a fleet), for each user count (``--users``, default 1 and 16),
every user a distinct prompt, ``--new-tokens`` tokens, EOS ignored, in four modes:

- ``greedy``            temperature 0, nothing else (today's fast path: top-1 from the last stage);
- ``greedy+penalties``  temperature 0, repetition 1.1, frequency 0.3, presence 0.2, one logit_bias;
- ``sampled``           temperature 0.8, top_p 0.95 (logits back already, as before this issue);
- ``sampled+penalties`` the same with the penalties, top_k 40 and min_p 0.05.

Rounds are interleaved (per round every mode, the order rotating), ``--warmups`` untimed rounds per
user count first; figures are medians over ``--repeats``. Per mode: tokens per second of the round
(all users), and from the coordinator's step log the median interval between consecutive decode
steps' answers (what a user waits per token: stages, wire and the coordinator's choosing). Then the
coordinator's own cost apart (no model runs): :func:`decide` for N rows of float32 logits [V] with a
history of ``--history`` tokens, µs per step, penalised versus plain greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.cli.main import Command
from tests.benchmarks.record import (
    DEFAULT_DOC,
    DEFAULT_JSON_DIR,
    machine_info,
    markdown_table,
    median,
    update_section,
    write_json,
)

COMMAND_LINE = "python -m tests.benchmarks samplers"
MODES = ("greedy", "greedy+penalties", "sampled", "sampled+penalties")
PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2,
             "logit_bias": ((13, -5.0),)}


def sampling_for(mode: str, seed: int) -> Any:
    from engine.generation.request import SamplingParams

    extra: dict[str, Any] = dict(PENALTIES) if mode.endswith("+penalties") else {}
    if mode.startswith("sampled"):
        extra.update(temperature=0.8, top_p=0.95, seed=seed)
        if mode.endswith("+penalties"):
            extra.update(top_k=40, min_p=0.05)
    return SamplingParams(**extra)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


async def run_round(coordinator: Any, prompts: list[tuple[int, ...]], new_tokens: int, mode: str,
                    timeout_s: float) -> dict[str, Any]:
    """Every prompt at once under ``mode``; tokens/s and the decode steps' answer intervals."""
    from engine.generation.request import GenerationRequest

    async def one(i: int, prompt: tuple[int, ...]) -> int:
        request = GenerationRequest(prompt, new_tokens, sampling_for(mode, 1000 + i), ignore_eos=True)
        return sum([1 async for _ in coordinator.stream(request)])

    coordinator.step_log.clear()
    started = time.perf_counter()
    counts = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), timeout_s)
    seconds = time.perf_counter() - started
    steps = [s for s in coordinator.step_log if not s.failed]
    decode = [b.answered_at - a.answered_at for a, b in zip(steps, steps[1:], strict=False)
              if b.tokens == b.answered == len(prompts) and a.tokens == a.answered == len(prompts)]
    return {"mode": mode, "users": len(prompts), "tokens": sum(counts), "seconds": seconds,
            "tokens_per_s": sum(counts) / seconds, "step_interval_ms": 1000 * median(decode),
            "decode_steps": len(decode)}


def prompts_for(tokenizer: Any, users: int, salt: int) -> list[tuple[int, ...]]:
    return [tuple(tokenizer.encode_chat([{"role": "user", "content": f"Note {salt}-{u}: tell me a long story about "
                                                                     "a lighthouse keeper and the sea."}]))
            for u in range(users)]


async def measure_rounds(coordinator: Any, tokenizer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rounds: list[dict[str, Any]] = []
    for users in _ints(args.users):
        for r in range(args.warmups + args.repeats):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for mode in order:
                result = await run_round(coordinator, prompts_for(tokenizer, users, 100 * r + len(rounds)),
                                         args.new_tokens, mode, args.timeout)
                result["round"], result["warmup"] = r, r < args.warmups
                _log(f"  {users} users, round {r}{' (warm-up)' if r < args.warmups else ''}, {mode}: "
                     f"{result['tokens_per_s']:.1f} tok/s, step {result['step_interval_ms']:.1f} ms")
                rounds.append(result)
    return rounds


def summarise(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    timed = [r for r in rounds if not r["warmup"]]
    out = []
    for users in sorted({r["users"] for r in timed}):
        base = {r["round"]: r for r in timed if r["users"] == users and r["mode"] == "greedy"}
        for mode in MODES:
            mine = [r for r in timed if r["users"] == users and r["mode"] == mode]
            out.append({"users": users, "mode": mode, "tokens_per_s": median([r["tokens_per_s"] for r in mine]),
                        "step_interval_ms": median([r["step_interval_ms"] for r in mine]),
                        "step_vs_greedy": median([r["step_interval_ms"] / base[r["round"]]["step_interval_ms"]
                                                  for r in mine if r["round"] in base])})
    return out


def decide_costs(vocab: int, users: list[int], history: int, reps: int) -> list[dict[str, Any]]:
    """µs the coordinator spends choosing one step's tokens for N rows, penalised and not."""
    from engine.paged.reply import decide

    rng = np.random.default_rng(0)
    out = []
    for n in users:
        logits = rng.normal(0, 3, (n, 1, vocab)).astype(np.float32)
        tokens = [list(rng.integers(0, vocab, history)) for _ in range(n)]
        row = {"users": n}
        for mode in MODES:
            params = sampling_for(mode, 1)
            wants = not params.greedy or params.penalised
            gen = np.random.default_rng(1)
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for i in range(n):
                    decide(params, gen, (), None, logits[i].argmax(-1), np.ones(1, np.float32),
                           logits[i] if wants else None, tokens[i], history // 2)
                samples.append(time.perf_counter() - t0)
            row[mode] = 1e6 * median(samples)
        out.append(row)
    return out


def command_line(args: argparse.Namespace) -> str:
    parts = [COMMAND_LINE, f"--users {args.users}", f"--new-tokens {args.new_tokens}", f"--repeats {args.repeats}",
             f"--warmups {args.warmups}", f"--threads {args.threads}"]
    return " ".join(parts + ([f"--export {args.export}"] if args.export else []))


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    rows = [[s["users"], s["mode"], f"{s['tokens_per_s']:.1f}", f"{s['step_interval_ms']:.1f}",
             f"{s['step_vs_greedy']:.3f}"] for s in result["summary"]]
    costs = [[c["users"], *(f"{c[mode]:.0f}" for mode in MODES)] for c in result["decide_costs"]]
    return "\n\n".join([
        "## Samplers: what penalties cost a decode step",
        f"`{result['command']}`",
        f"{result['model']}, {result['stages']} stages, a worker process per stage on loopback, "
        f"{result['new_tokens']} new tokens per user (EOS ignored), {result['repeats']} timed rounds per user count "
        f"after {result['warmups']} warm-up, the four modes interleaved (order rotating). {m['cores']} cores "
        f"({m['cpu']}), {m['date']}; load average {m['load_average']} at the start, {result['load_average_end']} at "
        f"the end; `uptime` at the start: {result['uptime']}. The machine is shared and loaded: compare "
        "ratios within one user count, not across runs.",
        "Modes: `greedy` (temperature 0: the last stage's top-1, today's path); `greedy+penalties` (repetition "
        "1.1, frequency 0.3, presence 0.2, one logit_bias: the row's logits [V] come back and the coordinator "
        "chooses); `sampled` (temperature 0.8, top_p 0.95: logits back, as before); `sampled+penalties` (the "
        "same with the penalties, top_k 40, min_p 0.05). Step = median interval between consecutive decode "
        "steps' answers (stages, wire, choosing); ratio = step / greedy's of the same round, median.",
        markdown_table(["users", "mode", "tok/s (all users)", "step ms", "step / greedy"], rows),
        f"The coordinator's choosing alone (`engine.paged.reply.decide`, no model; V = {result['vocab']}, "
        f"a history of {result['history']} tokens per row, µs per step for all N rows, median of "
        f"{result['micro_reps']}):",
        markdown_table(["users", *(f"{mode} µs" for mode in MODES)], costs),
        reading(result),
    ])


def reading(result: dict[str, Any]) -> str:
    """What the tables say, from their own figures (the most users measured)."""
    users = max(s["users"] for s in result["summary"])
    cell = {s["mode"]: s for s in result["summary"] if s["users"] == users}
    cost = next(c for c in result["decide_costs"] if c["users"] == users)
    return (f"Reading: at {users} users a penalised greedy step took {cell['greedy+penalties']['step_vs_greedy']:.2f}x "
            f"greedy's: each penalised row's logits ({4 * result['vocab'] // 1024} KiB) come back over the wire and "
            f"the coordinator penalises and chooses ({cost['greedy+penalties'] / 1000:.1f} ms for the {users} rows "
            f"here, against {cost['greedy'] / 1000:.2f} ms for plain greedy rows). Streams without penalties keep "
            "their path: a greedy one still takes the last stage's top-1 (the only added work is one check per "
            f"row). Sampling was the costlier path before this issue ({cell['sampled']['step_vs_greedy']:.2f}x "
            "greedy's step): without top_k its top-p sorts the whole vocabulary per row in the coordinator; "
            "top_k (as in sampled+penalties) makes that cheaper.")


async def _async_measure(export: Any, tokenizer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from engine.tools.local_fleet import paged_local_fleet

    async with paged_local_fleet(export, threads=args.threads, slots=max(_ints(args.users)),
                                 prefix_cache=False) as coordinator:
        return await measure_rounds(coordinator, tokenizer, args)


def run(args: argparse.Namespace) -> int:
    import subprocess

    from engine.generation.tokenizer import ChatTokenizer
    from engine.shards.manifest import load_manifest
    from tests.benchmarks.kit import export_or_default

    export, model = export_or_default(args.export)
    manifest = load_manifest(export)
    tokenizer = ChatTokenizer(export / "tokenizer")
    start, machine = time.monotonic(), machine_info()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    rounds = asyncio.run(_async_measure(export, tokenizer, args))
    _log("  the coordinator's choosing, apart ...")
    costs = decide_costs(manifest.model.vocab_size, _ints(args.users), args.history, args.micro_reps)
    result = {"benchmark": "samplers", "command": command_line(args), "machine": machine, "uptime": uptime,
              "load_average_end": [round(x, 2) for x in os.getloadavg()], "seconds": time.monotonic() - start,
              "model": model, "stages": len(manifest.stages), "threads": args.threads,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "warmups": args.warmups,
              "vocab": manifest.model.vocab_size, "history": args.history, "micro_reps": args.micro_reps,
              "penalties": {k: v for k, v in PENALTIES.items()}, "summary": summarise(rounds),
              "decide_costs": costs, "rounds": rounds}
    write_json(args.json, result)
    update_section(args.doc, "samplers", markdown(result))
    _log(markdown(result))
    return 0


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--users", default="1,16", help="user counts, comma-separated (default 1,16)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens per user (default 48)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per user count (default 3)")
    p.add_argument("--warmups", type=int, default=1, help="untimed rounds per user count first (default 1)")
    p.add_argument("--threads", type=int, default=1, help="inference threads per stage worker (default 1)")
    p.add_argument("--history", type=int, default=512, help="tokens per row in the choosing micro-benchmark")
    p.add_argument("--micro-reps", type=int, default=50, help="repetitions of the choosing micro-benchmark")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a round may take")
    p.add_argument("--export", type=Path, default=None, help="an export to use instead of the default model's")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "samplers.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


COMMAND = Command(name="samplers", help="what penalties and logit_bias cost a decode step at 1 and 16 users",
                  configure=configure, run=run)
