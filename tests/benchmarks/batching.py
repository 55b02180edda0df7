"""``python -m tests.benchmarks batching``: N concurrent users, batched inside every stage or not,
against openvino_genai's continuous batching (issue 14, Deliver 6).

Variants (:mod:`tests.benchmarks.batching_variants`), all loaded first, then run round by round:

- ``paged-local``     the paged coordinator (``BatchCoordinator``), 1 stage in this process
- ``paged-ring``      the paged coordinator over a worker process per stage (the 2-stage export)
- ``reference``       ``openvino_genai.ContinuousBatchingPipeline`` on one IR of the same model

(``stateful-local`` and ``stateful-ring``, the stateful runtime, were dropped when it was retired
from serving in issue 27; their last rows stay in docs/BENCHMARKS.md's history.)

For each user count (``--users``, default 1, 2, 4, 8, 16) every user sends a distinct short chat
prompt (a digit nonce first, new every round, then one of 16 questions); at the ``--long-users``
counts (default 1 and 8) a second row gives user 0 a ~``--long-tokens`` prompt instead (a long
prefill among decoding users). Every request asks ``--new-tokens`` (64) greedy tokens with EOS
ignored. Per round and variant, from each user's token arrival times: aggregate tok/s (all tokens
/ round wall time), decode tok/s (tokens after each user's first / from the first first token to
the last token), per-user decode tok/s (median and slowest user), TTFT p50/p95 (round start to a
user's first token). Rounds are interleaved: per round every variant once, the order rotated each
round; ``--warmups`` untimed rounds per user count first; figures are medians over ``--repeats``.

Like for like: the same prompts in a round for every variant, ``--threads`` inference threads per
stage (the reference gets ``--reference-threads``, by default the ring's total), f16 KV cache,
prefix caching off everywhere, a token budget of 256 per step (the paged scheduler's, the
reference's ``max_num_batched_tokens``), chunked prefill. Greedy tokens are compared with
``paged-local``'s for the same prompt (:data:`AGREEMENT_BASE`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.cli.main import Command
from engine.errors import DeskfleetError
from tests.benchmarks.batching_variants import (
    GENERATORS,
    STAGES,
    ReferenceServer,
    RoundError,
    Setup,
    UserRun,
    VariantUnavailable,
    generator_round_runner,
    reference_round_runner,
)
from tests.benchmarks.kit import verdict
from tests.benchmarks.record import (
    DEFAULT_DOC,
    DEFAULT_JSON_DIR,
    machine_info,
    markdown_table,
    median,
    update_section,
    write_json,
)

COMMAND_LINE = "python -m tests.benchmarks batching"
VARIANTS = ("paged-local", "paged-ring", "reference")
AGREEMENT_BASE = "paged-local"  # every variant's greedy tokens against this one's, prompt by prompt
HEADLINE = "paged-ring"
# Issue 14, Deliver 6: the ring at 8 users >= 4x its own 1 user; >= 0.95x the reference at 8 users.
SCALING_TARGET, REFERENCE_TARGET, TARGET_USERS = 4.0, 0.95, 8
NOT_MEASURED = "not yet measured"
QUESTIONS = (
    "What is a GPU?", "Say hello to the office.", "Name three rivers in Europe.", "Why is the sky blue?",
    "Give me a haiku about printers.", "What is 17 times 23?", "Suggest a name for a cat.", "Is a tomato a fruit?",
    "How do I reset a password?", "What is a spreadsheet?", "Name a planet with rings.", "Why do leaves fall?",
    "What does a router do?", "Write one line about Monday.", "How many legs has a spider?",
    "What is the boiling point of water?",
)
LONG_PARAGRAPH = (
    "The quarterly report covers the migration of the accounting department to the new building, the "
    "replacement of the ageing printers on the second floor, the pilot of the shared calendar, and the "
    "results of the staff survey on remote work. Most teams moved without disruption; two servers had "
    "to be reinstalled after a power cut, and the help desk handled twice the usual number of tickets "
    "in the first week. ")
ROUND_TIMEOUT_S = 1800.0
PROMPT_SLACK = 128  # the nonce, the chat template and a question around the long paragraph


class BatchingSettingsError(DeskfleetError):
    """The options ask for something the model cannot serve (a long prompt past its context)."""


def check_fits(long_tokens: int, new_tokens: int, context: int, has_long_rows: bool) -> None:
    need = (long_tokens if has_long_rows else 0) + PROMPT_SLACK + new_tokens
    if need > context:
        raise BatchingSettingsError(f"a prompt of about {need - new_tokens} tokens plus {new_tokens} new ones does "
                                    f"not fit the model's context of {context}: lower --long-tokens or "
                                    "--new-tokens, or pass --long-users ''")


# -- what runs ----------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cells(users: Sequence[int], long_users: Sequence[int]) -> list[tuple[int, str]]:
    """(users, prompts) in run order: every short row, and a "long" row at each long-user count run."""
    return [(n, kind) for n in users for kind in ("short", "long") if kind == "short" or n in set(long_users)]


def rotated(names: Sequence[str], k: int) -> list[str]:
    k %= max(len(names), 1)
    return list(names[k:]) + list(names[:k])


def make_prompts(tokenizer: Any, users: int, kind: str, rng: random.Random, nonce_tokens: int,
                 long_tokens: int) -> list[list[int]]:
    """``users`` distinct chat prompts: a digit nonce (new every call) and a question each; for
    ``kind == "long"`` user 0's question follows the report paragraph repeated to ~``long_tokens``."""
    from tests.benchmarks.parity import nonce_prompt

    prompts = []
    for i in range(users):
        question = QUESTIONS[i % len(QUESTIONS)]
        text = question
        if kind == "long" and i == 0:
            one = len(tokenizer.encode_chat([{"role": "user", "content": LONG_PARAGRAPH + question}]))
            repeats = max(1, round(long_tokens / max(one - len(tokenizer.encode_chat(
                [{"role": "user", "content": question}])), 1)))
            text = LONG_PARAGRAPH * repeats + question
        chat = tokenizer.encode_chat([{"role": "user", "content": text}])
        prompts.append(nonce_prompt(tokenizer, chat, rng, nonce_tokens))
    return prompts


