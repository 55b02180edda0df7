"""``python -m tests.benchmarks fairness``: three chat users beside one greedy user, fair share on and
off (issue 33 deliverable 3: the chat users' TTFT p95 within 2x of the same load without the
greedy user).

The default model's 1-stage export served by the paged coordinator and the real API in this
process, with a key book of four keys; every user is the real ``openai`` client (``AsyncOpenAI``).
Per round, four variants run interleaved (order rotated each round): the chat users alone or
beside the greedy user, with the scheduler's fair share on or off (``SchedulerConfig.fair_share``;
two coordinators, loaded once). The greedy user keeps ``--greedy-requests`` ``n = 8`` requests on
long prompts in flight (2: every one of the 16 slots), back to back; each chat user asks
``--chats`` short questions in turn. TTFT is measured by each chat user from sending to its first
streamed token; figures are medians over rounds of each round's p95.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
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

COMMAND_LINE = "python -m tests.benchmarks fairness"
VARIANTS = (("alone", True), ("greedy", True), ("alone", False), ("greedy", False))
QUESTIONS = ("What is a GPU?", "Say hello to the office.", "Name three rivers in Europe.", "Why is the sky blue?",
             "What is 17 times 23?", "Suggest a name for a cat.")
LONG = ("The quarterly report covers the migration of the accounting department to the new building, the "
        "replacement of the ageing printers on the second floor, the pilot of the shared calendar, and the "
        "results of the staff survey on remote work. ")
TARGET = 2.0


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))] if ordered else float("nan")


async def _chat_user(client: Any, model: str, questions: int, tokens: int, seed: int) -> list[float]:
    ttfts = []
    for i in range(questions):
        text = f"{seed}{i} {QUESTIONS[(seed + i) % len(QUESTIONS)]}"
        start = time.perf_counter()
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                      max_tokens=tokens, stream=True)
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
        ttfts.append(first if first is not None else time.perf_counter() - start)
    return ttfts


async def _greedy_user(client: Any, model: str, long_repeats: int, tokens: int, stop: asyncio.Event) -> int:
    sent = 0
    while not stop.is_set():
        text = f"{sent} " + LONG * long_repeats + "Summarise this report."
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], n=8,
                                             max_tokens=tokens, temperature=0.7)
        sent += 1
    return sent


async def _round(urls: dict[bool, str], secrets: list[str], model: str, with_greedy: bool, fair: bool,
                 args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import openai

    url = urls[fair]
    clients = [openai.AsyncOpenAI(base_url=url, api_key=s, max_retries=0, timeout=1800) for s in secrets]
    stop = asyncio.Event()
    try:
        greedy = asyncio.gather(*(_greedy_user(clients[0], model, args.long_repeats, args.greedy_tokens, stop)
                                  for _ in range(args.greedy_requests))) if with_greedy else None
        if greedy is not None:
            await asyncio.sleep(args.head_start)  # the greedy user's choices in the slots first
        users = await asyncio.gather(*(_chat_user(c, model, args.chats, args.chat_tokens, seed * 10 + k)
                                       for k, c in enumerate(clients[1:])))
        stop.set()
        if greedy is not None:
            await greedy
    finally:
        for c in clients:
            await c.close()
    ttfts = [t for u in users for t in u]
    return {"ttft_p95_s": p95(ttfts), "ttft_p50_s": statistics.median(ttfts), "ttfts": ttfts}


async def _async_run(args: argparse.Namespace, export: Path) -> dict[str, Any]:
    from engine.api.server import ApiSettings, async_run_api
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator
    from engine.trust.key_book import KeyBook

    with tempfile.TemporaryDirectory() as state:
        book = KeyBook(state)
        secrets = [book.issue(name).secret for name in ("greedy", "chat1", "chat2", "chat3")]
        tokenizer = await asyncio.to_thread(ChatTokenizer, export / "tokenizer")
        settings = ApiSettings(max_prompt_tokens=4000, default_max_tokens=64, max_tokens_limit=512,
                               max_concurrent=32, key_streams=16)
        async with contextlib.AsyncExitStack() as stack:
            urls, model = {}, ""
            for fair in (True, False):
                coordinator = await stack.enter_async_context(BatchCoordinator.local(
                    export, num_threads=args.threads, slots=args.slots, fair_share=fair))
                api = await async_run_api(coordinator, tokenizer, settings, keys=book)
                stack.push_async_callback(api.async_stop)
                urls[fair], model = api.url, coordinator.model.name
            rounds: list[dict[str, Any]] = []
            for r in range(-args.warmups, args.rounds):
                order = VARIANTS[r % 4:] + VARIANTS[:r % 4]
                for load, fair in order:
                    result = await _round(urls, secrets, model, load == "greedy", fair, args, r)
                    if r >= 0:  # warm-up rounds (negative) compile the step shapes: not recorded
                        rounds.append({"round": r, "load": load, "fair": fair, **result})
                    print(f"round {r} {load:6s} fair={fair}: TTFT p95 {result['ttft_p95_s']:.2f} s", file=sys.stderr)
    return {"rounds": rounds}


def summarise(rounds: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for load, fair in VARIANTS:
        out[f"{load}-{'fair' if fair else 'fcfs'}"] = median([r["ttft_p95_s"] for r in rounds
                                                              if r["load"] == load and r["fair"] == fair])
    return out


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every variant once (default 3)")
    p.add_argument("--warmups", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--chats", type=int, default=4, help="questions per chat user per round (default 4)")
    p.add_argument("--chat-tokens", type=int, default=16, help="tokens per chat answer (default 16)")
    p.add_argument("--greedy-requests", type=int, default=2,
                   help="n = 8 requests the greedy user keeps in flight at once (default 2: 16 streams)")
    p.add_argument("--greedy-tokens", type=int, default=64, help="tokens per greedy choice (default 64)")
    p.add_argument("--long-repeats", type=int, default=12, help="paragraphs in the greedy prompt (default 12)")
    p.add_argument("--head-start", type=float, default=2.0, help="seconds the greedy user starts first")
    p.add_argument("--slots", type=int, default=16, help="the ring's slots (default 16)")
    p.add_argument("--threads", type=int, default=None, help="inference threads")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "fairness.json")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC)


def run(args: argparse.Namespace) -> int:
    from tests.benchmarks.kit import default_model_exports

    _, exports, _ = default_model_exports(("int4", 1, True))
    machine = machine_info()
    raw = asyncio.run(_async_run(args, exports[0]))
    figures = summarise(raw["rounds"])
    ratio_fair = figures["greedy-fair"] / figures["alone-fair"]
    ratio_fcfs = figures["greedy-fcfs"] / figures["alone-fcfs"]
    write_json(args.json, {"machine": machine, "args": {k: str(v) for k, v in vars(args).items() if k != "_run"},
                           "figures": figures, **raw})
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                     if k in ("rounds", "warmups", "chats", "chat_tokens", "greedy_requests", "greedy_tokens",
                              "long_repeats", "slots"))
    rows = [["fair share on", f"{figures['alone-fair']:.2f}", f"{figures['greedy-fair']:.2f}", f"{ratio_fair:.2f}x",
             "met" if ratio_fair <= TARGET else "**missed**"],
            ["fair share off (first come first served)", f"{figures['alone-fcfs']:.2f}",
             f"{figures['greedy-fcfs']:.2f}", f"{ratio_fcfs:.2f}x", "-"]]
    body = (f"## Fairness: chat users beside a greedy user\n\n`{COMMAND_LINE} {flags}`\n\n"
            "Three chat users (the real `openai` client, streamed, one key each) ask short questions in turn; "
            f"a fourth key keeps {args.greedy_requests} `n = 8` requests on long prompts in flight, back to back. "
            "TTFT p95 of the chat users, "
            f"median over {args.rounds} interleaved rounds after {args.warmups} untimed, default model (int4, "
            f"1 stage), {args.slots} slots. "
            f"Issue 33's goal: within {TARGET:.0f}x of the same chat load without the greedy user. "
            f"Machine: {machine['cores']} cores, load average {machine['load_average']} at the start "
            f"({machine['date']}; shared and loaded: compare the ratios).\n\n"
            + markdown_table(["scheduler", "TTFT p95 alone (s)", "TTFT p95 beside greedy (s)", "ratio", "goal"], rows))
    update_section(args.doc, "fairness", body)
    print(body)
    return 0


COMMAND = Command(name="fairness", help="chat users' TTFT beside a greedy n = 8 user, fair share on and off",
                  configure=configure, run=run)
