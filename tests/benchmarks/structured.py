"""``python -m tests.benchmarks structured``: what a JSON schema costs a served answer (issue 17).

The default model (SmolLM2-135M-Instruct, 2 INT4 stages) on the paged runtime over a worker
process per stage on loopback (``paged_local_fleet``: the masks travel the wire to the last stage,
as in a fleet). For each user count (``--users``, default 1 and 8) every user sends the same chat
question behind a distinct digit nonce, asking for ``--new-tokens`` (64) tokens, EOS ignored,
greedy, in two modes:

- ``plain``   no constraint;
- ``schema``  ``response_format`` json_schema (strict) of a list of people that needs more items
  than fit in the tokens asked (``minItems``), so a constrained answer runs the same length as a
  plain one: both modes decode the same number of steps at the same batch size.

Rounds are interleaved (per round both modes, the order alternating), ``--warmups`` untimed rounds
per user count first; figures are medians over ``--repeats``; ratio = schema / plain of the same
round, median over rounds. From the coordinator's step log: the median decode step (a step of N
answered rows), send to answer, and its last stage's compute.

Then the mask's cost per step, apart (no model runs; V = the export's logits width):
- coordinator: each user's matcher mask (``GrammarMatcher.mask``) and ``consume`` of the token,
  following the answers the schema rounds produced, N users one after another (µs per step);
- wire: the encoded bytes of the hop's Step frame (hidden states [Tb, H] float32) with and
  without N masks, and its encode + decode time;
- last stage: :func:`engine.shards.step_answer.answer_step` on float32 logits [N, V] with and
  without the N masks (µs).
Each row also checks the schema answers: every one is a prefix the grammar accepted (the matcher
followed it), and a separate ``--valid-users`` run of a small closed schema to its end parses
(json.loads + jsonschema).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
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

COMMAND_LINE = "python -m tests.benchmarks structured"
MODES = ("plain", "schema")
TOKEN_BUDGET = 256
NONCE_TOKENS = 8
QUESTION = ("List the people who work in our office as JSON: for each person their name, age and city. "
            "Make up as many as you like.")
PEOPLE = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 1000, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 32}, "age": {"type": "integer"},
                       "city": {"type": "string", "maxLength": 32}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}
PERSON = {  # closed: an answer under it ends (finish STOP) within ~40 tokens
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                   "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"], "additionalProperties": False,
}
PERSON_QUESTION = "Describe one person who works in our office as JSON with their name, age and city."


def constraint(schema: dict[str, Any], name: str) -> Any:
    from engine.generation.request import JsonConstraint

    return JsonConstraint(json.dumps(schema, separators=(",", ":")), name, strict=True)


@dataclass(frozen=True)
class Answer:
    """One user's stream: seconds from the round's start, its tokens and how it finished."""

    ttft_s: float
    last_s: float
    tokens: tuple[int, ...]
    finish: str


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# -- one round ----------------------------------------------------------------------------------


async def run_round(generator: Any, prompts: Sequence[Sequence[int]], new_tokens: int, mode: str,
                    timeout_s: float, ignore_eos: bool = True, schema: dict[str, Any] = PEOPLE) -> list[Answer]:
    """Every prompt as one user, all at once, greedy; ``mode`` "schema" constrains each to ``schema``."""
    from engine.generation.request import GenerationRequest

    rule = constraint(schema, "people" if schema is PEOPLE else "person") if mode == "schema" else None
    start = time.perf_counter()

    async def user(ids: Sequence[int]) -> Answer:
        first, last, tokens, finish = None, 0.0, [], "none"
        request = GenerationRequest(tuple(ids), new_tokens, ignore_eos=ignore_eos, constraint=rule)
        async for event in generator.stream(request):
            last = time.perf_counter() - start
            first = last if first is None else first
            tokens.append(event.token_id)
            if event.finish is not None:
                finish = event.finish.value
        if first is None:
            raise RuntimeError("a user's stream ended without a token")
        return Answer(first, last, tuple(tokens), finish)

    return list(await asyncio.wait_for(asyncio.gather(*(user(p) for p in prompts)), timeout_s))


def round_figures(answers: Sequence[Answer]) -> dict[str, float]:
    total = sum(len(a.tokens) for a in answers)
    wall = max(a.last_s for a in answers)
    per_user = [(len(a.tokens) - 1) / (a.last_s - a.ttft_s) for a in answers if a.last_s > a.ttft_s]
    return {"aggregate_tok_s": total / wall if wall > 0 else 0.0, "per_user_tok_s": median(per_user),
            "ttft_ms": median([1000 * a.ttft_s for a in answers]), "tokens": total, "wall_s": wall}


def decode_steps(step_log: Sequence[Any], since: float, users: int) -> dict[str, float]:
    """From the decode steps (``users`` answered rows of one token each) sent after ``since``: the
    median send-to-answer ms, last-stage ms, and interval ms from one decode step's send to the
    next one's (consecutive seqs), which adds the coordinator's own work between steps (the masks
    are made before a send and the grammar follows the tokens after the answer)."""
    steps = [s for s in step_log if s.sent_at >= since and not s.failed and s.answered == users and s.tokens == users]
    by_seq = {s.seq: s for s in steps}
    intervals = [1000 * (by_seq[s.seq + 1].sent_at - s.sent_at) for s in steps if s.seq + 1 in by_seq]
    return {"decode_steps": len(steps),
            "step_ms": median([1000 * (s.answered_at - s.sent_at) for s in steps]),
            "last_stage_ms": median([s.stage_ms[-1] for s in steps if s.stage_ms]),
            "interval_ms": median(intervals)}


def prompts_for(tokenizer: Any, users: int, rng: random.Random, question: str = QUESTION) -> list[list[int]]:
    from tests.benchmarks.parity import nonce_prompt

    chat = tokenizer.encode_chat([{"role": "user", "content": question}])
    return [nonce_prompt(tokenizer, chat, rng, NONCE_TOKENS) for _ in range(users)]


async def measure_rounds(coordinator: Any, tokenizer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(17)
    rounds = []
    for users in _ints(args.users):
        for r in range(args.warmups + args.repeats):
            prompts = prompts_for(tokenizer, users, rng)
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                since = time.monotonic()
                answers = await run_round(coordinator, prompts, args.new_tokens, mode, args.timeout)
                record = {"users": users, "mode": mode, "warmup": r < args.warmups, **round_figures(answers),
                          **decode_steps(coordinator.step_log, since, users),
                          "finish": sorted({a.finish for a in answers}),
                          "answers": [list(a.tokens) for a in answers]}
                rounds.append(record)
                _log(f"  {users} users {mode:6s}{' (warm-up)' if record['warmup'] else ''}: "
                     f"{record['aggregate_tok_s']:.1f} tok/s, step {record['step_ms']:.1f} ms")
    return rounds


async def validity_run(coordinator: Any, tokenizer: Any, users: int, timeout_s: float) -> dict[str, Any]:
    """``users`` answers under the closed PERSON schema to their end: how many parse and validate."""
    prompts = prompts_for(tokenizer, users, random.Random(5), PERSON_QUESTION)
    answers = await run_round(coordinator, prompts, 96, "schema", timeout_s, ignore_eos=False, schema=PERSON)
    texts = [tokenizer.decode(a.tokens) for a in answers]
    return {"users": users, "finish": [a.finish for a in answers], "valid": sum(map(schema_valid, texts)),
            "texts": texts}


def schema_valid(text: str, schema: dict[str, Any] = PERSON) -> bool:
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    return bool(jsonschema.Draft202012Validator(schema).is_valid(value))


# -- the mask's cost per step, apart --------------------------------------------------------------


def _timed_us(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t) / 1000)
    return median(times)


def mask_fill_us(vocabulary: Any, answers: Sequence[Sequence[int]], users: int) -> tuple[float, list[np.ndarray]]:
    """Median µs per step of ``users`` matchers each giving its mask and consuming its token, along
    ``answers`` (each user its own; cycled when fewer); also the masks of the first step."""
    from engine.paged.constraints import grammar_for

    tok = vocabulary.load()
    grammar = grammar_for(constraint(PEOPLE, "people"))
    walks = [list(answers[u % len(answers)]) for u in range(users)]
    matchers = [tok.matcher(grammar) for _ in range(users)]
    steps = min(len(w) for w in walks)
    times: list[float] = []
    first: list[np.ndarray] = []
    for i in range(steps):
        t = time.perf_counter_ns()
        masks = [m.mask() for m in matchers]
        for m, w in zip(matchers, walks, strict=True):
            m.consume([w[i]])
        times.append((time.perf_counter_ns() - t) / 1000)
        first = first or masks
    return median(times), first


def wire_figures(users: int, vocab: int, hidden: int, masks: Sequence[np.ndarray], reps: int) -> dict[str, float]:
    """The hop's decode Step frame for ``users`` rows: bytes and encode + decode µs, masked and not."""
    from engine.wire.codec import decode, encode
    from engine.wire.format import StreamId
    from engine.wire.messages import Step
    from engine.wire.step_plan import SCRATCH_BLOCKS, PlanRow, plan

    def step(masked: bool) -> Step:
        rows = [PlanRow(u + 1, 40, 1, (SCRATCH_BLOCKS + u, SCRATCH_BLOCKS + users + u), 1,
                        mask=masks[u % len(masks)][None] if masked else None) for u in range(users)]
        the_plan = plan(32, 2 * users + SCRATCH_BLOCKS + 1, rows)
        return Step(StreamId(1), 7, the_plan, np.zeros((the_plan.padded_tokens, hidden), np.float32), (1.0,))

    out: dict[str, float] = {}
    for label, masked in (("plain", False), ("masked", True)):
        frame = step(masked)
        data = encode(frame)
        out[f"{label}_bytes"] = len(data)
        out[f"{label}_codec_us"] = _timed_us(lambda f=frame: decode(encode(f)), reps)
    out["bytes_per_row"] = (out["masked_bytes"] - out["plain_bytes"]) / users
    assert out["bytes_per_row"] >= 4 * -(-vocab // 32)
    return out


def answer_figures(users: int, vocab: int, masks: Sequence[np.ndarray], reps: int) -> dict[str, float]:
    """The last stage's answer to ``users`` decode rows (float32 logits [users, V]), masked and not."""
    from engine.shards.step_answer import answer_step
    from engine.wire.step_plan import SCRATCH_BLOCKS, PlanRow, plan

    logits = np.random.default_rng(users).normal(0, 4, (users, vocab)).astype(np.float32)
    out = {}
    for label, masked in (("plain", False), ("masked", True)):
        rows = [PlanRow(u + 1, 20, 1, (SCRATCH_BLOCKS + u,), 1, mask=masks[u % len(masks)][None] if masked else None)
                for u in range(users)]
        the_plan = plan(32, users + SCRATCH_BLOCKS + 1, rows)
        out[f"{label}_us"] = _timed_us(lambda p=the_plan: answer_step(logits.copy(), p), reps)
    return out


def mask_costs(export: Path, rounds: Sequence[dict[str, Any]], users_list: Sequence[int], reps: int
               ) -> dict[str, dict[str, float]]:
    from engine.paged.constraints import GrammarVocabulary
    from engine.shards.manifest import load_manifest

    manifest = load_manifest(export)
    vocabulary = GrammarVocabulary.of_export(export, manifest)
    if vocabulary is None:
        raise SystemExit(f"{export} has no tokenizer/tokenizer.json: no masks can be built for it")
    answers = [a for r in rounds if r["mode"] == "schema" and not r["warmup"] for a in r["answers"]]
    out = {}
    for users in users_list:
        fill_us, masks = mask_fill_us(vocabulary, answers, users)
        out[str(users)] = {"fill_consume_us": fill_us,
                           **{f"wire_{k}": v for k, v in wire_figures(users, vocabulary.logits_width,
                                                                      manifest.model.hidden_size, masks, reps).items()},
                           **{f"answer_{k}": v for k, v in answer_figures(users, vocabulary.logits_width, masks,
                                                                          reps).items()}}
    return out


# -- summary and table ----------------------------------------------------------------------------


def add_predictions(costs: dict[str, dict[str, float]], summary: dict[str, dict[str, Any]], frames: int) -> None:
    """Into each user count's mask costs: ``added_ms``, what masking adds to one decode step (masks +
    consume, ``frames`` Step frames' extra codec time, the last stage's extra answer time), and
    ``added_share``, that over the plain mode's step interval."""
    for users, c in costs.items():
        added_us = (c["fill_consume_us"] + frames * (c["wire_masked_codec_us"] - c["wire_plain_codec_us"])
                    + c["answer_masked_us"] - c["answer_plain_us"])
        c["added_ms"] = added_us / 1000
        c["added_share"] = c["added_ms"] / summary[users]["plain"]["interval_ms"]


def summarise(rounds: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per user count: each mode's medians and the schema/plain ratios of the same rounds."""
    out: dict[str, dict[str, Any]] = {}
    timed = [r for r in rounds if not r["warmup"]]
    for users in sorted({r["users"] for r in timed}):
        cell: dict[str, Any] = {}
        for mode in MODES:
            mine = [r for r in timed if r["users"] == users and r["mode"] == mode]
            cell[mode] = {k: median([r[k] for r in mine]) for k in
                          ("aggregate_tok_s", "per_user_tok_s", "ttft_ms", "step_ms", "last_stage_ms",
                           "interval_ms")}
            cell[mode]["finish"] = sorted({f for r in mine for f in r["finish"]})
        plain = [r for r in timed if r["users"] == users and r["mode"] == "plain"]
        schema = [r for r in timed if r["users"] == users and r["mode"] == "schema"]
        cell["tok_s_ratio"] = median([s["aggregate_tok_s"] / p["aggregate_tok_s"]
                                      for p, s in zip(plain, schema, strict=True)])
        cell["interval_ratio"] = median([s["interval_ms"] / p["interval_ms"]
                                         for p, s in zip(plain, schema, strict=True)])
        out[str(users)] = cell
    return out


def render(result: dict[str, Any], json_path: Path) -> str:
    m = result["machine"]
    head = (f"`{result['command']}` → `{json_path.as_posix()}` ({m['date']}, {m['cores']} cores, "
            f"load average at start {m['load_average']}, at end {result['load_average_end']}; "
            f"{result['seconds']:.0f} s). {result['model']}, {result['stages']} stages, a paged worker process "
            f"per stage on loopback, {result['threads']} inference thread(s) per stage, token budget "
            f"{TOKEN_BUDGET}, prefix cache off. Every user: one chat question behind a distinct "
            f"{NONCE_TOKENS}-digit nonce, {result['new_tokens']} greedy tokens, EOS ignored; `schema` = "
            "response_format json_schema (strict) of a list of people with more items required than fit, "
            "so both modes decode the same steps. Interleaved rounds (both modes per round, order "
            f"alternating), {result['warmups']} warm-up round(s), medians over {result['repeats']}; × plain = "
            "median of per-round ratios. From the coordinator's step log, for the decode steps (N rows of one "
            "token): step interval = one send to the next (the coordinator's mask and grammar work included), "
            "step = sent to answered, last stage = its compute ms as it reports it.")
    rows = []
    for users, cell in result["summary"].items():
        for mode in MODES:
            c = cell[mode]
            rows.append([users, mode, f"{c['aggregate_tok_s']:.1f}", f"{c['per_user_tok_s']:.1f}",
                         f"{c['ttft_ms']:.0f}", f"{c['interval_ms']:.1f}", f"{c['step_ms']:.1f}",
                         f"{c['last_stage_ms']:.1f}", "1.00" if mode == "plain" else f"{cell['tok_s_ratio']:.2f}",
                         "1.00" if mode == "plain" else f"{cell['interval_ratio']:.2f}", "/".join(c["finish"])])
    table = markdown_table(["users", "mode", "aggregate tok/s", "per-user tok/s", "TTFT ms", "step interval ms",
                            "step ms", "last stage ms", "× plain tok/s", "× plain interval", "finish"], rows)
    cost_rows = []
    for users, c in result["mask_costs"].items():
        frame = f"{c['wire_plain_bytes']:,} → {c['wire_masked_bytes']:,} (+{c['wire_bytes_per_row']:,.0f}/row)"
        cost_rows.append([users, f"{c['fill_consume_us']:.0f}", frame,
                          f"{c['wire_plain_codec_us']:.0f} → {c['wire_masked_codec_us']:.0f}",
                          f"{c['answer_plain_us']:.0f} → {c['answer_masked_us']:.0f}",
                          f"{c['added_ms']:.2f}", f"+{c['added_share']:.1%}"])
    costs = markdown_table(["users", "coordinator: masks + consume µs", "hop frame bytes",
                            "frame encode+decode µs", "last-stage answer µs", "sum ms", "× plain step interval"],
                           cost_rows)
    v = result["validity"]
    valid = (f"Closed schema (one person: name, age, city) to its end at {v['users']} users: {v['valid']}/{v['users']} "
             f"answers parse and validate (finish: {'/'.join(sorted(set(v['finish'])))}).")
    intro = (f"The mask's cost per decode step, apart (V = {result['vocab']:,}; plain → masked; medians): sum = "
             f"what masking adds to a step (masks + consume, the codec's extra time on each of the step's "
             f"{result['stages']} Step frames, the last stage's extra answer time), against the plain step interval "
             "above: the end-to-end ratios cannot resolve a difference this small on a shared machine.")
    return "\n\n".join([head, table, intro, costs, valid])


# -- the command ----------------------------------------------------------------------------------


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--users", default="1,8", help="concurrent users per row (default 1,8)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per answer (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per row (default 3)")
    p.add_argument("--warmups", type=int, default=1, help="untimed rounds per row first (default 1)")
    p.add_argument("--threads", type=int, default=1, help="inference threads per stage (default 1)")
    p.add_argument("--valid-users", type=int, default=4, help="users of the closed-schema check (default 4)")
    p.add_argument("--micro-reps", type=int, default=200, help="repetitions of each mask-cost timing (default 200)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a round may take (default 600)")
    p.add_argument("--export", type=Path, default=None,
                   help="a paged export to use (default: the default model's 2-stage INT4 export, made once)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "structured.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def command_line(args: argparse.Namespace) -> str:
    parts = [COMMAND_LINE, f"--users {args.users}", f"--new-tokens {args.new_tokens}", f"--repeats {args.repeats}",
             f"--warmups {args.warmups}", f"--threads {args.threads}"]
    return " ".join(parts + ([f"--export {args.export}"] if args.export else []))


async def _async_measure(export: Path, tokenizer: Any, args: argparse.Namespace) -> tuple[list, dict]:
    from engine.paged.constraints import GrammarVocabulary
    from engine.shards.manifest import load_manifest
    from engine.tools.local_fleet import paged_local_fleet

    users = _ints(args.users)
    async with paged_local_fleet(export, threads=args.threads, slots=max(max(users), args.valid_users),
                                 prefix_cache=False, token_budget=TOKEN_BUDGET,
                                 prefill_chunk=TOKEN_BUDGET) as coordinator:
        coordinator.use_grammar(GrammarVocabulary.of_export(export, load_manifest(export)))  # as serve --workers
        rounds = await measure_rounds(coordinator, tokenizer, args)
        validity = await validity_run(coordinator, tokenizer, args.valid_users, args.timeout)
    return rounds, validity


def run(args: argparse.Namespace) -> int:
    import os

    from engine.generation.tokenizer import ChatTokenizer
    from engine.shards.manifest import load_manifest
    from tests.benchmarks.kit import export_or_default

    export, model = export_or_default(args.export)
    manifest = load_manifest(export)
    tokenizer = ChatTokenizer(export / "tokenizer")
    start, machine = time.monotonic(), machine_info()
    rounds, validity = asyncio.run(_async_measure(export, tokenizer, args))
    _log("  mask costs ...")
    costs = mask_costs(export, rounds, _ints(args.users), args.micro_reps)
    summary = summarise(rounds)
    add_predictions(costs, summary, len(manifest.stages))
    result = {"benchmark": "structured", "command": command_line(args), "machine": machine,
              "load_average_end": [round(x, 2) for x in os.getloadavg()], "seconds": time.monotonic() - start,
              "model": model, "stages": len(manifest.stages), "threads": args.threads,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "warmups": args.warmups,
              "vocab": manifest.model.vocab_size, "schema": PEOPLE, "summary": summary,
              "mask_costs": costs, "validity": validity, "rounds": rounds}
    write_json(args.json, result)
    update_section(args.doc, "structured", "## Structured output: a JSON schema's cost on the paged ring\n\n"
                   + render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="structured", help="tok/s of the default model on the paged ring with and without a JSON "
                  "schema at 1 and 8 users, and the mask's cost per step", configure=configure, run=run)
