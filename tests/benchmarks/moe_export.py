"""``python -m tests.benchmarks moe-export``: a Qwen3-30B-A3B-shaped mixture-of-experts exported to INT4
and served, against the bandwidth bound of the bytes a token really reads.

A random-weight bf16 checkpoint of Qwen3-30B-A3B's shape (hidden 2048, 32 query / 4 KV heads of 128,
128 experts of width 768 with 8 per token, vocab 151936), cut to ``--layers`` of its 48 so that it
fits a shared 2-core box, is written as a stream (8 MB slices of a bf16 pool at seeded offsets, as
export-memory writes its 8B shape). ``deskfleet export --weights int4`` exports it in a measured child
(peak RSS over the RSS after imports, seconds): the experts are quantised one by one, each with its
own scales, into one stacked constant per layer and projection. The stage is then served as one
loopback worker process and chained in one process (token ids must agree), and the served decode
speed is set against the bandwidth bound of the **active** bytes per token: the dense weights (minus
the embedding table, of which a token reads one row) plus top-k / experts of the expert weights.
The checkpoint and the export are deleted after; the load average is recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from engine.cli.main import Command
from tests.support.synthetic_checkpoint import Qwen3MoeShape

COMMAND_LINE = "python -m tests.benchmarks moe-export"
MB = 1024 * 1024
COMPLETE = ".complete"
# --toy: the benchmark's own test runs every step on this (seconds, not minutes)
TOY = Qwen3MoeShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, per_token=2,
                    expert_intermediate=32, vocab=512)


def write_moe_checkpoint(directory: Path, shape, seed: int = 0) -> Path:
    """A random-weight bf16 Qwen3-MoE checkpoint (config.json + one model.safetensors), streamed; a
    complete one of the same config is reused."""
    import numpy as np

    from tests.benchmarks.export_memory import POOL_VALUES, _bf16_pool, _write_bf16_shard
    from tests.support.synthetic_checkpoint import qwen3_moe_config, qwen3_moe_tensors

    directory = Path(directory)
    config = qwen3_moe_config(shape)
    marker = directory / COMPLETE
    if marker.is_file() and json.loads((directory / "config.json").read_text()) == config:
        return directory
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    tensors = qwen3_moe_tensors(shape)
    largest = max(int(np.prod(dims, dtype=np.int64)) for _, dims in tensors)
    pool = _bf16_pool(seed, min(POOL_VALUES, max(1 << 16, largest)))
    _write_bf16_shard(directory / "model.safetensors", tensors, pool, seed)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    marker.write_text("")
    return directory


def active_bytes(export_dir: Path, vocab: int, hidden: int) -> dict:
    """Weight bytes a decode step reads, from the manifest's MoE entry: the dense bytes less the
    embedding's INT8 codes (vocab x hidden; a token gathers one row), plus k / E of the experts'."""
    from engine.shards.manifest import load_manifest

    manifest = load_manifest(export_dir)
    moe = [s.moe for s in manifest.stages if s.moe is not None]
    if not moe:
        raise ValueError(f"{export_dir} has no mixture-of-experts stage")
    experts = sum(m.expert_bytes for m in moe)
    dense = sum(m.dense_bytes for m in moe)
    k, e = moe[0].per_token, moe[0].experts
    embedding = vocab * hidden
    return {"expert_bytes": experts, "dense_bytes": dense, "embedding_codes_bytes": embedding,
            "per_token": k, "experts": e, "active_bytes_per_token": dense - embedding + experts * k // e,
            "stage_bytes": [sum(f.size for f in s.files if f.path.endswith(".bin")) for s in manifest.stages]}


def run(args: argparse.Namespace) -> int:
    from tests.benchmarks.export_memory import BenchError, measure_export
    from tests.benchmarks.export_memory_serve import serve_phase
    from tests.benchmarks.record import machine_info, update_section, write_json
    from tests.support.synthetic_checkpoint import QWEN3_30B_A3B

    if args.render_only:
        recorded = json.loads(args.json.read_text())
        update_section(args.doc, "moe-export", render(recorded, args.json))
        return 0
    shape = replace(TOY if args.toy else QWEN3_30B_A3B, layers=args.layers)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    ckpt, out = work / f"qwen3-30b-a3b-shape-{shape.layers}l", work / "int4-1"
    result: dict = {"benchmark": "moe-export", "command": _command(args), "layers": shape.layers,
                    "layers_of_the_real_model": QWEN3_30B_A3B.layers, "group_size": args.group_size,
                    "shape": shape.__dict__}
    try:
        result["load_before_write"] = [round(x, 2) for x in os.getloadavg()]
        t = time.perf_counter()
        write_moe_checkpoint(ckpt, shape, seed=args.seed)
        result["checkpoint"] = {"bytes": (ckpt / "model.safetensors").stat().st_size,
                                "write_seconds": round(time.perf_counter() - t, 1)}
        result["load_before_export"] = [round(x, 2) for x in os.getloadavg()]
        result["export"] = measure_export(ckpt, out, 1, "int4", args.group_size, keep=True)
        if not result["export"].get("ok"):
            raise BenchError(f"the export failed: {result['export'].get('stdout_tail', '')[-500:]}")
        result["bytes"] = active_bytes(out, shape.vocab, shape.hidden)
        result["load_before_serve"] = [round(x, 2) for x in os.getloadavg()]
        served = serve_phase(out, tokens=args.tokens, threads=args.threads)
        bound = served["bandwidth"]["bytes_per_s"] / result["bytes"]["active_bytes_per_token"]
        served.update({"active_bound_tok_per_s": bound,
                       "served_fraction_of_active_bound": served["served"]["decode_tok_per_s"] / bound})
        result["serve"] = served
    except (BenchError, OSError, ValueError) as exc:
        result["error"] = str(exc)[-2000:]
    finally:
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            out.with_suffix(".log").unlink(missing_ok=True)  # the export child's stderr
    result["machine"] = machine_info()
    write_json(args.json, result)
    update_section(args.doc, "moe-export", render(result, args.json))
    print(render(result, args.json))
    return 1 if "error" in result else 0


def _command(args: argparse.Namespace) -> str:
    """The command as run: the options that differ from their defaults."""
    parts = [COMMAND_LINE]
    if args.toy:
        parts.append("--toy")
    for flag, value, default in (("--layers", args.layers, 4), ("--tokens", args.tokens, 16),
                                 ("--threads", args.threads, 1), ("--group-size", args.group_size, 128)):
        if value != default:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def render(result: dict, json_path: Path) -> str:
    from tests.benchmarks.record import markdown_table

    machine = result.get("machine", {})
    lines = ["## MoE export: a Qwen3-30B-A3B-shaped synthetic, INT4, served on one stage", "",
             f"`{result.get('command', COMMAND_LINE)}` (raw run: `{json_path}`; machine: {machine.get('cores', '?')} "
             f"cores, {machine.get('memory_gb', '?')} GiB, shared; {machine.get('date', '')}).", "",
             f"Qwen3-30B-A3B's shape (hidden 2048, 32 / 4 heads of 128, 128 experts of width 768, 8 per token, "
             f"vocab 151936) with **{result.get('layers')} of its {result.get('layers_of_the_real_model')} layers** "
             "(the disk and the time of a shared 2-core box), random bf16 weights written as a stream and deleted "
             f"after. `deskfleet export --weights int4 --group-size {result.get('group_size')} --stages 1` in a "
             "measured child (experts quantised one by one into one stacked constant per layer and projection), "
             "then the stage served as one loopback worker process with "
             f"{(result.get('serve') or {}).get('threads_per_worker', '?')} inference thread. The bound: a "
             "one-thread sweep's bytes/s over the **active** bytes per token (dense weights less the embedding "
             "table's codes, of which a token reads one row, plus 8/128 of the expert weights)."]
    if "error" in result:
        lines += ["", f"The run failed: {result['error'][:500]}"]
    ck, ex, by, sv = (result.get(k) or {} for k in ("checkpoint", "export", "bytes", "serve"))
    rows = []
    if ck:
        rows.append(["checkpoint (bf16)", f"{ck['bytes'] / 1e9:.2f} GB written in {ck['write_seconds']:.0f} s",
                     result.get("load_before_write")])
    if ex.get("ok"):
        net = ex["peak_minus_baseline_bytes"] / MB
        rows.append(["export to 1 INT4 stage", f"{ex.get('export_seconds', ex['wall_seconds']):.0f} s; stage "
                     f"{ex['largest_stage_bytes'] / MB:.0f} MiB; peak - baseline {net:.0f}"
                     f" MiB ({ex['net_over_largest_stage']:.2f} x the stage; bound 1.3 x + 64 MB "
                     f"{'met' if ex['within_bound'] else '**missed**'})", result.get("load_before_export")])
    if by:
        rows.append(["bytes per token", f"experts {by['expert_bytes'] / MB:.0f} MiB (all in memory), dense "
                     f"{by['dense_bytes'] / MB:.0f} MiB; active per token {by['active_bytes_per_token'] / MB:.0f} MiB",
                     ""])
    if sv:
        rows.append(["decode, served (1 worker)", f"{sv['served']['decode_tok_per_s']:.2f} tok/s (rounds: "
                     + ", ".join(f"{r['decode_tok_per_s']:.2f}" for r in sv["served"]["rounds"]) + "; best quoted)",
                     result.get("load_before_serve")])
        rows.append(["decode, chained in process", f"{sv['chained']['decode_tok_per_s']:.2f} tok/s; tokens equal to "
                     f"the served run over {sv['tokens']} steps: {'yes' if sv['tokens_equal'] else '**no**'}", ""])
        rows.append(["bandwidth bound (active bytes)", f"{sv['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s / "
                     f"{by['active_bytes_per_token'] / 1e9:.3f} GB = {sv['active_bound_tok_per_s']:.2f} tok/s; served "
                     f"= {sv['served_fraction_of_active_bound']:.2f} of it", ""])
    if rows:
        lines += ["", markdown_table(["step", "result", "load average (1, 5, 15 min) before it"], rows)]
    if by and sv:
        lines += ["", _whole_model(result)]
    lines += ["", f"Load average when recorded: {machine.get('load_average', '?')}. Figures on this shared machine "
              "move with its load; compare within the table."]
    return "\n".join(lines)


def _whole_model(result: dict) -> str:
    """The 48-layer model extrapolated from the cut, per layer (a prediction, not a measurement): the
    LM head's INT8 codes (vocab x hidden) are read once per token whatever the depth."""
    by, sv, layers = result["bytes"], result["serve"], result["layers"]
    real = result["layers_of_the_real_model"]
    head = by["embedding_codes_bytes"]  # the head's codes: the same vocab x hidden as the embedding's
    per_layer_active = (by["active_bytes_per_token"] - head) / layers
    active = head + per_layer_active * real
    experts = by["expert_bytes"] / layers * real
    return (f"Extrapolated to all {real} layers (predicted from the cut, not measured): experts "
            f"{experts / 1e9:.1f} GB held in memory (across the fleet's PCs), active "
            f"{per_layer_active / MB:.0f} MiB per layer + {head / MB:.0f} MiB of LM head = {active / 1e9:.2f} GB read "
            f"per token, a one-thread bound of {sv['bandwidth']['bytes_per_s'] / active:.2f} tok/s on this machine.")


def configure(p: argparse.ArgumentParser) -> None:
    from tests.benchmarks.record import DEFAULT_DOC, DEFAULT_JSON_DIR

    p.add_argument("--work", type=Path, default=Path("/var/tmp/deskfleet-moe-export"),
                   help="scratch directory for the checkpoint and the export (~1.3 GB a layer, + 1.3 GB)")
    p.add_argument("--layers", type=int, default=4, help="layers of the real model's 48 (default 4)")
    p.add_argument("--group-size", type=int, default=128, help="INT4 group size (default 128)")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated by the served/chained runs")
    p.add_argument("--threads", type=int, default=1, help="inference threads of the worker (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and the export")
    p.add_argument("--toy", action="store_true", help="a toy shape (hidden 64, 8 experts) for the benchmark's test")
    p.add_argument("--render-only", action="store_true", help="rewrite the Markdown section from --json, run nothing")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "moe_export.json")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC)


COMMAND = Command(name="moe-export", help="a Qwen3-30B-A3B-shaped synthetic (cut to --layers) exported to INT4 "
                  "and served on one stage, against the bandwidth bound of its active bytes", configure=configure,
                  run=run)
