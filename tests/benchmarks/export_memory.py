"""``python -m tests.benchmarks export-memory``: the exporter's peak memory against the stage it
writes.

A random-weight checkpoint in Llama-3.1-8B shape (bf16, sharded like HF, ~16 GB) is written as a
stream if absent, exported by ``deskfleet export`` in a child process whose /proc status the
parent samples every ~50 ms (RssAnon, RssFile, RssShmem peaks; VmHWM and the RSS after imports as
the export child reports them), and compared with the issue's bound: peak - baseline <= 1.3x the
largest stage's files + 64 MB. The old torch path runs from a git worktree of the commit before
the builder, inside a memory-capped cgroup, on a 4-layer cut of the same shape. Then the 4 INT4
stages are served as loopback worker processes and their decode speed is set against the
bandwidth bound (weight bytes per token / a one-thread sweep's bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engine.cli.main import Command
from tests.benchmarks.export_child import PEAK_LINE
from tests.benchmarks.kit import EXPORT_CHILD, REPO

COMMAND_LINE = "python -m tests.benchmarks export-memory"
MB = 1024 * 1024
GIB = 1024 ** 3
SHARD_BYTES = 5 * 10 ** 9  # HF's 8B checkpoints come as ~5 GB shards
COMPLETE = ".complete"  # written last: a checkpoint without it was interrupted and is rewritten
STATUS_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
BOUND_FACTOR, BOUND_SLACK = 1.3, 64 * MB


class BenchError(Exception):
    """Raised when the benchmark cannot run here (no space, no cgroup, an export failed); the
    message says what to do."""


# ---------------------------------------------------------------- the synthetic checkpoint

POOL_VALUES = 1 << 25  # 64 MB of bf16 random values; every matrix is slices of it
_CHUNK_VALUES = 1 << 22  # 8 MB written at a time


def _bf16_pool(seed: int, values: int = POOL_VALUES) -> np.ndarray:
    """N(0, 0.05) values encoded to bf16 once, by tests.support.synthetic_checkpoint's own rounding: encoding
    16 GB value by value costs ~30 min of a shared core, copying slices of a pool ~1."""
    from tests.support.synthetic_checkpoint import _encode

    rng = np.random.default_rng([seed, 7])
    return _encode(np.float32(0.05) * rng.standard_normal(values, dtype=np.float32), "BF16")


def _write_bf16_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], pool, seed: int) -> int:
    """One safetensors file in the layout of tests.support.synthetic_checkpoint.write_safetensors, written
    in 8 MB chunks: matrices are pool slices at seeded offsets, norm gammas 1 + N(0, 0.1)."""
    import struct

    from tests.support.synthetic_checkpoint import _encode

    header: dict = {}
    offset = 0
    for name, dims in tensors:
        size = 2 * int(np.prod(dims, dtype=np.int64))
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dims in tensors:
            rng = np.random.default_rng([seed, *name.encode()])
            if len(dims) == 1:
                f.write(_encode(1.0 + np.float32(0.1) * rng.standard_normal(dims, dtype=np.float32), "BF16").tobytes())
                continue
            left = int(np.prod(dims, dtype=np.int64))
            while left:
                n = min(left, _CHUNK_VALUES, len(pool))
                at = int(rng.integers(0, len(pool) - n + 1))
                f.write(memoryview(pool[at:at + n]).cast("B"))
                left -= n
    return path.stat().st_size


def write_sharded_llama(directory: Path, shape, seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Path:
    """A random-weight bf16 Llama checkpoint as HF shards (model-0000i-of-0000n.safetensors +
    index), streamed (never whole in memory). An existing complete checkpoint of the same
    config is reused; an interrupted one is rewritten."""
    from tests.support.synthetic_checkpoint import llama_config, llama_tensors

    directory = Path(directory)
    config = llama_config(shape)
    marker = directory / COMPLETE
    if marker.is_file() and json.loads((directory / "config.json").read_text()) == config:
        return directory
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in llama_tensors(shape):
        nbytes = 2
        for d in dims:
            nbytes *= d
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    largest = max(int(np.prod(dims, dtype=np.int64)) for _, dims in llama_tensors(shape))
    pool = _bf16_pool(seed, min(POOL_VALUES, max(1 << 16, largest)))  # small models: a small pool
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_bf16_shard(directory / fname, tensors, pool, seed)
        weight_map.update({name: fname for name, _ in tensors})
    del pool
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    marker.write_text("")
    return directory


def checkpoint_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))


# ---------------------------------------------------------------- measuring one export

def _status(pid: int) -> dict[str, int] | None:
    """The memory fields of /proc/<pid>/status in bytes (None once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in STATUS_FIELDS:
            out[key] = int(rest.split()[0]) * 1024
    return out or None


@dataclass
class Sampler:
    """Peaks of a process's memory fields, sampled from outside. The export child resets its VmHWM
    after its imports (clear_refs 5), so the sample where VmHWM falls is the post-import baseline
    of the anonymous/file-backed split; when the import peak was the RSS itself there is no fall,
    and the first sample after the progress bar of stage 0 appears is taken instead."""

    peaks: dict
    baseline: dict | None = None
    last: dict | None = None
    samples: int = 0

    def add(self, status: dict[str, int], started: bool = False) -> None:
        dropped = self.last is not None and status.get("VmHWM", 0) < self.last.get("VmHWM", 0)
        if self.baseline is None and (dropped or started):
            self.baseline = dict(status)
            self.peaks = dict(status)  # the peaks from here on
        for k, v in status.items():
            self.peaks[k] = max(self.peaks.get(k, 0), v)
        self.last = dict(status)
        self.samples += 1


def _has_begun(log: Path) -> bool:
    """The export's progress (stderr) shows stage 0: its imports are done."""
    try:
        with open(log, "rb") as f:
            return b"stage 0" in f.read(65536)
    except OSError:
        return False


def _join_cgroup(procs: Path):
    def join() -> None:  # runs in the child before exec: it is capped from its first byte
        procs.write_text(str(os.getpid()))
    return join


def run_measured(argv: list[str], *, env: dict | None = None, cwd: Path | None = None,
                 cgroup: Path | None = None, log: Path | None = None, interval: float = 0.05,
                 timeout: float = 7200.0) -> dict:
    """Run ``argv`` (a ``deskfleet export``) and sample its /proc status every ``interval`` s."""
    err = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True,
                            preexec_fn=_join_cgroup(cgroup / "cgroup.procs") if cgroup else None)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    sampler = Sampler(peaks={})
    while proc.poll() is None:
        status = _status(proc.pid)
        if status:
            sampler.add(status, started=sampler.baseline is None and log is not None and _has_begun(log))
        if time.perf_counter() - started > timeout:
            proc.kill()
        time.sleep(interval)
    reader.join(5)
    seconds = time.perf_counter() - started
    if log:
        err.close()
    stdout = "".join(out)
    result = {"argv": argv, "returncode": proc.returncode, "wall_seconds": round(seconds, 1),
              "samples": sampler.samples, "sampled_peak": sampler.peaks, "sampled_baseline": sampler.baseline,
              "stdout_tail": stdout[-2000:]}
    found = PEAK_LINE.search(stdout)  # the first: an old tree's exporter printed its own
    if found:
        result["peak_rss_bytes"] = int(found.group(1)) * 10 ** 6
        result["baseline_rss_bytes"] = int(found.group(2)) * 10 ** 6
    secs = re.search(r" in ([0-9.]+) s\n", stdout)
    if secs:
        result["export_seconds"] = float(secs.group(1))
    return result


