"""``python -m tests.benchmarks rings``: one model served by 1 and by 2 rings behind one API
(issue 15, Deliver 8).

Throughput: ``--rings`` local fleets of the export (:func:`engine.tools.local_rings.local_rings`: a
paged worker process per stage, ``--threads`` inference threads each) are started once, in a
service thread of this process; one API is served per ring count over a Router holding the first
N rings (the same fleets: an idle ring costs nothing). Per round, every ring count once (the order
rotated each round), ``--users`` users each stream one chat completion of ``--new-tokens`` greedy
tokens through the real `openai` client (a fresh nonce per user and round, so no prefix is
shared). Per round: aggregate tok/s (every completion token / the round's wall time), TTFT p50
and p95, how many requests each ring took; figures are medians over ``--repeats`` rounds after
``--warmups``. **The rings share this machine's cores**: two rings here are twice the workers on
the same CPUs, so the ratio measures contention and batching, not what two rings on separate PCs
give (that is ``ring-model``'s prediction).

The service at rest and its restart (``--idle-seconds``; 0 skips): ``deskfleet serve --workers
--rings R`` (R the largest ring count) as its own process, with a compile cache. It is started
once (the cache is filled), stopped, then started again: the time from that restart to the first
answer; then, idle, its CPU (% of one core, the service process and its workers apart) and RSS.
Then the fleet service (:mod:`tests.benchmarks.rings_service`, unless ``--no-fleet``; a 2-stage
export): ``deskfleet fleet`` with two agents on loopback serving one ring, SIGKILLed and started
again: restart to first answer (the target's figure: it re-forms its ring with no admin action),
then its idle CPU and RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.cli.main import Command
from tests.benchmarks.record import (
    DEFAULT_DOC,
    DEFAULT_JSON_DIR,
    machine_info,
    markdown_table,
    median,
    update_section,
    write_json,
)
from tests.support.processes import stop

COMMAND_LINE = "python -m tests.benchmarks rings"
QUESTIONS = ("What is a GPU?", "Name three rivers in Europe.", "Why is the sky blue?", "What is 17 times 23?",
             "Give me a haiku about printers.", "How do I reset a password?", "What does a router do?",
             "Why do leaves fall?")
RESTART_TARGET_S = 30.0  # issue 15, Deliver 8: service restart to first answer
READY_TIMEOUT_S = 900.0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def rotated(items: Sequence[int], k: int) -> list[int]:
    k %= max(len(items), 1)
    return list(items[k:]) + list(items[:k])


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def user_messages(users: int, rng: random.Random) -> list[list[dict[str, str]]]:
    """One chat per user, a random nonce first so no two share a prefix block."""
    return [[{"role": "user", "content": f"[{rng.randrange(10**8):08d}] {QUESTIONS[i % len(QUESTIONS)]}"}]
            for i in range(users)]


def round_figures(wall_s: float, ttfts: Sequence[float], tokens: Sequence[int]) -> dict[str, float]:
    """One round's figures from each user's time to first token and completion tokens."""
    return {"aggregate_tok_s": sum(tokens) / wall_s if wall_s > 0 else float("nan"),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95),
            "tokens": float(sum(tokens)), "wall_s": wall_s}


def summarise(rounds: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Medians over the timed rounds, per ring count."""
    out: dict[str, dict[str, float]] = {}
    for n in sorted({r["rings"] for r in rounds}):
        mine = [r for r in rounds if r["rings"] == n and not r["warmup"]]
        out[str(n)] = {key: median([r[key] for r in mine])
                       for key in ("aggregate_tok_s", "ttft_p50_s", "ttft_p95_s", "tokens", "wall_s")}
        out[str(n)]["rounds"] = float(len(mine))
    return out


# -- throughput: the rings in a service thread, the users here ----------------------------------

