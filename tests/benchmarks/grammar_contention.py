"""The ``grammar`` benchmark's contention part (issue 29, M5): one key's big schemas against
another key's small one, and a step's big masks against the event loop.

- **build**: a victim's small schema (the benchmark's ``json_schema`` person) gets its matcher
  through a :class:`~engine.generation.grammar_pool.GrammarPool`, alone, then while an attacker
  key has ``attackers`` big schemas (``--big-properties`` integer properties each, inside the size
  budget) asked for at once. Two pools: ``one thread`` (what each ring had before: one worker,
  nobody's share bounded) and ``pool`` (the default budget: a few workers, each key's share).
- **loop**: ``attackers`` streams of a fresh big schema compute their first step's masks, on the event loop
  (what the paged coordinator did) and on a mask thread (``StreamConstraints.async_off_loop``'s
  way), while a 5 ms ticker on the loop records its longest gap: how long every other client of
  the process was kept waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine.generation.grammar import GrammarMatcher, GrammarTokenizer
from engine.generation.grammar_pool import GrammarBudget, GrammarBusyError, GrammarPool
from engine.generation.response_format import json_schema_grammar

POLICIES = {
    "one thread": GrammarBudget(workers=1, per_owner=1000, max_waiting=1000, max_schema_bytes=1 << 30,
                                compile_budget_s=3600, queue_timeout_s=3600),
    "pool": GrammarBudget(),
}
_TICK_S = 0.005
_fresh = itertools.count()


def big_schema(properties: int) -> dict[str, Any]:
    tag = next(_fresh)
    return {"type": "object", "properties": {f"k{tag}_{i}": {"type": "integer"} for i in range(properties)}}


async def _ticker(stop: asyncio.Event) -> float:
    """The loop's longest gap between 5 ms ticks until ``stop``, in seconds."""
    longest, last = 0.0, time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(_TICK_S)
        now = time.perf_counter()
        longest, last = max(longest, now - last - _TICK_S), now
    return longest


async def _victim_build(pool: GrammarPool, build: Callable[[], GrammarMatcher]) -> float:
    t = time.perf_counter()
    await pool.async_matcher(("victim", next(_fresh)), build, owner="victim")
    return time.perf_counter() - t


async def _build_round(vocab: GrammarTokenizer, victim: Any, budget: GrammarBudget, attackers: int,
                       properties: int) -> dict[str, Any]:
    pool = GrammarPool(budget)
    try:
        def victim_build() -> GrammarMatcher:
            return vocab.matcher(victim())

        alone = statistics.median([await _victim_build(pool, victim_build) for _ in range(3)])

        def attacker_build(schema: dict[str, Any]) -> Callable[[], GrammarMatcher]:
            return lambda: vocab.matcher(json_schema_grammar(schema))

        async def attack() -> str:
            schema = big_schema(properties)
            try:
                await pool.async_matcher(("attacker", next(_fresh)), attacker_build(schema), owner="attacker")
                return "built"
            except GrammarBusyError:
                return "refused"

        stop = asyncio.Event()
        ticker = asyncio.ensure_future(_ticker(stop))
        attacks = [asyncio.ensure_future(attack()) for _ in range(attackers)]
        await asyncio.sleep(0.1)
        under_attack = await _victim_build(pool, victim_build)
        outcomes = await asyncio.gather(*attacks)
        stop.set()
        return {"victim_alone_s": alone, "victim_under_attack_s": under_attack,
                "attacker_built": outcomes.count("built"), "attacker_refused": outcomes.count("refused"),
                "loop_gap_s": await ticker}
    finally:
        pool.close()


async def _mask_round(vocab: GrammarTokenizer, streams: int, properties: int, off_loop: bool) -> dict[str, float]:
    """The first step's masks of ``streams`` streams of a fresh big schema (built first, untimed):
    the cold masks a new schema costs, which is what an attacker sending new schemas makes every
    step pay."""
    first = vocab.matcher(json_schema_grammar(big_schema(properties)))
    matchers = [first.fork() for _ in range(streams)]
    stop = asyncio.Event()
    ticker = asyncio.ensure_future(_ticker(stop))
    await asyncio.sleep(0.02)

    def masks() -> None:
        for m in matchers:
            m.mask()

    t = time.perf_counter()
    if off_loop:
        await asyncio.to_thread(masks)
    else:
        masks()
    took = time.perf_counter() - t
    await asyncio.sleep(0.02)
    stop.set()
    return {"step_masks_s": took, "loop_gap_s": await ticker}


def measure_contention(vocab: GrammarTokenizer, victim: Any, attackers: int, properties: int,
                       runs: int) -> dict[str, Any]:
    """Figures of both parts (see the module docstring), medians over ``runs`` (rounds interleaved)."""
    builds: dict[str, list[dict[str, Any]]] = {name: [] for name in POLICIES}
    masks: dict[str, list[dict[str, float]]] = {"on the loop": [], "mask thread": []}
    for _ in range(runs):
        for name, budget in POLICIES.items():
            builds[name].append(asyncio.run(_build_round(vocab, victim, budget, attackers, properties)))
        for name, off in (("on the loop", False), ("mask thread", True)):
            masks[name].append(asyncio.run(_mask_round(vocab, attackers, properties, off)))
    return {"attackers": attackers, "big_properties": properties,
            "big_schema_bytes": len(str(big_schema(properties)).encode()), "builds": builds, "masks": masks}


def render_contention(c: dict[str, Any], median: Callable[[list[float]], float],
                      table: Callable[[list[str], list[list[Any]]], str]) -> str:
    head = (f"Contention (issue 29, M5): an attacker key asks for {c['attackers']} schemas of "
            f"{c['big_properties']:,} integer properties (~{c['big_schema_bytes'] // 1024} KB each) at once; "
            "the victim's matcher for the person schema, alone (median of 3) and meanwhile, through a one-thread "
            "pool (each ring's before) and the default pool; then the first step's masks of "
            f"{c['attackers']} streams of a fresh big schema, on the loop (the paged coordinator's before) and "
            "on a mask thread. Medians over the runs; 'loop gap' is the longest the event loop was kept from a "
            "5 ms ticker.")
    build_rows = []
    for name, rounds in c["builds"].items():
        build_rows.append([name, f"{median([r['victim_alone_s'] for r in rounds]) * 1e3:.1f} ms",
                           f"{median([r['victim_under_attack_s'] for r in rounds]):.3f} s",
                           f"{median([r['attacker_built'] for r in rounds]):.0f} / "
                           f"{median([r['attacker_refused'] for r in rounds]):.0f}",
                           f"{median([r['loop_gap_s'] for r in rounds]) * 1e3:.0f} ms"])
    mask_rows = [[name, f"{median([r['step_masks_s'] for r in rounds]) * 1e3:.0f} ms",
                  f"{median([r['loop_gap_s'] for r in rounds]) * 1e3:.0f} ms"] for name, rounds in c["masks"].items()]
    return "\n\n".join([head, table(["grammar workers", "victim alone", "victim under attack",
                                     "attacker built / refused (429)", "loop gap"], build_rows),
                        table(["masks of one step", "took", "loop gap"], mask_rows)])
