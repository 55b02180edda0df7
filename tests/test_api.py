"""The OpenAI-compatible API: pure policy with in-memory fakes, then the real `openai` client
against the real app served on loopback by the real coordinator over a tiny 2-stage export."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.api import (
    ApiError,
    ApiMetrics,
    ApiSettings,
    TextStream,
    api_error_from,
    async_run_api,
    parse_completion,
    render_prometheus,
    to_generation_request,
)
from engine.errors import DeskfleetError, GenerationError, TokenizerError
from engine.generator import ModelCard, OverloadedError, UnavailableError
from engine.request import FinishReason, GenerationRequest, TokenEvent

EOS = 256
TIMEOUT = 30.0


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes, 256 is EOS (special: skipped when decoding)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FakeGenerator:
    """Answers every request with the bytes of ``answer`` then EOS; can refuse, fail, or hold a stream."""

    def __init__(self, answer: str = "héllo wörld 🙂", *, refuse: Exception | None = None,
                 fail_at: int | None = None, hold_at: int | None = None):
        self.answer, self.refuse, self.fail_at, self.hold_at = answer, refuse, fail_at, hold_at
        self.model = ModelCard("fake", 64, (EOS,), 3)
        self.requests: list[GenerationRequest] = []
        self.active = 0
        self.closed_early = 0

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.refuse is not None:
            raise self.refuse
        ids = [*self.answer.encode(), EOS][: request.max_new_tokens]
        self.active += 1
        done = False
        try:
            for i, token in enumerate(ids):
                if i == self.fail_at:
                    raise RuntimeError("stage 1 crashed")
                if i == self.hold_at:
                    await asyncio.Future()  # until the consumer goes away
                last = i + 1 == len(ids)
                done = last
                yield TokenEvent(token, i, finish=(FinishReason.STOP if token == EOS else FinishReason.LENGTH)
                                 if last else None)
        finally:
            self.active -= 1
            self.closed_early += not done

    def metrics(self) -> dict[str, float]:
        return {"active_streams": float(self.active), 'stage_compute_ms_per_step{stage="0"}': 1.5}


CARD = ModelCard("fake", 64, (EOS,), 3)
SETTINGS = ApiSettings(max_prompt_tokens=40, default_max_tokens=20, max_tokens_limit=50)


def push_all(stream: TextStream, ids) -> list[str]:
    return [stream.push(i) for i in ids] + [stream.finish()]


# -- incremental detokenizer ---------------------------------------------------------------------

def test_text_stream_never_splits_a_multibyte_character():
    text = "añb€c🙂d"
    deltas = push_all(TextStream(ByteTokenizer().decode), text.encode())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[text.encode().index("🙂".encode()) : text.encode().index(b"d")][-1] == "🙂"


def first_stop_cut(text: str, stops: tuple[str, ...]) -> str:
    """Text up to the stop string that completes first (generation halts the moment one appears)."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return text[: min(found)[1]] if found else text


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(blacklist_characters="\ufffd"), max_size=30),
       st.lists(st.text(min_size=1, max_size=4), max_size=3).map(tuple))
def test_text_stream_matches_cutting_the_whole_text(text, stops):
    stream = TextStream(ByteTokenizer().decode, stops)
    deltas = push_all(stream, text.encode())
    assert "".join(deltas) == first_stop_cut(text, stops) == stream.text
    assert not any("\ufffd" in d for d in deltas)


def test_text_stream_flushes_a_truncated_character_at_the_end():
    stream = TextStream(ByteTokenizer().decode)
    assert stream.push(ord("a")) == "a"
    assert stream.push("€".encode()[0]) == ""
    assert stream.finish() == "\ufffd"


def test_stop_string_is_cut_and_never_partly_sent():
    stream = TextStream(ByteTokenizer().decode, stop=("END", "wor"))
    deltas = [stream.push(b) for b in b"hello world END"]
    assert "".join(deltas) == "hello " and stream.stopped
    assert stream.finish() == "" and stream.text == "hello "


