"""Hostile input against the live OpenAI-compatible API over a tiny-model coordinator (issue 7).

One server for the module (4 slots, exact f32 so greedy tokens cannot depend on batching).
Hypothesis builds /v1/chat/completions, /v1/completions and /v1/responses bodies field by field, each field
absent, valid or hostile (wrong types, huge numbers, NaN, lone surrogates, token ids far past the
vocabulary, stream flag combinations), and sends random methods, paths, raw bodies, content
types and API keys. The pure request parser and the tokenizer predict each answer: a valid
request must be served (JSON or an SSE stream ending in [DONE]), an invalid one must get exactly
the predicted 4xx with the OpenAI error body. Nothing may be a 5xx or go unanswered.

Meanwhile another user streams the same greedy chat over and over on its own connection with
the real ``openai`` client; every one of its answers must equal the undisturbed first one.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.api.generate import check_logit_bias, check_prompt_ids, prompt_ids, to_generation_request
from engine.api.openai_schema import ApiError, check_prompt_chars, parse_completion
from engine.api.responses_schema import parse_response_request
from engine.api.server import ApiSettings
from engine.errors import GenerationError, TokenizerError
from tests.support.fuzz_helpers import (
    CONTENT_TYPES,
    HUGE_NUMBERS,
    LIVE_FUZZ,
    METHODS,
    RAW_BODIES,
    Blob,
    HttpClient,
    Reply,
    assert_answered,
    dumps,
    fuzz_settings,
    json_values,
    paths,
    served_paged,
)

pytestmark = LIVE_FUZZ

CASES = {"OpenAI API: chat bodies": 900, "OpenAI API: completion bodies": 600, "OpenAI API: raw requests": 2000,
         "OpenAI API: responses bodies": 400}
KEY = "sk-fuzz-key"
SETTINGS = ApiSettings(api_key=KEY, max_body_bytes=64 << 10, max_prompt_tokens=480, default_max_tokens=3,
                       max_tokens_limit=16, max_concurrent=16)
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
NEIGHBOUR = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]
ABSENT = object()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "\u00e9 \U0001f600"}}
CHAT_ONLY = ("tools", "tool_choice", "response_format", "top_logprobs")  # a completions body gets them hostile only


class Neighbour:
    """Another user: the same greedy streamed chat, again and again, on its own loop and connection."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.answers: list[tuple[str, int]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline = asyncio.run(self._once_alone())

    async def _ask(self, client) -> tuple[str, int]:
        stream = await client.chat.completions.create(model=self.model, messages=NEIGHBOUR, temperature=0,
                                                      max_tokens=16, stream=True,
                                                      stream_options={"include_usage": True})
        text, used = [], 0
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return "".join(text), used

    async def _once_alone(self) -> tuple[str, int]:
        import openai

        async with openai.AsyncOpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=30) as client:
            return await self._ask(client)

    async def _loop(self) -> None:
        import openai

        async with openai.AsyncOpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    self.answers.append(await self._ask(client))
                except Exception as exc:  # recorded, then asserted by the tests
                    self.errors.append(repr(exc))

    def start(self) -> None:
        self._thread = threading.Thread(target=asyncio.run, args=(self._loop(),), name="fuzz-neighbour", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def check(self, since: int) -> None:
        """Every answer since answer ``since`` equals the undisturbed one, and there was at least one."""
        assert not self.errors, self.errors[:3]
        seen = self.answers[since:]
        assert seen, "the neighbour's stream made no progress while the fuzzing ran"
        assert all(a == self.baseline for a in seen), [a for a in seen if a != self.baseline][:2]


@dataclass
class LiveApi:
    client: HttpClient
    tokenizer: object
    card: object
    model: str
    neighbour: Neighbour
    served: dict = field(default_factory=lambda: {"ok": 0, "stream": 0, "refused": 0})
    features: frozenset = frozenset()  # what the coordinator honours of the pending features


@pytest.fixture(scope="module")
def live(tiny_export):
    with served_paged(tiny_export("llama", 2), SETTINGS) as (_, coordinator, api, tokenizer):
        neighbour = Neighbour(api.url, coordinator.model.name)
        neighbour.start()
        client = HttpClient(api.host, api.port)
        try:
            yield LiveApi(client, tokenizer, coordinator.model, coordinator.model.name, neighbour,
                          features=frozenset(coordinator.features))
        finally:
            neighbour.stop()
            client.close()



# -- strategies: a body is a few fields, each valid or absent, and a few of them hostile ----------

SAFE_TEXT = ("", "hi", "\U0001f600" * 5, "\u202e\u2066", "\u00e9" * 10, "\\", "${jndi:ldap://x}", "<script>",
             "' OR 1=1 --", "%s%s%n", "\r\nX-Injected: 1", "\u0000", "\ufeff", "\U0010ffff", "a\tb")
text = st.sampled_from(SAFE_TEXT) | st.text(max_size=20)
bad_text = st.sampled_from(("\ud800", "\udfff x", "A" * 5000, "\u00e9" * 3000))
role = st.sampled_from(["system", "developer", "user", "assistant"])
message = st.fixed_dictionaries({"role": role, "content": text | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2)})
EARLIER_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}
message = (message | st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("call_1"),
                                            "content": text})
           | st.fixed_dictionaries({"role": st.just("assistant"), "content": st.sampled_from([None, "", "ok"]),
                                    "tool_calls": st.just([EARLIER_CALL])}))
