"""``python -m tests.benchmarks grammar``: what grammar-constrained decoding costs per step on the
coordinator, for the default model's vocabulary (SmolLM2-135M-Instruct, 49,152 tokens).

Each grammar (``response_format`` json_object, a json_schema like a client's Pydantic model, a
tool call with ``tool_choice`` naming the function) follows a canned answer token by token, so
the matcher passes through the states a real answer does (keys, strings, numbers, nesting). At
every position it times, in µs: the packed mask (:meth:`GrammarMatcher.fill_mask`), committing the
token (:meth:`GrammarMatcher.consume`), and :func:`apply_mask` on one float32 logits row (the paths
that hold full logits). At 8 users it times the 8 masks of one step, one after another
(:func:`fill_masks`), and with llguidance's thread pool (``LLExecutor``), and the masks of a
4-token speculative draft (:meth:`GrammarMatcher.draft_masks`). Once per grammar: compiling it,
building a matcher, and its first mask; once per run: building the tokenizer.

No model runs: the figures are the grammar's own cost, to set against a decode step's time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.cli.main import Command
from engine.generation.grammar import GrammarMatcher, GrammarTokenizer, apply_mask, fill_masks
from engine.generation.response_format import ToolCallTemplate, response_format_grammar, tool_call_grammar
from tests.benchmarks.grammar_contention import measure_contention, render_contention
from tests.benchmarks.record import (
    DEFAULT_DOC,
    DEFAULT_JSON_DIR,
    machine_info,
    markdown_table,
    median,
    update_section,
    write_json,
)

COMMAND_LINE = "python -m tests.benchmarks grammar"
USERS = 8
DRAFT = 4

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
# grammar name -> (how it is built, the canned answer it follows)
CASES: dict[str, tuple[Callable[[], Any], str]] = {
    "json_object": (lambda: response_format_grammar({"type": "json_object"}),
                    '{"summary": "Quarterly sales rose 12 percent", "regions": [{"name": "north", "growth": 0.15}, '
                    '{"name": "south", "growth": 0.08}], "final": true}'),
    "json_schema": (lambda: response_format_grammar({"type": "json_schema", "json_schema": {
                        "name": "person", "schema": PERSON, "strict": True}}),
                    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "engines"], '
                    '"address": {"city": "London", "zip": "W1"}}'),
    "tool_call": (lambda: tool_call_grammar([ToolCallTemplate(
                      "get_weather", WEATHER, '<tool_call>\n{"name": "get_weather", "arguments": ',
                      "}\n</tool_call>")]),
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                  '\n</tool_call>'),
}


def _us(start_ns: int) -> float:
    return (time.perf_counter_ns() - start_ns) / 1000.0


def _p90(values: Sequence[float]) -> float:
    return float(np.percentile(values, 90)) if values else float("nan")


def walk(tok: GrammarTokenizer, grammar: Any, ids: Sequence[int], rng: np.random.Generator) -> dict[str, list[float]]:
    """Per-position timings (µs) of one matcher following ``ids``, then EOS."""
    matcher = tok.matcher(grammar)
    row = np.empty(tok.mask_width, np.uint32)
    logits = rng.normal(size=tok.logits_width).astype(np.float32)
    times: dict[str, list[float]] = {"mask": [], "consume": [], "apply": [], "draft": []}
    for i, token in enumerate([*ids, tok.eos_ids[0]]):
        t = time.perf_counter_ns()
        matcher.fill_mask(row)
        times["mask"].append(_us(t))
        t = time.perf_counter_ns()
        apply_mask(logits, row)
        times["apply"].append(_us(t))
        if i + DRAFT <= len(ids):
            t = time.perf_counter_ns()
            matcher.draft_masks(ids[i:i + DRAFT])
            times["draft"].append(_us(t))
        t = time.perf_counter_ns()
        matcher.consume([token])
        times["consume"].append(_us(t))
    assert matcher.is_stopped, "the canned answer does not complete its grammar"
    return times


def batch_walk(tok: GrammarTokenizer, grammar: Any, ids: Sequence[int], users: int) -> dict[str, list[float]]:
    """One step's masks for ``users`` streams at staggered positions of ``ids`` (µs per step):
    one after another, and through llguidance's thread pool."""
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask_par

    executor = llguidance.LLExecutor()
    matchers: list[GrammarMatcher] = []
    for u in range(users):
        m = tok.matcher(grammar)
        m.consume(ids[: (u * 3) % max(len(ids) // 2, 1)])
        matchers.append(m)
    out = np.empty((users, tok.mask_width), np.uint32)
    par = np.empty((users, tok.mask_width), np.int32)
    pairs = [(m.llg, i) for i, m in enumerate(matchers)]
    times: dict[str, list[float]] = {"sequential": [], "executor": []}
    steps = len(ids) - max(len(ids) // 2, 1)
    for _ in range(steps):
        t = time.perf_counter_ns()
        fill_masks(matchers, out)
        times["sequential"].append(_us(t))
        t = time.perf_counter_ns()
        fill_next_token_bitmask_par(executor, pairs, par)
        times["executor"].append(_us(t))
        np.testing.assert_array_equal(out.view(np.int32), par)
        for m in matchers:
            done = m.consumed
            if done < len(ids):
                m.consume([ids[done]])
    return times


def measure(tokenizer_json: Path, eos_id: int, runs: int, attackers: int = 8, big_properties: int = 1800
            ) -> dict[str, Any]:
    t = time.perf_counter()
    text = tokenizer_json.read_text(encoding="utf-8")
    vocab = GrammarTokenizer(text, logits_width=_vocab_size(text), eos_ids=[eos_id])
    tokenizer_s = time.perf_counter() - t
    warm = vocab.matcher(response_format_grammar({"type": "json_object"}))  # llguidance's one-off set-up,
    warm.mask()  # so that the per-request figures below are each request's own
    rng = np.random.default_rng(0)
    grammars: dict[str, dict[str, Any]] = {}
    for name, (build, answer) in CASES.items():
        once: dict[str, list[float]] = {"compile_ms": [], "matcher_ms": [], "first_mask_ms": []}
        per: dict[str, list[float]] = {"mask": [], "consume": [], "apply": [], "draft": [], "sequential": [],
                                       "executor": []}
        ids = vocab.llg.tokenize_str(answer)
        for _ in range(runs):  # interleaved: every measure of this grammar in each round
            t = time.perf_counter()
            grammar = build()
            once["compile_ms"].append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            first = vocab.matcher(grammar)
            once["matcher_ms"].append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            first.mask()
            once["first_mask_ms"].append((time.perf_counter() - t) * 1e3)
            for key, values in walk(vocab, grammar, ids, rng).items():
                per[key] += values
            for key, values in batch_walk(vocab, grammar, ids, USERS).items():
                per[key] += values
        grammars[name] = {
            "answer_tokens": len(ids), **{k: median(v) for k, v in once.items()},
            **{f"{k}_us_median": median(v) for k, v in per.items()},
            **{f"{k}_us_p90": _p90(v) for k, v in per.items()},
            "samples": {k: len(v) for k, v in per.items()},
        }
    contention = measure_contention(vocab, CASES["json_schema"][0], attackers, big_properties, runs)
    return {"vocab": vocab.logits_width, "mask_bytes": vocab.mask_width * 4, "tokenizer_s": tokenizer_s,
            "users": USERS, "draft": DRAFT, "runs": runs, "grammars": grammars, "contention": contention}


def _vocab_size(tokenizer_text: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_text).get_vocab_size(with_added_tokens=True)


def render(result: dict[str, Any], json_path: Path) -> str:
    m = result["machine"]
    head = (f"`{COMMAND_LINE}` → `{json_path.as_posix()}` ({m['cores']} cores, load {m['load_average']}, "
            f"{m['date']}). Vocabulary {result['vocab']:,} tokens: one packed mask is {result['mask_bytes']:,} bytes. "
            f"Each grammar follows a canned answer token by token, {result['runs']} rounds; µs per call, median "
            f"(p90); once per request: medians over the rounds. No model runs. The tokenizer took "
            f"{result['tokenizer_s']:.2f} s to build (once per model).")
    rows = []
    for name, g in result["grammars"].items():
        def cell(key: str, g: dict[str, Any] = g) -> str:
            return f"{g[key + '_us_median']:.0f} ({g[key + '_us_p90']:.0f})"

        rows.append([name, g["answer_tokens"], cell("mask"), cell("consume"), cell("apply"), cell("draft"),
                     cell("sequential"), cell("executor")])
    per_step = markdown_table(["grammar", "tokens", "mask", "consume", "apply_mask [V]",
                               f"draft masks ({result['draft']})", f"{result['users']} masks, in turn",
                               f"{result['users']} masks, LLExecutor"], rows)
    setup = markdown_table(["grammar", "compile", "matcher", "first mask"],
                           [[n, *(f"{g[k]:.2f} ms" for k in ("compile_ms", "matcher_ms", "first_mask_ms"))]
                            for n, g in result["grammars"].items()])
    return "\n\n".join([head, per_step, "Once per request:", setup,
                        render_contention(result["contention"], median, markdown_table)])


def _default_tokenizer(tmp: Path) -> tuple[Path, int]:
    from tokenizers import Tokenizer

    from export.gguf_tokenizer import write_tokenizer_files
    from export.sources import default_gguf_path

    write_tokenizer_files(default_gguf_path(), tmp)
    eos = Tokenizer.from_file(str(tmp / "tokenizer.json")).token_to_id("<|im_end|>")
    return tmp / "tokenizer.json", int(eos)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a tokenizer.json (default: the embedded default model's)")
    p.add_argument("--eos", type=int, default=None, help="its end-of-sequence id (needed with --tokenizer)")
    p.add_argument("--runs", type=int, default=5, help="rounds over every grammar (default 5)")
    p.add_argument("--attackers", type=int, default=8, help="big schemas one key asks for at once (default 8)")
    p.add_argument("--big-properties", type=int, default=1800,
                   help="integer properties of each big schema (default 1800: ~50 KB, inside the size budget)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "grammar.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        if args.tokenizer is None:
            tokenizer, eos = _default_tokenizer(Path(tmp))
        elif args.eos is None:
            raise SystemExit("--tokenizer needs --eos, the model's end-of-sequence id")
        else:
            tokenizer, eos = args.tokenizer, args.eos
        result = {"benchmark": "grammar", "command": COMMAND_LINE, "machine": machine_info(),
                  **measure(tokenizer, eos, args.runs, args.attackers, args.big_properties)}
    write_json(args.json, result)
    update_section(args.doc, "grammar", render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="grammar", help="the cost per step of grammar-constrained decoding (masks, consume, "
                  "apply) for the default model's vocabulary", configure=configure, run=run)



def main(argv: Sequence[str] | None = None) -> int:
    """Run it as ``python -m tests.benchmarks.grammar`` too (the same options)."""
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.grammar", description=COMMAND.help)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
