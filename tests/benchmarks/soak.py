"""``python -m tests.benchmarks soak``: four chat users against a local fleet for N minutes.

The fleet is ``deskfleet serve --workers`` in its own process (the coordinator and the OpenAI API;
each stage in a worker process it starts on loopback), so every process's memory is its own. Four
users (:mod:`tests.benchmarks.soak_users`) hold multi-turn conversations with the real ``openai`` client.
Recorded: requests served and failed, TTFT and per-request decode speed (p50/p95), aggregate
tokens/s, prefix-cache hits, and the RSS of every process at startup, after the warm-up and at the
end, sampled throughout. Targets: no failed request, RSS growth (after warm-up to end) under 5 %.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from engine.cli.main import Command
from engine.errors import DeskfleetError
from engine.worker.stage_worker import StageWorker
from tests.benchmarks.kit import verdict
from tests.benchmarks.record import (
    DEFAULT_DOC,
    DEFAULT_JSON_DIR,
    machine_info,
    markdown_table,
    update_section,
    write_json,
)
from tests.benchmarks.soak_users import Outcome, async_user

USERS = 4
SLOTS = 4
RSS_TARGET = 0.05
SAMPLE_EVERY_S = 10.0
CAPTURE_MB = inspect.signature(StageWorker).parameters["capture_bytes"].default >> 20
START_TIMEOUT_S = 600.0


class FleetProcess:
    """``deskfleet serve --workers`` on a free loopback port; stderr goes to a log file."""

    def __init__(self, export_dir: Path, log_path: Path) -> None:
        self.export_dir, self.log_path = export_dir, log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        argv = [sys.executable, "-m", "engine.cli.main", "serve", "--shards", str(self.export_dir), "--workers",
                "--port", "0", "--slots", str(SLOTS), "--max-concurrent", "16"]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the server's life
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise DeskfleetError(f"the fleet exited with {self.proc.returncode} before serving; "
                                     f"see {self.log_path}")
            if found := re.search(r"http://\S+/v1", line):
                self.url = found.group(0)
                return self.url
        raise DeskfleetError(f"the fleet did not start within {START_TIMEOUT_S:.0f} s; see {self.log_path}")

    def processes(self) -> dict[str, psutil.Process]:
        """'coordinator + API' and 'worker stage N' -> process, for every process of the fleet."""
        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        found = {"coordinator + API": root}
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmd = child.cmdline()
                name = f"worker stage {cmd[cmd.index('--stage') + 1]}" if "--stage" in cmd else f"child {child.pid}"
                found[name] = child
        return found

    def rss(self) -> dict[str, int]:
        out = {}
        for name, proc in self.processes().items():
            with contextlib.suppress(psutil.Error):
                out[name] = proc.memory_info().rss
        return out

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
        return self.proc.returncode


def _get_json(url: str) -> Any:
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:  # loopback only
        text = r.read().decode()
    return json.loads(text) if text.lstrip().startswith(("{", "[")) else text


def _prefix_hits(metrics_text: str) -> int:
    found = re.search(r"^deskfleet_prefix_hits_total (\S+)$", metrics_text, re.M)
    return int(float(found.group(1))) if found else 0


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def _async_drive(fleet: FleetProcess, minutes: float, warmup_s: float, seed: int,
                       sample_every_s: float = SAMPLE_EVERY_S) -> dict[str, Any]:
    models = _get_json(fleet.url + "/models")["data"][0]
    budget = min(int(models["context_length"]), 4096) * 3 // 4
    idle_rss = fleet.rss()
    outcomes: list[Outcome] = []
    timeline: list[dict[str, Any]] = []
    started = time.monotonic()
    deadline = started + minutes * 60

    async def sample() -> None:
        while True:
            timeline.append({"t_s": round(time.monotonic() - started, 1), "rss": fleet.rss()})
            await asyncio.sleep(sample_every_s)

    sampler = asyncio.create_task(sample())
    try:
        await asyncio.gather(*(async_user(i, fleet.url, models["id"], deadline=deadline, budget_tokens=budget,
                                          seed=seed, outcomes=outcomes) for i in range(USERS)))
    finally:
        sampler.cancel()
    elapsed = time.monotonic() - started
    end_rss = fleet.rss()
    warm = next((s for s in timeline if s["t_s"] >= warmup_s), timeline[-1])
    metrics = _get_json(fleet.url.removesuffix("/v1") + "/metrics")
    return {"model": models["id"], "context_length": models["context_length"], "elapsed_s": round(elapsed, 1),
            "warmup_s": warm["t_s"], "outcomes": outcomes, "timeline": timeline, "idle_rss": idle_rss,
            "warm_rss": warm["rss"], "end_rss": end_rss, "prefix_hits": _prefix_hits(metrics)}


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """The figures the section reports, from one drive's raw results."""
    outcomes: list[Outcome] = run["outcomes"]
    served = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    ttft = [o.ttft_s * 1000 for o in served if o.ttft_s is not None]
    rates = [r for o in served if (r := o.decode_tok_s) is not None]
    warm, end = run["warm_rss"], run["end_rss"]
    per_process = {name: {"idle_mb": run["idle_rss"].get(name, 0) / 2**20, "warm_mb": warm.get(name, 0) / 2**20,
                          "end_mb": end.get(name, 0) / 2**20,
                          "growth": end.get(name, 0) / warm[name] - 1 if warm.get(name) else None}
                   for name in sorted(set(warm) | set(end))}
    total_growth = sum(end.values()) / sum(warm.values()) - 1 if warm else None
    half = next((x for x in run["timeline"] if x["t_s"] >= run["elapsed_s"] / 2), run["timeline"][-1])["rss"]
    t0 = min((o.started for o in outcomes), default=0.0)
    minutes = []
    for m in range(int(run["elapsed_s"] // 60) + 1):
        bucket = [o for o in outcomes if m * 60 <= o.started - t0 < (m + 1) * 60]
        done = [o for o in bucket if o.ok]
        minutes.append({"minute": m + 1, "served": len(done), "failed": len(bucket) - len(done),
                        "completion_tokens": sum(o.completion_tokens for o in done),
                        "ttft_ms_p50": _pct([o.ttft_s * 1000 for o in done if o.ttft_s is not None], 50)})
    return {"requests": len(outcomes), "served": len(served), "failed": len(failed),
            "failures": sorted({o.error for o in failed if o.error})[:10],
            "streamed": sum(o.stream for o in served), "turns_max": max((o.turn for o in served), default=0) + 1,
            "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p95": _pct(ttft, 95),
            "decode_tok_s_p50": _pct(rates, 50), "decode_tok_s_p95": _pct(rates, 95),
            "aggregate_tok_s": sum(o.completion_tokens for o in served) / run["elapsed_s"],
            "prompt_tokens": sum(o.prompt_tokens for o in served),
            "completion_tokens": sum(o.completion_tokens for o in served), "prefix_hits": run["prefix_hits"],
            "rss": per_process, "rss_growth": total_growth,
            "rss_growth_second_half": sum(end.values()) / sum(half.values()) - 1 if half else None,
            "per_minute": minutes, "warmup_s": run["warmup_s"], "elapsed_s": run["elapsed_s"],
            "no_failures": verdict(len(failed), 0, higher=False),
            "rss_verdict": verdict(total_growth, RSS_TARGET, higher=False) if total_growth is not None else "n/a"}


def run_soak(export_dir: Path, minutes: float, *, warmup_s: float | None = None, seed: int = 7,
             sample_every_s: float = SAMPLE_EVERY_S) -> dict[str, Any]:
    """Serve ``export_dir`` as a local fleet, drive it for ``minutes``, and return raw results + summary."""
    warmup_s = min(180.0, minutes * 6) if warmup_s is None else warmup_s  # 10 % of the run, at most 3 min
    with tempfile.TemporaryDirectory(prefix="deskfleet-soak-") as tmp:
        fleet = FleetProcess(export_dir, Path(tmp) / "fleet.log")
        try:
            fleet.start()
            run = asyncio.run(_async_drive(fleet, minutes, warmup_s, seed, sample_every_s))
        except BaseException:
            log_tail = (Path(tmp) / "fleet.log").read_text(errors="replace")[-3000:]
            print(f"fleet log (last lines):\n{log_tail}", file=sys.stderr)
            raise
        finally:
            code = fleet.stop()
    summary = summarise(run)
    summary["fleet_exit_code"] = code
    return {"run": run, "summary": summary}


def tiny_export(root: Path) -> Path:
    """A random-weight tiny llama as 2 fp32 stages (built once under ``root``): for CI."""
    from engine.errors import ManifestError
    from engine.shards.manifest import load_manifest
    from export.exporter import ExportOptions, export_model
    from tests.support.tiny_models import build_tiny_model

    out = root / "tiny-llama-2"
    with contextlib.suppress(ManifestError):
        load_manifest(out)
        return out
    checkpoint = build_tiny_model(root / "tiny-llama-checkpoint", "llama")
    export_model(checkpoint, out, stages=2, options=ExportOptions(weights="fp32", group_size=16))
    return out


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="how long the users keep talking (default 30)")
    p.add_argument("--tiny", action="store_true", help="a random-weight tiny model instead of the default (CI)")
    p.add_argument("--seed", type=int, default=7, help="the users' conversation seed (default 7)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "soak.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def section(command: str, info: dict[str, Any], s: dict[str, Any], minutes: float, what: str) -> str:
    rows = [["requests served", s["served"], "", ""],
            ["failed requests", s["failed"], "0", s["no_failures"]],
            ["TTFT ms p50 / p95 (streamed)", f"{_fmt(s['ttft_ms_p50'])} / {_fmt(s['ttft_ms_p95'])}", "", ""],
            ["decode tok/s per request p50 / p95", f"{_fmt(s['decode_tok_s_p50'])} / {_fmt(s['decode_tok_s_p95'])}",
             "", ""],
            ["aggregate tok/s (4 users)", _fmt(s["aggregate_tok_s"], ".2f"), "", ""],
            ["prefix-cache hits", s["prefix_hits"], "", ""],
            ["RSS growth, all processes (after warm-up to end)", f"{_fmt(100 * s['rss_growth'], '+.2f')} %",
             "< 5 %", s["rss_verdict"]],
            ["RSS growth over the second half of the run", f"{_fmt(100 * s['rss_growth_second_half'], '+.2f')} %",
             "", ""]]
    procs = [[name, _fmt(p["idle_mb"]), _fmt(p["warm_mb"]), _fmt(p["end_mb"]),
              f"{_fmt(100 * p['growth'], '+.2f')} %" if p["growth"] is not None else "n/a"]
             for name, p in s["rss"].items()]
    failures = "".join(f"\n- failure: `{f}`" for f in s["failures"])
    return (f"## Soak: {USERS} chat users against a local fleet for {minutes:g} min\n\n"
            f"`{command}` → `docs/bench/soak.json` ({info['date']}, {info['cores']} cores, OpenVINO "
            f"{info['openvino']}, load average at start {info['load_average']}). {what} behind the OpenAI API "
            f"(`deskfleet serve --workers`, {SLOTS} slots, each stage in its own worker process); {USERS} users "
            "with the `openai` client holding multi-turn conversations (up to 6 turns, each resending the "
            "history, so the prefix cache is exercised), short/medium/long prompts, 16-128 new tokens, greedy, "
            f"about half streamed. {s['served']} requests, {s['prompt_tokens']} prompt and "
            f"{s['completion_tokens']} completion tokens.\n\n"
            + markdown_table(["measure", "value", "target", "verdict"], rows) + "\n\n"
            + markdown_table(["process", "RSS MB at startup", "after warm-up", "at end", "growth"], procs)
            + f"\n\nWarm-up: the first {s['warmup_s']:g} s; RSS growth is measured from its end. Each worker keeps "
            f"captured KV states for the prefix cache up to {CAPTURE_MB} MiB (least recently used evicted; the "
            "coordinator's index remembers 64 of them), so worker RSS rises until that store is full; it also rises "
            "as OpenVINO caches kernels for every new input shape (prompt and KV lengths): see *Shape caches* "
            "(`python -m tests.benchmarks shape-caches`), flat when shapes repeat. The RSS of every process, "
            "sampled every 10 s, is in the JSON." + failures)


def run(args: argparse.Namespace) -> int:
    from engine.shards.manifest import load_manifest

    if args.tiny:
        from export.sources import default_cache_root

        export, what = tiny_export(default_cache_root() / "bench-exports"), "A random-weight tiny llama, 2 fp32 stages,"
    else:
        from tests.benchmarks.kit import default_model_exports

        _, exports, _ = default_model_exports(("int4", 2, True))
        export, what = exports[0], "The default model (SmolLM2-135M-Instruct) as 2 INT4 stages"
    info = machine_info()
    print(f"soak: {args.minutes:g} min over {load_manifest(export).model.name} ({export})", file=sys.stderr)
    result = run_soak(export, args.minutes, seed=args.seed)
    summary = result["summary"]
    command = f"python -m tests.benchmarks soak --minutes {args.minutes:g}" + (" --tiny" if args.tiny else "")
    raw = {**result["run"], "outcomes": None,  # per minute in the summary; failed requests in full here
           "failed_requests": [vars(o) for o in result["run"]["outcomes"] if not o.ok]}
    write_json(args.json, {"command": command, "what": what, "machine": info, "summary": summary, "run": raw})
    update_section(args.doc, "soak", section(command, info, summary, args.minutes, what))
    print(f"soak: {summary['served']} served, {summary['failed']} failed, RSS growth "
          f"{_fmt(100 * summary['rss_growth'], '+.2f')} %; wrote {args.json} and {args.doc}", file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1


COMMAND = Command(name="soak",
                  help="stability: 4 chat users against a local fleet for N minutes, failures and RSS tracked",
                  configure=configure, run=run)
