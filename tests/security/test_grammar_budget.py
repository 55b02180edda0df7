"""Structured output cannot be denied to everyone by one key's schemas (issue 29, M5).

The attack the review ran: one key sends big JSON schemas (thousands of properties, seconds of
llguidance work each) with ``n`` > 1, several at once; before the fix the grammars were built on
one thread per ring and the masks on the event loop, and another key's small constrained request
waited 87 s. Here the real paged coordinator over the tiny 2-stage export serves the API on
loopback with two keys from a real key book; the attacker's schemas go to the process's grammar
pool, where the key holds its share of the workers and no more, and the victim's request is
answered with valid JSON. How long it takes is the ``grammar`` benchmark's business, not a test's
(timing on a shared CI box is noise): the guard below only stops a hang.
"""

from __future__ import annotations

import json
import threading

import openai
import pytest

from engine.generation.grammar_pool import GrammarBudget, use_grammar_budget
from tests.support.fuzz_helpers import loop_thread

pytestmark = pytest.mark.slow

HANG_GUARD_S = 300  # a client's timeout: far above any answer on a loaded box, only a hang reaches it
ASK = [{"role": "user", "content": "Give me a shape."}]
SHAPE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
         "required": ["ok", "color"], "additionalProperties": False}
VICTIM_FORMAT = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE, "strict": True}}
BUDGET = GrammarBudget()  # the defaults a server runs with


def big_format(tag: str, properties: int = 1800) -> dict:
    """A schema of ``properties`` integer properties (~52 KB at 1,800: inside the size budget,
    about a second of llguidance work even for the tiny tokenizer); ``tag`` makes each one new."""
    schema = {"type": "object", "properties": {f"{tag}_{i}": {"type": "integer"} for i in range(properties)}}
    return {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}


@pytest.fixture(scope="module")
def api(tiny_export, tmp_path_factory):
    """(url, attacker key, victim key): the API over the paged coordinator, a fresh grammar pool."""
    from engine.api.server import ApiSettings, async_run_api
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator
    from engine.trust.key_book import KeyBook

    export = tiny_export("llama", 2)
    book = KeyBook(tmp_path_factory.mktemp("keys"))
    attacker, victim = book.issue("attacker"), book.issue("victim")
    settings = ApiSettings(model_name="tiny", max_body_bytes=2 << 20, max_tokens_limit=256, max_concurrent=32)
    use_grammar_budget(BUDGET)
    with loop_thread() as loop:
        coordinator = BatchCoordinator.local(export, exact=True)
        loop.run(coordinator.__aenter__())
        try:
            running = loop.run(async_run_api(coordinator, ChatTokenizer(export / "tokenizer"), settings, keys=book))
            try:
                yield running.url, attacker.secret, victim.secret
            finally:
                loop.run(running.async_stop())
        finally:
            loop.run(coordinator.__aexit__(None, None, None))
            use_grammar_budget(GrammarBudget())


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=HANG_GUARD_S)


def _victim_answer(url: str, key: str) -> dict:
    with _client(url, key) as client:
        done = client.chat.completions.create(model="tiny", messages=ASK, response_format=VICTIM_FORMAT,
                                              max_tokens=64, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    answer = json.loads(choice.message.content)
    assert set(answer) == {"ok", "color"} and answer["color"] in ("red", "green", "blue")
    return answer


def test_one_keys_big_schemas_hold_only_its_share_and_anothers_small_one_is_answered(api):
    url, attacker_key, victim_key = api
    attackers = 4  # twice the key's share of the grammar workers, all at once, n=4 each
    start = threading.Barrier(attackers + 1)
    stop = threading.Event()
    refusals: list[str] = []
    lock = threading.Lock()

    def attack(i: int) -> None:
        with _client(url, attacker_key) as client:
            start.wait(HANG_GUARD_S)
            round_ = 0
            while not stop.is_set():
                round_ += 1
                try:
                    client.chat.completions.create(model="tiny", messages=ASK, n=4, max_tokens=4,
                                                   response_format=big_format(f"a{i}r{round_}"))
                except openai.APIStatusError as exc:  # a 429 for its share, a 400 from the model's output
                    with lock:
                        refusals.append(f"{exc.status_code} {exc.message}")

    threads = [threading.Thread(target=attack, args=(i,), name=f"attacker-{i}") for i in range(attackers)]
    for t in threads:
        t.start()
    try:
        start.wait(HANG_GUARD_S)
        answers = [_victim_answer(url, victim_key) for _ in range(3)]
    finally:
        stop.set()
        for t in threads:
            t.join(HANG_GUARD_S)
    assert len(answers) == 3
    shares = [r for r in refusals if r.startswith("429") and "its share of the grammar workers" in r]
    assert shares, f"the attacker key was never held to its share: {refusals[:5]}"
    assert not any(t.is_alive() for t in threads)


def test_a_schema_over_the_size_budget_is_a_400_naming_it_before_any_compiling(api):
    url, attacker_key, victim_key = api
    huge = big_format("huge", properties=3000)  # ~88 KB of schema text
    assert len(json.dumps(huge["json_schema"]["schema"])) > BUDGET.max_schema_bytes
    with _client(url, attacker_key) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, response_format=huge)
    assert refused.value.status_code == 400
    assert f"grammar size budget of {BUDGET.max_schema_bytes:,} bytes" in refused.value.message
    _victim_answer(url, victim_key)


def test_a_schema_over_the_time_budget_is_a_400_naming_it_and_a_full_pool_a_429(api):
    url, attacker_key, victim_key = api
    tight = GrammarBudget(workers=1, max_waiting=0, per_owner=4, compile_budget_s=0.05)
    use_grammar_budget(tight)
    try:
        with _client(url, attacker_key) as client:
            with pytest.raises(openai.BadRequestError) as slow:
                client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                               response_format=big_format("slow"))
            assert "grammar time budget of 0.05 s" in slow.value.message
            # The over-budget build still runs on the one worker: the next schema finds the pool full.
            with pytest.raises(openai.RateLimitError) as busy:
                client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                               response_format=big_format("next"))
            assert "the grammar workers are busy (1 compiling, 0 waiting, the limit)" in busy.value.message
    finally:
        use_grammar_budget(BUDGET)
    _victim_answer(url, victim_key)
