"""``python -m tests.benchmarks shape-caches``: where a worker's RSS growth comes from, and what
stopping it costs.

The soak benchmark saw each worker's RSS rise ~10 % over 30 minutes of chat, when workers served
the stateful runtime (retired from serving in issue 27; the stateful export stays, and this
benchmark runs it in process through the greedy oracle's pieces, ``Stage`` and ``KVLayout``). A
stateful shard has dynamic shapes: every step's KV length differs, and each prefill chunk has its
own length.
OpenVINO's CPU plugin keeps the executors it builds for each input shape (its runtime cache,
``CPU_RUNTIME_CACHE_CAPACITY``) and oneDNN keeps its primitives (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``),
both least-recently-used and bounded by entry count, not bytes.

Three variants, each a fresh process running one stage of the default model (INT4, 2 stages,
stage 0, one inference thread) through the same streams: a prompt of random length in 128-token
prefill chunks, then decode steps; RSS sampled as streams finish.

- ``default``: new shapes all the time (random prompt lengths), caches as shipped;
- ``repeated``: the same few prompts over and over (shapes repeat), caches as shipped;
- ``off``: new shapes, both caches disabled.

If ``repeated`` stays flat while ``default`` grows, the growth is shape-keyed caching; ``off``
shows its price in ms. Variants alternate, round by round; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from engine.cli.main import Command
from tests.benchmarks.record import machine_info, markdown_table, median, update_section, write_json

COMMAND_LINE = "python -m tests.benchmarks shape-caches"
VARIANTS = ("default", "repeated", "off")
CHUNK = 128
_CACHE_OFF_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}
_CACHE_OFF_PROPERTIES = {"CPU_RUNTIME_CACHE_CAPACITY": "0"}


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run_variant(shards: Path, variant: str, streams: int, measure_from: int, max_prompt: int,
                decode_steps: int, seed: int) -> dict[str, Any]:
    """One variant in this process (run it in a fresh one): timings and RSS samples."""
    import numpy as np

    from engine.generation.in_process import prefill_steps
    from engine.shards.kv_layout import KVLayout
    from engine.shards.stage import Stage, StepInputs

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    if variant == "off" and os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") != "0":
        raise RuntimeError("the 'off' variant needs ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 set before OpenVINO loads")
    stage = Stage(shards, 0, num_threads=1, properties=_CACHE_OFF_PROPERTIES if variant == "off" else None)
    vocab = min(stage.manifest.model.vocab_size, 1000)
    rng = np.random.default_rng(seed)
    decode_ms: list[float] = []
    prefill_ms_per_token: list[float] = []
    rss: list[tuple[int, float]] = [(0, _rss_mb())]
    for i in range(streams):
        if variant == "repeated" and i % 5 == 0:
            rng = np.random.default_rng(seed)  # the same five prompts, hence the same shapes
        stream, layout = stage.new_stream(), KVLayout()
        length = int(rng.integers(16, max_prompt + 1))
        measured = i >= measure_from
        prefill = prefill_steps(length, CHUNK)
        for k, n in enumerate(prefill + [1] * decode_steps):
            step = StepInputs(rng.integers(0, vocab, (1, n), dtype=np.int64), *layout.plan(n))
            t = time.perf_counter()
            stream.forward(step)
            ms = (time.perf_counter() - t) * 1000
            if measured and k < len(prefill):
                prefill_ms_per_token.append(ms / n)
            elif measured:
                decode_ms.append(ms)
            layout.append(n)
        del stream
        if (i + 1) % 10 == 0 or i + 1 == streams:
            rss.append((i + 1, _rss_mb()))
    return {"variant": variant, "decode_ms": median(decode_ms), "prefill_ms_per_token": median(prefill_ms_per_token),
            "rss": rss}


def _child(shards: Path, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, **(_CACHE_OFF_ENV if variant == "off" else {})}
    cmd = [sys.executable, "-m", "tests.benchmarks.shape_caches", "--child", variant, "--shards", str(shards),
           "--streams", str(args.streams), "--measure-from", str(args.measure_from),
           "--max-prompt", str(args.max_prompt), "--decode-steps", str(args.decode_steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {variant} variant failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rss_at(samples: list[list[float]], stream: int) -> float:
    """RSS at the first sample taken once ``stream`` streams were done."""
    return next(mb for n, mb in samples if n >= stream)


def summarise(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, shards: Path) -> dict[str, Any]:
    rows = {}
    for variant, rs in runs.items():
        start = [rss_at(r["rss"], args.measure_from) for r in rs]
        end = [r["rss"][-1][1] for r in rs]
        rows[variant] = {"decode_ms": median([r["decode_ms"] for r in rs]),
                         "prefill_ms_per_token": median([r["prefill_ms_per_token"] for r in rs]),
                         "rss_start_mb": median(start), "rss_end_mb": median(end),
                         "growth_pct": median([100 * (e / s - 1) for s, e in zip(start, end, strict=True)]),
                         "runs": rs}
    base = rows["default"]
    ratios = {"decode off/default": rows["off"]["decode_ms"] / base["decode_ms"],
              "prefill off/default": rows["off"]["prefill_ms_per_token"] / base["prefill_ms_per_token"]}
    return {"benchmark": "shape-caches", "command": COMMAND_LINE, "machine": machine_info(), "shards": shards.name,
            "streams": args.streams, "measure_from": args.measure_from, "max_prompt": args.max_prompt,
            "decode_steps": args.decode_steps, "rounds": args.runs, "variants": rows, "ratios": ratios}


def render(result: dict[str, Any], json_path: Path) -> str:
    m, v = result["machine"], result["variants"]
    lines = ["## Shape caches: a worker's RSS growth and its price\n",
             f"`{result['command']}` → `{json_path}` ({m['date']}, {m['cores']} cores, OpenVINO {m['openvino']}, "
             f"load average at start {m['load_average']}). Stage 0 of `{result['shards']}` (the stateful export, "
             "in process; the stateful runtime that served it was retired from serving in issue 27), one inference "
             "thread, "
             f"{result['streams']} streams per process (prompt 16-{result['max_prompt']} tokens in {CHUNK}-token "
             f"chunks, then {result['decode_steps']} decode steps); times and RSS growth from stream "
             f"{result['measure_from']} to the end; {result['rounds']} rounds, variants alternating, each in a "
             "fresh process, medians.\n",
             markdown_table(["variant", "decode ms/step", "prefill ms/token", "RSS MB at start", "at end", "growth"],
                            [[name, r["decode_ms"], r["prefill_ms_per_token"], r["rss_start_mb"], r["rss_end_mb"],
                              f"{r['growth_pct']:+.2f} %"] for name, r in v.items()]),
             "",
             f"Caches off over default: decode {result['ratios']['decode off/default']:.2f}×, prefill "
             f"{result['ratios']['prefill off/default']:.2f}× the time.",
             "",
             *findings(v, result["ratios"])]
    return "\n".join(lines)


def findings(v: dict[str, Any], ratios: dict[str, float]) -> list[str]:
    """What the three rows say, worded from the numbers."""
    fresh, same, off = (v[k]["growth_pct"] for k in VARIANTS)
    shape_keyed = abs(same) < 1.0 < fresh
    return [
        f"- **default**: new prompt lengths, hence new shapes, all the time: RSS {fresh:+.1f} %.",
        f"- **repeated**: the same five prompts again and again, hence the same shapes: RSS {same:+.1f} %. "
        + ("The growth is shape-keyed caching (the plugin's per-shape executors and oneDNN's primitives, least "
           "recently used, bounded by entry count), not a leak in our code." if shape_keyed else
           "Growth without new shapes: look for a leak outside OpenVINO's caches."),
        f"- **off**: `CPU_RUNTIME_CACHE_CAPACITY=0` and `ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`: RSS {off:+.1f} %, "
        f"from a floor {v['off']['rss_start_mb'] - v['default']['rss_start_mb']:+.0f} MB above the default's, at "
        f"{ratios['decode off/default']:.2f}× the decode and {ratios['prefill off/default']:.2f}× the prefill "
        "time (every new shape rebuilds its kernels). Workers keep the caches on."]


def configure(p: argparse.ArgumentParser) -> None:
    from tests.benchmarks.kit import add_common_arguments

    p.add_argument("--shards", type=Path, default=None,
                   help="a stateful export (default: the embedded default model, INT4, 2 stages)")
    p.add_argument("--streams", type=int, default=70, help="streams per process (default 70)")
    p.add_argument("--measure-from", type=int, default=30, help="time and RSS growth from this stream on (default 30)")
    p.add_argument("--max-prompt", type=int, default=400, help="longest prompt in tokens (default 400)")
    p.add_argument("--decode-steps", type=int, default=30, help="decode steps per stream (default 30)")
    add_common_arguments(p, "shape_caches.json", runs=4, warmups=0)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.measure_from < args.streams:
        raise SystemExit("--measure-from must be at least 0 and less than --streams")
    shards = args.shards
    if shards is None:
        from tests.benchmarks.kit import default_model_exports

        _, (shards,), _ = default_model_exports(("int4", 2, True))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for round_ in range(args.runs):
        for variant in VARIANTS:
            runs[variant].append(_child(shards, variant, args))
        print(f"  round {round_ + 1}/{args.runs}", file=sys.stderr, flush=True)
    result = summarise(runs, args, shards)
    write_json(args.json, result)
    update_section(args.doc, "shape-caches", render(result, args.json))
    print(render(result, args.json))
    return 0


def _child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.shape_caches")
    p.add_argument("--child", required=True, choices=VARIANTS)
    p.add_argument("--shards", type=Path, required=True)
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--measure-from", type=int, required=True)
    p.add_argument("--max-prompt", type=int, required=True)
    p.add_argument("--decode-steps", type=int, required=True)
    a = p.parse_args(argv)
    out = run_variant(a.shards, a.child, a.streams, a.measure_from, a.max_prompt, a.decode_steps, seed=7)
    print(json.dumps(out))
    return 0


COMMAND = Command(name="shape-caches", help="a stateful export's stage RSS growth from OpenVINO's per-shape caches "
                  "(in process), and the time it costs to turn them off", configure=configure, run=run)

if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