def stage_file_bytes(export_dir: Path) -> list[int]:
    from engine.shards.manifest import load_manifest

    return [sum(f.size for f in s.files) for s in load_manifest(export_dir).stages]


def summarise_export(run: dict, stages: list[int]) -> dict:
    """The issue's numbers for one export: net peak, its split, and the bound."""
    out = dict(run)
    if run.get("returncode") != 0 or "peak_rss_bytes" not in run:
        out["ok"] = False
        return out
    largest = max(stages)
    # The child's own VmHWM (rounded to MB on stdout) or the sampled one, whichever is larger.
    peak = max(run["peak_rss_bytes"], run["sampled_peak"].get("VmHWM", 0))
    net = peak - run["baseline_rss_bytes"]
    bound = BOUND_FACTOR * largest + BOUND_SLACK
    base = run.get("sampled_baseline") or {}
    out.update({
        "ok": True, "stage_file_bytes": stages, "largest_stage_bytes": largest,
        "peak_minus_baseline_bytes": net, "bound_bytes": int(bound), "within_bound": net <= bound,
        "net_over_largest_stage": round(net / largest, 3),
        "anon_peak_growth_bytes": run["sampled_peak"].get("RssAnon", 0) - base.get("RssAnon", 0),
        "file_peak_growth_bytes": run["sampled_peak"].get("RssFile", 0) - base.get("RssFile", 0),
        "shmem_peak_growth_bytes": run["sampled_peak"].get("RssShmem", 0) - base.get("RssShmem", 0),
        "baseline_split_seen": bool(base),
    })
    return out


