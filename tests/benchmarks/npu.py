"""``python -m tests.benchmarks npu``: packed multi-slot serving on static (NPU-target) shards, on
the CPU.

The default model as one INT4 static stage (``--target npu``) at a fixed context of 1024, the
paper's Table 20 window. No NPU here: the same IR compiles for the CPU, so this measures the
packing on the CPU device. Variants, interleaved round by round, medians:

- step cost  ms per inference and per token with every slot decoding, for the unpacked decode
             graph (1 slot) and the packed graph at 4, 8 and 16 slots (paper: 6.0x at 16 on NPU)
- TTFT       4 concurrent chat requests: packed in a 4-slot export, against the unpacked export
             serving them one after another (its prefill chunk included); worst-case time to
             first token and wall clock until all finish
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.cli.main import Command
from tests.benchmarks.kit import add_common_arguments
from tests.benchmarks.kit import verdict as _verdict
from tests.benchmarks.record import machine_info, markdown_table, median, update_section, write_json

COMMAND_LINE = "python -m tests.benchmarks npu"
SLOTS = (1, 4, 8, 16)
PREFILL_CHUNK = 16
QUESTIONS = (
    "What is the capital of France? Answer with some history.",
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about office computers that work at night.",
    "List five uses of a spreadsheet in a small company.",
)
PAPER_RATIO_16 = 6.01  # Table 20: ms/token at 1 slot over 16 slots, Lunar Lake NPU
PAPER_TTFT_CPU = 12.53 / 2.93  # §8.6: worst-case TTFT, 4 requests, serialized over packed, CPU


def _export_job(job: dict[str, Any]) -> dict[str, Any]:
    """Runs in a spawned process, so the benchmark process never holds torch or the export."""
    from export.exporter import ExportOptions, export_model

    report = export_model(job["checkpoint"], job["out"], stages=1, name=job["name"],
                          fingerprint=job["fingerprint"],
                          options=ExportOptions(weights="int4", group_size=64, force=True, target="npu",
                                                context=job["context"], slots=job["slots"],
                                                prefill_chunk=job["chunk"]))
    return {"seconds": report.seconds, "stage_file_bytes": list(report.stage_file_bytes)}


def ensure_npu_exports(context: int) -> tuple[Any, dict[int, Path], dict[int, dict]]:
    """The default model's static exports per slot count (cached next to the other bench exports)."""
    from engine.errors import ManifestError
    from engine.shards.manifest import load_manifest
    from export.sources import default_cache_root, model_fingerprint, resolve_model

    source = resolve_model(None)
    fingerprint = model_fingerprint(source.checkpoint_dir)
    root = default_cache_root() / "bench-exports"
    paths, stats = {}, {}
    for slots in SLOTS:
        chunk = PREFILL_CHUNK if slots == 1 else None
        name = f"{fingerprint[:16]}-int4-npu-T{context}-s{slots}" + (f"-c{chunk}" if chunk else "")
        out, stats_file = root / name, root / f"{name}.stats.json"
        try:
            fresh = load_manifest(out).model.fingerprint == fingerprint and stats_file.is_file()
        except ManifestError:
            fresh = False
        if not fresh:
            print(f"  exporting {name} ...", file=sys.stderr, flush=True)
            job = {"checkpoint": str(source.checkpoint_dir), "out": str(out), "name": source.name,
                   "fingerprint": fingerprint, "context": context, "slots": slots, "chunk": chunk}
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                write_json(stats_file, pool.apply(_export_job, (job,)))
        paths[slots], stats[slots] = out, json.loads(stats_file.read_text())
    return source, paths, stats


def _all_decoding(chain) -> tuple[Any, np.ndarray]:
    """A frame with every slot decoding at the middle of its region (ring filled with noise)."""
    from dataclasses import replace

    from engine.wire.plan_frame import PlanFrame

    geo = chain.geometry
    count = geo.region // 2
    rng = np.random.default_rng(0)
    for stage in chain.stages:
        stage.ring.fill(rng, np.arange(geo.window))
        stage.slots = tuple(replace(r, count=count) for r in stage.slots)
    rows = [(k, count, 0) for k in range(geo.slots)]
    return PlanFrame.of(rows, geo.slots), rng.integers(100, 40000, geo.slots).astype(np.int64)