@contextlib.asynccontextmanager
async def _service(export: Path, counts: Sequence[int], args: argparse.Namespace):
    """Local rings and one API per ring count; yields {count: API url}."""
    from engine.api.server import ApiSettings, async_run_api
    from engine.generation.router import Router
    from engine.generation.tokenizer import ChatTokenizer
    from engine.tools.local_rings import local_rings

    tokenizer = ChatTokenizer(export / "tokenizer")
    settings = ApiSettings(max_concurrent=max(64, 2 * args.users), max_tokens_limit=max(2048, args.new_tokens),
                           max_prompt_tokens=4096)
    async with local_rings(export, max(counts), threads=args.threads, kv_pool_bytes=args.kv_pool_mb << 20,
                           slots=max(16, args.users), token_budget=256, prefill_chunk=256,
                           cache_dir=args.cache_dir) as all_rings:
        rings = list(all_rings.rings().items())
        apis = {}
        try:
            for n in counts:
                router = Router()
                for ring_id, ring in rings[:n]:
                    router.add_ring(ring_id, ring)
                apis[n] = await async_run_api(router, tokenizer, settings)
            yield {n: api.url for n, api in apis.items()}
        finally:
            for api in apis.values():
                await api.async_stop()


async def _user(client: Any, model: str, messages: list[dict[str, str]], new_tokens: int,
                started: float) -> tuple[float, int]:
    """One user's streamed answer: (seconds to its first token, completion tokens)."""
    ttft = float("nan")
    tokens = 0
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=new_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and math.isnan(ttft):
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return ttft, tokens


async def _ring_counts(url: str) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url.removesuffix("/v1") + "/metrics") as r:
        text = await r.text()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^deskfleet_router_requests_total\{[^}]*ring="([^"]+)"[^}]*\} (\S+)$', text, re.M)}


