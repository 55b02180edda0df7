"""``python -m tests.benchmarks pipeline``: the ring against one PC, single user and micro-batched.

The default model as 2 INT4 stages, each in its own worker process limited to one inference
thread so that the two behave like two PCs. Variants, interleaved round-robin, medians:

- REF   ``openvino_genai.LLMPipeline`` (the parity benchmark's reference), all cores, one user
- IN1   our 1-stage shard in-process, all cores
- IN2   our 2 stages chained in-process, one thread each (what the ring distributes)
- R1    the ring, one stream (naive pipeline parallelism)
- R2/R3 the ring with 2 / 3 streams micro-batched (aggregate and per stream)

The ring is the paged runtime's (``engine.tools.local_fleet.paged_local_fleet``: a paged worker
process per stage, a micro-batch in flight per stage as on separate PCs); the stateful runtime it
measured before issue 27 was retired from serving.

Plus a per-token time breakdown of R1 from the coordinator's own step log: stage compute (each
stage's ms as it reports it in the step's reply), the coordinator's own time per token (a token's
time beyond the step's round trip: scheduling, streaming it out) and the rest of the round trip
(serialisation, sockets, hand-offs), i.e. transport.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from engine.cli.main import Command
from tests.benchmarks.kit import (
    Run,
    add_common_arguments,
    default_model_exports,
    reference_runner,
    shard_runner,
)
from tests.benchmarks.kit import verdict as _verdict
from tests.benchmarks.record import (
    machine_info,
    markdown_table,
    median,
    update_section,
    write_json,
)

PROMPT = "What is the capital of France? Answer in one long paragraph about its history."
COMMAND_LINE = "python -m tests.benchmarks pipeline"
POOL_BYTES = 64 << 20  # the ring's KV block pool per stage: 3 streams of the prompt and --tokens, many times over


async def ring_run(coordinator, ids: list[int], n: int, streams: int) -> dict[str, Any]:
    """``streams`` identical-length requests at once; aggregate and per-stream decode rates."""
    from engine.generation.request import GenerationRequest

    async def one(k: int) -> tuple[float, float, int]:
        first = last = 0.0
        count = 0
        prompt = tuple(ids[k:] if k else ids)  # different prompts, so streams are not in lockstep by content
        async for _ in coordinator.stream(GenerationRequest(prompt, n, ignore_eos=True)):
            now = time.perf_counter()
            first = first or now
            last = now
            count += 1
        return first, last, count

    started = time.perf_counter()
    results = await asyncio.gather(*(one(k) for k in range(streams)))
    firsts, lasts = [r[0] for r in results], [r[1] for r in results]
    per_stream = [(c - 1) / (b - a) for a, b, c in results]
    aggregate = sum(c - 1 for *_, c in results) / (max(lasts) - min(firsts))
    return {"aggregate_tok_per_s": aggregate, "per_stream_tok_per_s": per_stream,
            "ttft_ms": [1000 * (f - started) for f in firsts]}


def r1_breakdown(steps: list[Any]) -> dict[str, Any]:
    """The single stream's ring steps (``BatchCoordinator.step_log`` entries of R1's decode, one
    row each): medians of each stage's compute ms as the stages report it, and of the round
    trip from the step's send to its answer."""
    decode = [s for s in steps if not s.failed and s.answered == 1 and s.tokens == 1 and s.stage_ms]
    if not decode:
        return {"stage_compute_ms": [], "round_trip_ms": float("nan"), "steps": 0}
    stages = len(decode[0].stage_ms)
    return {"stage_compute_ms": [median([s.stage_ms[i] for s in decode]) for i in range(stages)],
            "round_trip_ms": median([1000 * (s.answered_at - s.sent_at) for s in decode]), "steps": len(decode)}


def configure(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, "pipeline.json", runs=5, warmups=2)


async def _async_bench(args: argparse.Namespace) -> dict[str, Any]:
    from engine.generation.tokenizer import ChatTokenizer
    from engine.tools.local_fleet import paged_local_fleet
    from tests.benchmarks.reference import export_reference

    source, (one, two), _ = default_model_exports(("int4", 1, True), ("int4", 2, True))
    ids = ChatTokenizer(source.checkpoint_dir).encode_chat([{"role": "user", "content": PROMPT}])
    sync_runners = {"REF": reference_runner(export_reference(source.checkpoint_dir, "int4")),
                    "IN1": shard_runner(one), "IN2": shard_runner(two, num_threads=1)}
    rows: dict[str, list] = {k: [] for k in [*sync_runners, "R1", "R2", "R3"]}
    r1_steps: list[Any] = []
    # lanes=None: a micro-batch in flight per stage, as the ring of separate PCs this imitates
    async with paged_local_fleet(two, slots=3, threads=1, lanes=None, kv_pool_bytes=POOL_BYTES) as coordinator:
        for round_ in range(args.warmups + args.runs):
            timed = round_ >= args.warmups
            for name, runner in sync_runners.items():
                r: Run = await asyncio.to_thread(runner, ids, args.tokens)
                if timed:
                    rows[name].append({"aggregate_tok_per_s": r.decode_tok_per_s, "ttft_ms": [1000 * r.ttft_s]})
            for k in (1, 2, 3):
                before = max((s.seq for s in coordinator.step_log), default=0)
                r = await ring_run(coordinator, ids, args.tokens, k)
                if timed:
                    rows[f"R{k}"].append(r)
                    if k == 1:
                        r1_steps += [s for s in coordinator.step_log if s.seq > before]
            print(f"  round {round_ + 1}/{args.warmups + args.runs} {'timed' if timed else 'warm-up'}",
                  file=sys.stderr, flush=True)
    return summarise(rows, r1_breakdown(r1_steps), args, len(ids))