def time_interleaved(chains: dict[int, Any], steps: int) -> dict[int, list[float]]:
    """ms of one decode inference with every slot busy, per variant, the variants taking turns
    inference by inference so that the load of a shared machine falls on all of them alike.

    The ring state is reset before each inference, so every one sees the same frame; the graph
    computes all T columns whatever the mask, so the cost does not depend on the fill.
    """
    prepared = {s: (_all_decoding(c), [st.slots for st in c.stages]) for s, c in chains.items()}
    times: dict[int, list[float]] = {s: [] for s in chains}
    for _ in range(steps):
        for s, chain in chains.items():
            (frame, tokens), start = prepared[s]
            for stage, slots in zip(chain.stages, start, strict=True):
                stage.slots = slots
            t = time.perf_counter()
            chain.step(frame, tokens)
            times[s].append(1000 * (time.perf_counter() - t))
    return times


def serve(chain, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """All ``prompts`` submitted at once; per-request TTFT, total wall clock, the tokens."""
    from engine.static.packed_stage import PackedServer

    chain.reset()
    server = PackedServer(chain)
    t0 = time.perf_counter()
    ids = [server.submit(p, tokens, ignore_eos=True) for p in prompts]
    done = server.run()
    wall = time.perf_counter() - t0
    return {"ttft_s": [done[i].first_token - t0 for i in ids], "wall_s": wall, "steps": server.steps,
            "tokens": [done[i].tokens for i in ids]}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=int, default=1024, help="static context of the exports (default 1024)")
    p.add_argument("--steps", type=int, default=12, help="timed decode inferences per variant per round")
    add_common_arguments(p, "npu.json", runs=5, warmups=1)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from engine.generation.tokenizer import ChatTokenizer
    from engine.static.packed_stage import StaticChain

    load_start = [round(x, 2) for x in os.getloadavg()]
    source, paths, stats = ensure_npu_exports(args.context)
    machine = machine_info()
    chains = {s: StaticChain.load(paths[s]) for s in SLOTS}
    tok = ChatTokenizer(source.checkpoint_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    step_ms: dict[int, list[float]] = {s: [] for s in SLOTS}
    runs: dict[str, list[dict]] = {"packed": [], "serialized": []}
    for round_ in range(args.warmups + args.runs):
        print(f"  round {round_ + 1}/{args.warmups + args.runs}", file=sys.stderr, flush=True)
        for s, times in time_interleaved(chains, args.steps).items():
            if round_ >= args.warmups:
                step_ms[s] += times
        order = (("packed", chains[4]), ("serialized", chains[1]))
        for name, chain in order if round_ % 2 else order[::-1]:
            r = serve(chain, prompts, args.tokens)
            if round_ >= args.warmups:
                runs[name].append(r)
    slots = {}
    for s in SLOTS:
        ms = median(step_ms[s])
        # Paired: inference i of this variant against inference i of the 1-slot graph, run
        # next to each other; the median of those ratios is what the verdict uses.
        paired = [a / (b / s) for a, b in zip(step_ms[1], step_ms[s], strict=True)]
        slots[str(s)] = {"ms_per_step": ms, "ms_per_token": ms / s, "speedup": median(paired),
                         "context_per_slot": chains[s].geometry.region, "ms_per_step_all": step_ms[s]}
    marginal = (median(step_ms[16]) - median(step_ms[1])) / 15
    pk, se = runs["packed"], runs["serialized"]
    ttft = {name: {"worst_ttft_s": median([max(r["ttft_s"]) for r in rs]),
                   "mean_ttft_s": median([float(np.mean(r["ttft_s"])) for r in rs]),
                   "wall_s": median([r["wall_s"] for r in rs]), "inferences": rs[-1]["steps"],
                   "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]}
            for name, rs in runs.items()}
    ttft["worst_ttft_ratio"] = median([max(b["ttft_s"]) / max(a["ttft_s"]) for a, b in zip(pk, se, strict=True)])
    ttft["wall_ratio"] = median([b["wall_s"] / a["wall_s"] for a, b in zip(pk, se, strict=True)])
    agree = sum(a == b for a, b in zip(pk[-1]["tokens"], se[-1]["tokens"], strict=True))
    return {"benchmark": "npu", "command": COMMAND_LINE, "machine": machine, "load_average_before_exports": load_start,
            "load_average_end": [round(x, 2) for x in os.getloadavg()], "context": args.context,
            "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.tokens, "warmups": args.warmups,
            "runs": args.runs, "steps_per_round": args.steps, "slots": slots, "ttft": ttft,
            "marginal_row_ms": marginal,
            "token_agreement": f"{agree}/{len(prompts)}", "exports": {str(k): v for k, v in stats.items()}}


def render(result: dict[str, Any], json_path: Path) -> str:
    m = result["machine"]
    rows = [[s, v["context_per_slot"], v["ms_per_step"], min(v["ms_per_step_all"]), v["ms_per_token"], v["speedup"]]
            for s, v in result["slots"].items()]
    t = result["ttft"]
    p, s = t["packed"], t["serialized"]
    ttft_ratio, wall_ratio = t["worst_ttft_ratio"], t["wall_ratio"]
    speed16 = result["slots"]["16"]["speedup"]
    lines = [
        "## NPU path: packed multi-slot serving on static shards (CPU device)\n",
        f"`{result['command']}` → `{json_path}` ({m['date']}, {m['cores']} cores, OpenVINO {m['openvino']}, "
        f"load average at start {m['load_average']}, at the end {result['load_average_end']}: the machine "
        "is shared). Default model INT4 as one static stage exported with `--target npu --context "
        f"{result['context']}`; no NPU here, so the same IR runs on the CPU device with default plugin "
        f"settings. {result['warmups']} warm-up + {result['runs']} interleaved rounds, medians.\n",
        f"Step cost, every slot decoding ({result['steps_per_round']} inferences per variant per round, the "
        "variants taking turns inference by inference); 1 slot is the unpacked decode graph. "
        "× vs 1 slot is the median of paired ratios (each inference against the 1-slot one next to it):\n",
        markdown_table(["slots", "context per slot", "ms per inference", "fastest", "ms per token", "× vs 1 slot"],
                       rows),
        "",
        "The spread between the median and the fastest inference is the load of the other users of the "
        "machine; the paired ratio is the figure to read.",
        "",
        f"Four concurrent chat requests ({', '.join(map(str, result['prompt_tokens']))} prompt tokens, "
        f"{result['new_tokens']} new tokens each, EOS ignored): packed in the 4-slot export, or served one "
        f"after another by the unpacked export (decode graph + {PREFILL_CHUNK}-token prefill graph):\n",
        markdown_table(["variant", "worst TTFT s", "mean TTFT s", "all done s", "inferences"], [
            ["packed, 4 slots", p["worst_ttft_s"], p["mean_ttft_s"], p["wall_s"], p["inferences"]],
            ["serialized", s["worst_ttft_s"], s["mean_ttft_s"], s["wall_s"], s["inferences"]]]),
        "",
        markdown_table(["measure", "value", "target", "verdict"], [
            ["ms/token, 1 slot over 16 slots", speed16, f"≥ {PAPER_RATIO_16:.2f} (paper, NPU)",
             _verdict(speed16, PAPER_RATIO_16)],
            ["worst TTFT, serialized over packed", ttft_ratio, f"≥ {PAPER_TTFT_CPU:.2f} (paper, CPU)",
             _verdict(ttft_ratio, PAPER_TTFT_CPU)],
            ["all done, serialized over packed", wall_ratio, "≥ 2.0 (paper, CPU)", _verdict(wall_ratio, 2.0)],
        ]),
        "",
        f"Each extra decoding row costs {result['marginal_row_ms']:.2f} ms on top of the 1-slot inference (paper, "
        "NPU: 0.2-0.3 ms). A row is ~0.27 GFLOP of INT4 matrix products for this model, and on these 2 "
        "cores they are compute-bound: rows do not ride free on one weight stream as they do on the NPU. "
        "The TTFT ratios are medians of per-round ratios (packed and serialized alternate which goes first). "
        f"Packed and serialized greedy tokens agree on {result['token_agreement']} requests (default plugin "
        "precision; agreement at exact precision is a test).",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = bench(args)
    write_json(args.json, result)
    update_section(args.doc, "npu", render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="npu", help="packed multi-slot serving on static NPU-target shards (on the CPU)",
                  configure=configure, run=run)