def test_a_held_stop_prefix_is_released_when_the_stop_string_does_not_follow():
    stream = TextStream(ByteTokenizer().decode, stop=("xyz",))
    assert [stream.push(b) for b in b"axy"] == ["a", "", ""]
    assert stream.push(ord("!")) == "xy!"
    assert not stream.stopped


# -- request parsing -----------------------------------------------------------------------------

def test_chat_body_maps_to_params_and_generation_request():
    body = {"model": "fake", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 3,
        "stop": "\n\n", "n": 1, "stream": True, "stream_options": {"include_usage": True}, "user": "x"}
    params = parse_completion(body, "chat", "fake")
    assert params.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"})
    assert (params.max_tokens, params.stop, params.stream, params.include_usage) == (7, ("\n\n",), True, True)
    assert (params.sampling.temperature, params.sampling.top_p, params.sampling.top_k, params.sampling.seed) == (
        0.5, 0.9, 40, 3)
    req = to_generation_request([1, 2, 3], params, SETTINGS, CARD)
    assert (req.prompt_ids, req.max_new_tokens, req.stop_token_ids, req.sampling) == ((1, 2, 3), 7, (EOS,),
                                                                                     params.sampling)


def test_completion_prompt_forms_and_defaults():
    assert parse_completion({"prompt": "hi"}, "text", "fake").prompt == "hi"
    assert parse_completion({"prompt": ["hi"]}, "text", "fake").prompt == "hi"
    assert parse_completion({"prompt": [5, 6]}, "text", "fake").prompt == (5, 6)
    params = parse_completion({"prompt": "hi", "stream_options": {"include_usage": True}}, "text", "fake")
    assert params.sampling.temperature == 1.0 and not params.include_usage  # OpenAI default; not streaming
    # No max_tokens: the server default, clipped to what the context still holds.
    assert to_generation_request(range(1, 11), params, SETTINGS, CARD).max_new_tokens == 20
    assert to_generation_request(range(1, 51), params, replace(SETTINGS, max_prompt_tokens=60), CARD
                                 ).max_new_tokens == 14


@pytest.mark.parametrize("patch, param", [
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": -0.1}, "top_p"),
    ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"seed": -1}, "seed"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"stream": "yes"}, "stream"), ({"top_k": -1}, "top_k"),
])
def test_invalid_fields_are_400_naming_the_field(patch, param):
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(ApiError) as info:
        parse_completion(body, "chat", "fake")
    assert (info.value.status, info.value.param, info.value.type) == (400, param, "invalid_request_error")


def test_top_p_zero_is_refused_by_sampling_params():
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": "x", "top_p": 0}, "text", "fake")
    assert info.value.status == 400 and "top_p" in info.value.message


def test_unknown_model_is_404():
    with pytest.raises(ApiError) as info:
        parse_completion({"model": "gpt-4", "prompt": "x"}, "text", "fake")
    assert info.value.status == 404 and "'fake'" in info.value.message


@pytest.mark.parametrize("n_prompt, max_tokens, code", [
    (41, None, "context_length_exceeded"),  # over max_prompt_tokens
    (30, 51, "invalid_value"),  # over max_tokens_limit
    (30, 40, "context_length_exceeded"),  # prompt + max_tokens over the context of 64
])
def test_limits_are_400(n_prompt, max_tokens, code):
    params = parse_completion({"prompt": "x", "max_tokens": max_tokens}, "text", "fake")
    with pytest.raises(ApiError) as info:
        to_generation_request(range(1, n_prompt + 1), params, SETTINGS, CARD)
    assert (info.value.status, info.value.code) == (400, code)


# -- error mapping and metrics -------------------------------------------------------------------

