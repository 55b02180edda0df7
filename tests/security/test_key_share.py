"""A key's share of the API (issue 29, M3 and L5), live on loopback with the real key book and the
real ``openai`` client: one key cannot hold every slot (its n = 8 requests past its share are a
429 while another key is served), its tokens are charged as they are generated (a stream over the
key's budget stops with finish_reason "length", stop_reason "token_budget"), and revoking a key
ends its running answers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import replace

import openai
import pytest

from engine.api.share import KeyWatch, StreamShares
from engine.generation.request import FinishReason, GenerationRequest, TokenEvent
from engine.trust.key_book import KeyBook
from tests.support.api_helpers import CARD, EOS, SETTINGS
from tests.support.key_helpers import serving

TIMEOUT = 60.0
CHAT = [{"role": "user", "content": "hello"}]
WIDE = replace(SETTINGS, max_prompt_tokens=200, default_max_tokens=400, max_tokens_limit=1000, key_streams=8)


class PacedGenerator:
    """Answers ``length`` bytes of "a" then EOS, one token every ``pace_s``; while ``gate`` is clear
    each stream holds after its first token (it keeps its slot)."""

    def __init__(self, length: int, pace_s: float = 0.0, gate: threading.Event | None = None) -> None:
        self.length, self.pace_s, self.gate = length, pace_s, gate
        self.model = replace(CARD, context_length=8192)
        self.started = 0

    def stream(self, request: GenerationRequest):
        self.started += 1
        return self._stream(request)

    async def _stream(self, request: GenerationRequest):
        ids = [ord("a")] * self.length + [EOS]
        ids = ids[: request.max_new_tokens]
        for i, token in enumerate(ids):
            while i == 1 and self.gate is not None and not self.gate.is_set():
                await asyncio.sleep(0.01)
            await asyncio.sleep(self.pace_s)
            last = i + 1 == len(ids)
            yield TokenEvent(token, i, finish=(FinishReason.STOP if token == EOS else FinishReason.LENGTH)
                             if last else None)

    def metrics(self) -> dict[str, float]:
        return {}


# -- the pure parts --------------------------------------------------------------------------------

def test_stream_shares_are_per_key_and_given_back():
    shares = StreamShares(8)
    assert shares.take("a", 8) is None and "share of this server is 8" in shares.take("a", 1)
    assert shares.take("b", 3) is None and shares.held("a") == 8  # a refused take counts nothing
    shares.give_back("a", 8)
    assert shares.held("a") == 0 and shares.take("a", 5) is None and shares.take("a", 4) is not None
    shares.give_back("a", 5)
    shares.give_back("b", 3)
    assert shares._held == {}  # nothing kept for keys with no streams: bounded by the streams in progress
    with pytest.raises(ValueError):
        StreamShares(0)


def test_a_key_watch_looks_again_at_most_every_period():
    now, answers, calls = [0.0], [True, False], []

    def check() -> bool:
        calls.append(now[0])
        return answers[len(calls) - 1]
    watch = KeyWatch(check, every_s=1.0, clock=lambda: now[0])
    assert watch.valid() and calls == []  # not yet due
    now[0] = 1.0
    assert watch.valid() and calls == [1.0]
    now[0] = 1.5
    assert watch.valid() and len(calls) == 1
    now[0] = 2.0
    assert not watch.valid() and not watch.valid() and len(calls) == 2  # revoked stays revoked


# -- live ------------------------------------------------------------------------------------------

def test_one_key_cannot_take_every_slot_while_another_key_is_served(tmp_path):
    book = KeyBook(tmp_path)
    greedy, other = book.issue("greedy"), book.issue("other")
    gate = threading.Event()
    generator = PacedGenerator(length=4, gate=gate)
    with serving(generator, WIDE, keys=book) as url, \
            openai.OpenAI(base_url=url, api_key=greedy.secret, max_retries=0, timeout=TIMEOUT) as hog, \
            openai.OpenAI(base_url=url, api_key=other.secret, max_retries=0, timeout=TIMEOUT) as fair, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(hog.chat.completions.create, model="fake", messages=CHAT, n=8)
        while generator.started < 8:  # its 8 choices are running, held after their first token
            assert not held.done(), held.exception()
            threading.Event().wait(0.01)
        with pytest.raises(openai.RateLimitError) as refused:
            hog.chat.completions.create(model="fake", messages=CHAT, n=1)
        assert refused.value.code == "key_share_exceeded" and "share of this server is 8" in refused.value.message
        late = pool.submit(fair.chat.completions.create, model="fake", messages=CHAT, n=2)
        while generator.started < 10:  # the other key's choices are admitted beside the held ones
            assert not late.done(), late.exception()
            threading.Event().wait(0.01)
        gate.set()
        assert len(held.result(TIMEOUT).choices) == 8 and late.result(TIMEOUT).choices[0].message.content == "aaaa"
        again = hog.chat.completions.create(model="fake", messages=CHAT, n=8)  # its share came back
        assert len(again.choices) == 8


def test_tokens_are_charged_as_generated_and_a_stream_over_budget_stops(tmp_path):
    book = KeyBook(tmp_path)
    thrifty = book.issue("thrifty", tpm=200)
    settings = replace(WIDE, key_streams=16)
    gate = threading.Event()  # both requests admitted (16 streams held at their first token) before the rest flows
    generator = PacedGenerator(length=300, gate=gate)
    with serving(generator, settings, keys=book) as url, \
            openai.OpenAI(base_url=url, api_key=thrifty.secret, max_retries=0, timeout=TIMEOUT) as client, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        asks = [pool.submit(client.chat.completions.create, model="fake", messages=CHAT, n=8) for _ in range(2)]
        while generator.started < 16:
            assert not any(a.done() for a in asks), [a.exception() for a in asks if a.done()]
            threading.Event().wait(0.01)
        gate.set()
        answers = [a.result(TIMEOUT) for a in asks]
    used = sum(a.usage.total_tokens for a in answers)
    prompts = sum(a.usage.prompt_tokens for a in answers)
    # the budget, each request's prompt (charged once tokenised), and at most one token per stream
    # past the moment the key ran out: before, both requests ran to 16 x 300 tokens
    assert used <= 200 + prompts + 16, used
    cut = [c for a in answers for c in a.choices]
    assert all(c.finish_reason == "length" and c.model_extra.get("stop_reason") == "token_budget" for c in cut)


def test_revoking_a_key_ends_its_running_answer(tmp_path):
    book = KeyBook(tmp_path)
    alice = book.issue("alice")
    with serving(PacedGenerator(length=600, pace_s=0.01), WIDE, keys=book) as url, \
            openai.OpenAI(base_url=url, api_key=alice.secret, max_retries=0, timeout=TIMEOUT) as client:
        stream = client.chat.completions.create(model="fake", messages=CHAT, max_tokens=600, stream=True)
        received = 0
        with pytest.raises(openai.APIError) as ended:
            for chunk in stream:
                received += len(chunk.choices[0].delta.content or "") if chunk.choices else 0
                if received == 20:
                    KeyBook(tmp_path).revoke("alice")  # as `deskfleet keys revoke` would, from another process
        assert "revoked" in str(ended.value)
        assert 20 <= received < 600  # the answer was cut, not run to its end