def summarise(rows: dict[str, list], r1: dict[str, Any], args: argparse.Namespace,
              prompt_tokens: int) -> dict[str, Any]:
    variants = {}
    for name, rs in rows.items():
        variants[name] = {
            "runs": rs,
            "median_aggregate_tok_per_s": median([r["aggregate_tok_per_s"] for r in rs]),
            "median_per_stream_tok_per_s": median([min(r.get("per_stream_tok_per_s", [r["aggregate_tok_per_s"]]))
                                                   for r in rs]),
            "median_ttft_ms": median([max(r["ttft_ms"]) for r in rs]),
        }
    agg = {k: v["median_aggregate_tok_per_s"] for k, v in variants.items()}
    step_ms = 1000 / agg["R1"]  # one token of a single stream = one trip around the ring
    compute = r1["stage_compute_ms"]
    overhead = step_ms - r1["round_trip_ms"]
    ratios = {"R2/R1": agg["R2"] / agg["R1"], "R1/IN2": agg["R1"] / agg["IN2"], "R2/REF": agg["R2"] / agg["REF"],
              "R3/REF": agg["R3"] / agg["REF"], "R1/REF": agg["R1"] / agg["REF"], "IN1/REF": agg["IN1"] / agg["REF"]}
    breakdown = {"r1_ms_per_token": step_ms, "stage_compute_ms": compute, "coordinator_overhead_ms": overhead,
                 "transport_ms": r1["round_trip_ms"] - sum(compute), "r1_steps_measured": r1["steps"]}
    return {"benchmark": "pipeline", "command": COMMAND_LINE, "machine": machine_info(), "prompt_tokens": prompt_tokens,
            "new_tokens": args.tokens, "warmups": args.warmups, "runs": args.runs, "variants": variants,
            "ratios": ratios, "breakdown": breakdown,
            "targets": {"R2/R1": 1.85, "R1/IN2": 0.9, "R2/REF": 2.0}}


def render(result: dict[str, Any], json_path: Path) -> str:
    m = result["machine"]
    lines = ["## Pipeline: the 2-node ring on loopback vs one PC\n",
             f"`{result['command']}` → `{json_path}` ({m['date']}, {m['cores']} cores, OpenVINO {m['openvino']}, "
             f"load average at start {m['load_average']}). Default model INT4, 2 paged stages in 2 worker "
             f"processes, one inference thread each, a micro-batch in flight per stage; "
             f"{result['prompt_tokens']}-token prompt, {result['new_tokens']} tokens with EOS ignored, "
             f"{result['warmups']} warm-ups + {result['runs']} interleaved rounds, medians.\n"]
    names = {"REF": "LLMPipeline (monolithic, all cores)", "IN1": "1 stage in-process (all cores)",
             "IN2": "2 stages in-process (1 thread each)", "R1": "ring, 1 stream", "R2": "ring, 2 streams",
             "R3": "ring, 3 streams"}
    rows = [[names[k], v["median_aggregate_tok_per_s"], v["median_per_stream_tok_per_s"], v["median_ttft_ms"]]
            for k, v in result["variants"].items()]
    lines.append(markdown_table(["variant", "aggregate tok/s", "slowest stream tok/s", "TTFT ms (worst)"], rows))
    r = result["ratios"]
    lines += ["", markdown_table(["ratio", "value", "target", "verdict"], [
        ["2 streams / 1 stream (R2/R1)", r["R2/R1"], "≥ 1.85", _verdict(r["R2/R1"], 1.85)],
        ["ring 1 stream / in-process 2 stages (R1/IN2)", r["R1/IN2"], "≥ 0.90", _verdict(r["R1/IN2"], 0.9)],
        ["headline: 2 users on the ring / LLMPipeline 1 user (R2/REF)", r["R2/REF"], "≥ 2.0",
         _verdict(r["R2/REF"], 2.0)],
        ["3 users on the ring / LLMPipeline (R3/REF)", r["R3/REF"], "", ""],
        ["our 1 stage / LLMPipeline (IN1/REF)", r["IN1/REF"], "", ""],
    ])]
    b = result["breakdown"]
    lines += ["", "Per-token time of a ring step (ms): "
              + ", ".join(f"stage {i} compute {c:.2f}" for i, c in enumerate(b["stage_compute_ms"]))
              + f", coordinator {b['coordinator_overhead_ms']:.2f}, transport (frames, sockets, hand-offs) "
              f"{b['transport_ms']:.2f}; one token of R1 takes {b['r1_ms_per_token']:.2f}."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_async_bench(args))
    write_json(args.json, result)
    update_section(args.doc, "pipeline", render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="pipeline", help="the 2-node ring vs one PC: single user, micro-batched, breakdown",
                  configure=configure, run=run)