@pytest.mark.parametrize("exc, status", [
    (OverloadedError("busy"), 429), (UnavailableError("down"), 503), (GenerationError("bad"), 400),
    (TokenizerError("template"), 400), (web.HTTPNotFound(), 404), (web.HTTPMethodNotAllowed("GET", ["POST"]), 405),
])
def test_engine_errors_map_to_statuses(exc, status):
    error = api_error_from(exc)
    assert error.status == status
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_unexpected_errors_are_500_without_leaking_details():
    error = api_error_from(KeyError("secret internal state"))
    assert error.status == 500 and "secret" not in error.message and error.type == "server_error"


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples by ``name{labels}``; asserts each family's TYPE line precedes its samples."""
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", key).group(0)
            assert re.sub(r"_(bucket|sum|count)$", "", name) in typed or name in typed, line
            samples[key] = float(value)
    return samples


def test_prometheus_rendering():
    api = ApiMetrics()
    for status in (200, 200, 429):
        api.count(status)
    for seconds in (0.07, 100.0):
        api.observe_ttft(seconds)
    api.observe_generation(11, 2.0)
    text = render_prometheus({"tokens_per_second": 12.5, 'stage_compute_ms_per_step{stage="1"}': 3.0,
                              "requests_total": 4, "bad name!": float("nan")}, api)
    samples = parse_prometheus(text)
    assert samples['deskfleet_stage_compute_ms_per_step{stage="1"}'] == 3.0
    assert samples["deskfleet_tokens_per_second"] == 12.5
    assert "# TYPE deskfleet_requests_total counter" in text and "deskfleet_bad_name_ NaN" in text
    assert samples['deskfleet_api_requests_total{code="200"}'] == 2
    assert samples['deskfleet_api_ttft_seconds_bucket{le="0.05"}'] == 0
    assert samples['deskfleet_api_ttft_seconds_bucket{le="0.1"}'] == 1
    assert samples['deskfleet_api_ttft_seconds_bucket{le="+Inf"}'] == samples["deskfleet_api_ttft_seconds_count"] == 2
    assert samples["deskfleet_api_decode_tokens_per_second"] == 5.0


# -- the HTTP layer over the fake ----------------------------------------------------------------

def over_http(generator, scenario: Callable, settings: ApiSettings = SETTINGS):
    """Serve ``generator`` on loopback and run ``scenario(session, base_url)`` against it."""
    async def main():
        api = await async_run_api(generator, ByteTokenizer(), settings)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
                return await asyncio.wait_for(scenario(session, f"http://127.0.0.1:{api.port}"), TIMEOUT)
        finally:
            await api.async_stop()
    return asyncio.run(main())


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


async def post(session, url, body, **kw) -> tuple[int, dict, str]:
    async with session.post(url, json=body, **kw) as r:
        return r.status, dict(r.headers), await r.text()


def sse_events(text: str) -> list:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


def test_auth_size_and_path_errors_are_openai_json():
    async def scenario(s, base):
        auth = {"Authorization": "Bearer k3y"}
        results = {
            "no key": await post(s, base + "/v1/chat/completions", CHAT),
            "wrong key": await post(s, base + "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer k3"}),
            "too large": await post(s, base + "/v1/completions", {"prompt": "x" * 300}, headers=auth),
            "no path": await post(s, base + "/v2/nothing", {}, headers=auth),
            "bad json": (await s.post(base + "/v1/completions", data=b"{", headers=auth)).status,
        }
        async with s.get(base + "/health") as r:
            health = r.status, await r.json()
        return results, health

    results, health = over_http(FakeGenerator(), scenario, replace(SETTINGS, api_key="k3y", max_body_bytes=200))
    assert [results[k][0] for k in ("no key", "wrong key", "too large", "no path")] == [401, 401, 413, 404]
    assert results["bad json"] == 400
    assert results["no key"][1]["WWW-Authenticate"] == "Bearer"
    assert json.loads(results["too large"][2])["error"]["code"] == "request_too_large"
    assert all(r[1]["X-Deskfleet-Stages"] == "3" for r in results.values() if isinstance(r, tuple))
    assert health == (200, {"status": "ok", "model": "fake", "stages": 3, "active_requests": 0})


