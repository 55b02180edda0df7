"""``python -m tests.benchmarks soak``: four chat users against a local paged fleet.

A fleet per runtime, ``deskfleet serve --workers`` (in its own process, the coordinator and the
OpenAI API, each stage in a worker process on loopback), started once and driven in segments of
``--minutes / --segments`` each; with several runtimes in the order A B B A A B ... (so a drift of
the machine's load over the run falls on all alike), the idle fleets waiting. Today there is one:
the paged runtime. Until issue 27 the soak drove the stateful runtime beside it (its last
comparison is kept in docs/BENCHMARKS.md's history); that runtime was retired from serving. Four
users (:mod:`tests.benchmarks.soak_users`) hold multi-turn conversations with the real ``openai``
client; segment *i* of every runtime starts from the same conversation seed.

Recorded per runtime: requests served and failed, TTFT and per-request decode speed (p50/p95),
aggregate tokens/s, prefix-cache hits, and the RSS of every process at startup, after the warm-up
and at the end (split into file-backed pages, the KV block pool and other anonymous memory),
sampled throughout; then, after the users, the gaps between a streamed answer's chunks alone and
while 3 prompts of 512 KiB are refused (the API's guard against huge prompts: it refuses them
unread, so the stream should not notice; tests/security asserts the refusal, this measures the
gap). Speed figures count the requests started after the runtime's warm-up (the first
``--warmup-s`` of its first segment); failures count every request. Targets: the paged
runtime's TTFT p95 <= 1 s; no failed request; RSS growth after warm-up under 5 %.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.cli.main import Command
from engine.wire.step_plan import SCRATCH_BLOCKS
from tests.benchmarks.kit import verdict
from tests.benchmarks.record import DEFAULT_DOC, DEFAULT_JSON_DIR, machine_info, update_section, write_json
from tests.benchmarks.soak_fleet import RUNTIMES, FleetProcess, FleetSettings, pool_tensor_bytes
from tests.benchmarks.soak_report import section
from tests.benchmarks.soak_users import Outcome, async_stall_probe, async_user

USERS = 4
RSS_TARGET = 0.05
TTFT_TARGET_MS = 1000.0
SAMPLE_EVERY_S = 10.0
METRICS_KEPT = ("prefix_hits_total", "prefix_tokens_reused_total", "requests_failed_total",
                "requests_rejected_total", "sched_preemptions_total", "kv_blocks_total", "kv_blocks_cached",
                "kv_blocks_evicted_total", "step_answered_rows_avg")


def segment_order(runtimes: tuple[str, ...], segments: int) -> list[str]:
    """A B, B A, A B, ... for ``segments`` rounds (one runtime: just it, ``segments`` times)."""
    order: list[str] = []
    for i in range(segments):
        order += list(runtimes if i % 2 == 0 else reversed(runtimes))
    return order


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def _drive_segment(fleet: FleetProcess, model: str, budget: int, seconds: float, seed: int,
                         outcomes: list[Outcome]) -> tuple[float, float]:
    """Four users until ``seconds`` have passed (in-flight requests finish); (start, end) monotonic."""
    started = time.monotonic()
    await asyncio.gather(*(async_user(i, fleet.url, model, deadline=started + seconds, budget_tokens=budget,
                                      seed=seed, outcomes=outcomes) for i in range(USERS)))
    return started, time.monotonic()


async def _async_soak(fleets: dict[str, FleetProcess], order: list[str], seconds: float, warmup_s: float,
                      seed: int, sample_every_s: float, pool_bytes: dict[str, int | None]) -> dict[str, Any]:
    first = next(iter(fleets.values()))
    card = await asyncio.to_thread(_models, first.url)
    budget = min(int(card["context_length"]), 4096) * 3 // 4
    t0 = time.monotonic()
    raw: dict[str, dict[str, Any]] = {
        r: {"outcomes": [], "segments": [], "timeline": [], "idle": f.memory(pool_bytes[r]), "warm": None,
            "end": None, "warm_t": None} for r, f in fleets.items()}

    async def sample() -> None:
        while True:
            for r, f in fleets.items():
                with contextlib.suppress(Exception):
                    raw[r]["timeline"].append({"t_s": round(time.monotonic() - t0, 1), "rss": f.rss()})
            await asyncio.sleep(sample_every_s)

    async def mark_warm(runtime: str) -> None:
        await asyncio.sleep(warmup_s)
        raw[runtime]["warm"] = await asyncio.to_thread(fleets[runtime].memory, pool_bytes[runtime])
        raw[runtime]["warm_t"] = time.monotonic()

    sampler = asyncio.create_task(sample())
    seen: dict[str, int] = {}
    try:
        for runtime in order:
            index = seen[runtime] = seen.get(runtime, -1) + 1
            warm = asyncio.create_task(mark_warm(runtime)) if index == 0 else None
            start, end = await _drive_segment(fleets[runtime], card["id"], budget, seconds, seed + index,
                                              raw[runtime]["outcomes"])
            if warm is not None and not warm.done():  # a segment shorter than the warm-up
                warm.cancel()
                raw[runtime]["warm"] = fleets[runtime].memory(pool_bytes[runtime])
                raw[runtime]["warm_t"] = time.monotonic()
            raw[runtime]["segments"].append({"index": index, "start_s": round(start - t0, 1),
                                             "end_s": round(end - t0, 1), "start": start, "end": end})
            if index == order.count(runtime) - 1:
                raw[runtime]["end"] = fleets[runtime].memory(pool_bytes[runtime])
    finally:
        sampler.cancel()
    for r, f in fleets.items():
        raw[r]["metrics"] = {k: v for k, v in f.metrics().items() if k in METRICS_KEPT}
    for r, f in fleets.items():  # after the metrics: its refusals are not the users'
        raw[r]["stall_probe"] = await async_stall_probe(f.url, card["id"])
    return {"model": card["id"], "context_length": card["context_length"], "budget_tokens": budget,
            "runtimes": raw}


def _models(url: str) -> dict[str, Any]:
    from tests.benchmarks.soak_fleet import get_json

    return get_json(url + "/models")["data"][0]


def _memory_rows(idle: dict, warm: dict, end: dict) -> dict[str, dict[str, Any]]:
    rows = {}
    for name in sorted(set(warm) | set(end)):
        w, e, i = warm.get(name, {}), end.get(name, {}), idle.get(name, {})
        rows[name] = {f"{when}_{k}_mb": d.get(k, 0) / 2**20 for when, d in (("idle", i), ("warm", w), ("end", e))
                      for k in ("rss", "file", "kv_pool", "other_anon")}
        rows[name]["kv_pool_mappings"] = e.get("kv_pool_mappings", 0)
        rows[name]["growth"] = e["rss"] / w["rss"] - 1 if w.get("rss") and e.get("rss") else None
    return rows


def summarise_runtime(raw: dict[str, Any]) -> dict[str, Any]:
    """One runtime's figures from its raw drive: speeds after its warm-up, failures over all."""
    outcomes: list[Outcome] = raw["outcomes"]
    warm_t = raw["warm_t"] if raw["warm_t"] is not None else float("-inf")
    failed = [o for o in outcomes if not o.ok]
    timed = [o for o in outcomes if o.ok and o.started >= warm_t]
    ttft = [o.ttft_s * 1000 for o in timed if o.ttft_s is not None]
    rates = [r for o in timed if (r := o.decode_tok_s) is not None]
    timed_s = sum(max(0.0, s["end"] - max(s["start"], warm_t)) for s in raw["segments"])
    memory = _memory_rows(raw["idle"], raw["warm"] or {}, raw["end"] or {})
    warm_sum = sum(m["warm_rss_mb"] for m in memory.values())
    end_sum = sum(m["end_rss_mb"] for m in memory.values())
    pool_growth = sum(m["end_kv_pool_mb"] - m["warm_kv_pool_mb"] for m in memory.values())
    segments = []
    for s in raw["segments"]:
        inside = [o for o in outcomes if s["start"] <= o.started <= s["end"]]
        done = [o for o in inside if o.ok]
        span = s["end"] - s["start"]
        segments.append({"index": s["index"], "start_s": s["start_s"], "end_s": s["end_s"], "served": len(done),
                         "failed": len(inside) - len(done),
                         "aggregate_tok_s": sum(o.completion_tokens for o in done) / span if span > 0 else None,
                         "ttft_ms_p50": _pct([o.ttft_s * 1000 for o in done if o.ttft_s is not None], 50)})
    growth = end_sum / warm_sum - 1 if warm_sum else None
    return {"requests": len(outcomes), "served": len(outcomes) - len(failed), "failed": len(failed),
            "failures": sorted({o.error for o in failed if o.error})[:10], "timed_requests": len(timed),
            "streamed": sum(o.stream for o in outcomes if o.ok),
            "turns_max": max((o.turn for o in outcomes if o.ok), default=-1) + 1,
            "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p95": _pct(ttft, 95),
            "decode_tok_s_p50": _pct(rates, 50), "decode_tok_s_p95": _pct(rates, 95),
            "aggregate_tok_s": sum(o.completion_tokens for o in timed) / timed_s if timed_s > 0 else None,
            "timed_s": round(timed_s, 1), "driven_s": round(sum(s["end"] - s["start"] for s in raw["segments"]), 1),
            "prompt_tokens": sum(o.prompt_tokens for o in outcomes if o.ok),
            "completion_tokens": sum(o.completion_tokens for o in outcomes if o.ok),
            "prefix_hits": int(raw["metrics"].get("prefix_hits_total", 0)),
            "prefix_tokens_reused": int(raw["metrics"].get("prefix_tokens_reused_total", 0)),
            "metrics": raw["metrics"], "memory": memory, "rss_growth": growth,
            "rss_growth_without_pool": (end_sum - pool_growth) / warm_sum - 1 if warm_sum else None,
            "segments": segments, "no_failures": verdict(len(failed), 0, higher=False),
            "stall_probe": raw.get("stall_probe"),
            "rss_verdict": verdict(growth, RSS_TARGET, higher=False) if growth is not None else "n/a"}