def export_argv(model: Path | None, out: Path, stages: int, weights: str, group_size: int | None,
                child: str = EXPORT_CHILD) -> list[str]:
    """``python -m <child> export ...``: today's tree through the measuring child; an old tree
    (whose exporter printed its own peak line) through its plain ``engine.cli.main``."""
    argv = [sys.executable, "-m", child, "export"] + ([str(model)] if model else [])
    argv += ["--stages", str(stages), "--weights", weights, "--out", str(out), "--force"]
    if weights == "int4" and group_size:
        argv += ["--group-size", str(group_size)]
    return argv


def measure_export(model: Path | None, out: Path, stages: int, weights: str, group_size: int | None,
                   keep: bool = False, child: str = EXPORT_CHILD, **kwargs) -> dict:
    print(f"  export {model or 'default model'} -> {stages} x {weights}", file=sys.stderr, flush=True)
    argv = export_argv(model, out, stages, weights, group_size, child)
    run = run_measured(argv, log=out.with_suffix(".log"), **kwargs)
    sizes = stage_file_bytes(out) if run["returncode"] == 0 else []
    result = summarise_export(run, sizes) if sizes else summarise_export(run, [1])
    result.update({"stages": stages, "weights": weights, "group_size": group_size if weights == "int4" else None})
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    print(f"    {_one_line(result)}", file=sys.stderr, flush=True)
    return result


def _one_line(r: dict) -> str:
    if not r.get("ok"):
        return f"FAILED (exit {r.get('returncode')}): {r.get('stdout_tail', '')[-300:]}"
    return (f"net peak {r['peak_minus_baseline_bytes'] / MB:.0f} MB for a {r['largest_stage_bytes'] / MB:.0f} MB stage "
            f"(bound {r['bound_bytes'] / MB:.0f} MB, {'met' if r['within_bound'] else 'MISSED'}), "
            f"anon +{r['anon_peak_growth_bytes'] / MB:.0f} MB, file +{r['file_peak_growth_bytes'] / MB:.0f} MB, "
            f"{r.get('export_seconds', r['wall_seconds'])} s")


# ---------------------------------------------------------------- the old torch path, capped

CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def make_cgroup(name: str, limit_bytes: int) -> Path:
    """A v1 memory cgroup capped at ``limit_bytes`` (memory+swap too, where the kernel has it)."""
    if not (CGROUP_V1 / "memory.limit_in_bytes").is_file():
        raise BenchError(f"no writable cgroup v1 memory controller at {CGROUP_V1}; run the old path with "
                         "--skip-old, or on a machine where it is mounted (this needs root)")
    group = CGROUP_V1 / name
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    memsw = group / "memory.memsw.limit_in_bytes"
    if memsw.is_file():
        memsw.write_text(str(limit_bytes))
    return group


