"""``deskfleet export`` (``deskfleet models`` is :mod:`console.fleet.models_cli`: it adds to the fleet service).

This module imports nothing heavy at load time: the CLI lists these commands even on a stage PC
without the export extra, and running them there explains which extra to install. The CPU/GPU
export needs openvino, numpy, safetensors and gguf only, for either target (CPU/GPU or ``--target
npu``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.cli.main import Command

EXPORT_STEPS = ("load", "convert", "stateful", "compress", "save")
# An NPU export pins static shapes where a stateful one adds state: same place in the bar.
_STEP_INDEX = {**{step: i for i, step in enumerate(EXPORT_STEPS)}, "static": EXPORT_STEPS.index("stateful")}


@contextlib.contextmanager
def export_progress() -> Iterator[Callable[[int, str], None]]:
    """One progress bar per stage on stderr, advanced by the exporter's (stage, step) callbacks."""
    # here, not at the top: `deskfleet --help` loads this module (the models/export commands) without tqdm
    from tqdm import tqdm

    bars: dict[int, tqdm] = {}

    def finish() -> None:
        for bar in bars.values():
            bar.update(bar.total - bar.n)
            bar.close()
        bars.clear()

    def progress(stage: int, step: str) -> None:
        if stage not in bars:
            finish()
            bars[stage] = tqdm(total=len(EXPORT_STEPS), desc=f"stage {stage}", unit="step", file=sys.stderr)
        bar = bars[stage]
        bar.set_postfix_str(step)
        bar.update(_STEP_INDEX[step] - bar.n)  # the steps before this one are done

    try:
        yield progress
    finally:
        finish()


def _split(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--split takes comma-separated layer numbers, e.g. 10,20 "
                                         f"(got {text!r})") from None


def configure_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--stages", type=int, help="number of stages, layers split as evenly as possible")
    how.add_argument("--split", type=_split, help="first layer of every stage after the first, e.g. 10,20")
    p.add_argument("--weights", choices=("int4", "int8", "fp16", "fp32", "keep"), default="int4",
                   help="weight compression (default int4); keep: a GGUF's own Q4_0/Q4_1/Q8_0/Q4_K/Q6_K "
                        "blocks as they are, no second rounding (GGUF models, stateful target)")
    p.add_argument("--group-size", type=int, default=64,
                   help="INT4 group size; must divide the hidden and intermediate sizes (default 64)")
    p.add_argument("--asym", action="store_true", help="asymmetric INT4 (default symmetric)")
    p.add_argument("--kv-cache-precision", choices=("f16", "f32", "u8"), default=None,
                   help="KV cache precision written into each shard's runtime options (default f16; "
                        "stateful target only)")
    p.add_argument("--no-beam-idx", action="store_true",
                   help="skip the beam_idx Gather injection (for comparison only: decode gets slower)")
    p.add_argument("--target", choices=("stateful", "npu"), default="stateful",
                   help="stateful: dynamic-shape shards with the KV cache in device state, for CPU/GPU "
                        "(default); npu: static, stateless shards with the KV cache on the host "
                        "(for the NPU; they also run on CPU)")
    p.add_argument("--context", type=int, default=None,
                   help="npu: attention length T fixed into the graph (past window = T - slots)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="npu: also export a prefill graph that consumes C prompt tokens per step")
    p.add_argument("--slots", type=int, default=1,
                   help="npu: export the packed graph serving this many concurrent requests (default 1)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--force", action="store_true", help="replace an existing export in --out")


def run_export(args: argparse.Namespace) -> int:
    # here: the exporter (OpenVINO, the builder) loads only for an export, not for `--help`
    from export.exporter import export_model
    from export.options import ExportError, ExportOptions
    from export.sources import resolve_model

    if args.target == "npu" and (args.kv_cache_precision or args.no_beam_idx):
        raise ExportError("--kv-cache-precision and --no-beam-idx apply to stateful shards only: an NPU "
                          "shard keeps its KV cache on the host (f32) and has no beam_idx input")
    options = ExportOptions(weights=args.weights, group_size=args.group_size, symmetric=not args.asym,
                            kv_cache_precision=args.kv_cache_precision or "f16", beam_idx=not args.no_beam_idx,
                            force=args.force, target=args.target, context=args.context, slots=args.slots,
                            prefill_chunk=args.prefill_chunk)
    source = resolve_model(args.model)
    with export_progress() as progress:
        report = export_model(source.weights, args.out, stages=args.stages, split=args.split,
                              options=options, name=source.name, progress=progress)
    m = report.manifest
    kind = "" if m.static is None else (
        f" static NPU (context {m.static.context}, {m.static.slots} slot(s)"
        + (f", prefill chunk {m.static.prefill_chunk}" if m.static.prefill_chunk else "") + ")")
    print(f"exported {m.model.name} ({m.model.architecture}, {m.model.num_layers} layers) "
          f"as {len(m.stages)} {args.weights}{kind} stage(s) to {report.out_dir} in {report.seconds:.1f} s")
    for s in m.stages:
        size = sum(f.size for f in s.files) / 1e6
        graphs = f", graphs {', '.join(g.name for g in s.graphs)}" if s.graphs else ""
        print(f"  stage {s.index}: layers {s.first_layer}-{s.last_layer}, {size:.1f} MB, "
              f"~{s.estimated_memory_bytes / 1e9:.2f} GB at run time{graphs}")
    return 0


EXPORT = Command(name="export", help="export a model into per-stage OpenVINO shards",
                 configure=configure_export, run=run_export)