def compare(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The paged runtime's speed target (issue 14's other one, 4x the stateful runtime's
    aggregate, went with that runtime: see the soak's history in docs/BENCHMARKS.md)."""
    paged = summaries.get("paged")
    out: dict[str, Any] = {"ttft_p95_target_ms": TTFT_TARGET_MS}
    if paged and paged["ttft_ms_p95"] is not None:
        out["paged_ttft_ms_p95"] = paged["ttft_ms_p95"]
        out["ttft_verdict"] = verdict(paged["ttft_ms_p95"], TTFT_TARGET_MS, higher=False)
    return out


def run_soak(export_dir: Path, minutes: float, *, runtimes: tuple[str, ...] = RUNTIMES, segments: int = 2,
             warmup_s: float | None = None, seed: int = 7, sample_every_s: float = SAMPLE_EVERY_S,
             settings: FleetSettings | None = None) -> dict[str, Any]:
    """Serve ``export_dir`` as one local fleet per runtime, drive each for ``minutes`` in
    ``segments`` interleaved pieces, and return the raw results, a summary per runtime and the
    comparison."""
    settings = settings or FleetSettings()
    warmup_s = min(180.0, minutes * 9) if warmup_s is None else warmup_s  # 15 % of a runtime's minutes
    order = segment_order(runtimes, segments)
    with tempfile.TemporaryDirectory(prefix="deskfleet-soak-") as tmp:
        fleets = {r: FleetProcess(export_dir, Path(tmp) / f"fleet-{r}.log", r, settings) for r in runtimes}
        codes: dict[str, int | None] = {}
        try:
            pool_bytes: dict[str, int | None] = {}
            for r, fleet in fleets.items():  # one after the other: their loads do not overlap
                fleet.start()
                blocks = fleet.metrics().get("kv_blocks_total") if r == "paged" else None  # scratch blocks apart
                pool_bytes[r] = pool_tensor_bytes(export_dir, int(blocks) + SCRATCH_BLOCKS) if blocks else None
            raw = asyncio.run(_async_soak(fleets, order, minutes * 60 / segments, warmup_s, seed, sample_every_s,
                                          pool_bytes))
        except BaseException:
            for r in runtimes:
                log = Path(tmp) / f"fleet-{r}.log"
                if log.is_file():
                    print(f"{r} fleet log (last lines):\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
        finally:
            for r, fleet in fleets.items():
                codes[r] = fleet.stop()
    summaries = {}
    for r in runtimes:
        summaries[r] = summarise_runtime(raw["runtimes"][r])
        summaries[r]["fleet_exit_code"] = codes[r]
        summaries[r]["serve_options"] = settings.describe(r)
        summaries[r]["warmup_s"] = warmup_s
        summaries[r]["pool_tensor_bytes"] = pool_bytes[r]
    for r in runtimes:  # monotonic seconds mean nothing outside this run
        for s in raw["runtimes"][r]["segments"]:
            s.pop("start"), s.pop("end")
    return {"run": raw, "order": order, "summaries": summaries, "comparison": compare(summaries),
            "minutes": minutes, "segments": segments, "warmup_s": warmup_s,
            "mmap_threshold_mb": settings.mmap_threshold_mb}


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
    d = FleetSettings()
    p.add_argument("--minutes", type=float, default=8.0,
                   help="minutes each runtime is driven, over all its segments (default 8)")
    p.add_argument("--segments", type=int, default=2,
                   help="segments per runtime, with several runtimes driven in the order A B B A ... (default 2)")
    p.add_argument("--runtimes", default=",".join(RUNTIMES),
                   help=f"comma-separated runtimes, the first driven first (default and only: {','.join(RUNTIMES)}; "
                        "the stateful runtime was retired from serving in issue 27)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds at the start of a runtime's first segment left out of its speed figures and "
                        "before its RSS baseline (default 15 %% of --minutes, at most 180)")
    p.add_argument("--slots", type=int, default=d.slots, help=f"serve --slots (default {d.slots}: "
                   "4 users never have more than 4 requests in flight)")
    p.add_argument("--kv-pool-mb", type=float, default=d.kv_pool_mb,
                   help=f"serve --kv-pool-mb, the block pool per stage (default {d.kv_pool_mb:g})")
    p.add_argument("--token-budget", type=int, default=d.token_budget,
                   help=f"serve --token-budget (default {d.token_budget})")
    p.add_argument("--mmap-threshold-mb", type=float, default=d.mmap_threshold_mb,
                   help="glibc's mmap threshold fixed in every fleet (MALLOC_MMAP_THRESHOLD_), so the paged KV "
                        f"pool's tensors are mappings of their own in smaps (default {d.mmap_threshold_mb:g}; 0 = "
                        "glibc's own, and the pool is not told apart)")
    p.add_argument("--tiny", action="store_true", help="a random-weight tiny model instead of the default (CI)")
    p.add_argument("--seed", type=int, default=7, help="the users' conversation seed (default 7)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "soak.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def _command_line(args: argparse.Namespace) -> str:
    d = FleetSettings()
    parts = ["python -m tests.benchmarks soak", f"--minutes {args.minutes:g}", f"--segments {args.segments}"]
    if args.runtimes != ",".join(RUNTIMES):
        parts.append(f"--runtimes {args.runtimes}")
    if args.warmup_s is not None:
        parts.append(f"--warmup-s {args.warmup_s:g}")
    for flag, value, default in (("--slots", args.slots, d.slots), ("--kv-pool-mb", args.kv_pool_mb, d.kv_pool_mb),
                                 ("--token-budget", args.token_budget, d.token_budget),
                                 ("--mmap-threshold-mb", args.mmap_threshold_mb, d.mmap_threshold_mb)):
        if value != default:
            parts.append(f"{flag} {value:g}")
    if args.seed != 7:
        parts.append(f"--seed {args.seed}")
    return " ".join(parts + (["--tiny"] if args.tiny else []))


def run(args: argparse.Namespace) -> int:
    from engine.shards.manifest import load_manifest

    runtimes = tuple(r.strip() for r in args.runtimes.split(",") if r.strip())
    if not runtimes or set(runtimes) - set(RUNTIMES) or len(set(runtimes)) != len(runtimes):
        raise SystemExit(f"--runtimes takes distinct names from {', '.join(RUNTIMES)}; got {args.runtimes!r}")
    if args.tiny:
        from export.sources import default_cache_root

        export, what = tiny_export(default_cache_root() / "bench-exports"), "A random-weight tiny llama, 2 fp32 stages,"
    else:
        from tests.benchmarks.kit import default_model_exports

        _, exports, _ = default_model_exports(("int4", 2, True))
        export, what = exports[0], "The default model (SmolLM2-135M-Instruct) as 2 INT4 stages"
    info = machine_info()
    settings = FleetSettings(slots=args.slots, kv_pool_mb=args.kv_pool_mb, token_budget=args.token_budget,
                             mmap_threshold_mb=args.mmap_threshold_mb)
    print(f"soak: {'/'.join(runtimes)}, {args.minutes:g} min each in {args.segments} segment(s), over "
          f"{load_manifest(export).model.name} ({export})", file=sys.stderr)
    result = run_soak(export, args.minutes, runtimes=runtimes, segments=args.segments, warmup_s=args.warmup_s,
                      seed=args.seed, settings=settings)
    command = _command_line(args)
    raw = {r: {**x, "outcomes": None,  # per segment in the summary; failed requests in full here
               "failed_requests": [vars(o) for o in x["outcomes"] if not o.ok]}
           for r, x in result["run"]["runtimes"].items()}
    write_json(args.json, {"command": command, "what": what, "machine": info, "order": result["order"],
                           "minutes_per_runtime": args.minutes, "segments": args.segments,
                           "warmup_s": result["warmup_s"], "summaries": result["summaries"],
                           "comparison": result["comparison"], "run": {**result["run"], "runtimes": raw}})
    update_section(args.doc, "soak", section(command, info, result, what))
    failed = sum(s["failed"] for s in result["summaries"].values())
    for r, s in result["summaries"].items():
        print(f"soak {r}: {s['served']} served, {s['failed']} failed, TTFT p95 {s['ttft_ms_p95']} ms, "
              f"{s['aggregate_tok_s']} tok/s, RSS growth {s['rss_growth']}", file=sys.stderr)
    print(f"soak: wrote {args.json} and {args.doc}", file=sys.stderr)
    return 0 if failed == 0 else 1


COMMAND = Command(name="soak",
                  help="stability and speed: 4 chat users against a local paged fleet",
                  configure=configure, run=run)