@pytest.mark.parametrize("generator, status", [
    (FakeGenerator(refuse=OverloadedError("all slots busy; retry shortly")), 429),
    (FakeGenerator(refuse=UnavailableError("stage 2 is down")), 503),
    (FakeGenerator(fail_at=0), 500),
])
@pytest.mark.parametrize("stream", [False, True])
def test_generator_refusals_keep_their_status(generator, status, stream, caplog):
    status_, _, text = over_http(generator, lambda s, b: post(s, b + "/v1/chat/completions",
                                                                {**CHAT, "stream": stream}))
    assert status_ == status
    assert json.loads(text)["error"]["message"] == (
        "internal server error; the server log has the details" if status == 500 else str(generator.refuse))
    assert (status == 500) == ("stage 1 crashed" in caplog.text)


def test_streaming_and_plain_answers_agree_and_stop_strings_close_the_stream():
    generator = FakeGenerator()

    async def scenario(s, base):
        plain = json.loads((await post(s, base + "/v1/chat/completions", CHAT))[2])
        streamed = (await post(s, base + "/v1/chat/completions",
                               {**CHAT, "stream": True, "stream_options": {"include_usage": True}}))[2]
        stopped = json.loads((await post(s, base + "/v1/completions", {"prompt": "a", "stop": ["wör"]}))[2])
        return plain, sse_events(streamed), stopped

    plain, events, stopped = over_http(generator, scenario)
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "héllo wörld 🙂"}
    assert plain["choices"][0]["finish_reason"] == "stop"
    n_prompt, n_answer = len("<user>hi<assistant>"), len("héllo wörld 🙂".encode()) + 1  # + EOS
    assert plain["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_answer,
                              "total_tokens": n_prompt + n_answer}
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c["choices"]) == \
        "héllo wörld 🙂"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert stopped["choices"][0]["text"] == "héllo " and stopped["choices"][0]["finish_reason"] == "stop"
    assert generator.closed_early == 1 and generator.active == 0


def test_length_finish_and_error_mid_stream_is_reported_in_band():
    async def scenario(s, base):
        length = json.loads((await post(s, base + "/v1/completions", {"prompt": "a", "max_tokens": 3}))[2])
        failed = await post(s, base + "/v1/completions", {"prompt": "a", "stream": True})
        return length, failed

    length, (status, _, text) = over_http(FakeGenerator(fail_at=4), scenario)
    assert (length["choices"][0]["text"], length["choices"][0]["finish_reason"]) == ("hé", "length")
    assert status == 200
    events = sse_events(text)
    assert json.loads(events[-1])["error"]["code"] == "internal_error" and "[DONE]" not in events


# -- the real thing: openai client -> API -> coordinator -> 2 OpenVINO stages ---------------------

@contextlib.contextmanager
def serve_in_thread(setup: Callable, timeout: float = 120.0):
    """Run ``setup()`` (an async context manager) on its own loop in a thread; yield what it yields."""
    ready: concurrent.futures.Future = concurrent.futures.Future()
    control: dict = {}

    async def main():
        control["loop"], control["stop"] = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with setup() as value:
                ready.set_result(value)
                await control["stop"].wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="api-test-server")
    thread.start()
    try:
        yield ready.result(timeout)
    finally:
        if "stop" in control:
            control["loop"].call_soon_threadsafe(control["stop"].set)
        thread.join(timeout)
        assert not thread.is_alive(), "the API test server did not stop"


class HeldGenerator:
    """The real generator's stream, held open after ``hold_after`` tokens until its consumer leaves."""

    def __init__(self, inner, hold_after: int = 1):
        self.inner, self.hold_after = inner, hold_after
        self.released = 0  # streams closed while held: only their consumer leaving can do that

    @property
    def model(self) -> ModelCard:
        return self.inner.model

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        async with contextlib.aclosing(self.inner.stream(request)) as tokens:
            async for event in tokens:
                yield event
                if event.index + 1 == self.hold_after and event.finish is None:
                    try:
                        await asyncio.Future()
                    finally:
                        self.released += 1


@dataclass
class Fleet:
    url: str
    held_url: str
    model: str
    held: HeldGenerator
    key: str = "sk-deskfleet-test"


