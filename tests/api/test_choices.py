"""Several choices (``n``) and log-probabilities in the answers (issue 17).

``n=3`` runs on the real coordinator over a tiny 2-stage export (exact f32, so a seeded choice
cannot depend on what else is batched with it) through the real ``openai`` client, in chat and
legacy completions, streamed and not. Log-probabilities are shaped from what the generator puts
on its token events; their exact shapes are checked over a canned generator here (the real
coordinators' values: tests/api/test_logprobs_values.py, test_constrained_api.py).
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict

import openai
import pytest

from engine.api.fan_in import merged
from engine.api.openai_schema import NOT_YET_SERVED
from engine.api.server import ApiSettings
from tests.support.canned_api import CannedGenerator, fake_logprobs, served
from tests.support.fuzz_helpers import served_paged

KEY = "sk-choices"
ASK = [{"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def tiny_api(tiny_export):
    settings = ApiSettings(api_key=KEY, max_prompt_tokens=200, default_max_tokens=12, max_tokens_limit=64)
    # seeded choices are compared across requests: no prefix blocks (see served_paged)
    with served_paged(tiny_export("llama", 2), settings, prefix_cache=False) as (_, coordinator, api, _):
        yield api.url, coordinator.model.name


@pytest.fixture
def client(tiny_api):
    with openai.OpenAI(base_url=tiny_api[0], api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def streamed_texts(chunks, field: str) -> dict[int, str]:
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if field == "delta" else choice.text
    return dict(texts)


def test_chat_n3_seeded_choices_differ_repeat_and_stream_the_same(client, tiny_api):
    model = tiny_api[1]
    ask = dict(model=model, messages=ASK, temperature=1.5, seed=7, max_tokens=10, n=3)
    first, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices], "the same seed gave other choices"
    assert len(set(texts)) > 1, "seed + i should make the choices differ"
    one = client.chat.completions.create(**{**ask, "n": 1})
    assert one.choices[0].message.content == texts[0]  # choice 0 is the request's own seed
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert streamed_texts(chunks, "delta") == dict(enumerate(texts))
    finishes = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}
    assert finishes == {c.index: c.finish_reason for c in first.choices}
    # usage counts every choice's tokens and the prompt once
    assert chunks[-1].usage == first.usage
    assert first.usage.completion_tokens > one.usage.completion_tokens
    assert first.usage.prompt_tokens == one.usage.prompt_tokens


def test_legacy_completions_n3_streamed_and_not(client, tiny_api):
    ask = dict(model=tiny_api[1], prompt="The capital of France is", temperature=1.0, seed=11, max_tokens=8, n=3)
    plain = client.completions.create(**ask)
    streamed = streamed_texts(client.completions.create(**ask, stream=True), "text")
    assert streamed == {c.index: c.text for c in plain.choices} and len(plain.choices) == 3
    alone = [client.completions.create(**{**ask, "n": 1, "seed": 11 + i}) for i in range(3)]
    assert [a.choices[0].text for a in alone] == [c.text for c in plain.choices]  # choice i: seed + i
    assert plain.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_n_over_the_cap_is_refused_naming_the_field_and_n3_logprobs_come_per_choice(client, tiny_api):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=tiny_api[1], messages=ASK, n=9)
    assert info.value.body["param"] == "n"
    answer = client.chat.completions.create(model=tiny_api[1], messages=ASK, logprobs=True, top_logprobs=2, n=3,
                                            temperature=1.2, seed=3, max_tokens=4)
    for choice in answer.choices:  # values: tests/api/test_logprobs_values.py
        assert len(choice.logprobs.content) == 4 and all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)


# -- log-probabilities, shaped from the generator's token events -----------------------------------

def expected_entries(text: str, k: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    out = []
    for token in text.encode():
        logprob, top = fake_logprobs(token, k)
        out.append((bytes([token]).decode("utf-8", "replace"), logprob,
                    [(bytes([t]).decode("utf-8", "replace"), lp) for t, lp in top]))
    return out


def test_chat_logprobs_non_streamed_and_streamed():
    answer = "Paris é"
    generator = CannedGenerator(answer)
    with served(generator, pending=frozenset(NOT_YET_SERVED) - {"logprobs"}) as url, \
            openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        plain = client.chat.completions.create(model="fake", messages=ASK, logprobs=True, top_logprobs=3)
        chunks = list(client.chat.completions.create(model="fake", messages=ASK, logprobs=True, top_logprobs=3,
                                                     stream=True))
        bare = client.chat.completions.create(model="fake", messages=ASK, logprobs=True)
    assert generator.requests[0].logprobs == 3 and generator.requests[2].logprobs == 0
    content = plain.choices[0].logprobs.content
    got = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]
    assert got == expected_entries(answer, 3)  # EOS is not listed
    # ByteTokenizer has no token_bytes: a token's bytes are its text's (the pieces of "é" show as U+FFFD)
    assert [bytes(e.bytes) for e in content] == [e.token.encode() for e in content]
    streamed = [e for chunk in chunks for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
    assert all(math.isclose(e.logprob, math.log(0.5)) for e in bare.choices[0].logprobs.content)


def test_a_tokens_bytes_are_exact_for_the_real_tokenizer(tmp_path):
    from engine.api.openai_answer import token_bytes_of
    from engine.generation.tokenizer import ChatTokenizer
    from tests.support.tiny_models import build_tiny_tokenizer

    tokenizer = ChatTokenizer(build_tiny_tokenizer(tmp_path / "tok"))
    text = "héllo wörld 🙂 Paris, naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [token_bytes_of(tokenizer)(i) for i in ids]
    assert b"".join(pieces).decode() == text and len(ids) > 5
    assert tokenizer.token_bytes(tokenizer.token_id("<|im_end|>")) == b""  # a special token has none


def test_a_sentencepiece_tokens_bytes_keep_its_space(tmp_path):
    """A SentencePiece-style token ("\u2581the") stands for " the": decoded alone the decoder would
    drop that space."""
    import json

    from engine.generation.tokenizer import ChatTokenizer
    from tests.api.test_text_stream import CORPUS, sentencepiece_style_tokenizer

    root = tmp_path / "sp"
    root.mkdir()
    sentencepiece_style_tokenizer().save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))
    tokenizer = ChatTokenizer(root)
    ids = tokenizer.encode(CORPUS, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode() == " " + CORPUS  # the text's own first space is the decoder's to drop
    assert any(p.startswith(b" ") and len(p) > 1 for p in pieces[1:])


def test_legacy_logprobs_tokens_offsets_and_alternatives():
    answer = "a é b"
    with served(CannedGenerator(answer), pending=frozenset()) as url, \
            openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        plain = client.completions.create(model="fake", prompt="x", logprobs=2)
        chunks = list(client.completions.create(model="fake", prompt="x", logprobs=2, stream=True))
    lp = plain.choices[0].logprobs
    want = expected_entries(answer, 2)
    assert lp.tokens == [t for t, _, _ in want] and lp.token_logprobs == [p for _, p, _ in want]
    assert lp.top_logprobs == [dict(top) for _, _, top in want]
    # where each token's text starts: "é" is two tokens, the second starts where the first does
    assert lp.text_offset == [0, 1, 2, 2, 3, 4]
    streamed = [c.logprobs for chunk in chunks for c in chunk.choices if c.logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_logprobs_of_n_choices_are_per_choice():
    generator = CannedGenerator(lambda request, i: "ab" if request.sampling.seed == 4 else "xyz")

    async def ask(url):
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
            return await client.chat.completions.create(model="fake", messages=ASK, logprobs=True, n=2, seed=4)

    with served(generator, pending=frozenset()) as url:
        answer = asyncio.run(ask(url))
    assert [[e.token for e in c.logprobs.content] for c in answer.choices] == [["a", "b"], ["x", "y", "z"]]
    assert answer.usage.completion_tokens == 2 + 3 + 2  # both EOS tokens count


# -- running the choices at once -------------------------------------------------------------------

def test_merged_streams_interleave_fail_together_and_close_together():
    closed: list[str] = []

    async def numbers(name: str, n: int, fail_at: int | None = None):
        try:
            for i in range(n):
                await asyncio.sleep(0)
                if i == fail_at:
                    raise RuntimeError(f"{name} failed")
                yield name, i
            await asyncio.Future() if name == "held" else None
        finally:
            closed.append(name)

    async def scenario():
        items = [x async for x in merged([numbers("a", 3), numbers("b", 2)])]
        with pytest.raises(RuntimeError, match="b failed"):
            _ = [x async for x in merged([numbers("held", 1), numbers("b", 2, fail_at=1)])]
        stream = merged([numbers("held", 1), numbers("c", 1)])
        first = await anext(stream)
        await stream.aclose()  # what a client leaving does: every choice's generation ends
        return items, first

    items, first = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert sorted(items) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert [name for name, _ in items] != ["a", "a", "a", "b", "b"], "the streams did not interleave"
    assert first in (("held", 0), ("c", 0))
    assert sorted(closed) == ["a", "b", "b", "c", "held", "held"]


# -- log-probabilities from a logits row (what an in-process generator puts on its events) ----------

def test_token_logprobs_equal_an_independent_log_softmax_after_the_mask():
    import numpy as np
    import torch

    from engine.generation.logprobs import token_logprobs

    rng = np.random.default_rng(3)
    logits = rng.normal(0, 4, 1000).astype(np.float32)
    allowed = rng.random(1000) < 0.3
    chosen = int(np.flatnonzero(allowed)[5])
    logprob, top = token_logprobs(logits, chosen, 20, allowed)
    reference = torch.log_softmax(torch.tensor(np.where(allowed, logits, -np.inf), dtype=torch.float64), 0)
    assert math.isclose(logprob, float(reference[chosen]), rel_tol=1e-12)
    want = torch.topk(reference, 20)
    assert [i for i, _ in top] == want.indices.tolist()
    assert np.allclose([lp for _, lp in top], want.values.numpy())
    assert all(allowed[i] for i, _ in top)
    free, free_top = token_logprobs(logits, chosen, 0)
    assert free_top == () and math.isclose(free, float(torch.log_softmax(torch.tensor(logits, dtype=torch.float64),
                                                                          0)[chosen]), rel_tol=1e-12)
    few = np.zeros(1000, bool)
    few[[4, 9]] = True
    assert [i for i, _ in token_logprobs(logits, 4, 5, few)[1]] == sorted([4, 9], key=lambda i: -logits[i])
    with pytest.raises(ValueError, match="no token is allowed"):
        token_logprobs(logits, 0, 1, np.zeros(1000, bool))


def test_a_client_leaving_a_streamed_n3_answer_cancels_every_choice():
    class Held(CannedGenerator):
        """Each choice gives one token, then waits until its consumer goes away."""

        closed = 0

        async def _stream(self, request, index):
            try:
                async for event in super()._stream(request, index):
                    yield event
                    await asyncio.Future()
            finally:
                Held.closed += 1

    async def scenario(url):
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
            stream = await client.chat.completions.create(model="fake", messages=ASK, n=3, stream=True)
            first = await anext(aiter(stream))
            await stream.close()
            for _ in range(500):
                if Held.closed == 3:
                    break
                await asyncio.sleep(0.02)
            return first

    generator = Held("abc")
    with served(generator) as url:
        first = asyncio.run(scenario(url))
    assert first.choices[0].delta.role == "assistant"
    assert len(generator.requests) == 3 and Held.closed == 3