bad_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["tool", "function", "", "USER", None, 1]), "content": text}),
    st.fixed_dictionaries({"role": role, "content": bad_text}),
    st.fixed_dictionaries({"role": role, "content": st.sampled_from([None, 1, {}, [{"type": "image_url"}],
                                                                    [{"type": "text", "text": 5}], [1]])}),
    st.fixed_dictionaries({"role": role}), st.sampled_from([None, "hi", 1, [], {}]),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(), "tool_calls": st.sampled_from(
        [[], "x", [{"id": "c"}], [{"id": 1, "function": {"name": "f", "arguments": "{}"}}],
         [{"id": "c", "function": {"name": "f", "arguments": {}}}]])}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.sampled_from([None, "", 5]), "content": text}))
HOSTILE = (None, True, False, "", "1", "NaN", [], {}, [1], {"a": 1}, float("nan"), float("inf"), -float("inf"),
           *HUGE_NUMBERS, -1, 0, 0.5, 1.5)
hostile = st.sampled_from(HOSTILE)

# name -> (valid value or absent, hostile value)
FIELDS = {
    "model": (st.sampled_from([ABSENT, "MODEL"]), st.sampled_from(["gpt-4", "", "MODEL ", 1, [], {}])),
    "max_tokens": (st.just(ABSENT) | st.integers(1, 6), st.integers(17, 10**6) | hostile),
    "max_completion_tokens": (st.just(ABSENT) | st.integers(1, 6), hostile),
    "temperature": (st.just(ABSENT) | st.floats(0, 2), st.floats(2.0001, 1e308) | hostile),
    "top_p": (st.just(ABSENT) | st.floats(0.01, 1), st.sampled_from([0, -0.1, 1.01]) | hostile),
    "top_k": (st.just(ABSENT) | st.integers(-1, 50), st.integers(max_value=-2) | hostile),
    "min_p": (st.just(ABSENT) | st.floats(0, 1), st.sampled_from([-0.1, 1.01]) | hostile),
    "seed": (st.just(ABSENT) | st.integers(0, 2**63 - 1), st.integers(min_value=2**63) | hostile),
    "stop": (st.just(ABSENT) | text.filter(bool) | st.lists(text.filter(bool), max_size=4),
             st.lists(text.filter(bool), min_size=5, max_size=6) | st.sampled_from([[""], "", [1], {}, 3])),
    "stream": (st.sampled_from([ABSENT, True, True, False, None]), st.sampled_from(["true", 1, 0, [], {}, "false"])),
    "stream_options": (st.sampled_from([ABSENT, {"include_usage": True}, {"include_usage": False}, {}, None]),
                       st.sampled_from([{"include_usage": "yes"}, [], "x", {"include_usage": 1}, 5])),
    "n": (st.sampled_from([ABSENT, ABSENT, 1, None, 2, 3]), st.integers(9, 2**70) | hostile),
    "best_of": (st.sampled_from([ABSENT, 1]), st.integers(2, 5) | hostile),
    "tools": (st.sampled_from([ABSENT, ABSENT, [], None, [WEATHER], [WEATHER, CLOCK]]),
              st.sampled_from([[{"type": "function"}], "x", 1, [WEATHER, WEATHER], [{"type": "code"}],
                               [{"type": "function", "function": {"name": "a b"}}],
                               [{"type": "function", "function": {"name": "f", "parameters": []}}]])),
    "tool_choice": (st.sampled_from([ABSENT, ABSENT, "auto", "none", None]),
                    st.sampled_from(["required", {"type": "function", "function": {"name": "get_weather"}},
                                     {"type": "function", "function": {"name": "nope"}}, "any", 1, {}, []])),
    "response_format": (st.sampled_from([ABSENT, ABSENT, None, {"type": "text"}]),
                        st.sampled_from([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "object"}}}, {"type": "json_schema"}, {"type": "xml"},
                            "json", 1, []])),
    "logprobs": (st.sampled_from([ABSENT, False, None]), st.sampled_from([True, 5, "x", 21, -1])),
    "top_logprobs": (st.sampled_from([ABSENT, None]), st.sampled_from([0, 2, 20, 21, -1, "x", True])),
    "presence_penalty": (st.sampled_from([ABSENT, 0, None, 0.5, -2]), st.sampled_from([2.01, "x", -3]) | hostile),
    "frequency_penalty": (st.just(ABSENT) | st.floats(-2, 2), st.sampled_from([2.5, "x", -2.01]) | hostile),
    "repetition_penalty": (st.just(ABSENT) | st.floats(0.5, 2), st.sampled_from([0, -1, 10.5, "x"]) | hostile),
    "logit_bias": (st.sampled_from([ABSENT, None, {}, {"5": -100}, {"7": 2.5, "9": 0}]),
                   st.sampled_from([{"x": 1}, {"5": 101}, {"-1": 1}, {"600": 1}, [1], "5", {"5": "1"}]) | hostile),
    "messages": (st.lists(message, min_size=1, max_size=3),
                 st.lists(bad_message, min_size=1, max_size=2) | st.sampled_from([ABSENT, [], None, "hi", {}, 1])),
    "prompt": (text.filter(bool) | st.lists(st.integers(0, 511), min_size=1, max_size=8)
               | st.lists(text.filter(bool), min_size=1, max_size=1),
               bad_text | st.lists(st.integers(512, 2**62) | st.integers(max_value=-1), min_size=1, max_size=4)
               | st.lists(text, min_size=2, max_size=3) | st.sampled_from([ABSENT, [], "", [[]], [True], [1.5], None])
               | st.lists(st.lists(st.integers(0, 9), min_size=1), min_size=1, max_size=2)),
}