async def _async_rounds(urls: dict[int, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    import openai

    rng = random.Random(args.seed)
    counts = sorted(urls)
    clients = {n: openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
               for n, url in urls.items()}
    rounds = []
    try:
        model = (await clients[counts[0]].models.list()).data[0].id
        for r in range(args.warmups + args.repeats):
            for n in rotated(counts, r):
                messages = user_messages(args.users, rng)
                before = await _ring_counts(urls[n]) if n > 1 else {}
                started = time.perf_counter()
                results = await asyncio.gather(*(_user(clients[n], model, m, args.new_tokens, started)
                                                  for m in messages))
                wall = time.perf_counter() - started
                after = await _ring_counts(urls[n]) if n > 1 else {}
                figures = round_figures(wall, [t for t, _ in results], [k for _, k in results])
                per_ring = {ring: after[ring] - before.get(ring, 0.0) for ring in after}
                rounds.append({"rings": n, "round": r, "warmup": r < args.warmups, **figures, "per_ring": per_ring})
                print(f"rings: round {r + 1}/{args.warmups + args.repeats}, {n} ring(s): "
                      f"{figures['aggregate_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            await client.close()
    return rounds


def measure_throughput(export: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from console.shared.loop_thread import LoopThread
    from tests.support.asyncutil import held_on

    counts = _ints(args.rings)
    with LoopThread("bench-rings-service") as loop, held_on(loop, lambda: _service(export, counts, args),
                                                            timeout=READY_TIMEOUT_S) as urls:
        return asyncio.run(_async_rounds(urls, args))


# -- the service process: restart to first answer, idle CPU and RSS --------------------------------

def _serve_argv(export: Path, rings: int, args: argparse.Namespace, cache: Path) -> list[str]:
    return [sys.executable, "-m", "engine.cli.main", "serve", "--shards", str(export), "--workers",
            "--rings", str(rings), "--port", "0", "--cache-dir", str(cache),
            "--kv-pool-mb", str(args.kv_pool_mb)]


def _first_answer(url: str) -> None:
    import openai

    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as client:
        model = client.models.list().data[0].id
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=1)


@contextlib.contextmanager
def _serve(argv: list[str]):
    """The serve process; yields (process, its API URL) once it printed it, stops it with SIGTERM."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"serve exited with {proc.wait()} before it served; run {' '.join(argv)}")
            if found := re.search(r"http://\S+/v1", line):
                yield proc, found.group(0)
                break
        else:
            raise RuntimeError(f"serve printed no URL within {READY_TIMEOUT_S:.0f} s")
    finally:
        stop(proc, 60)


def _cpu_s(p: Any) -> float:
    t = p.cpu_times()
    return t.user + t.system


def measure_service(export: Path, args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    """Start, stop, restart (timed to the first answer), then sample the idle service."""
    import psutil

    rings = max(_ints(args.rings))
    argv = _serve_argv(export, rings, args, cache)
    with _serve(argv) as (_, url):  # fills the compile cache
        _first_answer(url)
    started = time.perf_counter()
    with _serve(argv) as (proc, url):
        ready_s = time.perf_counter() - started
        _first_answer(url)
        restart_s = time.perf_counter() - started
        service = psutil.Process(proc.pid)
        workers = service.children(recursive=True)
        time.sleep(1.0)  # let the first answer's tail settle
        cpu0 = _cpu_s(service), sum(_cpu_s(w) for w in workers)
        t0 = time.perf_counter()
        time.sleep(args.idle_seconds)
        elapsed = time.perf_counter() - t0
        cpu1 = _cpu_s(service), sum(_cpu_s(w) for w in workers)
        return {"rings": rings, "workers": len(workers), "restart_to_url_s": ready_s,
                "restart_to_first_answer_s": restart_s, "idle_seconds": elapsed,
                "idle_cpu_pct_service": 100 * (cpu1[0] - cpu0[0]) / elapsed,
                "idle_cpu_pct_workers": 100 * (cpu1[1] - cpu0[1]) / elapsed,
                "rss_mb_service": service.memory_info().rss / 2**20,
                "rss_mb_workers": sum(w.memory_info().rss for w in workers) / 2**20}


# -- the command -------------------------------------------------------------------------------

def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rings", default="1,2", help="ring counts compared (default 1,2)")
    p.add_argument("--users", type=int, default=8, help="concurrent users per round (default 8)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per answer (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per ring count (default 3)")
    p.add_argument("--warmups", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--threads", type=int, default=1, help="inference threads per worker (default 1)")
    p.add_argument("--stages", type=int, default=2, help="stages per ring, for the default model's export (default 2)")
    p.add_argument("--weights", default="int4", help="weights of the default model's export (default int4)")
    p.add_argument("--kv-pool-mb", type=int, default=512, help="KV pool per stage, MiB (default 512)")
    p.add_argument("--export", type=Path, default=None, help="an export to serve instead of the default model's")
    p.add_argument("--idle-seconds", type=float, default=10.0,
                   help="the idle service sampled this long; 0 skips the service process (default 10)")
    p.add_argument("--cache-dir", type=Path, default=None, help="OpenVINO compile cache (default: a temporary one)")
    p.add_argument("--no-fleet", action="store_true",
                   help="skip the fleet-service phase (deskfleet fleet with two agents, killed and restarted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "rings.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def command_line(args: argparse.Namespace) -> str:
    parts = [COMMAND_LINE, f"--rings {args.rings}", f"--users {args.users}", f"--new-tokens {args.new_tokens}",
             f"--repeats {args.repeats}", f"--warmups {args.warmups}", f"--threads {args.threads}",
             f"--idle-seconds {args.idle_seconds:g}"]
    if args.no_fleet:
        parts.append("--no-fleet")
    if args.export is not None:
        parts.append(f"--export {args.export.name}")
    else:
        parts += [f"--stages {args.stages}", f"--weights {args.weights}"]
    return " ".join(parts)


def render(result: dict[str, Any], command: str) -> str:
    m = result["machine"]
    summary = result["summary"]
    lines = ["## Rings: one model on 1 and 2 rings behind one API (issue 15)\n", f"`{command}`\n",
             f"{m['date']}, {m['cpu']}, {m['cores']} cores, load average {m['load_average']}. "
             f"{result['settings']['users']} users stream one chat answer each per round ({result['export']}, "
             f"{result['stages']} stage(s) per ring, {result['settings']['threads']} thread(s) per worker); "
             "every ring count once per round, order rotated; medians. **Every ring runs on this machine's cores**: "
             "2 rings are twice the workers on the same CPUs, not two PCs' worth.\n"]
    base = summary.get("1", {}).get("aggregate_tok_s")
    rows = []
    for n, s in summary.items():
        share = [r["per_ring"] for r in result["rounds"] if r["rings"] == int(n) and not r["warmup"]]
        split = "/".join(f"{median([p.get(k, 0.0) for p in share]):.0f}" for k in sorted(share[0])) if share and \
            share[0] else "-"
        ratio = f"{s['aggregate_tok_s'] / base:.2f}" if base else "-"
        rows.append([n, f"{s['aggregate_tok_s']:.1f}", ratio, f"{s['ttft_p50_s']:.2f}", f"{s['ttft_p95_s']:.2f}",
                     f"{s['tokens']:.0f}", split, f"{s['rounds']:.0f}"])
    lines.append(markdown_table(["rings", "aggregate tok/s", "vs 1 ring", "TTFT p50 s", "TTFT p95 s",
                                 "tokens/round", "requests per ring", "rounds"], rows))
    service = result.get("service")
    if service:
        lines += ["", f"The service at rest (`deskfleet serve --workers --rings {service['rings']}`, "
                      f"{service['workers']} worker processes, warm spares included, "
                      f"{service['idle_seconds']:.0f} s idle):", "",
                  markdown_table(["figure", "value", "target"], [
                      ["restart to first answer (compile cache warm)", f"{service['restart_to_first_answer_s']:.1f} s",
                       f"<= {RESTART_TARGET_S:.0f} s: "
                       + ("met" if service["restart_to_first_answer_s"] <= RESTART_TARGET_S else "**missed**")],
                      ["idle CPU, service process", f"{service['idle_cpu_pct_service']:.1f} % of a core", ""],
                      ["idle CPU, its workers", f"{service['idle_cpu_pct_workers']:.1f} % of a core", ""],
                      ["RSS, service process", f"{service['rss_mb_service']:.0f} MiB", ""],
                      ["RSS, its workers", f"{service['rss_mb_workers']:.0f} MiB", ""]])]
    fleet = result.get("fleet")
    if fleet:
        met = "met" if fleet["restart_to_first_answer_s"] <= RESTART_TARGET_S else "**missed**"
        lines += ["", f"The fleet service (`deskfleet fleet`, two agents on loopback, one ring; SIGKILLed and "
                      f"started again, {fleet['idle_seconds']:.0f} s idle after):", "",
                  markdown_table(["figure", "value", "target"], [
                      ["restart to first answer", f"{fleet['restart_to_first_answer_s']:.1f} s",
                       f"<= {RESTART_TARGET_S:.0f} s: {met}"],
                      ["restart to its admin API", f"{fleet['restart_to_admin_s']:.1f} s", ""],
                      ["idle CPU, service process", f"{fleet['idle_cpu_pct']:.1f} % of a core", ""],
                      ["RSS, service process", f"{fleet['rss_mb']:.0f} MiB", ""]])]
    return "\n".join(lines) + "\n"


def _export(args: argparse.Namespace) -> Path:
    if args.export is not None:
        return args.export
    from export.sources import default_cache_root, model_fingerprint, resolve_model
    from tests.benchmarks.kit import ensure_export

    source = resolve_model(None)
    root = default_cache_root() / "bench-exports" / "rings"
    export, _ = ensure_export(root, source, model_fingerprint(source.checkpoint_dir), args.weights, args.stages, True)
    return export


def run(args: argparse.Namespace) -> int:
    import tempfile

    from engine.shards.manifest import load_manifest

    export = _export(args)
    with tempfile.TemporaryDirectory(prefix="bench-rings-cache-") as tmp:
        if args.cache_dir is None:
            args.cache_dir = Path(tmp)
        rounds = measure_throughput(export, args)
        service = measure_service(export, args, args.cache_dir) if args.idle_seconds > 0 else None
        fleet = None
        if not args.no_fleet and args.idle_seconds > 0:
            from tests.benchmarks.rings_service import measure_fleet_restart

            with tempfile.TemporaryDirectory(prefix="bench-rings-fleet-") as root:
                fleet = measure_fleet_restart(export, Path(root), args.idle_seconds)
    result = {"machine": machine_info(), "export": export.name, "stages": len(load_manifest(export).stages),
              "settings": {"rings": _ints(args.rings), "users": args.users, "new_tokens": args.new_tokens,
                           "repeats": args.repeats, "warmups": args.warmups, "threads": args.threads},
              "rounds": rounds, "summary": summarise(rounds), "service": service, "fleet": fleet}
    write_json(args.json, result)
    command = command_line(args)
    update_section(args.doc, "rings", render(result, command))
    print(render(result, command))
    return 0


COMMAND = Command(name="rings", help="one model on 1 and 2 rings behind one API: aggregate tok/s at N users, "
                                     "the idle service's CPU and RSS, restart to first answer",
                  configure=configure, run=run)
