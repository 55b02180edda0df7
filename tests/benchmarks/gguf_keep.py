"""``python -m tests.benchmarks gguf-keep``: a GGUF's own quantisation kept (``--weights keep``)
against the dequantised route and against re-quantising it to INT4.

The default model ships as a Q4_1 GGUF (groups of 32, an f16 scale and an f16 offset each).
Four 1-stage exports of that one file, all by :func:`export.exporter.export_model`:

- ``keep``       the Q4_1 blocks re-packed as u4 codes with their own scales and offsets (no rounding)
- ``fp32``       the same blocks dequantised to f32: the reference, what the GGUF means
- ``int4 g32``   dequantised, then RTN INT4 asymmetric, groups of 32 (the GGUF's group size)
- ``int4 g64``   the same with groups of 64 (the exporter's default group size)

Agreement: 8 fixed chat prompts, greedy tokens (EOS ignored) at the exact settings (f32 compute,
f32 KV, no dynamic quantisation); for each variant and prompt the index of the first token that
differs from ``fp32``'s (the token count = none differs).

Speed: ``keep``, ``int4 g32``, ``int4 g64`` at the default (fast) settings, one inference thread,
all loaded first, then round by round with the order rotated each round; decode tok/s and TTFT,
medians, and ratios as medians over rounds of the pair measured in the same round.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cli.main import Command
from tests.benchmarks.record import machine_info, markdown_table, median, update_section, write_json

COMMAND_LINE = "python -m tests.benchmarks gguf-keep"
REFERENCE = "fp32"
SPEED_VARIANTS = ("keep", "int4 g32", "int4 g64")
# Fixed, varied chat requests (facts, a list, code, a story, arithmetic, advice, translation, a
# definition), so that a divergence is not one prompt's accident.
PROMPTS = (
    "What is the capital of France? Answer in one long paragraph about its history.",
    "List five tips for staying focused while working from home, with a sentence on each.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "If a train travels 60 km in 45 minutes, what is its average speed? Show your steps.",
    "How should a small office back up its files? Give a practical plan.",
    "Translate into French and explain the grammar: 'The cat is sleeping on the warm windowsill.'",
    "Explain what photosynthesis is to a ten-year-old.",
)


@dataclass(frozen=True)
class Variant:
    """One export of the GGUF: ``weights`` as ``deskfleet export --weights`` takes it."""

    name: str
    weights: str
    group_size: int = 64
    symmetric: bool = True


VARIANTS = (Variant("keep", "keep"), Variant(REFERENCE, "fp32"),
            Variant("int4 g32", "int4", 32, symmetric=False), Variant("int4 g64", "int4", 64, symmetric=False))


def export_variants(gguf: Path, name: str, root: Path, variants: Sequence[Variant] = VARIANTS,
                    log: Callable[[str], None] = print) -> dict[str, Path]:
    """1-stage exports of ``gguf`` under ``root``, reused while the file and the exporter code are
    unchanged (the key holds both)."""
    from export.exporter import export_model
    from export.options import ExportOptions
    from export.sources import model_fingerprint
    from tests.benchmarks.parity import _builder_digest

    fingerprint = model_fingerprint(gguf)
    key = f"{fingerprint[:12]}-{_builder_digest()}"
    dirs = {}
    for v in variants:
        out = root / f"{key}-{v.weights}-g{v.group_size}-{'sym' if v.symmetric else 'asym'}-1"
        if not (out / "manifest.json").is_file():
            log(f"  exporting {v.name} ({v.weights}) ...")
            export_model(gguf, out, stages=1, name=name, fingerprint=fingerprint,
                         options=ExportOptions(weights=v.weights, group_size=v.group_size, symmetric=v.symmetric,
                                               force=True))
        dirs[v.name] = out
    return dirs


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """Index of the first token that differs (the shorter length if one is a prefix of the other)."""
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return min(len(tokens), len(reference))


def exact_tokens(export_dir: Path, prompts: Sequence[Sequence[int]], tokens: int,
                 threads: int | None) -> list[list[int]]:
    """Greedy tokens for every prompt at the exact settings (EOS ignored), one chain loaded."""
    from engine.generation.in_process import greedy_generate
    from engine.shards.stage import LocalChain

    chain = LocalChain.load(export_dir, exact=True, num_threads=threads)
    return [list(greedy_generate(chain, list(p), tokens, ignore_eos=True).tokens) for p in prompts]


def agreement(dirs: dict[str, Path], prompts: Sequence[Sequence[int]], tokens: int, threads: int | None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Each variant's first diverging token against the dequantised route, per prompt."""
    generated = {}
    for name, d in dirs.items():
        log(f"  exact greedy: {name}")
        generated[name] = exact_tokens(d, prompts, tokens, threads)
    ref = generated[REFERENCE]
    out = {}
    for name, runs in generated.items():
        if name == REFERENCE:
            continue
        first = [first_divergence(t, r) for t, r in zip(runs, ref, strict=True)]
        out[name] = {"first_divergence": first, "prompts_equal": sum(f == tokens for f in first),
                     "min_first_divergence": min(first), "median_first_divergence": median(first)}
    return {"variants": out, "tokens": generated}