@st.composite
def bodies(draw, kind: str, model: str):
    names = [n for n in FIELDS if n != ("prompt" if kind == "chat" else "messages")]
    n_bad = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]), label="hostile fields")
    bad = set(draw(st.lists(st.sampled_from(names), min_size=n_bad, max_size=n_bad, unique=True)))
    if kind == "text":
        names = [n for n in names if n not in CHAT_ONLY or n in bad]
    body = {name: draw(FIELDS[name][name in bad], label=name) for name in names}
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(max_size=12), label="extra key")] = draw(hostile, label="extra value")
    return {k: (model if isinstance(v, str) and v.startswith("MODEL") else v)
            for k, v in body.items() if v is not ABSENT}


# -- the oracle and the checks --------------------------------------------------------------------

def predict(live: LiveApi, body: dict, kind: str) -> ApiError | None:
    """What the server must answer: None (serve it) or the ApiError it must refuse it with."""
    try:
        params = parse_completion(body, kind, live.model, pending=SETTINGS.pending - live.features)
        check_prompt_chars(params, SETTINGS.max_prompt_tokens)  # refused unread: too long to tokenise
        check_prompt_ids(params, live.card.vocab_size)
        check_logit_bias(params, live.card.vocab_size)
        to_generation_request(prompt_ids(live.tokenizer, params), params, SETTINGS, live.card)
    except ApiError as exc:
        return exc
    except (TokenizerError, GenerationError) as exc:
        return ApiError(400, str(exc), "invalid_prompt")
    return None


