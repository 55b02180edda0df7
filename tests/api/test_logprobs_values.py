"""Log-probabilities through the API carry the model's values (issue 17): the real ``openai``
client against the API over the tiny 2-stage export's paged coordinator (exact f32); each
token's log-probability and top-k are checked against an independent log-softmax (float64 numpy,
here) of the logits the same export gives for the same tokens in one forward pass of the
in-process oracle, before any temperature.

The rest of what this module tested on the retired stateful runtime is covered on the paged one:
parse with a pydantic model, streamed schemas, forced tool calls streamed and not, the '{' first
token of json_object at log-probability 0 and the 400 for a schema that does not compile in
tests/api/test_constrained_api.py (``deskfleet serve --workers``); the coordinator's features and
its log-probabilities against the stages' own logits in tests/coordinator/test_constrained_decoding.py.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from engine.api.server import ApiSettings
from engine.generation.in_process import greedy_generate
from engine.shards.kv_layout import KVLayout
from engine.shards.stage import LocalChain, StepInputs
from tests.support.fuzz_helpers import served_paged

ASK = [{"role": "user", "content": "Describe a shape as JSON."}]
PROMPT = [1, 17, 42, 99, 7, 300, 12, 5]


@pytest.fixture(scope="module")
def export(tiny_export):
    return tiny_export("llama", 2)


@pytest.fixture(scope="module")
def client(export):
    settings = ApiSettings(max_prompt_tokens=480, default_max_tokens=32, max_tokens_limit=256)
    with served_paged(export, settings) as (_, coordinator, api, _), \
            openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c, coordinator.model.name


def reference_logprobs(export, prompt, n) -> tuple[list[int], np.ndarray]:
    """The greedy tokens of ``prompt`` and the log-softmax [n, V] (float64) of the logits that
    chose each, from one forward pass of prompt + tokens over a fresh chain of the same export."""
    chain = LocalChain.load(export, exact=True)
    tokens = list(greedy_generate(chain, prompt, n, ignore_eos=True).tokens)
    fed = np.asarray([prompt + tokens[:-1]], dtype=np.int64)
    layout = KVLayout(fed.shape[1])
    mask, positions = layout.plan(fed.shape[1])
    logits = chain.forward(chain.new_streams(), StepInputs(fed, mask, positions, 0))[0].astype(np.float64)
    rows = logits[len(prompt) - 1:]  # [n, V]: the row before each generated token
    top = rows.max(axis=1, keepdims=True)
    return tokens, rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))


def test_logprobs_equal_an_independent_log_softmax_of_the_same_logits(client, export):
    c, model = client
    n, k = 6, 4
    tokens, want = reference_logprobs(export, PROMPT, n)
    got = c.completions.create(model=model, prompt=PROMPT, max_tokens=n, logprobs=k, temperature=0).choices[0].logprobs
    assert len(got.token_logprobs) == n
    for i, token in enumerate(tokens):
        assert got.token_logprobs[i] == pytest.approx(want[i, token], abs=1e-4)
        best = np.sort(want[i])[::-1][:k]
        assert got.token_logprobs[i] == pytest.approx(best[0], abs=1e-4)  # greedy: the chosen is the top-1
        # a dict by token text: random-byte tokens that decode alike share one key (the later one wins)
        values = got.top_logprobs[i].values()
        assert values and all(np.isclose(best, v, atol=1e-4).any() for v in values)
    # sampled at a temperature: still the raw (temperature 1) log-softmax of the chosen token's row
    hot = c.chat.completions.create(model=model, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=2,
                                    temperature=1.7, seed=11).choices[0].logprobs.content
    assert len(hot) == 5 and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in hot)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in hot)
