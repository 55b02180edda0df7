"""The sampler fields of issue 35 on the wire: ``frequency_penalty``, ``presence_penalty``,
``repetition_penalty`` (and llama.cpp's ``repeat_penalty``), ``top_k``, ``min_p`` and
``logit_bias``. Parsing (pure: values, ranges, 400s naming the field), the refusal where the
runtime does not apply them, and live: the real ``openai`` client (OpenAI's fields as arguments,
the others through ``extra_body``) and a raw body as Open WebUI sends it, against the tiny
export's paged coordinator, with the penalised greedy text equal to the independent reference
(tests/support/penalty_reference.py) decoded."""

from __future__ import annotations

import json

import openai
import pytest

from engine.api.generate import check_logit_bias
from engine.api.openai_schema import NOT_YET_SERVED, ApiError, parse_completion
from engine.api.server import ApiSettings
from engine.generation.penalties import PENALTY_FEATURES
from engine.generation.request import SamplingParams
from engine.shards.stage import LocalChain
from tests.conftest import PROMPT_IDS
from tests.support.fuzz_helpers import HttpClient, served_paged
from tests.support.penalty_reference import reference

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


def sampling(**fields) -> SamplingParams:
    return parse_completion({**CHAT, **fields}, "chat", "fake", pending=()).sampling


# -- parsing ------------------------------------------------------------------------------------------

def test_the_fields_map_to_sampling_params():
    got = sampling(frequency_penalty=0.5, presence_penalty=-1, repetition_penalty=1.15, top_k=40, min_p=0.05,
                   logit_bias={"50": -100, "7": 2.5, "9": 0})
    assert got == SamplingParams(temperature=1.0, top_k=40, min_p=0.05, frequency_penalty=0.5, presence_penalty=-1.0,
                                 repetition_penalty=1.15, logit_bias=((7, 2.5), (50, -100.0)))
    assert sampling(repeat_penalty=1.3).repetition_penalty == 1.3  # llama.cpp's / Ollama's name
    assert sampling(repeat_penalty=1.3, repetition_penalty=1.3).repetition_penalty == 1.3
    assert sampling(top_k=-1).top_k == 0 and sampling(top_k=0).top_k == 0  # vLLM's and llama.cpp's "off"
    assert sampling(logit_bias=[[7, 2.5], [50, -100]]).logit_bias == ((7, 2.5), (50, -100.0))  # llama.cpp's form
    assert sampling(logit_bias={"9": 0}).logit_bias == () and not sampling(frequency_penalty=0).penalised


@pytest.mark.parametrize("fields, param, says", [
    ({"frequency_penalty": 2.5}, "frequency_penalty", "between -2.0 and 2.0"),
    ({"presence_penalty": -3}, "presence_penalty", "between -2.0 and 2.0"),
    ({"presence_penalty": "0.5"}, "presence_penalty", "a number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "above 0"),
    ({"repetition_penalty": 11}, "repetition_penalty", "10.0"),
    ({"repeat_penalty": -1}, "repeat_penalty", "between"),
    ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repetition_penalty", "differ"),
    ({"min_p": 1.5}, "min_p", "between 0.0 and 1.0"),
    ({"top_k": -2}, "top_k", "between -1"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"-5": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"5": True}}, "logit_bias", "token 5"),
    ({"logit_bias": [[5, 1], [5, 2]]}, "logit_bias", "named twice"),
    ({"logit_bias": [5]}, "logit_bias", "at most 300"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "301 entries"),
])
def test_bad_values_are_400_naming_the_field_and_its_range(fields, param, says):
    with pytest.raises(ApiError) as info:
        parse_completion({**CHAT, **fields}, "chat", "fake", pending=())
    assert info.value.status == 400 and info.value.param == param and says in info.value.message


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0.2), ("presence_penalty", 0.2),
                                          ("repetition_penalty", 1.1), ("logit_bias", {"5": 3})])
