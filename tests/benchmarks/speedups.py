"""``python -m tests.benchmarks speedups``: what speculation, micro-batching, top-1 replies and the
prefix cache buy on a 2-stage ring, from loopback to 100 ms per hop.

The default model as 2 INT4 stages in 2 paged worker processes (one inference thread each, a
micro-batch in flight per stage, as on separate PCs): the paged runtime's ring
(``engine.tools.local_fleet.paged_local_fleet``); the stateful runtime these figures were first
taken on was retired from serving in issue 27. Every hop of the ring (coordinator → stage 0 →
stage 1 → coordinator) goes through the WAN emulator.
Per one-way delay, interleaved rounds, medians:

- naive        one stream, no speculation
- lookup       one stream, prompt-lookup drafts, K chosen per stream
- draft        one stream, a draft model (the target's own 1-stage INT4 export: an upper bound
               on acceptance, since no smaller model with this tokenizer is available here)
- full stack   two streams micro-batched, each speculating with prompt lookup

Also: top-1 vs full-logits replies at 100 ms + 10 Mbit/s, warm vs cold TTFT with a ~1,000-token
conversation history (the paged scheduler's prefix blocks: a fleet with prefix caching off, then
one with it on), how close the WAN emulator itself stays to its delay (:func:`wan_accuracy`, no
model), and on the stateful export in process (the greedy oracle's KV layout) the cost of a mask
rewind vs a physical trim of every KV state per step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.cli.main import Command
from tests.benchmarks.kit import add_common_arguments, default_model_exports
from tests.benchmarks.kit import verdict as _verdict
from tests.benchmarks.record import (
    machine_info,
    markdown_table,
    median,
    update_section,
    write_json,
)

# A task with overlap between prompt and answer (quoting, editing, summarising), as assistants
# are often given; prompt lookup feeds on such overlap.
PASSAGE = ("Deskfleet pools the idle office computers of a company into one inference fleet. "
           "Each computer runs a contiguous range of layers of the model and passes its hidden "
           "states to the next computer over the office network. ")
PROMPT = f"Repeat the following text three times, exactly as written:\n\n{PASSAGE}"
COMMAND_LINE = "python -m tests.benchmarks speedups"


async def timed_streams(coordinator, prompts: list[tuple[int, ...]], n: int, want_logits: bool = False) -> dict:
    from engine.generation.request import GenerationRequest

    async def one(ids):
        started = time.perf_counter()
        first = last = 0.0
        count = 0
        async for _ in coordinator.stream(GenerationRequest(ids, n, ignore_eos=True, want_logits=want_logits)):
            last = time.perf_counter()
            first = first or last
            count += 1
        return started, first, last, count

    results = await asyncio.gather(*(one(p) for p in prompts))
    total = sum(c for *_, c in results)
    wall = max(r[2] for r in results) - min(r[0] for r in results)
    return {"tok_per_s": total / wall, "ttft_ms": median([1000 * (f - s) for s, f, _, _ in results])}


POOL_BYTES = 64 << 20  # the ring's KV block pool per stage: two streams of a ~1,000-token history, many times over


@contextlib.asynccontextmanager
async def wan_fleet(export: Path, delay_ms: float, bandwidth_mbit: float | None = None, **settings):
    """A 2-worker paged fleet whose every hop is delayed by ``delay_ms`` (one way); ``settings``
    go to the paged scheduler (slots, prefix_cache, ...)."""
    from engine.tools.local_fleet import paged_local_fleet
    from engine.tools.wan_emulator import WanProxy
    from engine.wire.address import Address

    proxies: list[WanProxy] = []

    async def hop(target: Address) -> Address:
        proxy = WanProxy(Address("127.0.0.1", 0), target, delay_ms=delay_ms, bandwidth_mbit=bandwidth_mbit)
        proxies.append(proxy)
        return await proxy.async_start()

    try:
        async with paged_local_fleet(export, threads=1, hop=hop, lanes=None, kv_pool_bytes=POOL_BYTES,
                                     **settings) as coordinator:
            yield coordinator
    finally:
        for proxy in proxies:
            await proxy.async_close()


async def wan_accuracy(delays_ms: tuple[float, ...] = (10.0, 50.0), samples: int = 10,
                       burst: int = 20) -> dict[str, dict[str, float]]:
    """The WAN emulator against its own setting, over an echo server on loopback (what
    tests/wire/test_wan.py asserts only as lower bounds): per one-way delay D, ms over 2 × D of a
    4-byte round trip (median, max of ``samples``) and of ``burst`` back-to-back chunk-sized
    messages echoed whole (median; a proxy holding one chunk at a time would add (burst - 1) × 2 × D)."""
    from engine.tools.wan_emulator import CHUNK_BYTES, WanProxy
    from engine.wire.address import Address

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(CHUNK_BYTES):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def timed(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, payload: bytes) -> float:
        started = time.perf_counter()
        writer.write(payload)
        await asyncio.wait_for(reader.readexactly(len(payload)), 60)
        return time.perf_counter() - started

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = Address("127.0.0.1", server.sockets[0].getsockname()[1])
    out: dict[str, dict[str, float]] = {}
    try:
        for delay in delays_ms:
            async with WanProxy(Address("127.0.0.1", 0), target, delay_ms=delay) as proxy:
                reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
                trips = [await timed(writer, reader, b"ping") for _ in range(samples)]
                bursts = [await timed(writer, reader, bytes(burst * CHUNK_BYTES)) for _ in range(max(1, samples // 5))]
                writer.close()
            floor = 2 * delay / 1000
            out[f"{delay:g}"] = {"round_trip_over_ms": 1000 * (median(trips) - floor),
                                 "round_trip_over_max_ms": 1000 * (max(trips) - floor),
                                 "burst_over_ms": 1000 * (median(bursts) - floor), "burst_messages": burst}
    finally:
        server.close()
        await server.wait_closed()
    return out


def rewind_costs(export: Path, cached: int = 512, k: int = 8, repeats: int = 50) -> dict[str, float]:
    """ms per step on the stateful export in process (the greedy oracle's KVLayout): mask rewind
    bookkeeping vs physically trimming every KV state, vs a decode step."""
    from engine.shards.kv_layout import KVLayout
    from engine.shards.stage import LocalChain, StepInputs

    chain = LocalChain.load(export)
    streams = chain.new_streams()
    layout = KVLayout()
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 1000, (1, cached), dtype=np.int64)
    mask, pos = layout.plan(cached)
    chain.forward(streams, StepInputs(ids, mask, pos, 1))
    layout.append(cached)
    decode = []
    for _ in range(repeats):
        mask, pos = layout.plan(1)
        t = time.perf_counter()
        chain.forward(streams, StepInputs(ids[:, :1], mask, pos))
        decode.append(time.perf_counter() - t)
        layout.append(1)
    masks = []
    for _ in range(repeats):
        t = time.perf_counter()
        layout.append(k + 1)
        layout.mask_last(k)
        layout.plan(1)
        masks.append(time.perf_counter() - t)
    trims = []
    for _ in range(repeats // 5):
        t = time.perf_counter()
        for stream in streams:  # what a physical rewind costs: read, cut and write every state
            for state in stream.request.query_state():
                data = state.state.data
                state.state = ov_tensor(np.ascontiguousarray(data[:, :, : data.shape[2] - 1]))
        trims.append(time.perf_counter() - t)
    step = median(decode)
    return {"cached_tokens": cached, "decode_step_ms": 1000 * step, "mask_rewind_ms": 1000 * median(masks),
            "physical_trim_ms": 1000 * median(trims), "mask_share_of_step": median(masks) / step}


def ov_tensor(array: np.ndarray):
    import openvino as ov

    return ov.Tensor(array)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delays", default="0,10,50,100", help="one-way ms per hop (default 0,10,50,100)")
    add_common_arguments(p, "speedups.json", runs=3, warmups=1)


async def _async_bench(args: argparse.Namespace) -> dict[str, Any]:
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.speculation import SpeculationConfig, Speculator

    source, (one, two), _ = default_model_exports(("int4", 1, True), ("int4", 2, True))
    tok = ChatTokenizer(source.checkpoint_dir)
    ids = tuple(tok.encode_chat([{"role": "user", "content": PROMPT}]))
    other = tuple(tok.encode_chat([{"role": "user", "content": PROMPT + " Then say thank you."}]))
    result: dict[str, Any] = {"delays": {}, "wan_accuracy": await wan_accuracy()}
    for delay in [float(d) for d in args.delays.split(",")]:
        print(f"  {delay:g} ms per hop", file=sys.stderr, flush=True)
        rows: dict[str, list[dict]] = {"naive": [], "lookup": [], "draft": [], "full stack": []}
        specs = {"lookup": Speculator(SpeculationConfig("lookup")),
                 "draft": Speculator(SpeculationConfig("draft", draft_export=one)),
                 "full stack": Speculator(SpeculationConfig("lookup"))}
        async with wan_fleet(two, delay, slots=2, prefix_cache=False) as c:
            for round_ in range(args.warmups + args.runs):
                for name in rows:
                    c.speculation = specs.get(name)
                    prompts = [ids, other] if name == "full stack" else [ids]
                    r = await timed_streams(c, prompts, args.tokens)
                    await c.async_wait_idle()
                    if round_ >= args.warmups:
                        rows[name].append(r)
            c.speculation = None  # each Speculator is closed below, once
        for s in specs.values():
            s.close()
        result["delays"][str(delay)] = {
            name: {"median_tok_per_s": median([r["tok_per_s"] for r in rs]), "runs": rs,
                   "acceptance_rate": specs[name].accepted / specs[name].proposed
                   if name in specs and specs[name].proposed else None,
                   "median_k": median(specs[name].k_history) if name in specs and specs[name].k_history else None}
            for name, rs in rows.items()}
    print("  top-1 vs full logits at 100 ms + 10 Mbit/s", file=sys.stderr, flush=True)
    replies: dict[str, list[float]] = {"top-1": [], "full logits": []}
    async with wan_fleet(two, 100.0, bandwidth_mbit=10.0, prefix_cache=False) as c:
        for round_ in range(args.warmups + args.runs):
            for name, want in (("top-1", False), ("full logits", True)):
                r = await timed_streams(c, [ids], 32, want_logits=want)
                if round_ >= args.warmups:
                    replies[name].append(r["tok_per_s"])
    result["replies"] = {k: median(v) for k, v in replies.items()}
    print("  warm vs cold TTFT", file=sys.stderr, flush=True)
    result["ttft"] = await _ttft(two, tok)
    result["rewind"] = await asyncio.to_thread(rewind_costs, one)
    result.update({"benchmark": "speedups", "command": COMMAND_LINE, "machine": machine_info(),
                   "prompt_tokens": len(ids), "new_tokens": args.tokens, "warmups": args.warmups, "runs": args.runs})
    return result


def _history(tok, turns: int) -> list[dict[str, str]]:
    messages = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: {PASSAGE} What does this say?"})
        messages.append({"role": "assistant", "content": f"Answer {i}: it says that {PASSAGE.lower()}"})
    return messages


async def _ttft(export: Path, tok, target_tokens: int = 1000) -> dict[str, Any]:
    """The follow-up's TTFT on a fleet with no prefix cache (cold) and, once the conversation so
    far was served, on one whose scheduler keeps prefix blocks (warm)."""
    from engine.generation.request import GenerationRequest
    from engine.tools.local_fleet import paged_local_fleet

    turns = 1
    while len(tok.encode_chat(_history(tok, turns))) < target_tokens:
        turns += 1
    history = _history(tok, turns)
    before = tuple(tok.encode_chat(history[:-1] + [history[-1]]))
    follow = tuple(tok.encode_chat(history + [{"role": "user", "content": "Summarise all of that."}]))
    cold, warm = [], []
    fleet = {"threads": 1, "lanes": None, "kv_pool_bytes": POOL_BYTES}
    async with paged_local_fleet(export, prefix_cache=False, **fleet) as c:
        for _ in range(3):
            r = await timed_streams(c, [follow], 2)
            cold.append(r["ttft_ms"])
            await c.async_wait_idle()
    async with paged_local_fleet(export, **fleet) as c:
        for _ in range(3):
            async for _ in c.stream(GenerationRequest(before, 2, ignore_eos=True)):
                pass
            await c.async_wait_idle()  # the conversation so far is in the pool's prefix blocks
            r = await timed_streams(c, [follow], 2)
            warm.append(r["ttft_ms"])
            await c.async_wait_idle()
        hits = c.metrics()["prefix_hits_total"]
    return {"history_tokens": len(follow), "cold_ttft_ms": median(cold), "warm_ttft_ms": median(warm),
            "warm_over_cold": median(warm) / median(cold), "prefix_hits": hits}


def render(result: dict[str, Any], json_path: Path) -> str:
    m = result["machine"]
    lines = ["## Speed-ups on the ring: speculation, micro-batching, top-1, prefix cache\n",
             f"`{result['command']}` → `{json_path}` ({m['date']}, {m['cores']} cores, OpenVINO {m['openvino']}, "
             f"load average at start {m['load_average']}). Default model INT4, 2 paged worker processes with one "
             f"thread each, every hop through the WAN emulator; {result['prompt_tokens']}-token prompt asking to "
             f"repeat a passage, {result['new_tokens']} tokens, {result['warmups']} warm-up + {result['runs']} "
             "interleaved rounds per delay, medians. The draft model is the target's own 1-stage export (an upper "
             "bound on acceptance: no smaller model with this tokenizer exists here).\n"]
    rows = []
    for delay, v in result["delays"].items():
        naive = v["naive"]["median_tok_per_s"]
        for name, r in v.items():
            rows.append([f"{float(delay):g}", name, r["median_tok_per_s"], r["median_tok_per_s"] / naive,
                         "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}",
                         "" if r["median_k"] is None else f"{r['median_k']:g}"])
    lines.append(markdown_table(["ms per hop", "variant", "tok/s (aggregate)", "× naive", "acceptance",
                                 "median K"], rows))
    last = result["delays"][max(result["delays"], key=float)]
    full = last["full stack"]["median_tok_per_s"] / last["naive"]["median_tok_per_s"]
    rep = result["replies"]
    ratio = rep["top-1"] / rep["full logits"]
    t = result["ttft"]
    rw = result["rewind"]
    lines += ["", markdown_table(["measure", "value", "target", "verdict"], [
        [f"full stack / naive at {float(max(result['delays'], key=float)):g} ms per hop", full, "≥ 5",
         _verdict(full, 5.0)],
        ["top-1 / full logits at 100 ms + 10 Mbit/s", ratio, "≥ 3", _verdict(ratio, 3.0)],
        [f"mask rewind share of a decode step ({rw['cached_tokens']} cached; stateful export in process)",
         rw["mask_share_of_step"], "≤ 0.01",
         _verdict(rw["mask_share_of_step"], 0.01, higher=False)],
        [f"warm / cold TTFT ({t['history_tokens']}-token conversation)", t["warm_over_cold"], "≤ 0.2",
         _verdict(t["warm_over_cold"], 0.2, higher=False)],
    ]), "",
        f"Top-1 {rep['top-1']:.2f} tok/s vs full logits {rep['full logits']:.2f} tok/s. Rewind per step: mask "
        f"{rw['mask_rewind_ms']:.3f} ms, physical trim of every KV state {rw['physical_trim_ms']:.2f} ms, decode step "
        f"{rw['decode_step_ms']:.2f} ms. TTFT cold {t['cold_ttft_ms']:.0f} ms, warm {t['warm_ttft_ms']:.0f} ms "
        f"({t['prefix_hits']:g} prefix hits)."]
    wan = result.get("wan_accuracy")
    if wan:
        lines += ["", "The WAN emulator against its setting (an echo server on loopback behind it; ms over 2 × the "
                  "one-way delay; tests/wire/test_wan.py asserts only that the delay is never undercut):", "",
                  markdown_table(["one-way ms", "round trip: median / max over", "burst of chunk-sized messages: "
                                  "median over"],
                                 [[d, f"{w['round_trip_over_ms']:.2f} / {w['round_trip_over_max_ms']:.2f}",
                                   f"{w['burst_over_ms']:.2f} ({w['burst_messages']} × 64 KiB)"]
                                  for d, w in wan.items()])]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_async_bench(args))
    write_json(args.json, result)
    update_section(args.doc, "speedups", render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="speedups", help="speculation, micro-batching, top-1 and prefix cache on a WAN-emulated ring",
                  configure=configure, run=run)
