"""One key cannot learn another key's prompts from the shared prefix cache (issue 29, M1, L8).

The review's attack: the victim (key ``victim``) sent a payroll prompt holding a 4-digit PIN; the
attacker (key ``bob``) read ``prefix_tokens_reused_total`` on ``/metrics``, sent the same text with
a guessed PIN and read it again: 32 tokens reused for the right guess, 0 for the wrong ones.

Here the real paged coordinator (the tiny export, prefix cache on) serves the real API with a
real key book, and the real ``openai`` client plays both users: the attacker's exact copy of the
victim's prompt reuses nothing (the cache is scoped to one key), while the victim's own second
request does reuse (the test can see a reuse when there is one). ``/metrics`` is refused to a
plain key and to no key, and read by a key issued for monitoring; ``/health`` tells a stranger its
status only.
"""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from engine.api.server import ApiSettings, async_run_api
from engine.trust.key_book import KeyBook
from tests.support.asyncutil import run

pytestmark = pytest.mark.slow

POOL = 16 << 20
SYSTEM = ("You are the payroll assistant of Acme Corp. Answer briefly, never repeat personal numbers, and keep "
          "every conversation private to the person who started it. Answer in English.")
SECRET = [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "My bank PIN is 7319. Please remind me to change it next week."}]


def test_a_key_reuses_its_own_prefix_never_another_keys_and_metrics_are_for_the_operator(tiny_export, tmp_path):
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator

    book = KeyBook(tmp_path)
    victim, bob, monitor = book.issue("victim"), book.issue("bob"), book.issue("grafana", metrics=True)
    export = tiny_export("llama", 1)

    async def main():
        tokenizer = await asyncio.to_thread(ChatTokenizer, export / "tokenizer")
        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL) as coordinator:
            settings = ApiSettings(default_max_tokens=8, max_tokens_limit=8)
            api = await async_run_api(coordinator, tokenizer, settings, keys=book)
            base = api.url.removesuffix("/v1")
            try:
                async def ask(secret: str) -> float:
                    async with openai.AsyncOpenAI(base_url=api.url, api_key=secret, max_retries=0, timeout=60) as c:
                        answer = await c.chat.completions.create(model=coordinator.model.name, messages=SECRET,
                                                                 max_tokens=1)
                        assert answer.usage.prompt_tokens > 64  # at least two full blocks to share
                    await coordinator.async_wait_idle()
                    return coordinator.metrics()["prefix_tokens_reused_total"]

                before = await ask(victim.secret)
                after_bob = await ask(bob.secret)
                after_victim = await ask(victim.secret)
                assert after_bob == before, "the attacker's copy of the victim's prompt reused the victim's blocks"
                assert after_victim > after_bob, "the victim's own second request reused nothing: a broken test"

                async with aiohttp.ClientSession() as http:
                    async def get(path: str, secret: str | None) -> tuple[int, dict | str]:
                        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
                        async with http.get(base + path, headers=headers) as resp:
                            body = await (resp.json() if path == "/health" else resp.text())
                            return resp.status, body

                    status, text = await get("/metrics", bob.secret)
                    assert status == 403 and "metrics_forbidden" in text and "prefix_tokens" not in text
                    status, text = await get("/metrics", None)
                    assert status == 401 and "prefix_tokens" not in text
                    status, text = await get("/metrics", monitor.secret)
                    assert status == 200 and "deskfleet_prefix_tokens_reused_total" in text

                    status, health = await get("/health", None)
                    assert status == 200 and health == {"status": "ok"}  # no rings, models, counts or details
                    status, health = await get("/health", bob.secret)
                    assert status == 200 and health["rings"] and health["model"] == coordinator.model.name
            finally:
                await api.async_stop()

    run(main(), 300)