def test_a_runtime_that_does_not_apply_penalties_refuses_them_by_name(field, value):
    assert set(PENALTY_FEATURES) <= set(NOT_YET_SERVED)
    with pytest.raises(ApiError) as info:  # the default pending: a generator that declares no features
        parse_completion({**CHAT, field: value}, "chat", "fake")
    assert info.value.param == field and "not applied by the runtime serving this model" in info.value.message
    parse_completion({**CHAT, field: value, "top_k": 5, "min_p": 0.1}, "chat", "fake",
                     pending=set(NOT_YET_SERVED) - PENALTY_FEATURES)


def test_bias_ids_are_checked_against_the_models_vocabulary():
    params = parse_completion({**CHAT, "logit_bias": {"511": 1, "3": 1}}, "chat", "fake", pending=())
    check_logit_bias(params, 512)
    check_logit_bias(params, None)  # not known: the stream fails at its first token instead
    with pytest.raises(ApiError) as info:
        check_logit_bias(params, 511)
    assert info.value.param == "logit_bias" and "ids 0 to 510" in info.value.message


# -- live: the tiny export's paged coordinator -----------------------------------------------------------

N = 24


@pytest.fixture(scope="module")
def served(tiny_export):
    export = tiny_export("llama", 2)
    settings = ApiSettings(max_prompt_tokens=480, default_max_tokens=16, max_tokens_limit=64)
    with served_paged(export, settings) as (_, coordinator, api, tokenizer), \
            openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client, coordinator, api, tokenizer, LocalChain.load(tiny_export("llama", 1), exact=True)


def test_the_openai_client_gets_the_reference_penalised_text(served):
    client, coordinator, _, tokenizer, chain = served
    eos = coordinator.model.eos_token_ids
    bias = {**{e: -100.0 for e in eos}, 300: 1.5}  # no early stop: every position is compared
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                            logit_bias=tuple(sorted(bias.items())))
    want, _ = reference(chain, PROMPT_IDS, N, params)
    got = client.completions.create(
        model=coordinator.model.name, prompt=list(PROMPT_IDS), max_tokens=N, temperature=0, frequency_penalty=0.4,
        presence_penalty=0.3, logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"repetition_penalty": 1.3})
    assert got.usage.completion_tokens == N and got.choices[0].text == tokenizer.decode(want)
    plain = client.completions.create(model=coordinator.model.name, prompt=list(PROMPT_IDS), max_tokens=N,
                                      temperature=0, logit_bias={str(e): -100 for e in eos})
    assert plain.choices[0].text != got.choices[0].text  # the penalties changed the answer
    forced = client.chat.completions.create(model=coordinator.model.name, messages=[{"role": "user", "content": "x"}],
                                            max_tokens=4, temperature=0, logit_bias={"300": 100})
    assert forced.choices[0].message.content == tokenizer.decode([300] * 4)
    hot = client.chat.completions.create(model=coordinator.model.name, messages=[{"role": "user", "content": "x"}],
                                         max_tokens=6, temperature=1.2, seed=4, presence_penalty=1.0,
                                         extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2})
    assert hot.usage.completion_tokens >= 1


def test_a_raw_body_as_open_webui_sends_it_is_served_streamed(served):
    _, coordinator, api, _, _ = served
    body = {"model": coordinator.model.name, "stream": True, "messages": [{"role": "user", "content": "Hello"}],
            "temperature": 0.8, "top_p": 0.9, "min_p": 0.05, "max_tokens": 8, "frequency_penalty": 0.3,
            "presence_penalty": 0.2, "seed": 7, "logit_bias": {"300": 5}, "stream_options": {"include_usage": True},
            # Ollama-named advanced params Open WebUI passes on as they are
            "repeat_penalty": 1.1, "top_k": 40}
    http = HttpClient(api.host, api.port)
    try:
        reply = http.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
        bad = http.request("POST", "/v1/chat/completions", json.dumps({**body, "logit_bias": {"100000": 5}}).encode(),
                           {"Content-Type": "application/json"})
    finally:
        http.close()
    assert reply.status == 200 and reply.content_type == "text/event-stream"
    events = [line[6:] for line in reply.body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    docs = [json.loads(e) for e in events[:-1]]
    assert not any("error" in d for d in docs) and docs[-1]["usage"]["completion_tokens"] >= 1
    assert bad.status == 400 and bad.json()["error"]["param"] == "logit_bias"