def speed(dirs: dict[str, Path], prompts: Sequence[Sequence[int]], tokens: int, runs: int, warmups: int,
          threads: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Paired interleaved rounds of the speed variants at the default settings."""
    from tests.benchmarks.kit import shard_runner
    from tests.benchmarks.parity import interleave, paired

    runners = {name: shard_runner(dirs[name], num_threads=threads) for name in SPEED_VARIANTS}
    rounds = [list(prompts[i % len(prompts)]) for i in range(warmups + runs)]
    all_runs, orders = interleave(runners, rounds, tokens, log)
    timed = {k: v[warmups:] for k, v in all_runs.items()}
    variants = {name: {"decode_tok_per_s": [r.decode_tok_per_s for r in rs], "ttft_ms": [r.ttft_s * 1e3 for r in rs],
                       "median_decode_tok_per_s": median([r.decode_tok_per_s for r in rs]),
                       "median_ttft_ms": median([r.ttft_s * 1e3 for r in rs])} for name, rs in timed.items()}
    ratios = {f"keep/{other.split()[1]}": {"decode": paired(timed, "keep", other, "decode_tok_per_s"),
                                           "ttft": paired(timed, "keep", other, "ttft_s")}
              for other in SPEED_VARIANTS[1:]}
    return {"variants": variants, "ratios": ratios, "round_orders": orders}


def _export_mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and f.suffix in (".bin", ".xml")) / 1e6


def measure(gguf: Path, name: str, root: Path, prompts: Sequence[Sequence[int]], *, tokens: int, runs: int,
            warmups: int, threads: int, exact_threads: int | None,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every measurement of the benchmark on ``gguf`` (prompts as token ids)."""
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    dirs = export_variants(gguf, name, root, log=log)
    agree = agreement(dirs, prompts, tokens, exact_threads, log)
    fast = speed(dirs, prompts, tokens, runs, warmups, threads, log)
    return {"benchmark": "gguf-keep", "model": name, "gguf": gguf.name, "machine": machine_info(),
            "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()],
            "seconds": round(time.time() - started, 1), "new_tokens": tokens, "prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts], "runs": runs, "warmups": warmups,
            "threads": threads, "exact_threads": exact_threads, "reference": REFERENCE,
            "exports": {n: {"dir": d.name, "mb": round(_export_mb(d), 2)} for n, d in dirs.items()},
            "agreement": agree, "speed": fast}


def render(result: dict[str, Any], json_path: Path) -> str:
    m, n = result["machine"], result["new_tokens"]
    a, s = result["agreement"]["variants"], result["speed"]
    lines = [
        "## GGUF keep: the GGUF's own quantisation against the dequantised route and INT4\n",
        f"`{result['command']}` → `{json_path}` ({m['date']}, {m['cores']} cores, OpenVINO {m['openvino']}; "
        f"load average before {result['load_before']}, after {result['load_after']}; {result['seconds']:.0f} s). "
        f"`{result['gguf']}`, 1-stage exports by `deskfleet export`: `--weights keep`, `--weights fp32` (the "
        "dequantised route, the reference), `--weights int4 --asym --group-size 32` and `--group-size 64`.\n",
        f"**Agreement** with `fp32`: {result['prompts']} fixed chat prompts ({min(result['prompt_tokens'])}-"
        f"{max(result['prompt_tokens'])} tokens), {n} greedy tokens each with EOS ignored, at the exact settings "
        f"(f32 compute, f32 KV cache, no dynamic quantisation); the first diverging token index per prompt "
        f"({n} = none differs).\n",
        markdown_table(["variant", "first divergence per prompt", "prompts equal", "min", "export MB"],
                       [[k, " ".join(str(x) for x in v["first_divergence"]),
                         f"{v['prompts_equal']}/{result['prompts']}", v["min_first_divergence"],
                         result["exports"][k]["mb"]] for k, v in a.items()]),
        "",
        f"**Speed** at the default settings (f16 KV cache, the plugin's default precision), "
        f"{result['threads']} inference thread, {result['warmups']} untimed + {result['runs']} timed rounds over the "
        f"same prompts, variant order rotated each round; medians.\n",
        markdown_table(["variant", "decode tok/s", "TTFT ms"],
                       [[k, v["median_decode_tok_per_s"], v["median_ttft_ms"]] for k, v in s["variants"].items()]),
        "",
        markdown_table(["ratio (paired, median)", "decode", "TTFT"],
                       [[k, f"{v['decode']:.3f}×", f"{v['ttft']:.3f}×"] for k, v in s["ratios"].items()]),
        "",
        *findings(result),
    ]
    return "\n".join(lines)


def findings(result: dict[str, Any]) -> list[str]:
    """What the tables say, worded from the numbers."""
    a, r, n, p = result["agreement"]["variants"], result["speed"]["ratios"], result["new_tokens"], result["prompts"]
    keep = a["keep"]
    out = [("- **keep** gives the dequantised route's tokens on every prompt: the kept blocks compute what the "
            "GGUF means, with no second rounding." if keep["prompts_equal"] == p else
            f"- **keep** differs from the dequantised route on {p - keep['prompts_equal']} of {p} prompts (first at "
            f"token {keep['min_first_divergence']}): Q4_1's offset is kept as f16 (-m/d), within f16 rounding of "
            "the GGUF's, so a near-tie can flip.")]
    for name in ("int4 g32", "int4 g64"):
        v = a[name]
        out.append(f"- **{name}** (the Q4_1 values rounded a second time): {v['prompts_equal']}/{p} prompts equal, "
                   f"first divergence at median token {v['median_first_divergence']:.0f} of {n}.")
    d32, d64 = r["keep/g32"]["decode"], r["keep/g64"]["decode"]
    out.append(f"- Speed: keep decodes at {d32:.2f}× g32 and {d64:.2f}× g64 (TTFT {r['keep/g32']['ttft']:.2f}× and "
               f"{r['keep/g64']['ttft']:.2f}×). "
               + ("Keep is no slower than INT4 at the same group size." if d32 >= 0.97 else
                  "Keep is slower than INT4 at the same group size (a miss). Not diagnosed here; the one "
                  "difference in the weight pattern is keep's f16 per-group zero point (a Subtract of f16 values, "
                  "where INT4 asym subtracts u4 codes), so the CPU kernel's handling of it is the first suspect."))
    load = max(result["load_before"][0], result["load_after"][0])
    if load > (result["machine"]["cores"] or 1):
        out.append(f"- The machine was shared (1-minute load up to {load:.1f} on {result['machine']['cores']} cores): "
                   "absolute figures are low and noisy; the paired ratios are the result.")
    return out


def configure(p: argparse.ArgumentParser) -> None:
    from tests.benchmarks.kit import add_common_arguments

    p.add_argument("--threads", type=int, default=1, help="inference threads for the speed rounds (default 1)")
    p.add_argument("--exact-threads", type=int, default=None,
                   help="inference threads for the exact-settings agreement runs (default: all cores)")
    p.add_argument("--export-root", type=Path, default=None, help="where the exports are kept (default: the cache)")
    add_common_arguments(p, "gguf_keep.json", runs=8, warmups=1)


def _command_line(args: argparse.Namespace) -> str:
    parts = [COMMAND_LINE, f"--runs {args.runs}", f"--warmups {args.warmups}", f"--tokens {args.tokens}",
             f"--threads {args.threads}"]
    if args.exact_threads:
        parts.append(f"--exact-threads {args.exact_threads}")
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    from engine.generation.tokenizer import ChatTokenizer
    from export.sources import default_cache_root, resolve_model

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    source = resolve_model(None)
    if source.weights.suffix != ".gguf":
        raise SystemExit(f"the default model is not a GGUF ({source.weights}); gguf-keep needs one")
    tokenizer = ChatTokenizer(source.checkpoint_dir)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]
    root = args.export_root or default_cache_root() / "bench-exports" / "gguf-keep"
    result = measure(source.weights, source.name, root, prompts, tokens=args.tokens, runs=args.runs,
                     warmups=args.warmups, threads=args.threads, exact_threads=args.exact_threads, log=log)
    result = {"command": _command_line(args), **result}
    write_json(args.json, result)
    update_section(args.doc, "gguf-keep", render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="gguf-keep", help="a GGUF's own quantisation kept (--weights keep) against the dequantised "
                  "route (greedy agreement) and INT4 asym g32/g64 (speed)", configure=configure, run=run)