def _is_openai_error(doc) -> bool:
    error = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and bool(error["message"])


def check_served(reply: Reply, body: dict, kind: str, what: str) -> bool:
    """A 200 in the shape asked for; returns whether it was streamed."""
    assert reply.status == 200, f"{what}: a valid request got {reply.status}: {reply.body[:300]!r}"
    if body.get("stream") is True:
        assert reply.content_type == "text/event-stream", what
        events = [line[6:] for line in reply.body.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{what}: the stream did not end with [DONE]: {events[-3:]}"
        docs = [json.loads(e) for e in events[:-1]]
        assert not any("error" in d for d in docs), f"{what}: error mid-stream: {docs[-1]}"
        return True
    doc = reply.json()
    assert [c["index"] for c in doc["choices"]] == list(range(body.get("n") or 1)), what
    for choice in doc["choices"]:
        if kind == "chat" and choice["message"].get("tool_calls"):
            assert choice["finish_reason"] == "tool_calls" and body.get("tools"), what
        else:
            assert isinstance(choice["message"]["content"] if kind == "chat" else choice["text"], str), what
            assert choice["finish_reason"] in ("stop", "length"), what
    return False


def check_refused(reply: Reply, expected: ApiError, what: str) -> None:
    text = reply.body.decode("utf-8", "replace")
    assert reply.status == expected.status, (f"{what}: expected {expected.status} ({expected}), "
                                             f"got {reply.status}: {text[:300]}")
    assert reply.content_type == "application/json" and _is_openai_error(reply.json()), f"{what}: {text[:300]}"
    assert "Traceback" not in text
    if expected.param is not None:
        assert reply.json()["error"]["param"] == expected.param, f"{what}: {text[:300]}"


def _fuzz_bodies(live: LiveApi, kind: str, name: str) -> None:
    ran = []
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    since = len(live.neighbour.answers)

    @fuzz_settings(CASES[name])
    @given(body=bodies(kind, live.model))
    def case(body):
        ran.append(1)
        reply = live.client.request("POST", path, dumps(body), AUTH)
        what = f"{path} {json.dumps(body)[:200]}"
        assert_answered(reply, what)
        expected = predict(live, body, kind)
        if expected is None:
            live.served["stream" if check_served(reply, body, kind, what) else "ok"] += 1
        else:
            live.served["refused"] += 1
            check_refused(reply, expected, what)

    case()
    assert len(ran) >= CASES[name]
    live.neighbour.check(since)
    print(f"{name}: {live.served} (cumulative), neighbour answers {len(live.neighbour.answers)}")


def test_fuzz_chat_bodies(live):
    _fuzz_bodies(live, "chat", "OpenAI API: chat bodies")
    assert min(live.served.values()) >= 50, live.served  # the mix reaches every outcome


def test_fuzz_completion_bodies(live):
    _fuzz_bodies(live, "text", "OpenAI API: completion bodies")


ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/x", "/health", "/metrics",
          "/v1/responses", "/v1/responses/resp_x")
AUTH_VARIANTS = ({"Authorization": f"Bearer {KEY}"}, {}, {"Authorization": "Bearer wrong"},
                 {"Authorization": f"Basic {KEY}"}, {"Authorization": f"bearer  {KEY} "},
                 {"Authorization": "Bearer " + "x" * 4000}, {"Authorization": f"Bearer {KEY}\u00e9"})


# None: http.client's own Host header (the address dialled)
GOOD_HOSTS = (None, "127.0.0.1", "localhost:1234", "[::1]:80", "LOCALHOST.")
BAD_HOSTS = ("evil.example", "127.0.0.1.nip.io:8000", "", "10.9.8.7", "127.0.0.1:x", "[::1", "localhost:80:80")