def cgroup_report(group: Path) -> dict:
    def read(name: str) -> str:
        p = group / name
        return p.read_text().strip() if p.is_file() else ""

    return {"limit_bytes": int(read("memory.limit_in_bytes") or 0),
            "max_usage_bytes": int(read("memory.max_usage_in_bytes") or 0),
            "failcnt": int(read("memory.failcnt") or 0),
            "oom_control": read("memory.oom_control").replace("\n", "; ")}


def old_tree(commit: str, where: Path) -> Path:
    """A git worktree of ``commit`` at ``where``, checked to hold the torch exporter."""
    repo = REPO
    if not where.exists():
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(where), commit],
                       check=True, capture_output=True)
    if (where / "export" / "builder").exists():
        raise BenchError(f"{where} (commit {commit}) already has export/builder: pick the commit before it")
    return where


def check_old_imports(where: Path) -> str:
    """The file the child imports export.exporter from, with PYTHONPATH set to the worktree."""
    env = {**os.environ, "PYTHONPATH": str(where)}
    code = "import export.exporter as e, engine.cli.main as c; print(e.__file__); print(c.__file__)"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=where, capture_output=True, text=True, check=True)
    files = done.stdout.split()
    if not all(f.startswith(str(where)) for f in files):
        raise BenchError(f"PYTHONPATH={where} still imports {files}: the old path would not be measured")
    return files[0]


def remove_tree(where: Path) -> None:
    repo = REPO
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(where)], capture_output=True)


# ---------------------------------------------------------------- the command

PHASES = ("8b", "serve", "cut", "default")
OLD_COMMIT = "03f1c76"  # the last commit before export.builder replaced torch tracing
CUT_LAYERS = 4


def _record(args: argparse.Namespace, result: dict) -> None:
    from tests.benchmarks.record import machine_info, update_section, write_json

    result["machine"] = machine_info()
    write_json(args.json, result)
    update_section(args.doc, "export-memory", render(result, args.json))


def run(args: argparse.Namespace) -> int:
    from tests.support.synthetic_checkpoint import LLAMA31_8B

    if args.render_only:  # the table again from the JSON (after a change to render or the bound)
        from tests.benchmarks.record import update_section, write_json

        result = json.loads(args.json.read_text())
        if isinstance(result.get("cut"), dict) and extrapolate_old(result["cut"]):
            result["cut"]["extrapolation_32_layers"] = extrapolate_old(result["cut"])
        write_json(args.json, result)
        update_section(args.doc, "export-memory", render(result, args.json))
        print(render(result, args.json))
        return 0
    only = args.only.split(",") if args.only else list(PHASES)
    unknown = set(only) - set(PHASES)
    if unknown:
        raise SystemExit(f"--only takes {', '.join(PHASES)} (got {', '.join(sorted(unknown))})")
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    result = json.loads(args.json.read_text()) if args.json.is_file() else {}
    result.update({"benchmark": "export-memory", "command": COMMAND_LINE, "group_size_8b": args.group_size,
                   "bound": f"peak - baseline <= {BOUND_FACTOR} x largest stage files + {BOUND_SLACK // MB} MB"})
    big = work / "llama31-8b-shape"
    four = work / "8b-int4-4"
    if "8b" in only or ("serve" in only and not (four / "manifest.json").is_file()):
        if free < 40 * 10 ** 9 and not (big / COMPLETE).is_file():
            raise BenchError(f"{work} has {free / 1e9:.0f} GB free; the 8B-shape run needs ~40 GB (--work elsewhere)")
        t = time.perf_counter()
        write_sharded_llama(big, LLAMA31_8B, seed=args.seed)
        result["checkpoint_8b"] = {"bytes": checkpoint_bytes(big), "files": len(list(big.glob("*.safetensors"))),
                                   "write_seconds": round(time.perf_counter() - t, 1)}
        result["8b"] = []
        for stages in (2, 4):
            keep = stages == 4 and "serve" in only
            result["8b"].append(measure_export(big, work / f"8b-int4-{stages}", stages, "int4", args.group_size,
                                               keep=keep))
            _record(args, result)
    if "serve" in only:
        from tests.benchmarks.export_memory_serve import serve_phase

        try:
            result["serve"] = serve_phase(four, tokens=args.tokens, threads=1)
            shutil.rmtree(four, ignore_errors=True)
        except (BenchError, OSError) as exc:  # the exports above stay recorded; the stages stay for a retry
            result["serve"] = {"error": str(exc), "kept": str(four)}
        _record(args, result)
    if not args.keep:
        shutil.rmtree(big, ignore_errors=True)
    if "cut" in only:
        try:
            result["cut"] = cut_phase(args, work)
        except (BenchError, OSError, subprocess.CalledProcessError) as exc:
            result["cut"] = {"error": f"{exc} {getattr(exc, 'stderr', '') or ''}"[-2000:]}
        _record(args, result)
    if "default" in only:
        result["default"] = [measure_export(None, work / f"default-{w}-{s}", s, w, None)
                             for w in ("int4", "fp16") for s in (1, 2, 3)]
        _record(args, result)
    print(render(result, args.json))
    return 0


