"""The grammar pool's bounds (issue 29, M5): the size budget before compiling, the time budget,
the workers' queue, each key's share, one build per schema. Real llguidance matchers over the
tiny tokenizer on the pool's real threads; a build held on an Event stands for a slow schema."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from engine.generation.grammar import load_grammar_tokenizer
from engine.generation.grammar_pool import (
    GrammarBudget,
    GrammarBudgetError,
    GrammarBusyError,
    GrammarPool,
    check_constraint_size,
    constraint_bytes,
)
from engine.generation.request import FunctionSchema, JsonConstraint, ToolCallConstraint
from engine.generation.response_format import json_schema_grammar

HANG_GUARD_S = 30  # every wait here ends in milliseconds; this only stops a broken pool hanging the run


@pytest.fixture(scope="module")
def build(tiny_tokenizer_dir):
    """``build(release=None)`` -> a build of a real boolean matcher, held until ``release`` is set."""
    tokenizer = load_grammar_tokenizer(tiny_tokenizer_dir, logits_width=512, eos_ids=(0,))
    grammar = json_schema_grammar({"type": "boolean"})

    def make(release: threading.Event | None = None, calls: list | None = None):
        def run():
            if calls is not None:
                calls.append(1)
            if release is not None:
                assert release.wait(HANG_GUARD_S)
            return tokenizer.matcher(grammar)
        return run

    return make


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


def test_the_size_budget_is_checked_before_compiling_and_named():
    budget = GrammarBudget(max_schema_bytes=1000)
    small = JsonConstraint(json.dumps({"type": "object"}), "ok")
    check_constraint_size(small, budget)
    big = JsonConstraint(json.dumps({"enum": ["x" * 1000]}), "big")
    with pytest.raises(GrammarBudgetError, match=r"response_format.json_schema.schema is 1,014 bytes, over this "
                                                 r"server's grammar size budget of 1,000 bytes"):
        check_constraint_size(big, budget)
    tools = ToolCallConstraint(tuple(FunctionSchema(f"f{i}", json.dumps({"enum": ["y" * 300]})) for i in range(4)))
    assert constraint_bytes(tools) > 1000  # each tool is small; together they are over
    with pytest.raises(GrammarBudgetError, match="the tools' parameters .together. is .* over .* 1,000 bytes"):
        check_constraint_size(tools, budget)


def test_one_build_per_schema_and_copies_for_every_stream(build):
    pool = GrammarPool(GrammarBudget())
    calls: list = []
    release = threading.Event()

    async def main():
        first = [asyncio.ensure_future(pool.async_matcher("k", build(release, calls), owner="a")) for _ in range(4)]
        await asyncio.sleep(0.05)
        assert pool.pending == 1  # the other three joined the one build without a slot of their own
        release.set()
        matchers = await asyncio.gather(*first)
        again = await pool.async_matcher("k", build(None, calls), owner="b")  # cached: no build
        return [*matchers, again]

    try:
        matchers = _run(main())
        assert len(calls) == 1 and len({id(m) for m in matchers}) == 5
        fresh = matchers[1].mask()
        allowed = int(next(t for t in range(512) if fresh[t // 32] >> (t % 32) & 1))
        matchers[0].consume([allowed])  # one stream moves on; the others (and the cached one) do not
        assert matchers[0].consumed == 1 and all(m.consumed == 0 for m in matchers[1:])
        assert (matchers[4].mask() == fresh).all()
    finally:
        release.set()
        pool.close()


def test_a_key_holds_its_share_and_another_key_is_built_at_once(build):
    pool = GrammarPool(GrammarBudget(workers=2, per_owner=1, max_waiting=4))
    hold = threading.Event()

    async def main():
        slow = asyncio.ensure_future(pool.async_matcher("big-1", build(hold), owner="attacker"))
        await asyncio.sleep(0.05)
        with pytest.raises(GrammarBusyError, match=r"this API key already has 1 grammars compiling, its share .*"
                                                   r"at most 1 at once"):
            await pool.async_matcher("big-2", build(hold), owner="attacker")
        victim = await pool.async_matcher("small", build(), owner="victim")  # the other worker is free
        hold.set()
        await slow
        return victim

    try:
        assert _run(main()).consumed == 0
        assert pool.pending == 0
    finally:
        hold.set()
        pool.close()


def test_a_full_queue_is_a_clear_429_and_a_long_wait_gives_up(build):
    pool = GrammarPool(GrammarBudget(workers=1, max_waiting=1, per_owner=8, queue_timeout_s=0.3))
    hold = threading.Event()

    async def main():
        running = asyncio.ensure_future(pool.async_matcher("a", build(hold), owner="x"))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(pool.async_matcher("b", build(hold), owner="y"))
        await asyncio.sleep(0.05)
        with pytest.raises(GrammarBusyError, match=r"the grammar workers are busy \(1 compiling, 1 waiting, the "
                                                   r"limit\); retry shortly"):
            await pool.async_matcher("c", build(), owner="z")
        with pytest.raises(GrammarBusyError, match="stayed busy for 0.3 s"):
            await queued
        hold.set()
        await running

    try:
        _run(main())
    finally:
        hold.set()
        pool.close()


def test_a_build_over_the_time_budget_is_a_400_and_keeps_its_worker_until_it_ends(build):
    pool = GrammarPool(GrammarBudget(workers=1, per_owner=1, compile_budget_s=0.2))
    hold = threading.Event()
    calls: list = []

    async def main():
        with pytest.raises(GrammarBudgetError, match="did not compile within this server's grammar time budget "
                                                     "of 0.2 s"):
            await pool.async_matcher("slow", build(hold, calls), owner="a")
        assert pool.pending == 1  # the thread cannot be stopped: its worker and the key's share stay taken
        with pytest.raises(GrammarBusyError, match="its share"):
            await pool.async_matcher("other", build(), owner="a")
        hold.set()
        while pool.pending:
            await asyncio.sleep(0.01)
        with pytest.raises(GrammarBudgetError):  # not cached: the same schema is built again, and refused again
            await pool.async_matcher("slow", build(again, calls), owner="a")

    again = threading.Event()
    try:
        _run(main())
        assert len(calls) == 2
    finally:
        hold.set()
        again.set()
        pool.close()


def test_a_schema_that_does_not_compile_is_the_builds_own_error(tiny_tokenizer_dir):
    from engine.generation.grammar import GrammarError

    pool = GrammarPool()

    def bad():
        return load_grammar_tokenizer(tiny_tokenizer_dir, logits_width=512, eos_ids=(0,)).matcher(
            json_schema_grammar({"type": "no-such-type"}))

    try:
        with pytest.raises(GrammarError, match="no-such-type"):
            _run(pool.async_matcher("bad", bad, owner="a"))
        assert pool.pending == 0
    finally:
        pool.close()
