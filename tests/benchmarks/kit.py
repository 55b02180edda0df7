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

from tests.benchmarks.record import write_json

REPO = Path(__file__).resolve().parents[2]  # the clone's root: children run `python -m tests...` there


@dataclass(frozen=True)
class Run:
    tokens: tuple[int, ...]
    ttft_s: float
    decode_tok_per_s: float


Runner = Callable[[list[int], int], Run]


def _export_job(job: dict[str, Any]) -> dict[str, Any]:
    """Runs in a spawned process: export one variant and report its own peak RSS."""
    from export.exporter import ExportOptions, export_model
    from tests.benchmarks.export_child import peak_rss_bytes, reset_peak_rss

    baseline = reset_peak_rss()
    report = export_model(job["checkpoint"], job["out"], stages=job["stages"],
                          options=ExportOptions(weights=job["weights"], beam_idx=job["beam_idx"], force=True),
                          name=job["name"], fingerprint=job["fingerprint"])
    return {"seconds": report.seconds, "peak_rss_bytes": peak_rss_bytes(),
            "baseline_rss_bytes": baseline, "stage_file_bytes": list(report.stage_file_bytes)}


def ensure_export(root: Path, source: Any, fingerprint: str, weights: str, stages: int,
                  beam_idx: bool) -> tuple[Path, dict]:
    """Export (or reuse) one variant under ``root``; returns its directory and export stats."""
    from engine.errors import ManifestError
    from engine.shards.manifest import load_manifest

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
    from engine.generation.in_process import greedy_generate
    from engine.shards.stage import LocalChain

    chain = LocalChain.load(export_dir, num_threads=num_threads)

    def run(ids: list[int], n: int) -> Run:
        r = greedy_generate(chain, ids, n, ignore_eos=True)
        return Run(r.tokens, r.ttft_s, r.decode_tok_per_s)

    return run


# Our shards' default KV-cache precision; the reference gets the same, so the comparison is of
# the export path alone (optimum's IR sets none, and the CPU plugin would default to u8).
REFERENCE_PROPERTIES = {"KV_CACHE_PRECISION": "f16"}


def reference_runner(model_dir: Path, *, backend: str | None = None, num_threads: int | None = None) -> Runner:
    """``openvino_genai.LLMPipeline`` on ``model_dir`` (all cores unless ``num_threads``);
    ``backend`` "sdpa" or "pa" as :func:`tests.benchmarks.reference.pipeline_properties` says."""
    from tests.benchmarks.reference import ReferencePipeline

    props: dict[str, Any] = dict(REFERENCE_PROPERTIES)
    if num_threads:
        props["INFERENCE_NUM_THREADS"] = num_threads
    pipe = ReferencePipeline(model_dir, props, backend=backend)  # type: ignore[arg-type]

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
    from tests.benchmarks.record import DEFAULT_DOC, DEFAULT_JSON_DIR

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


# -- an export measured from outside ----------------------------------------------------------

EXPORT_CHILD = "tests.benchmarks.export_child"  # `deskfleet export` with its peak RSS printed
_SAMPLE_S = 0.05  # the kernel keeps no peak for RssAnon/RssFile: sample them this often
_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def export_or_default(export: Path | None) -> tuple[Path, str]:
    """A benchmark's ``--export`` and its model's name, or the embedded default model's 2-stage INT4
    export (made on first use) named "<model> INT4"."""
    from engine.shards.manifest import load_manifest

    if export is not None:
        return export, load_manifest(export).model.name
    source, (made,), _ = default_model_exports(("int4", 2, True))
    return made, f"{source.name} INT4"


def _status_kb(pid: int) -> dict[str, int]:
    """The memory fields of /proc/<pid>/status in kB ({} once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in _STATUS_FIELDS:
            out[key] = int(value.split()[0])
    return out


@dataclass(frozen=True)
class ExportMemory:
    """One `deskfleet export` run as the parent saw it (bytes; ``peak_*`` from 50 ms samples).

    ``vmhwm`` is the kernel's peak RSS (exact); anonymous and file-backed RSS have no kernel
    peak, so ``peak_anon``/``peak_file`` are the largest sampled values and ``at_peak_*`` the
    split in the sample with the largest RSS. ``after_imports*`` is the RSS the parent read once
    the CLI's modules were imported (the child waits for it); ``exporter_baseline`` the RSS the
    child printed when it reset its peak, just before the export (MB precision).
    """

    seconds: float
    after_imports: int
    after_imports_anon: int
    after_imports_file: int
    exporter_baseline: int
    vmhwm: int
    peak_anon: int
    peak_file: int
    at_peak_anon: int
    at_peak_file: int
    samples: int
    stage_file_bytes: tuple[int, ...]


def measured_export(model: str | None, out: Path, weights: str, stages: int, *,
                    group_size: int = 64, timeout_s: float = 900.0) -> ExportMemory:
    """Run `deskfleet export` (the CLI's own entry point) in a child and sample its memory."""
    import subprocess
    import time

    from engine.shards.manifest import load_manifest
    from tests.benchmarks.export_child import IMPORTED, PEAK_LINE

    argv = [sys.executable, "-m", EXPORT_CHILD, "--wait", "export", *([model] if model else []),
            "--stages", str(stages), "--weights", weights, "--group-size", str(group_size),
            "--out", str(out), "--force"]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    assert proc.stdout is not None and proc.stdin is not None
    first = proc.stdout.readline()
    if IMPORTED not in first:
        proc.kill()
        rest = first + proc.stdout.read()
        proc.wait()
        raise RuntimeError(f"the export child did not start: {rest[-2000:]}")
    base = _status_kb(proc.pid)
    proc.stdin.write("go\n")
    proc.stdin.close()
    import threading

    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    peak = dict(base)
    best = dict(base)
    n = 0
    while proc.poll() is None:
        s = _status_kb(proc.pid)
        if s:
            n += 1
            peak = {k: max(v, peak.get(k, 0)) for k, v in s.items()}
            if s.get("VmRSS", 0) >= best.get("VmRSS", 0):
                best = s
        if time.perf_counter() - started > timeout_s:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the export did not finish within {timeout_s:.0f} s")
        time.sleep(_SAMPLE_S)
    reader.join(timeout=10)
    seconds = time.perf_counter() - started
    text = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"deskfleet export failed (exit {proc.returncode}):\n{text[-3000:]}")
    # The child resets its VmHWM once the parent has read it (its RSS then, after every import,
    # is the baseline) and prints both: "peak RSS N MB (after imports M MB)".
    printed = PEAK_LINE.findall(text)
    vmhwm = int(printed[-1][0]) * 10 ** 6 if printed else 0
    exporter_base = int(printed[-1][1]) * 10 ** 6 if printed else base.get("VmRSS", 0) * 1024
    manifest = load_manifest(out)
    sizes = tuple(sum(f.size for f in s.files) for s in manifest.stages)
    kb = 1024
    return ExportMemory(seconds, base.get("VmRSS", 0) * kb, base.get("RssAnon", 0) * kb, base.get("RssFile", 0) * kb,
                        exporter_base, max(vmhwm, peak.get("VmHWM", 0) * kb), peak.get("RssAnon", 0) * kb,
                        peak.get("RssFile", 0) * kb, best.get("RssAnon", 0) * kb, best.get("RssFile", 0) * kb,
                        n, sizes)