def test_fuzz_raw_requests(live):
    ran = []
    since = len(live.neighbour.answers)

    @fuzz_settings(CASES["OpenAI API: raw requests"])
    @given(method=st.sampled_from(METHODS), path=st.sampled_from(ROUTES) | paths(ROUTES),
           body=st.sampled_from(RAW_BODIES) | st.binary(max_size=300).map(Blob) | json_values().map(dumps)
           | st.integers((64 << 10) + 1, 200 << 10).map(lambda n: Blob(b"{\"prompt\": \"" + b"x" * n + b"\"}")),
           content_type=st.sampled_from(CONTENT_TYPES), auth=st.sampled_from(AUTH_VARIANTS),
           host=st.sampled_from((*GOOD_HOSTS, *GOOD_HOSTS, *BAD_HOSTS)))
    def case(method, path, body, content_type, auth, host):
        ran.append(1)
        headers = {**auth, "Content-Type": content_type, **({} if host is None else {"Host": host})}
        reply = live.client.request(method, path, body, {k: v.encode().decode("latin-1") for k, v in headers.items()})
        what = f"{method} {path[:80]} ({len(body)} B, {auth.get('Authorization', 'no key')[:20]})"
        assert_answered(reply, what)
        authorised = auth.get("Authorization", "").strip() in (f"Bearer {KEY}", f"bearer  {KEY}")
        if host in BAD_HOSTS:  # a rebinding page's name (or none): refused before anything else
            parser_refused = reply.status == 400 and reply.content_type != "application/json"
            assert reply.status == 421 or parser_refused, f"{what}: Host {host!r} got {reply.status}"
            return
        assert reply.status != 421, f"{what}: Host {host!r} refused"
        is_json = content_type.split(";")[0].strip() == "application/json"
        if authorised and method == "POST" and path in ROUTES[:2] and not is_json:
            assert reply.status == 415, f"{what}: a {content_type!r} POST got {reply.status}"
        if reply.status == 200:
            assert authorised or path.split("?")[0] == "/health", f"{what}: answered 200 without the key"
        if reply.status >= 400 and method != "HEAD" and reply.content_type == "application/json":
            assert _is_openai_error(reply.json()), f"{what}: {reply.body[:200]!r}"
        if len(body) > SETTINGS.max_body_bytes and authorised and method == "POST" and path in ROUTES[:2] and is_json:
            assert reply.status == 413, what

    case()
    assert len(ran) >= CASES["OpenAI API: raw requests"]
    live.neighbour.check(since)


# -- /v1/responses: the same checks, the Responses parser as the oracle --------------------------

FUNCTION = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}
item = st.one_of(
    st.fixed_dictionaries({"role": role, "content": text | st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["input_text", "output_text"]), "text": text}), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"),
                           "name": st.just("get_weather"), "arguments": st.sampled_from(['{"city": "x"}', "{}"])}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("call_1"), "output": text}))
bad_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["tool", "", None, 1]), "content": text}),
    st.fixed_dictionaries({"role": role, "content": st.sampled_from([[{"type": "input_image", "image_url": "x"}],
                                                                    [{"type": "x"}], 5, None])}),
    st.fixed_dictionaries({"type": st.sampled_from(["computer_call", "web_search_call", 3, None])}),
    hostile)
