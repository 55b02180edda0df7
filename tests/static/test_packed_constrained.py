"""Structured output, forced tool calls and log-probabilities on the static (NPU-target) path
(issue 17): the real ``openai`` client against ``deskfleet serve --workers`` over a 2-stage static
export (packed stage workers in processes, real sockets), where a step that samples a constrained
or logprobs request's row sends a Packed frame with WANT_LOGITS and the tokens are chosen at the
coordinator (engine.static.packed_choice). Static exports decode greedily.

The tiny model's weights are random, so what it says is the grammar's doing: enums and booleans.
Log-probabilities are checked against an independent float64 log-softmax of the same checkpoint's
logits from its stateful export (tests/api/test_logprobs_values.reference_logprobs).
"""

from __future__ import annotations

import json
import urllib.request
from typing import Literal

import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel

from tests.api.test_constrained_api import TOOLS, WEATHER
from tests.api.test_logprobs_values import PROMPT, reference_logprobs
from tests.support.api_helpers import serve_process
from tests.support.npu_helpers import npu_export

# an NPU-target export and a fleet of worker processes: the slow lane (~35 s)
pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Describe a shape as JSON."}]
TIMEOUT = 180


class Shape(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_checkpoint):
    # one slot of 496 positions: the generic tool block takes ~416 of the tiny model's 512
    export = npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=512, prefill_chunk=16)
    with serve_process("--shards", str(export), "--workers", "--exact", "--model-name", "tiny",
                       ready_timeout=TIMEOUT, timeout=TIMEOUT) as url, \
            openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


def test_a_pydantic_model_and_a_streamed_strict_schema_are_valid_when_finished(client):
    done = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Shape, max_tokens=120)
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(done.choices[0].message.parsed, Shape)
    schema = {**Shape.model_json_schema(), "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "shape", "schema": schema, "strict": True}}
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, stream=True,
                                                 max_tokens=120))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), schema)


def test_a_forced_tool_call_round_trip(client):
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
               tool_choice={"type": "function", "function": {"name": "weather"}}, max_tokens=80)
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    with client.chat.completions.stream(**ask) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == ("weather", arguments)


def test_logprobs_equal_an_independent_log_softmax_and_plain_requests_share_the_steps(client, tiny_export):
    n, k = 5, 3
    tokens, want = reference_logprobs(tiny_export("llama", 2), PROMPT, n)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, logprobs=k, temperature=0)
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) == n
    for i, token in enumerate(tokens):
        assert lp.token_logprobs[i] == pytest.approx(want[i, token], abs=1e-3)
        best = np.sort(want[i])[::-1][:k]
        assert all(np.isclose(best, v, atol=1e-3).any() for v in lp.top_logprobs[i].values())
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, temperature=0)
    assert plain.choices[0].text == got.choices[0].text  # top-1 from the stages == top-1 from the logits
    shaped = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, logprobs=True, top_logprobs=2,
                                            response_format={"type": "json_object"})
    first = shaped.choices[0].logprobs.content[0]
    assert (first.token, first.logprob, [t.token for t in first.top_logprobs]) == ("{", 0.0, ["{"])


def test_every_static_stage_reports_its_compute_in_the_servers_metrics(client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        samples = dict(line.rsplit(" ", 1) for line in reply.read().decode().splitlines()
                       if line and not line.startswith("#"))
    for stage in (0, 1):  # each packed stage worker appends its own ms to the frames it passes on
        assert float(samples[f'deskfleet_stage_compute_seconds_per_step{{stage="{stage}"}}']) > 0
    assert float(samples["deskfleet_packed_logit_steps_total"]) > 0  # the tests above asked for logits


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0.5), ("presence_penalty", -0.5),
                                          ("repetition_penalty", 1.2), ("logit_bias", {"5": -100})])
def test_penalties_are_refused_by_name_and_top_k_min_p_served_greedily(client, field, value):
    # a static export decodes from its last stage's top-1: it cannot apply penalties (issue 35)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={field: value})
    assert info.value.body["param"] == field, info.value.body
    assert "not applied by the runtime serving this model" in str(info.value)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    filtered = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                         extra_body={"top_k": 5, "min_p": 0.2})
    assert filtered.choices[0].text == plain.choices[0].text  # greedy keeps the top token under any filter
