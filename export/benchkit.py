"""Shared pieces of the benchmarks: cached exports (each made in its own process, so its peak
RSS is its own), and runners that time one generation of a variant."""

from __future__ import annotations

import json
import multiprocessing
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.benchrecord import write_json


@dataclass(frozen=True)
class Run:
    tokens: tuple[int, ...]
    ttft_s: float
    decode_tok_per_s: float


Runner = Callable[[list[int], int], Run]


def _export_job(job: dict[str, Any]) -> dict[str, Any]:
    """Runs in a spawned process: export one variant and report its own peak RSS."""
    from export.exporter import ExportOptions, export_model

    report = export_model(job["checkpoint"], job["out"], stages=job["stages"],
                          options=ExportOptions(weights=job["weights"], beam_idx=job["beam_idx"], force=True),
                          name=job["name"], fingerprint=job["fingerprint"])
    return {"seconds": report.seconds, "peak_rss_bytes": report.peak_rss_bytes,
            "baseline_rss_bytes": report.baseline_rss_bytes, "stage_file_bytes": list(report.stage_file_bytes)}


def ensure_export(root: Path, source: Any, fingerprint: str, weights: str, stages: int, beam_idx: bool) -> tuple[Path, dict]:
    """Export (or reuse) one variant under ``root``; returns its directory and export stats."""
    from engine.errors import ManifestError
    from engine.manifest import load_manifest

    name = f"{fingerprint[:16]}-{weights}-{stages}{'' if beam_idx else '-nobeam'}"
    out, stats_file = root / name, root / f"{name}.stats.json"
    try:
        if load_manifest(out).model.fingerprint == fingerprint and stats_file.is_file():
            return out, json.loads(stats_file.read_text())
    except ManifestError:
        pass
    print(f"  exporting {name} ...", file=sys.stderr, flush=True)
    job = {"checkpoint": str(source.checkpoint_dir), "out": str(out), "stages": stages, "weights": weights,
           "beam_idx": beam_idx, "name": source.name, "fingerprint": fingerprint}
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        stats = pool.apply(_export_job, (job,))
    write_json(stats_file, stats)
    return out, stats


def shard_runner(export_dir: Path, num_threads: int | None = None) -> Runner:
    """Greedy generation over every stage of ``export_dir`` chained in this process."""
    from engine.generate import greedy_generate
    from engine.shard import LocalChain

    chain = LocalChain.load(export_dir, num_threads=num_threads)

    def run(ids: list[int], n: int) -> Run:
        r = greedy_generate(chain, ids, n, ignore_eos=True)
        return Run(r.tokens, r.ttft_s, r.decode_tok_per_s)

    return run


# Our shards' default KV-cache precision; the reference gets the same, so the comparison is of
# the export path alone (optimum's IR sets none, and the CPU plugin would default to u8).
REFERENCE_PROPERTIES = {"KV_CACHE_PRECISION": "f16"}


def reference_runner(model_dir: Path) -> Runner:
    """``openvino_genai.LLMPipeline`` on an optimum-intel export, all cores."""
    from export.reference import ReferencePipeline

    pipe = ReferencePipeline(model_dir, REFERENCE_PROPERTIES)

    def run(ids: list[int], n: int) -> Run:
        r = pipe.generate(ids, n)
        return Run(tuple(r.tokens), r.ttft_s, r.decode_tok_per_s)

    return run


def verdict(value: float, target: float, higher: bool = True) -> str:
    """How a measured figure stands against its target, for the tables."""
    ok = value >= target if higher else value <= target
    return "met" if ok else "**missed**"


def add_common_arguments(p: Any, json_name: str, runs: int, warmups: int) -> None:
    """--runs, --warmups, --tokens, --json and --doc, as every benchmark takes them."""
    from engine.benchrecord import DEFAULT_DOC, DEFAULT_JSON_DIR

    p.add_argument("--runs", type=int, default=runs, help=f"timed rounds (default {runs})")
    p.add_argument("--warmups", type=int, default=warmups, help=f"untimed rounds first (default {warmups})")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / json_name, help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def default_model_exports(*variants: tuple[str, int, bool]) -> tuple[Any, list[Path], list[dict]]:
    """The embedded default model and its exports for (weights, stages, beam_idx) variants."""
    from export.sources import default_cache_root, model_fingerprint, resolve_model

    source = resolve_model(None)
    fingerprint = model_fingerprint(source.checkpoint_dir)
    root = default_cache_root() / "bench-exports"
    made = [ensure_export(root, source, fingerprint, w, s, b) for w, s, b in variants]
    return source, [m[0] for m in made], [m[1] for m in made]
