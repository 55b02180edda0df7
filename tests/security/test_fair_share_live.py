"""Inside a ring, a key's streams are capped per step (issue 29 deliverable 2, issue 33 deliverable 3),
live: the real paged coordinator over the tiny export, the real API with a real key book, and the
real ``openai`` client on loopback.

The greedy key asks ``n = 8`` on a long prompt with many tokens to generate: its choices take every
one of the ring's 4 slots and 4 more wait behind them. Another key then asks a short question. First
come first served, it would wait behind the greedy key's queued choices until 4 of them had ended;
with the fair share the greedy key gives up slots (its newest streams, preempted) and the other
key's request is admitted into the very next steps and answered while every one of the greedy
key's 8 choices is still running or waiting. Asserted on the scheduling facts the server exposes
(``sched_fair_*`` on /metrics, the scheduler's streams), not on time.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from engine.api.server import ApiSettings, async_run_api
from engine.trust.key_book import KeyBook
from tests.support.asyncutil import run

pytestmark = pytest.mark.slow

POOL = 16 << 20
LONG = "Summarise the quarterly report of the accounting department for the board, in plain words. " * 3
TIMEOUT = 120.0


def test_a_greedy_keys_n8_and_long_prompt_cannot_keep_another_key_out_of_the_steps(tiny_export, tmp_path):
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator

    book = KeyBook(tmp_path)
    greedy, chatty = book.issue("greedy"), book.issue("chatty")
    export = tiny_export("llama", 1)

    async def main():
        tokenizer = await asyncio.to_thread(ChatTokenizer, export / "tokenizer")
        async with BatchCoordinator.local(export, slots=4, token_budget=64, prefill_chunk=32,
                                          kv_pool_bytes=POOL) as coordinator:
            settings = ApiSettings(max_prompt_tokens=400, default_max_tokens=8, max_tokens_limit=300,
                                   max_concurrent=16, key_streams=8)
            api = await async_run_api(coordinator, tokenizer, settings, keys=book)
            sched = coordinator.scheduler
            try:
                async with openai.AsyncOpenAI(base_url=api.url, api_key=greedy.secret, max_retries=0,
                                              timeout=TIMEOUT) as hog, \
                        openai.AsyncOpenAI(base_url=api.url, api_key=chatty.secret, max_retries=0,
                                           timeout=TIMEOUT) as user:
                    held = asyncio.ensure_future(hog.chat.completions.create(
                        model=coordinator.model.name, messages=[{"role": "user", "content": LONG}], n=8,
                        max_tokens=250, temperature=0.0))
                    while not (sched.streams == 8 and sched.running == 4 and sched.stream(1) is not None
                               and sched.stream(1).generated):  # every slot the greedy key's, 4 more waiting
                        assert not held.done(), held.exception()
                        await asyncio.sleep(0.005)
                    before = coordinator.metrics()
                    answer = await user.chat.completions.create(
                        model=coordinator.model.name, messages=[{"role": "user", "content": "Hello?"}], max_tokens=4)
                    assert answer.choices[0].message.content
                    # answered while all 8 of the greedy key's choices were still running or waiting
                    assert not held.done() and sched.streams == 8, "the other key waited for the greedy key's streams"
                    after = coordinator.metrics()
                    assert after["sched_fair_preemptions_total"] - before["sched_fair_preemptions_total"] >= 1
                    assert after["sched_fair_steps_total"] > before["sched_fair_steps_total"]
                    assert len((await held).choices) == 8  # the greedy key is served too, to its end
            finally:
                await api.async_stop()

    run(main(), timeout=300)
