"""Smoke run: a local fleet's worker SIGKILLed mid-answer, restarted in place, and where the added
time went (notice, back-off, spawn and imports, open and compile, re-dial, replay).

    python -m tests.tools.restart_smoke [--export DIR] [--users 3] [--tokens 48] [--kill-at 16]

Default export: the demo's (the embedded default model, 2 stages, int4). Three rounds: a warm
spare takes over (``serve --workers`` when the memory holds spares), a restart in place with the
workers' shared compile cache (``--spares off``), and one with the cache emptied just before the
kill (a cold compile). This shows the pieces work and roughly where time goes; it is
not a benchmark: run it on a quiet machine for numbers (this one's 2 cores are shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from engine.generation.request import GenerationRequest
from engine.tools.local_fleet import paged_local_fleet

PROMPT_WORDS = 100  # about 300 tokens a user


def _worker_pid(stage: int) -> int:
    for child in psutil.Process(os.getpid()).children(recursive=True):
        argv = child.cmdline()
        if "worker" in argv and "--stage" in argv and argv[argv.index("--stage") + 1] == str(stage):
            return child.pid
    raise RuntimeError(f"no worker process for stage {stage}")


async def one_round(export: Path, *, users: int, tokens: int, kill_at: int, stage: int, mode: str) -> dict:
    from engine.generation.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(export / "tokenizer")
    restarts = []
    spares: set[int] = set()
    cold = mode == "cold"
    times: dict[int, list[float]] = {u: [] for u in range(users)}
    answers: dict[int, list[int]] = {u: [] for u in range(users)}
    killed: dict[str, float] = {}
    prompt_tokens: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="deskfleet-smoke-cache-") as cache:
        async with paged_local_fleet(export, failover=True, cache_dir=cache, kv_pool_bytes=128 << 20,
                                     on_restart=restarts.append, spares=mode == "spare", on_spare=spares.add) as c:
            async def user(u: int, kill: bool) -> None:
                text = " ".join(f"word{(u * 7 + i) % 97}" for i in range(PROMPT_WORDS))
                ids = tokenizer.encode_chat([{"role": "user", "content": f"Summarise: {text}"}])
                prompt_tokens[u] = len(ids)
                async for event in c.stream(GenerationRequest(tuple(ids), tokens, ignore_eos=True)):
                    answers[u].append(event.token_id)
                    times[u].append(time.monotonic())
                    if kill and len(answers[u]) == kill_at:
                        if cold:
                            for entry in Path(cache).iterdir():
                                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                        killed["at"] = time.monotonic()
                        os.kill(_worker_pid(stage), signal.SIGKILL)

            began = time.monotonic()
            await asyncio.gather(*(user(u, False) for u in range(users)))  # undisturbed, for identity
            prefill = min(ts[0] for ts in times.values()) - began  # the same prompts' batched prefill
            while mode == "spare" and stage not in spares:
                await asyncio.sleep(0.1)
            reference = {u: list(a) for u, a in answers.items()}
            for u in range(users):
                answers[u].clear()
                times[u].clear()
            await asyncio.gather(*(user(u, u == 0) for u in range(users)))
    (restart,) = restarts
    t0 = times[0]
    gaps = [b - a for a, b in zip(t0, t0[1:], strict=False)]
    gap = gaps[kill_at - 1]
    normal = statistics.median(gaps[:kill_at - 1] + gaps[kill_at:])
    after = min(t for ts in times.values() for t in ts if t > restart.reconnected_at)
    return {
        "round": {"spare": "a warm spare takes over", "cache": "restart in place, shared compile cache",
                  "cold": "restart in place, compile cache emptied before the kill"}[mode],
        "identical": answers == reference,
        "users": users, "prompt_tokens": prompt_tokens[0],
        "added_s": round(gap - normal, 3),
        "notice_s": round(restart.noticed_at - killed["at"], 3),
        **{k: round(v, 3) for k, v in restart.breakdown().items()},
        "replay_to_first_token_s": round(after - restart.reconnected_at, 3),
        "undisturbed_first_token_s": round(prefill, 3),
        "token_interval_s": round(normal, 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", type=Path, default=None, help="export directory (default: the demo's)")
    p.add_argument("--users", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--kill-at", type=int, default=16)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--modes", default="spare,cache,cold", help="rounds to run (default spare,cache,cold)")
    args = p.parse_args()
    export = args.export
    if export is None:
        from export.demo import ensure_default_export

        export = ensure_default_export("int4", 2)[1]
    for mode in args.modes.split(","):
        result = asyncio.run(one_round(export, users=args.users, tokens=args.tokens, kill_at=args.kill_at,
                                       stage=args.stage, mode=mode))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