REAL_SETTINGS = ApiSettings(api_key="sk-deskfleet-test", max_body_bytes=64 << 10, max_prompt_tokens=200,
                            default_max_tokens=24, max_tokens_limit=400, max_concurrent=4)


@pytest.fixture(scope="module")
def fleet(tiny_export):
    from engine.coordinator import Coordinator
    from engine.tokenizer import ChatTokenizer

    export = tiny_export("llama", 2)
    tokenizer = ChatTokenizer(export / "tokenizer")

    @contextlib.asynccontextmanager
    async def setup():
        async with Coordinator.local(export, slots=4) as coordinator:
            # The first step starts the coordinator's compute thread: start it here, before any
            # test, so the leaked-thread check does not blame the test that happens to come first.
            async with contextlib.aclosing(coordinator.stream(GenerationRequest((1, 5, 9), 2))) as tokens:
                _ = [e async for e in tokens]
            held = HeldGenerator(coordinator)
            api = await async_run_api(coordinator, tokenizer, REAL_SETTINGS)
            held_api = await async_run_api(held, tokenizer, replace(REAL_SETTINGS, max_concurrent=1))
            try:
                yield Fleet(api.url, held_api.url, coordinator.model.name, held)
            finally:
                await held_api.async_stop()
                await api.async_stop()

    with serve_in_thread(setup) as value:
        yield value


@pytest.fixture
def client(fleet):
    with openai.OpenAI(base_url=fleet.url, api_key=fleet.key, max_retries=0, timeout=TIMEOUT) as c:
        yield c


def scrape(url: str, key: str) -> dict[str, float]:
    async def get():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
            async with s.get(url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200
                return parse_prometheus(await r.text())
    return asyncio.run(get())


def wait_for_metrics(fleet: Fleet, url: str, condition: Callable[[dict], bool], timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url, fleet.key)
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, f"metrics never met the condition: {samples}"
        time.sleep(0.02)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital?"}]


def test_chat_streaming_and_plain_give_the_same_text(client, fleet):
    raw = client.chat.completions.with_raw_response.create(model=fleet.model, messages=MESSAGES, temperature=0,
                                                           max_tokens=16)
    assert raw.headers["x-deskfleet-stages"] == "2"
    plain = raw.parse()
    chunks = list(client.chat.completions.create(model=fleet.model, messages=MESSAGES, temperature=0,
                                                 max_tokens=16, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert plain.choices[0].message.content and streamed == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens <= 16


def test_completions_streaming_and_plain(client, fleet):
    plain = client.completions.create(model=fleet.model, prompt="The capital of France is", max_tokens=10,
                                      temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=fleet.model, prompt="The capital of France is", max_tokens=10, temperature=0, stream=True))
    assert plain.choices[0].text == streamed
    assert plain.choices[0].finish_reason in ("stop", "length") and 1 <= plain.usage.completion_tokens <= 10


def test_models_list_and_retrieve(client, fleet):
    assert [m.id for m in client.models.list()] == [fleet.model]
    assert client.models.retrieve(fleet.model).id == fleet.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_seeded_sampling_repeats_and_differs_from_greedy(client, fleet):
    def ask(**kw) -> str:
        return client.chat.completions.create(model=fleet.model, messages=MESSAGES, max_tokens=24,
                                              **kw).choices[0].message.content
    sampled = [ask(temperature=1.5, seed=seed) for seed in (1, 1, 2, 3)]
    assert sampled[0] == sampled[1]
    assert len({*sampled, ask(temperature=0)}) > 1, "sampling with a seed gave the greedy text every time"


def test_auth_and_validation_errors_reach_the_client_typed(fleet, client):
    with openai.OpenAI(base_url=fleet.url, api_key="wrong", max_retries=0) as stranger, \
            pytest.raises(openai.AuthenticationError, match="Bearer"):
        stranger.models.list()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=fleet.model, messages=MESSAGES, temperature=5)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=fleet.model, messages=[{"role": "user", "content": "capital " * 300}])
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)


