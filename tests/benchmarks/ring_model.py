"""``python -m tests.benchmarks ring-model``: the batched ring's *predicted* decode throughput on
2 and 4 PCs, next to what one box measures.

Nothing is run: one 2-core box cannot show a multi-PC gain (its two "PCs" share one memory path,
docs/BENCHMARKS.md, *Reading these numbers*), so this prints and records what
`engine.placement.throughput` predicts from the inputs below. Each input says where it comes
from; to re-predict from this session's own 1-box figures, edit the ``SMOL_*`` constants (the
per-stage step times at 1 and 8 rows) or pass ``--measured`` with the ring's aggregate tok/s.

Two row sets:
- **SmolLM2-135M INT4 on PCs like one core of this box** (one inference thread per stage), from
  measurements here: NOTES-paged-attention §4 (one batched infer per stage: ~15-20 ms at 1 row,
  40-54 ms at 8), the placement fit (4.1 ms of frame/TLS/copy CPU per stage and step), the
  pipeline split (0.75 ms coordinator per step), the exported stage sizes.
- **An 8B-class model (Llama-3-8B shape) INT4 on office PCs**: a prediction only, from the
  model's shape and typical hardware (DDR5 50-60 GB/s, gigabit Ethernet); no 8B run here.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engine.cli.main import Command
from engine.placement.throughput import (
    FleetPrediction,
    LinkSpec,
    ModelCost,
    PcSpec,
    RingSpec,
    StageCost,
    Workload,
    predict,
    predict_rings,
    split_stages,
    uniform_ring,
)
from tests.benchmarks.record import (
    DEFAULT_DOC,
    DEFAULT_JSON_DIR,
    machine_info,
    markdown_table,
    update_section,
    write_json,
)

COMMAND_LINE = "python -m tests.benchmarks ring-model"
USERS = (1, 8, 16)

# --- SmolLM2-135M-Instruct INT4, one thread per stage, this box ------------------------------------
# Stage files of the 2-stage export: 56.7 MB each = 15 layers (1.89 MB each, INT4 g64) + the
# embedding (stage 0, gathered, not streamed) or the tied LM head (stage 1, 28.4 MB, streamed).
# Weight rate 4.5 GB/s and the row costs are fitted so that the model gives NOTES §4's per-stage
# steps (stage 0 ~15 -> 40 ms, stage 1 ~20 -> 54 ms from 1 to 8 rows at ~50 cached tokens), with
# the context cost from §4's 8-row step at ~435 vs ~52 tokens (+13.5 ms).
SMOL = ModelCost(layers=30, layer_bytes=1.89e6, layer_row_ms=0.236, layer_context_ms=4e-5, head_bytes=28.4e6,
                 head_row_ms=1.29, hidden_size=576, fixed_ms=4.1)
SMOL_PC = PcSpec(weight_gb_s=4.5)
SMOL_CONTEXT = 50  # mean cached tokens per user (short chat prompts, as in §4 and the batching benchmark)
SMOL_EXPORT_SPLIT = (15, 15)  # the 2-stage export the 1-box rows run
# NOTES §4 (in-process, batched, 2 stages, 1 thread, ~50 tokens of context): aggregate tok/s.
SMOL_MEASURED = {1: 28.5, 8: 84.6}
SMOL_MEASURED_SOURCE = "NOTES-paged-attention §4, one process, batched, 2 stages"

# --- an 8B-class model (32 layers, hidden 4096, 8 KV heads of 128, vocab 128k), INT4, office PCs --
# Layers: 218 M parameters each at ~0.53 B (INT4 g128 + scales) = 115 MB; head 525 M parameters
# INT8 = 0.53 GB (streamed), embedding the same (gathered): 4.8 GB on disk, 4.2 GB streamed a step.
# Row: ~15 GFLOP of matmuls = 15 ms on a 6-8 core AVX2-VNNI desktop (~65 rows/s of batched prefill),
# the head 1 ms of it. Context: f16 K+V is 4 KiB per token per layer, read at the weight rate.
BIG_PC = PcSpec(weight_gb_s=50.0)  # DDR5 dual channel: 50-60 GB/s, the low end as the achieved rate
BIG = ModelCost(layers=32, layer_bytes=115e6, layer_row_ms=14.0 / 32, layer_context_ms=4096 / 50e6,
                head_bytes=0.53e9, head_row_ms=1.0, hidden_size=4096, fixed_ms=4.1)
BIG_CONTEXT = 1000  # mean cached tokens per user: office chats with some history

LOCAL = LinkSpec(latency_ms=0.75)  # a hop on one PC: (3.05 ms - 0.75 coordinator) / 3 hops, placement run
LAN = LinkSpec(latency_ms=1.0, gbit_s=0.94)  # gigabit Ethernet: the same software path + 0.25 ms of wire
COORDINATOR_MS = 0.75  # per step, the pipeline benchmark's split


def _smol_export_stages() -> tuple[StageCost, ...]:
    return tuple(SMOL.stage(n, last=k == len(SMOL_EXPORT_SPLIT) - 1) for k, n in enumerate(SMOL_EXPORT_SPLIT))


def layouts(model: ModelCost, pc: PcSpec, users: int, context: float, one_box: bool) -> list[dict[str, Any]]:
    """Every layout's prediction for ``users``: the baseline first (1 box = 2 stages on one memory
    path for the 135M export, 1 PC = 1 stage for the 8B), then 2 PCs and both 4-PC layouts; each
    with the number of micro-batches up to 2 per stage that would serve the most."""
    out = []

    def ring(stages: tuple[StageCost, ...], own: bool) -> RingSpec:
        return uniform_ring(stages, pc=pc, own_pcs=own, local=LOCAL, lan=LAN, hidden_size=model.hidden_size,
                            coordinator_ms=COORDINATOR_MS)

    def add(name: str, spec: RingSpec, m: int, rings: int = 1) -> None:
        def at(k: int) -> FleetPrediction:
            return predict_rings(spec, Workload(users, k, context), rings)

        fleet, best = at(m), max(range(1, 2 * len(spec.stages) + 1), key=lambda k: at(k).aggregate_tok_s)
        p = fleet.rings[0]
        out.append({"layout": name, "rings": len(fleet.rings), "users": users, "micro_batches": p.micro_batches,
                    "rows": max(p.rows), "slowest_stage_ms": max(p.stage_ms), "round_trip_ms": p.round_trip_ms,
                    "period_ms": p.period_ms, "bound": p.bound, "per_user_tok_s": fleet.per_user_tok_s,
                    "aggregate_tok_s": fleet.aggregate_tok_s, "best_micro_batches": min(best, users),
                    "best_aggregate_tok_s": at(best).aggregate_tok_s})

    if one_box:
        box = ring(_smol_export_stages(), own=False)
        add("1 box, 2 stages, M=1", box, 1)
        add("1 box, 2 stages, M=2", box, 2)
    else:
        add("1 PC, 1 stage", ring(split_stages(model, 1, pc, users, context), True), 1)
    for n in (2, 4):
        add(f"{n} PCs, {n} stages, M={n}", ring(split_stages(model, n, pc, -(-users // n), context), True), n)
    add("4 PCs, 2 rings of 2 stages, M=2 each", ring(split_stages(model, 2, pc, -(-users // 4), context), True), 2,
        rings=2)
    base = out[0]["aggregate_tok_s"]
    for row in out:
        row["x_baseline"] = row["aggregate_tok_s"] / base
    return out


def predict_all(measured: dict[int, float], source: str, measured_m: int = 1) -> dict[str, Any]:
    sets = []
    for name, model, pc, context, one_box in (
            ("SmolLM2-135M INT4, PCs like one core of this box", SMOL, SMOL_PC, SMOL_CONTEXT, True),
            ("8B-class INT4 (Llama-3-8B shape), office PCs: prediction only", BIG, BIG_PC, BIG_CONTEXT, False)):
        rows = [r for n in USERS for r in layouts(model, pc, n, context, one_box)]
        if one_box:
            for r in rows:
                if r["layout"] == f"1 box, 2 stages, M={measured_m}" and r["users"] in measured:
                    r["measured_tok_s"] = measured[r["users"]]
        sets.append({"name": name, "context_tokens": context, "model": asdict(model), "pc": asdict(pc),
                     "rows": rows})
    smol_check = [{"stage": k, "rows": b, "step_ms": predict(
        uniform_ring(_smol_export_stages(), pc=SMOL_PC, own_pcs=True, local=LOCAL, lan=LAN, hidden_size=576,
                     coordinator_ms=COORDINATOR_MS), Workload(b, 1, SMOL_CONTEXT)).stage_ms[k]}
        for k in (0, 1) for b in (1, 8)]
    return {"benchmark": "ring-model", "command": COMMAND_LINE, "machine": machine_info(),
            "links": {"local": asdict(LOCAL), "lan": asdict(LAN)}, "coordinator_ms": COORDINATOR_MS,
            "measured_source": source, "sets": sets, "smol_stage_check": smol_check}


def render(result: dict[str, Any], json_path: Path) -> str:
    lan, local = result["links"]["lan"], result["links"]["local"]
    lines = ["## Predicted multi-PC batched throughput (a model, not a measurement)\n",
             f"`{result['command']}` → `{json_path.as_posix()}` ({result['machine']['date']}). Nothing runs: "
             "`engine.placement.throughput` predicts steady decode on paged, micro-batched rings (its docstring "
             "has the model). A stage's step = fixed + its streamed weights / the PC's weight rate + rows × "
             "(row cost + context × per-token cost); a round (every user one token) takes the larger of the "
             "slowest micro-batch's round trip and the busiest PC, link or coordinator; N users in M "
             "micro-batches of ⌈N/M⌉ rows. Hops: on one PC "
             f"{local['latency_ms']} ms; between PCs {lan['latency_ms']} ms + {lan['gbit_s']} Gbit/s "
             f"(hidden states f32); coordinator {result['coordinator_ms']} ms per step, on stage 0's PC.\n",
             "**Assumptions**: each PC has its own memory bandwidth and cores and nothing else runs on it; "
             "stages on one PC share its memory path (their times add: what one 2-core box shows); rows add "
             "to the weight pass (no overlap: pessimistic where rows ride free on the weight stream); decode "
             "only (no prefill, no speculation, mean context constant); no scheduling stalls. Multi-PC rows "
             "use the split that balances their stages at that load; \"× base\" is against the set's first "
             "layout at the same users.\n"]
    header = ["layout", "users", "M", "rows/step", "slowest stage ms", "round trip ms", "round ms", "bound",
              "per-user tok/s", "aggregate tok/s", "× base", "best M: tok/s", "measured tok/s"]
    for s in result["sets"]:
        m = s["model"]
        lines += [f"### {s['name']}\n",
                  f"{m['layers']} layers of {m['layer_bytes'] / 1e6:.2f} MB streamed, head "
                  f"{m['head_bytes'] / 1e6:.1f} MB; per layer {m['layer_row_ms']:.3f} ms a row, "
                  f"{m['layer_context_ms'] * 1e3:.3f} µs a cached token; {m['fixed_ms']} ms per stage step; "
                  f"weight rate {s['pc']['weight_gb_s']} GB/s; {s['context_tokens']} cached tokens per user.\n",
                  markdown_table(header, [[r["layout"], r["users"], r["micro_batches"], r["rows"],
                                           r["slowest_stage_ms"], r["round_trip_ms"], r["period_ms"], r["bound"],
                                           r["per_user_tok_s"], r["aggregate_tok_s"], f"{r['x_baseline']:.2f}",
                                           f"{r['best_micro_batches']}: {r['best_aggregate_tok_s']:.1f}",
                                           r.get("measured_tok_s", "")] for r in s["rows"]]), ""]
    check = ", ".join(f"stage {c['stage']} at {c['rows']} row(s) {c['step_ms']:.1f} ms"
                      for c in result["smol_stage_check"])
    lines += [f"The 135M inputs against what they were fitted to: {check} (NOTES §4: ~15-20 ms at 1 row, "
              f"40-54 ms at 8). Measured column: {result['measured_source']}.\n", "Reading it:", ""]
    users = "/".join(str(n) for n in USERS)
    for s in result["sets"]:
        gains = {}
        for r in s["rows"]:
            gains.setdefault(r["layout"], []).append(f"{r['x_baseline']:.2f}")
        base = s["rows"][0]["layout"]
        lines.append(f"- {s['name'].split(',')[0]}, × {base} at {users} users: " + "; ".join(
            f"{name} ×{'/'.join(g)}" for name, g in gains.items() if not name.startswith(("1 box", "1 PC"))) + ".")
    rows = [r for s in result["sets"] for r in s["rows"]]
    box = {(r["users"], r["micro_batches"]): r["aggregate_tok_s"] for r in rows if r["layout"].startswith("1 box")}
    own = [r for r in rows if "PCs" in r["layout"]]
    box_worse = all(box[(n, 2)] < box[(n, 1)] for n in USERS if (n, 2) in box)
    s_best = all(r["best_micro_batches"] == r["micro_batches"] for r in own)
    trip = sum(r["bound"] == "round trip" for r in own)
    lines += [f"- On one box every extra micro-batch costs another weight pass (M=2 serves "
              f"{'less' if box_worse else 'not always less'} than M=1). On PCs of their own M = S "
              f"{'serves the most of M ≤ 2S in every row' if s_best else 'is not always the best M ≤ 2S'}; the "
              f"round trip bounds {trip} of {len(own)} multi-PC rows: hops, the coordinator and uneven stages "
              "leave each stage idle part of a round, and one more micro-batch costs another weight pass.",
              "- At a fixed number of users the gain comes from splitting every row's work over the PCs, so it "
              "grows with users toward S×; a lone user gains nothing (the hops cost it a little). Where the "
              "weights dominate, S PCs serve S times the users at about one PC's per-user speed until a "
              "link's bandwidth over a row's bytes caps it (the unit tests check both limits); at gigabit an "
              "8B row of f32 hidden states is 16 KB, about 7,000 rows/s per hop, far above these rates.",
              "- \"4 PCs\" both ways: one ring of 4 stages (each PC a quarter of the model) or two rings of 2 "
              "(half each, users split between them). Two rings pay fewer stage steps and hops per token and "
              "serve more whenever each PC can hold half the model; one ring of 4 needs a quarter per PC."]
    return "\n".join(lines)


def _measured(text: str) -> dict[int, float]:
    try:
        pairs = [p.split("=") for p in text.split(",") if p]
        return {int(u): float(t) for u, t in pairs}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--measured takes USERS=TOK_S,... (e.g. 1=30.5,8=120), not {text!r}") \
            from exc


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measured", type=_measured, default=None,
                   help="the 1-box ring's measured aggregate tok/s per user count, USERS=TOK_S,... "
                        f"(default: {SMOL_MEASURED_SOURCE})")
    p.add_argument("--measured-source", default=None, help="where --measured comes from, for the table's note")
    p.add_argument("--measured-micro-batches", type=int, choices=(1, 2), default=1,
                   help="how many micro-batches the measured 1-box run kept in flight (default 1)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "ring_model.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def run(args: argparse.Namespace) -> int:
    measured = SMOL_MEASURED if args.measured is None else args.measured
    source = SMOL_MEASURED_SOURCE if args.measured is None else (args.measured_source or "given on the command line")
    result = predict_all(measured, source, args.measured_micro_batches)
    write_json(args.json, result)
    text = render(result, args.json)
    update_section(args.doc, "ring-model", text)
    print(text)
    return 0


COMMAND = Command(name="ring-model", help="predicted decode tok/s of batched rings on 2 and 4 PCs (a model)",
                  configure=configure, run=run)
