"""The OpenAI-compatible API: error mapping and metrics, the HTTP layer over an in-memory
generator, then the real `openai` client against the real app served on loopback by the real
paged coordinator over a tiny 2-stage export. The pure request/response schema is tested in
test_openai_schema.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import aiohttp
import openai
import pytest
from aiohttp import web

from engine.api.api_metrics import ApiMetrics, DictCollector, render
from engine.api.server import ApiSettings, api_error_from, async_run_api
from engine.errors import DeskfleetError, GenerationError, TokenizerError
from engine.generation.generator import ModelCard, OverloadedError, UnavailableError
from engine.generation.request import FinishReason, GenerationRequest, TokenEvent
from tests.support.api_helpers import CARD, EOS, SETTINGS, ByteTokenizer, serve_process

TIMEOUT = 30.0


class FakeGenerator:
    """Answers every request with the bytes of ``answer`` then EOS; can refuse, fail, or hold a stream."""

    def __init__(self, answer: str = "héllo wörld 🙂", *, refuse: Exception | None = None,
                 fail_at: int | None = None, hold_at: int | None = None):
        self.answer, self.refuse, self.fail_at, self.hold_at = answer, refuse, fail_at, hold_at
        self.model = CARD
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
    api.use_generator(DictCollector(lambda: {
        "tokens_per_second": 12.5, 'stage_compute_ms_per_step{stage="1"}': 3.0, "requests_total": 4,
        "bad name!": float("nan"), 'step_seconds_bucket{le="0.1"}': 1, 'step_seconds_bucket{le="+Inf"}': 2,
        "step_seconds_sum": 0.6, "step_seconds_count": 2}))
    for status in (200, 200, 429):
        api.count(status)
    for seconds in (0.07, 100.0):
        api.observe_ttft(seconds, "m")
    api.observe_generation(11, 2.0, "m", "alice")
    text = render(api.registry).decode()
    samples = parse_prometheus(text)
    # milliseconds are exposed in seconds (promtool refuses abbreviated units)
    assert samples['deskfleet_stage_compute_seconds_per_step{stage="1"}'] == 0.003
    assert samples["deskfleet_tokens_per_second"] == 12.5
    assert "# TYPE deskfleet_requests_total counter" in text and "deskfleet_bad_name_ NaN" in text
    assert "# TYPE deskfleet_step_seconds histogram" in text and samples["deskfleet_step_seconds_count"] == 2
    assert samples['deskfleet_api_requests_total{code="200"}'] == 2
    assert samples['deskfleet_api_ttft_seconds_bucket{le="0.05",model="m"}'] == 0
    assert samples['deskfleet_api_ttft_seconds_bucket{le="0.1",model="m"}'] == 1
    assert samples['deskfleet_api_ttft_seconds_bucket{le="+Inf",model="m"}'] == \
        samples['deskfleet_api_ttft_seconds_count{model="m"}'] == 2
    assert samples["deskfleet_api_decode_tokens_per_second"] == 5.0
    assert samples['deskfleet_api_time_per_output_token_seconds_sum{model="m"}'] == 0.2
    assert samples['deskfleet_api_key_tokens_total{key="alice",kind="completion",model="m"}'] == 11


def test_usage_labels_are_bounded(monkeypatch):
    monkeypatch.setattr("engine.api.api_metrics.MAX_KEY_LABELS", 2)
    api = ApiMetrics()
    for key in ("a", "b", "c", "d", "a"):
        api.observe_prompt(1, "m", key)
    text = render(api.registry).decode()
    keys = {k for k in parse_prometheus(text) if k.startswith("deskfleet_api_key_tokens_total")}
    assert {re.search(r'key="(\w+)"', k).group(1) for k in keys} == {"a", "b", "other"}


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
            "bad json": (await s.post(base + "/v1/completions", data=b"{",
                                      headers={**auth, "Content-Type": "application/json"})).status,
            "form post": (await s.post(base + "/v1/completions", data=b"prompt=hi", headers=auth)).status,
        }
        async with s.get(base + "/health", headers=auth) as r:
            health = r.status, await r.json()
        async with s.get(base + "/health") as r:  # a stranger: the status only
            bare = r.status, await r.json()
        return results, health, bare

    results, health, bare = over_http(FakeGenerator(), scenario, replace(SETTINGS, api_key="k3y", max_body_bytes=200))
    assert [results[k][0] for k in ("no key", "wrong key", "too large", "no path")] == [401, 401, 413, 404]
    assert results["bad json"] == 400
    assert results["form post"] == 415  # what a cross-site HTML form can send
    assert results["no key"][1]["WWW-Authenticate"] == "Bearer"
    assert json.loads(results["too large"][2])["error"]["code"] == "request_too_large"
    assert all(r[1]["X-Deskfleet-Stages"] == "3" for r in results.values() if isinstance(r, tuple))
    assert health == (200, {"status": "ok", "model": "fake", "stages": 3, "active_requests": 0, "rings": [
        {"ring": "default", "model": "fake", "status": "ok", "active": 0, "waiting": 0}]})
    assert bare == (200, {"status": "ok"})


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
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator

    export = tiny_export("llama", 2)
    tokenizer = ChatTokenizer(export / "tokenizer")

    @contextlib.asynccontextmanager
    async def setup():
        async with BatchCoordinator.local(export, slots=4, kv_pool_bytes=16 << 20) as coordinator:
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


@contextlib.asynccontextmanager
async def held_stream(fleet: Fleet):
    """``(client, stream, first chunk)``: a streamed chat answer on the held API, admitted and held open."""
    async with openai.AsyncOpenAI(base_url=fleet.held_url, api_key=fleet.key, max_retries=0,
                                  timeout=TIMEOUT) as c:
        stream = await c.chat.completions.create(model=fleet.model, messages=MESSAGES, temperature=0,
                                                 max_tokens=300, stream=True)
        yield c, stream, await anext(aiter(stream))


def test_over_max_concurrent_is_429_with_retry_after(fleet):
    async def scenario():
        async with held_stream(fleet) as (c, first, _):
            with pytest.raises(openai.RateLimitError) as info:
                await c.chat.completions.create(model=fleet.model, messages=MESSAGES, max_tokens=4)
            await first.close()
            return info.value

    error = asyncio.run(scenario())
    assert error.response.headers["retry-after"] == "1" and "limit" in error.message
    # the held stream's cancellation reaches the coordinator after the API's count drops: wait for both, so the
    # next test's before/after counts see only its own request
    wait_for_metrics(fleet, fleet.held_url, lambda m: m["deskfleet_api_active_requests"] == 0
                     and m["deskfleet_active_streams"] == 0)


def test_client_disconnect_cancels_the_generation(fleet):
    before = scrape(fleet.held_url, fleet.key)
    released = fleet.held.released

    async def scenario():
        async with held_stream(fleet) as (_, stream, first):
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
    from engine.cli.serve import api_key_from_env

    assert api_key_from_env(None, {}) is None
    assert api_key_from_env("DF_KEY", {"DF_KEY": " s3cret\n"}) == "s3cret"
    with pytest.raises(DeskfleetError, match="DF_KEY"):
        api_key_from_env("DF_KEY", {})


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGTERM")
@pytest.mark.parametrize("extra", [[], ["--workers", "--speculation", "draft", "--spec-k", "3"]],
                         ids=["in-process", "workers+draft"])
def test_serve_command_answers_and_stops_on_sigterm(extra, tiny_export):
    export = tiny_export("llama", 2)
    if "draft" in extra:
        extra += ["--draft", str(tiny_export("llama", 1))]
    with serve_process("--shards", str(export), "--api-key-env", "DF_TEST_KEY", "--slots", "2", *extra,
                       env={"DF_TEST_KEY": "k-123"}, ready_timeout=120, timeout=TIMEOUT) as url:
        with openai.OpenAI(base_url=url, api_key="k-123", max_retries=0, timeout=TIMEOUT) as c:
            answer = c.completions.create(model=c.models.list().data[0].id, prompt="Hello", max_tokens=6,
                                          temperature=0)
            assert answer.choices and answer.usage.completion_tokens == 6


def test_multi_turn_chat_hits_the_prefix_cache_without_client_help(client, fleet):
    before = scrape(fleet.url, fleet.key)
    first = client.chat.completions.create(model=fleet.model, messages=MESSAGES, temperature=0, max_tokens=12)
    wait_for_metrics(fleet, fleet.url, lambda m: m.get("deskfleet_active_streams", 1) == 0)
    conversation = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And the second one?"}]
    client.chat.completions.create(model=fleet.model, messages=conversation, temperature=0, max_tokens=8)
    after = wait_for_metrics(fleet, fleet.url, lambda m: m.get("deskfleet_active_streams", 1) == 0)
    assert after["deskfleet_prefix_hits_total"] >= before.get("deskfleet_prefix_hits_total", 0) + 1