RESPONSE_FIELDS = {  # name: (valid or absent, hostile)
    "model": (st.sampled_from([ABSENT, "MODEL"]), st.sampled_from(["nope", 1, None, ""])),
    "input": (text.filter(bool) | st.lists(item, min_size=1, max_size=3),
              st.lists(bad_item, min_size=1, max_size=2) | st.sampled_from([ABSENT, [], None, {}, 1])),
    "instructions": (st.sampled_from([ABSENT, None]) | text, st.sampled_from([1, [], {}]) | bad_text),
    "max_output_tokens": (st.sampled_from([ABSENT, None, 1, 3, 16]), st.sampled_from([0, -1, "3", 2**70, 1.5])),
    "temperature": (st.sampled_from([ABSENT, 0, 0.7, None]), st.sampled_from([-1, 3, "hot", float("nan")])),
    "top_p": (st.sampled_from([ABSENT, 1, 0.5]), st.sampled_from([2, -0.1, "x"])),
    "tools": (st.sampled_from([ABSENT, [], [FUNCTION]]),
              st.sampled_from([[{"type": "web_search"}], "x", [FUNCTION, FUNCTION], [{"type": "function"}]])),
    "tool_choice": (st.sampled_from([ABSENT, "auto", "none"]),
                    st.sampled_from(["required", {"type": "function", "name": "get_weather"}, {"type": "x"}, 1])),
    "text": (st.sampled_from([ABSENT, None, {"format": {"type": "text"}}]),
             st.sampled_from([{"format": {"type": "json_object"}}, {"format": {"type": "yaml"}}, {"format": 1}, 2])),
    "store": (st.sampled_from([ABSENT, True, False]), st.sampled_from(["yes", 1, None])),
    "previous_response_id": (st.just(ABSENT), st.sampled_from(["resp_nope", 1, "", None])),
    "metadata": (st.sampled_from([ABSENT, {}, {"team": "a"}]), st.sampled_from([{"k": 1}, [], {"k": "v" * 600}])),
    "stream": (st.sampled_from([ABSENT, True, False]), st.sampled_from(["true", 1, []])),
    "background": (st.just(ABSENT), st.sampled_from([True, 1])),
}


@st.composite
def response_bodies(draw, model: str):
    n_bad = draw(st.sampled_from([0, 0, 0, 1, 1, 2]), label="hostile fields")
    bad = set(draw(st.lists(st.sampled_from(list(RESPONSE_FIELDS)), min_size=n_bad, max_size=n_bad, unique=True)))
    body = {name: draw(RESPONSE_FIELDS[name][name in bad], label=name) for name in RESPONSE_FIELDS}
    return {k: (model if v == "MODEL" else v) for k, v in body.items() if v is not ABSENT}


def predict_response(live: LiveApi, body: dict) -> ApiError | None:
    if body.get("previous_response_id") is not None:  # none is kept under a made-up id
        return ApiError(404, "no such response", "response_not_found", param="previous_response_id")
    try:
        params = parse_response_request(body, live.model, pending=SETTINGS.pending - live.features,
                                        max_prompt_tokens=SETTINGS.max_prompt_tokens)
        to_generation_request(prompt_ids(live.tokenizer, params.chat), params.chat, SETTINGS, live.card)
    except ApiError as exc:
        return exc
    except (TokenizerError, GenerationError) as exc:
        return ApiError(400, str(exc), "invalid_prompt")
    return None


def test_fuzz_responses_bodies(live):
    name, ran, since = "OpenAI API: responses bodies", [], len(live.neighbour.answers)
    outcomes = {"ok": 0, "stream": 0, "refused": 0}

    @fuzz_settings(CASES[name])
    @given(body=response_bodies(live.model))
    def case(body):
        ran.append(1)
        reply = live.client.request("POST", "/v1/responses", dumps(body), AUTH)
        what = f"/v1/responses {json.dumps(body)[:200]}"
        assert_answered(reply, what)
        expected = predict_response(live, body)
        outcomes["refused" if expected is not None else "stream" if body.get("stream") is True else "ok"] += 1
        if expected is not None:
            check_refused(reply, expected, what)
            return
        assert reply.status == 200, f"{what}: a valid request got {reply.status}: {reply.body[:300]!r}"
        if body.get("stream") is True:
            kinds = [line[7:] for line in reply.body.decode().split("\n") if line.startswith("event: ")]
            assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), what
        else:
            doc = reply.json()
            assert doc["object"] == "response" and doc["status"] in ("completed", "incomplete"), what

    case()
    assert len(ran) >= CASES[name]
    live.neighbour.check(since)
    assert min(outcomes.values()) >= 20, outcomes  # the mix reaches every outcome (derandomized: 107, 25, 268)