def test_too_large_body_is_413(fleet):
    async def send():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
            body = {"model": fleet.model, "prompt": "x" * (100 << 10)}
            return await post(s, fleet.url + "/completions", body, headers={"Authorization": f"Bearer {fleet.key}"})

    status, _, text = asyncio.run(send())
    assert status == 413 and "exceeds 65536 bytes" in json.loads(text)["error"]["message"]


def test_over_max_concurrent_is_429_with_retry_after(fleet):
    async def scenario():
        async with openai.AsyncOpenAI(base_url=fleet.held_url, api_key=fleet.key, max_retries=0,
                                      timeout=TIMEOUT) as c:
            first = await c.chat.completions.create(model=fleet.model, messages=MESSAGES, temperature=0,
                                                    max_tokens=300, stream=True)
            await anext(aiter(first))  # admitted, and now held open
            with pytest.raises(openai.RateLimitError) as info:
                await c.chat.completions.create(model=fleet.model, messages=MESSAGES, max_tokens=4)
            await first.close()
            return info.value

    error = asyncio.run(scenario())
    assert error.response.headers["retry-after"] == "1" and "limit" in error.message
    wait_for_metrics(fleet, fleet.held_url, lambda m: m["deskfleet_api_active_requests"] == 0)


def test_client_disconnect_cancels_the_generation(fleet):
    before = scrape(fleet.held_url, fleet.key)
    released = fleet.held.released

    async def scenario():
        async with openai.AsyncOpenAI(base_url=fleet.held_url, api_key=fleet.key, max_retries=0,
                                      timeout=TIMEOUT) as c:
            stream = await c.chat.completions.create(model=fleet.model, messages=MESSAGES, temperature=0,
                                                     max_tokens=300, stream=True)
            first = await anext(aiter(stream))
            await stream.close()  # drops the connection while the server is waiting for tokens
            return first

    assert asyncio.run(scenario()).choices[0].delta.role == "assistant"
    after = wait_for_metrics(fleet, fleet.held_url, lambda m: m["deskfleet_api_active_requests"] == 0
                             and m["deskfleet_active_streams"] == 0)
    assert fleet.held.released == released + 1, "the token stream was not closed by the disconnect"
    assert after.get('deskfleet_api_requests_total{code="499"}', 0) == \
        before.get('deskfleet_api_requests_total{code="499"}', 0) + 1
    ended = ("deskfleet_requests_cancelled_total", "deskfleet_requests_finished_total")
    assert sum(after[k] - before[k] for k in ended) == 1


# -- `deskfleet serve` ---------------------------------------------------------------------------

def test_api_key_comes_only_from_the_environment():
    from engine.serve_cli import api_key_from_env

    assert api_key_from_env(None, {}) is None
    assert api_key_from_env("DF_KEY", {"DF_KEY": " s3cret\n"}) == "s3cret"
    with pytest.raises(DeskfleetError, match="DF_KEY"):
        api_key_from_env("DF_KEY", {})


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGTERM")
def test_serve_command_answers_and_stops_on_sigterm(tiny_export):
    export = tiny_export("llama", 2)
    launcher = ("import argparse, sys; from engine.serve_cli import COMMAND; p = argparse.ArgumentParser(); "
                "COMMAND.configure(p); sys.exit(COMMAND.run(p.parse_args(sys.argv[1:])))")
    env = {**os.environ, "DF_TEST_KEY": "k-123"}
    proc = subprocess.Popen([sys.executable, "-c", launcher, "--shards", str(export), "--port", "0",
                             "--api-key-env", "DF_TEST_KEY", "--slots", "2"], cwd=Path(__file__).parents[1],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # the server prints its URL once ready
        line = proc.stdout.readline() if ready else ""
        url = re.search(r"http://\S+/v1", line)
        assert url, f"no URL in {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        with openai.OpenAI(base_url=url.group(0), api_key="k-123", max_retries=0, timeout=TIMEOUT) as c:
            assert c.completions.create(model=c.models.list().data[0].id, prompt="Hello", max_tokens=3).choices
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()