def stage_params(shape, stages: int) -> list[int]:
    """Weights per stage (layers split evenly as the exporter does; embedding first, head last)."""
    from tests.support.synthetic_checkpoint import llama_tensors

    per_layer: dict[int, int] = {}
    edge = {"first": 0, "last": 0}
    for name, dims in llama_tensors(shape):
        n = 1
        for d in dims:
            n *= d
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            per_layer[layer] = per_layer.get(layer, 0) + n
        else:
            edge["first" if "embed" in name else "last"] += n
    counts = [shape.layers // stages + (1 if i < shape.layers % stages else 0) for i in range(stages)]
    out, at = [], 0
    for i, c in enumerate(counts):
        out.append(sum(per_layer[j] for j in range(at, at + c)) + (edge["first"] if i == 0 else 0)
                   + (edge["last"] if i == stages - 1 else 0))
        at += c
    return out


def extrapolate_old(cut: dict) -> dict | None:
    """The torch path's net peak on the full 8B shape, assuming (as the issue describes it) that
    it scales with the fp32 size of the stage it materialises: the cut's net peak per fp32 byte of
    its largest stage, times the fp32 size of the 8B shape's largest stage."""
    from tests.support.synthetic_checkpoint import LLAMA31_8B

    old = cut.get("old") or {}
    if not old.get("ok"):
        return None
    cut_fp32 = 4 * max(stage_params(replace(LLAMA31_8B, layers=cut["layers"]), cut["stages"]))
    per_byte = old["peak_minus_baseline_bytes"] / cut_fp32
    return {"net_per_fp32_stage_byte": round(per_byte, 3),
            **{f"stages_{n}_net_bytes": int(per_byte * 4 * max(stage_params(LLAMA31_8B, n))) for n in (2, 4)}}


def cut_phase(args: argparse.Namespace, work: Path) -> dict:
    """Old torch path (worktree, capped cgroup) and the builder on a 4-layer cut of the 8B shape."""
    from tests.support.synthetic_checkpoint import LLAMA31_8B

    cut = work / f"llama31-8b-shape-{CUT_LAYERS}l"
    write_sharded_llama(cut, replace(LLAMA31_8B, layers=CUT_LAYERS), seed=args.seed)
    out: dict = {"layers": CUT_LAYERS, "stages": 2, "checkpoint_bytes": checkpoint_bytes(cut),
                 "old_commit": OLD_COMMIT, "cgroup_limit_bytes": args.old_cap_gb * GIB}
    out["new"] = measure_export(cut, work / "cut-new", 2, "int4", args.group_size)
    where = old_tree(OLD_COMMIT, work / "old-tree")
    try:
        out["old_imports_from"] = check_old_imports(where)
        group = make_cgroup("deskfleet-bench", args.old_cap_gb * GIB)
        env = {**os.environ, "PYTHONPATH": str(where)}
        out["old"] = measure_export(cut, work / "cut-old", 2, "int4", args.group_size, child="engine.cli.main",
                                    env=env, cwd=where, cgroup=group)
        out["old"]["cgroup"] = cgroup_report(group)
        group.rmdir()
    finally:
        remove_tree(where)
        if not args.keep:
            shutil.rmtree(cut, ignore_errors=True)
    new, old = out["new"], out["old"]
    if new.get("ok") and old.get("ok"):
        out["old_over_new_net_peak"] = round(old["peak_minus_baseline_bytes"] / new["peak_minus_baseline_bytes"], 2)
        out["old_net_over_largest_stage"] = old["net_over_largest_stage"]
        out["extrapolation_32_layers"] = extrapolate_old(out)
    return out


def _row(label: str, r: dict) -> list:
    if not r.get("ok"):
        return [label, r.get("stages", ""), "failed", f"exit {r.get('returncode')}", "", "", "", "", "", ""]
    return [label, r["stages"], f"{r['weights']}" + (f" g{r['group_size']}" if r.get("group_size") else ""),
            f"{r['largest_stage_bytes'] / MB:.0f}", f"{r['peak_minus_baseline_bytes'] / MB:.0f}",
            f"{r['anon_peak_growth_bytes'] / MB:.0f}", f"{r['file_peak_growth_bytes'] / MB:.0f}",
            f"{r['net_over_largest_stage']:.2f}", "met" if r["within_bound"] else "**missed**",
            f"{r.get('export_seconds', r['wall_seconds']):.0f}"]


def render(result: dict, json_path: Path) -> str:
    from tests.benchmarks.record import markdown_table

    header = ["model", "stages", "weights", "largest stage MiB", "peak - baseline MiB", "anon growth MiB",
              "file growth MiB", "net / stage", "bound", "seconds"]
    rows = [_row("Llama-3.1-8B shape (bf16, random)", r) for r in result.get("8b", [])]
    cut = result.get("cut") or {}
    for key, label in (("new", "builder"), ("old", f"torch path @ {OLD_COMMIT}")):
        if key in cut:
            rows.append(_row(f"8B shape, {cut['layers']}-layer cut, {label}", cut[key]))
    rows += [_row("default model", r) for r in result.get("default", [])]
    ck = result.get("checkpoint_8b") or {}
    lines = ["## Export memory", "",
             f"`{result.get('ran_as', COMMAND_LINE)}` (raw runs: `{json_path}`; machine: "
             f"{result.get('machine', {}).get('cores', '?')} cores, load average "
             f"{result.get('machine', {}).get('load_average', '?')} when recorded).", "",
             (f"The 8B-shape checkpoint: {ck['bytes'] / 1e9:.1f} GB bf16 in {ck['files']} HF shards, written "
              f"in {ck['write_seconds']:.0f} s as 8 MB slices of a 64 MB pool of N(0, 0.05) bf16 values at seeded "
              "offsets (never whole in memory), deleted after the run. " if ck else "")
             + f"INT4 is the export default (symmetric), group size {result.get('group_size_8b')} for the 8B "
             "shape, the CLI's default 64 for the default model. "
             "Each export is `deskfleet export` in a child process;",
             "peak is its VmHWM, baseline its RSS after imports (both as the export process reports them), and the",
             "anonymous / file-backed growth are the peaks of RssAnon / RssFile sampled from the parent every",
             f"50 ms minus their values at the baseline. Bound: {result.get('bound', '')}.", "",
             markdown_table(header, rows)]
    if "error" in cut:
        lines += ["", f"The old torch path on the cut did not run: {cut['error'][:300]}"]
    elif cut.get("old") and not cut["old"].get("ok"):
        lines += ["", f"The torch path on the {cut['layers']}-layer cut failed inside its "
                  f"{cut['cgroup_limit_bytes'] / GIB:.0f} GiB cgroup: {cut['old'].get('cgroup', {})}."]
    if cut.get("old_over_new_net_peak"):
        lines += ["", f"On the {cut['layers']}-layer cut ({cut['stages']} stages) the torch path at {OLD_COMMIT} "
                  f"(git worktree, `PYTHONPATH` checked to import it) peaks at {cut['old_over_new_net_peak']}x the "
                  f"builder's net ({cut['old_net_over_largest_stage']}x its largest stage), in a "
                  f"{cut['cgroup_limit_bytes'] / GIB:.0f} GiB memory cgroup."]
        ex = extrapolate_old(cut)
        if ex:
            lines += [f"Extrapolated to 32 layers by the fp32 size of the stage it materialises "
                      f"({ex['net_per_fp32_stage_byte']} bytes of net peak per fp32 byte on the cut): "
                      f"~{ex['stages_2_net_bytes'] / GIB:.0f} GiB at 2 stages, "
                      f"~{ex['stages_4_net_bytes'] / GIB:.0f} GiB at 4 (this machine has 24 GiB and no swap)."]
    serve = result.get("serve")
    if serve and "error" in serve:
        lines += ["", f"Serving the 4 stages failed: {serve['error'][:300]}"]
    elif serve:
        lines += ["", f"Served: the 4 INT4 stages as loopback `deskfleet worker` processes, "
                  f"{serve['threads_per_worker']} inference thread each: "
                  f"{serve['served']['decode_tok_per_s']:.2f} tok/s decode; bound "
                  f"{serve['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s (one-thread sweep over "
                  f"{serve['bandwidth']['gib']:.0f} GiB) / {serve['weight_bytes_per_token'] / 1e9:.2f} GB of "
                  f"weights per token = {serve['bound_tok_per_s']:.2f} tok/s, so "
                  f"{serve['served_fraction_of_bound']:.2f} of the bound. Tokens over {serve['tokens']} "
                  f"steps equal to the in-process chained run: {'yes' if serve['tokens_equal'] else '**no**'}.",
                  "Decode rounds (tok/s): "
                  + ", ".join(f"{r['decode_tok_per_s']:.2f}" for r in serve["served"]["rounds"])
                  + " (the best is quoted); the chained run in one process: "
                  + f"{serve['chained']['decode_tok_per_s']:.2f}."]
    return "\n".join(lines)


def configure(p: argparse.ArgumentParser) -> None:
    from tests.benchmarks.record import DEFAULT_DOC, DEFAULT_JSON_DIR

    p.add_argument("--work", type=Path, default=Path("/var/tmp/deskfleet-export-memory"),
                   help="scratch directory for the checkpoints and exports (needs ~40 GB free)")
    p.add_argument("--only", default=None, help=f"comma-separated phases of {', '.join(PHASES)} (default all)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints for the next run")
    p.add_argument("--group-size", type=int, default=128, help="INT4 group size for the 8B shape (default 128)")
    p.add_argument("--old-cap-gb", type=int, default=12, help="memory cgroup cap of the old torch path (GiB)")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated by the served/chained comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--render-only", action="store_true", help="rewrite the Markdown section from --json, run nothing")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "export_memory.json")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC)


COMMAND = Command(name="export-memory", help="the exporter's peak memory against its largest stage "
                  "(Llama-3.1-8B-shaped synthetic, the old torch path on a cut, the default model), "
                  "and the 8B-shape stages served", configure=configure, run=run)
