"""``deskfleet bench parity``: do our shards run as fast as the monolithic reference?

Variants, per weight format, all on the embedded default model, 128 greedy tokens, EOS ignored:

- A   ``openvino_genai.LLMPipeline`` on an optimum-intel export (the independent reference)
- B   our 1-stage shard                     - B0  the same without the beam_idx injection
- C2  2 stages chained in one process       - C3  3 stages chained in one process

All variants are loaded first, then run round-robin (2 warm-ups + N timed rounds) so that the
machine's noise hits every variant alike; medians are reported. Every export runs in a fresh
subprocess so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from engine.benchrecord import (
    machine_info,
    markdown_table,
    median,
    update_section,
    write_json,
)
from engine.cli import Command
from export.benchkit import (
    Run,
    Runner,
    add_common_arguments,
    default_model_exports,
    reference_runner,
    shard_runner,
)
from export.benchkit import verdict as _verdict

PROMPT = "What is the capital of France? Answer in one long paragraph about its history."
COMMAND_LINE = "deskfleet bench parity"
TARGETS = {"B/A": 1.00, "B/B0 (int4)": 2.0, "C2/A": 0.95, "C3/A": 0.93, "export RSS / largest stage": 2.0}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="int4,fp16", help="comma-separated weight formats (default int4,fp16)")
    add_common_arguments(p, "parity.json", runs=5, warmups=2)


def run(args: argparse.Namespace) -> int:
    from engine.tokenizer import ChatTokenizer
    from export.reference import export_reference

    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    runners: dict[str, Runner] = {}
    exports: dict[str, dict] = {}
    labels = (("B", 1, True), ("B0", 1, False), ("C2", 2, True), ("C3", 3, True))
    for w in formats:
        print(f"preparing {w} variants", file=sys.stderr, flush=True)
        source, dirs, stats = default_model_exports(*((w, stages, beam) for _, stages, beam in labels))
        runners[f"A {w}"] = reference_runner(export_reference(source.checkpoint_dir, w))
        for (label, _, _), out, st in zip(labels, dirs, stats, strict=True):
            exports[f"{label} {w}"] = st
            runners[f"{label} {w}"] = shard_runner(out)
    tokenizer = ChatTokenizer(source.checkpoint_dir)
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    runs: dict[str, list[Run]] = {k: [] for k in runners}
    for round_ in range(args.warmups + args.runs):
        timed = round_ >= args.warmups
        for name, runner in runners.items():
            r = runner(ids, args.tokens)
            if timed:
                runs[name].append(r)
        print(f"  round {round_ + 1}/{args.warmups + args.runs} {'timed' if timed else 'warm-up'}",
              file=sys.stderr, flush=True)
    result = summarise(runs, exports, formats, args, len(ids))
    write_json(args.json, result)
    update_section(args.doc, "parity", render(result, args.json))
    print(render(result, args.json))
    return 0


def summarise(runs: dict[str, list[Run]], exports: dict[str, dict], formats: list[str],
              args: argparse.Namespace, prompt_tokens: int) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        rows[name] = {
            "decode_tok_per_s": [r.decode_tok_per_s for r in rs],
            "ttft_ms": [r.ttft_s * 1000 for r in rs],
            "median_decode_tok_per_s": median([r.decode_tok_per_s for r in rs]),
            "median_ttft_ms": median([r.ttft_s * 1000 for r in rs]),
            "tokens": list(rs[-1].tokens) if rs else [],
        }
    ratios: dict[str, dict[str, float]] = {}
    for w in formats:
        tok = {v: rows[f"{v} {w}"]["median_decode_tok_per_s"] for v in ("A", "B", "B0", "C2", "C3")}
        ratios[w] = {"B/A": tok["B"] / tok["A"], "B/B0": tok["B"] / tok["B0"],
                     "C2/A": tok["C2"] / tok["A"], "C3/A": tok["C3"] / tok["A"]}
        same = {v: rows[f"{v} {w}"]["tokens"] == rows[f"B {w}"]["tokens"] for v in ("B0", "C2", "C3")}
        same["A"] = rows[f"A {w}"]["tokens"] == rows[f"B {w}"]["tokens"]
        ratios[w]["tokens_equal_to_B"] = same  # type: ignore[assignment]
    rss = {}
    for name, st in exports.items():
        largest = max(st["stage_file_bytes"])
        rss[name] = {"peak_rss_mb": st["peak_rss_bytes"] / 1e6, "after_imports_mb": st["baseline_rss_bytes"] / 1e6,
                     "largest_stage_mb": largest / 1e6, "ratio_absolute": st["peak_rss_bytes"] / largest,
                     "ratio_above_imports": (st["peak_rss_bytes"] - st["baseline_rss_bytes"]) / largest,
                     "export_seconds": st["seconds"]}
    return {"benchmark": "parity", "command": COMMAND_LINE, "machine": machine_info(), "prompt_tokens": prompt_tokens,
            "new_tokens": args.tokens, "warmups": args.warmups, "runs": args.runs, "variants": rows,
            "ratios": ratios, "export_rss": rss, "targets": TARGETS}


def render(result: dict[str, Any], json_path: Path) -> str:
    lines = ["## Parity: shards vs monolithic LLMPipeline\n",
             f"`{result['command']}` → `{json_path}` ({result['machine']['date']}, {result['machine']['cores']} cores, "
             f"OpenVINO {result['machine']['openvino']}, load average at start {result['machine']['load_average']}). "
             f"Default model, {result['prompt_tokens']}-token chat prompt, {result['new_tokens']} greedy tokens "
             f"with EOS ignored, {result['warmups']} warm-ups + {result['runs']} interleaved runs, medians.\n"]
    rows = [[name, v["median_decode_tok_per_s"], v["median_ttft_ms"]] for name, v in result["variants"].items()]
    lines.append(markdown_table(["variant", "decode tok/s", "TTFT ms"], rows))
    lines.append("")
    ratio_rows = []
    for w, r in result["ratios"].items():
        ratio_rows.append([w, r["B/A"], r["B/B0"], r["C2/A"], r["C3/A"],
                           ", ".join(f"{k}{'=' if v else '≠'}B" for k, v in r["tokens_equal_to_B"].items())])
    lines.append(markdown_table(["weights", "B/A (≥1.00)", "B/B0 (≥2.0 int4)", "C2/A (≥0.95)", "C3/A (≥0.93)",
                                 "greedy tokens"], ratio_rows))
    lines.append("")
    for w, r in result["ratios"].items():
        verdicts = [f"B/A {_verdict(r['B/A'], 1.0)}", f"C2/A {_verdict(r['C2/A'], 0.95)}",
                    f"C3/A {_verdict(r['C3/A'], 0.93)}"]
        if w == "int4":
            verdicts.append(f"B/B0 {_verdict(r['B/B0'], 2.0)}")
        lines.append(f"- {w}: " + "; ".join(verdicts))
    lines.append("")
    rss_rows = [[name, v["peak_rss_mb"], v["after_imports_mb"], v["largest_stage_mb"], v["ratio_absolute"],
                 v["ratio_above_imports"], v["export_seconds"]] for name, v in result["export_rss"].items()]
    lines.append(markdown_table(["export", "peak RSS MB", "RSS after imports MB", "largest stage MB",
                                 "peak / stage (≤2)", "(peak − imports) / stage", "export s"], rss_rows))
    return "\n".join(lines)


COMMAND = Command(name="parity", help="shards vs monolithic openvino_genai.LLMPipeline (decode tok/s, TTFT, RSS)",
                  configure=configure, run=run)