# -- per round and per cell ---------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def round_figures(runs: Sequence[UserRun]) -> dict[str, float]:
    """One round's figures from its users' runs (seconds from the round's start)."""
    total = sum(len(r.tokens) for r in runs)
    wall = max(r.last_s for r in runs)
    window = wall - min(r.ttft_s for r in runs)
    per_user = [r.decode_tok_s for r in runs]
    ttft_ms = [1000 * r.ttft_s for r in runs]
    return {"aggregate_tok_s": total / wall if wall > 0 else 0.0,
            "decode_tok_s": sum(len(r.tokens) - 1 for r in runs) / window if window > 0 else 0.0,
            "per_user_tok_s": median(per_user), "slowest_user_tok_s": min(per_user),
            "ttft_p50_ms": percentile(ttft_ms, 50), "ttft_p95_ms": percentile(ttft_ms, 95),
            "first_user_ttft_ms": ttft_ms[0], "wall_s": wall}


FIGURES = ("aggregate_tok_s", "decode_tok_s", "per_user_tok_s", "slowest_user_tok_s", "ttft_p50_ms", "ttft_p95_ms",
           "first_user_ttft_ms", "wall_s")


def cell_key(users: int, kind: str) -> str:
    return f"{users}" if kind == "short" else f"{users}-long"


def summarise(rounds: list[dict[str, Any]], variants: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per variant and cell: the median over timed rounds of every figure, and per-round ratios
    to the reference measured in the same round."""
    timed = [r for r in rounds if not r["warmup"]]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name in variants:
        for key in dict.fromkeys(r["cell"] for r in timed if r["variant"] == name):
            mine = [r for r in timed if r["variant"] == name and r["cell"] == key]
            s: dict[str, Any] = {f: median([r["figures"][f] for r in mine]) for f in FIGURES}
            s["rounds"] = len(mine)
            refs = {r["round"]: r for r in timed if r["variant"] == "reference" and r["cell"] == key}
            pairs = [(r["figures"]["aggregate_tok_s"], refs[r["round"]]["figures"]["aggregate_tok_s"])
                     for r in mine if r["round"] in refs]
            s["aggregate_vs_reference"] = median([a / b for a, b in pairs if b > 0]) if pairs else None
            s["same_tokens_as_paged_local"] = _agreement(timed, name, key)
            out.setdefault(name, {})[key] = s
        rows = out.get(name, {})
        for key, s in rows.items():  # a long row against the long row at 1 user
            one = rows.get("1-long" if key.endswith("-long") else "1")
            s["aggregate_vs_1_user"] = (s["aggregate_tok_s"] / one["aggregate_tok_s"]
                                        if one and one["aggregate_tok_s"] > 0 else None)
    return out


def _agreement(timed: list[dict[str, Any]], name: str, key: str) -> str | None:
    """"k/n": users whose greedy tokens equal the base variant's for the same prompt (same round)."""
    base = {r["round"]: r["tokens"] for r in timed if r["variant"] == AGREEMENT_BASE and r["cell"] == key}
    pairs = [(a, b) for r in timed if r["variant"] == name and r["cell"] == key and r["round"] in base
             for a, b in zip(r["tokens"], base[r["round"]], strict=True)]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}" if pairs else None


def targets(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The issue's two targets for the headline variant, or None where not measured."""
    ring = summary.get(HEADLINE, {}).get(str(TARGET_USERS))
    scaling = ring["aggregate_vs_1_user"] if ring else None
    vs_ref = ring["aggregate_vs_reference"] if ring else None
    return {"scaling": {"value": scaling, "target": SCALING_TARGET,
                        "verdict": verdict(scaling, SCALING_TARGET) if scaling is not None else NOT_MEASURED},
            "vs_reference": {"value": vs_ref, "target": REFERENCE_TARGET,
                             "verdict": verdict(vs_ref, REFERENCE_TARGET) if vs_ref is not None else NOT_MEASURED}}


# -- the run ------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _async_measure(args: argparse.Namespace, setup: Setup, tokenizer: Any) -> tuple[list, dict]:
    """Load every variant, then run the rounds; returns (rounds, variant statuses)."""
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    status: dict[str, dict[str, Any]] = {}
    runners = {}
    async with contextlib.AsyncExitStack() as stack:
        for name in names:
            started = time.perf_counter()
            try:
                if name == "reference":
                    if setup.reference_dir is None:
                        raise VariantUnavailable("no reference IR (see --reference)")
                    server = await asyncio.to_thread(ReferenceServer, setup.reference_dir, setup.reference_threads,
                                                     setup.max_users)
                    runners[name] = reference_round_runner(server, ROUND_TIMEOUT_S)
                    extra: dict[str, Any] = {"scheduler": server.scheduler, "properties": server.properties,
                                             "model_dir": str(setup.reference_dir)}
                else:
                    generator = await stack.enter_async_context(GENERATORS[name](setup))
                    runners[name] = generator_round_runner(generator, ROUND_TIMEOUT_S)
                    extra = {"stages": STAGES[name], "export": str(setup.one_stage if STAGES[name] == 1
                                                                   else setup.two_stage)}
            except VariantUnavailable as exc:
                _log(f"  {name}: skipped: {exc}")
                status[name] = {"ran": False, "reason": str(exc)}
                continue
            threads = setup.reference_threads if name == "reference" else setup.threads * STAGES[name]
            status[name] = {"ran": True, "load_s": round(time.perf_counter() - started, 2),
                            "inference_threads_total": threads, **extra}
            _log(f"  {name}: loaded in {status[name]['load_s']:.1f} s")
        rounds = await _async_rounds(args, runners, tokenizer)
    return rounds, status


async def _async_rounds(args: argparse.Namespace, runners: dict, tokenizer: Any) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    rounds: list[dict[str, Any]] = []
    turn = 0
    plan = cells(_ints(args.users), _ints(args.long_users))
    for users, kind in plan:
        key = cell_key(users, kind)
        for r in range(args.warmups + args.repeats):
            prompts = make_prompts(tokenizer, users, kind, rng, args.nonce_tokens, args.long_tokens)
            order = rotated(list(runners), turn)
            turn += 1
            for name in order:
                runs = await runners[name](prompts, args.new_tokens)
                short = [len(x.tokens) for x in runs if len(x.tokens) != args.new_tokens]
                if short:
                    raise RoundError(f"{name}, {users} users: users got {short} tokens, not {args.new_tokens}")
                rounds.append({"variant": name, "cell": key, "users": users, "prompts": kind, "round": r,
                               "warmup": r < args.warmups, "order": order,
                               "prompt_tokens": [len(p) for p in prompts],
                               "figures": round_figures(runs),
                               "users_runs": [{"ttft_s": x.ttft_s, "last_s": x.last_s} for x in runs],
                               "tokens": [list(x.tokens) for x in runs]})
            _log(f"  {key} users, round {r + 1}/{args.warmups + args.repeats}"
                 f"{' (warm-up)' if r < args.warmups else ''}: "
                 + ", ".join(f"{n} {rounds[-len(order) + i]['figures']['aggregate_tok_s']:.1f} tok/s"
                             for i, n in enumerate(order)))
    return rounds


def prepare(args: argparse.Namespace) -> tuple[Setup, Any, dict[str, Any]]:
    """The exports (made or reused), the tokenizer and the reference IR."""
    from engine.generation.tokenizer import ChatTokenizer
    from engine.shards.manifest import load_manifest
    from export.sources import default_cache_root, model_fingerprint, resolve_model
    from tests.benchmarks.kit import ensure_export
    from tests.benchmarks.parity import _builder_digest

    source = None
    if args.exports:
        one, two = (Path(p) for p in args.exports.split(",", 1))
    else:
        source = resolve_model(args.model)
        root = args.export_root or default_cache_root() / "bench-exports" / "batching" / _builder_digest()
        fingerprint = model_fingerprint(source.checkpoint_dir)
        one, _ = ensure_export(root, source, fingerprint, args.weights, 1, True)
        two, _ = ensure_export(root, source, fingerprint, args.weights, 2, True)
    tokenizer = ChatTokenizer(one / "tokenizer")
    long_rows = any(kind == "long" for _, kind in cells(_ints(args.users), _ints(args.long_users)))
    check_fits(args.long_tokens, args.new_tokens, load_manifest(one).model.max_position_embeddings, long_rows)
    reference_dir = _reference_dir(args, one, source)
    users = _ints(args.users)
    threads = args.threads
    ref_threads = args.reference_threads or threads * 2
    setup = Setup(one, two, threads, ref_threads, max(users), reference_dir)
    return setup, tokenizer, {"exports": [str(one), str(two)], "reference_dir": str(reference_dir)}


def _reference_dir(args: argparse.Namespace, one: Path, source: Any) -> Path | None:
    from tests.benchmarks.reference import export_reference, pipeline_dir_from_export

    if "reference" not in [v.strip() for v in args.variants.split(",")]:
        return None
    if args.reference_dir:
        return Path(args.reference_dir)
    if args.reference == "ours-ir":
        return pipeline_dir_from_export(one, one.parent / f"{one.name}-genai",
                                        source.checkpoint_dir if source is not None else None)
    if source is None:
        raise SystemExit("--reference optimum needs the checkpoint: give --model (or --reference-dir DIR)")
    return (cached_reference(source.checkpoint_dir, args.weights, args.group_size)
            or export_reference(source.checkpoint_dir, args.weights, group_size=args.group_size))


def cached_reference(checkpoint: Path, weights: str, group_size: int) -> Path | None:
    """A complete optimum-intel export already made from ``checkpoint`` (same directory, weights and
    group size), whatever fingerprint its name carries: a changed fingerprint function would
    otherwise re-export it (minutes)."""
    import json

    from export.sources import default_cache_root
    from tests.benchmarks.reference import EXPORT_RECORD, EXPORTS_SUBDIR, REQUIRED_EXPORT_FILES

    for record in sorted((default_cache_root() / EXPORTS_SUBDIR).glob(f"*/{EXPORT_RECORD}")):
        try:
            made = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        same = (made.get("checkpoint") == str(Path(checkpoint).resolve()) and made.get("weights") == weights
                and made.get("group_size") == (group_size if weights == "int4" else None))
        if same and all((record.parent / f).is_file() for f in REQUIRED_EXPORT_FILES):
            return record.parent
    return None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--users", default="1,2,4,8,16", help="concurrent user counts (default 1,2,4,8,16)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per request, EOS ignored (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per user count (default 3)")
    p.add_argument("--warmups", type=int, default=1, help="untimed rounds per user count first (default 1)")
    p.add_argument("--long-users", default="1,8",
                   help="user counts (of --users) that also get a row with user 0 on a long prompt (default 1,8; "
                        "'' for none)")
    p.add_argument("--long-tokens", type=int, default=1024, help="the long prompt's length, about (default 1024)")
    p.add_argument("--threads", type=int, default=1, help="inference threads per stage (default 1)")
    p.add_argument("--reference-threads", type=int, default=None,
                   help="the reference's inference threads (default: the ring's total, 2 x --threads)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"which to run (default {','.join(VARIANTS)})")
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: the embedded default model)")
    p.add_argument("--weights", default="int4", help="weight format of the exports and reference (default int4)")
    p.add_argument("--group-size", type=int, default=64, help="the optimum reference's INT4 group size (default 64)")
    p.add_argument("--exports", default=None, metavar="ONE,TWO",
                   help="an existing 1-stage and 2-stage export to use as they are (default: made under the cache)")
    p.add_argument("--export-root", type=Path, default=None, help="where the exports are made (default under the "
                   "cache, keyed by the exporter code)")
    p.add_argument("--reference", choices=("optimum", "ours-ir"), default="optimum",
                   help="the reference's IR: an optimum-intel export (default) or our 1-stage IR")
    p.add_argument("--reference-dir", default=None, help="an existing optimum-intel export to use as it is")
    p.add_argument("--nonce-tokens", type=int, default=8, help="digit tokens opening every prompt (default 8)")
    p.add_argument("--seed", type=int, default=7, help="the nonces' seed (default 7)")
    p.add_argument("--template", action="store_true",
                   help="measure nothing: write the section with every figure 'not yet measured'")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "batching.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def command_line(args: argparse.Namespace) -> str:
    parts = [COMMAND_LINE, f"--users {args.users}", f"--new-tokens {args.new_tokens}", f"--repeats {args.repeats}",
             f"--warmups {args.warmups}", f"--long-users '{args.long_users}'", f"--long-tokens {args.long_tokens}",
             f"--threads {args.threads}"]
    for flag, value, default in (("--reference-threads", args.reference_threads, None),
                                 ("--variants", args.variants, ",".join(VARIANTS)), ("--model", args.model, None),
                                 ("--weights", args.weights, "int4"), ("--exports", args.exports, None),
                                 ("--reference", args.reference, "optimum"),
                                 ("--reference-dir", args.reference_dir, None)):
        if value != default:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


# -- the section -------------------------------------------------------------------------------

CONDITIONS = (
    "Every user sends a distinct short chat prompt (an {nonce}-digit nonce, new every round, then one of 16 "
    "questions); a \"long\" row gives user 0 a ~{long}-token prompt instead. {new} greedy tokens per request, "
    "EOS ignored; f16 KV cache; prefix caching off everywhere; a token budget of 256 per step and chunked "
    "prefill (the paged scheduler's budget, the reference's max_num_batched_tokens). "
    "{threads} inference thread(s) per stage; the reference {ref_threads} (the ring's total). Variants: "
    "`paged-*` the paged coordinator (the stateful runtime's `stateful-*` rows are gone with that runtime, "
    "retired from serving in issue 27: see the history below), `*-local` the 1-stage export in this process, "
    "`*-ring` the 2-stage export, a worker process per stage on loopback; `reference` openvino_genai's "
    "ContinuousBatchingPipeline (add_request/step) on {ref_ir}. Rounds "
    "interleaved (every variant once per round, the order rotated each round), {warmups} warm-up round(s) per "
    "row, medians over {repeats}. Aggregate = all tokens / round wall time; decode = tokens after each user's "
    "first / (last token - first first token); per-user = a user's decode tok/s (median user / slowest); TTFT = "
    "round start to a user's first token; × 1 user = this row's aggregate / the same variant's at 1 user (a "
    "long row against the long row); × reference = median of per-round ratios of aggregates; same tokens = "
    "users whose greedy tokens equal paged-local's for the same prompt.")


def _cell(value: Any, spec: str = ".1f") -> str:
    return NOT_MEASURED if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"  # the row it compares with was not in this run


def render(result: dict[str, Any] | None, command: str, args: argparse.Namespace) -> str:
    """The section of docs/BENCHMARKS.md; ``result`` None gives the template (nothing measured)."""
    summary = result["summary"] if result else {}
    status = result["variants"] if result else {}
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    threads = args.threads
    ref_threads = args.reference_threads or 2 * threads
    ref_ir = ("our 1-stage IR" if args.reference == "ours-ir"
              else "an optimum-intel export of the same checkpoint (same compression)")
    if result:
        m = result["machine_at_start"]
        when = (f"{m['date']}, {m['cores']} cores, OpenVINO {m['openvino']}, load average at start "
                f"{m['load_average']}, at end {result['machine']['load_average']}; {result['seconds']:.0f} s")
    else:
        when = NOT_MEASURED
    lines = ["## Batching: concurrent users, batched in every stage or not, vs ContinuousBatchingPipeline\n",
             f"`{command}` → `{args.json}` ({when}). "
             + CONDITIONS.format(nonce=args.nonce_tokens, long=args.long_tokens, new=args.new_tokens,
                                 threads=threads, ref_threads=ref_threads, ref_ir=ref_ir, warmups=args.warmups,
                                 repeats=args.repeats) + "\n"]
    rows = []
    for users, kind in cells(_ints(args.users), _ints(args.long_users)):
        key = cell_key(users, kind)
        for name in names:
            s = summary.get(name, {}).get(key)
            total = ref_threads if name == "reference" else threads * STAGES[name]
            if s is None:
                reason = NOT_MEASURED if not status.get(name, {}).get("reason") else "skipped"
                rows.append([users, kind, name, total, *[reason] * 7])
                continue
            rows.append([users, kind, name, total, _cell(s["aggregate_tok_s"]), _cell(s["decode_tok_s"]),
                         f"{_cell(s['per_user_tok_s'])} / {_cell(s['slowest_user_tok_s'])}",
                         f"{_cell(s['ttft_p50_ms'], '.0f')} / {_cell(s['ttft_p95_ms'], '.0f')}",
                         _ratio(s["aggregate_vs_reference"]), _ratio(s["aggregate_vs_1_user"]),
                         s["same_tokens_as_paged_local"] or "–"])
    lines.append(markdown_table(["users", "prompts", "variant", "threads", "aggregate tok/s", "decode tok/s",
                                 "per-user tok/s (median / slowest)", "TTFT ms p50 / p95", "× reference",
                                 "× 1 user", "same tokens"], rows))
    t = targets(summary)
    lines += ["", markdown_table(["target (issue 14)", "value", "target", "verdict"], [
        [f"{HEADLINE}: {TARGET_USERS} users / 1 user, aggregate", _cell(t["scaling"]["value"], ".2f"),
         f"≥ {SCALING_TARGET:g}", t["scaling"]["verdict"]],
        [f"{HEADLINE} / reference at {TARGET_USERS} users, aggregate", _cell(t["vs_reference"]["value"], ".2f"),
         f"≥ {REFERENCE_TARGET:g}", t["vs_reference"]["verdict"]]])]
    skipped = [f"- `{n}` skipped: {s['reason']}" for n, s in status.items() if not s["ran"]]
    if skipped:
        lines += ["", *skipped]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.template:
        update_section(args.doc, "batching", render(None, command_line(args), args))
        _log(f"batching: wrote the template section of {args.doc}")
        return 0
    started = time.time()
    setup, tokenizer, where = prepare(args)
    info = machine_info()
    _log(f"batching: users {args.users}, {args.new_tokens} tokens, {args.repeats} repeats; loading the variants")
    rounds, status = asyncio.run(_async_measure(args, setup, tokenizer))
    ran = [n for n, s in status.items() if s["ran"]]
    summary = summarise(rounds, ran)
    result = {"benchmark": "batching", "command": command_line(args), "machine": machine_info(),
              "machine_at_start": info, "seconds": round(time.time() - started, 1),
              "settings": {"users": _ints(args.users), "long_users": _ints(args.long_users),
                           "long_tokens": args.long_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
                           "warmups": args.warmups, "threads_per_stage": setup.threads,
                           "reference_threads": setup.reference_threads, "nonce_tokens": args.nonce_tokens,
                           "kv_cache_precision": "f16", "prefix_caching": False, "ignore_eos": True,
                           "greedy": True, **where},
              "variants": status, "summary": summary, "targets": targets(summary), "rounds": rounds}
    write_json(args.json, result)
    text = render(result, result["command"], args)
    update_section(args.doc, "batching", text)
    print(text)
    return 0


COMMAND = Command(name="batching", help="N concurrent users: the paged coordinator, in-process and on a ring, "
                  "vs openvino_genai's ContinuousBatchingPipeline", configure=configure, run=run)
