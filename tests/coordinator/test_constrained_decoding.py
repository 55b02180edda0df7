"""Constrained decoding and log-probabilities on the paged coordinator, with the real tiny model
(OpenVINO CPU, exact f32, 2 stages in this process) and real llguidance matchers (issue 17).

The tiny model's weights are random: whatever JSON comes out is the grammar's doing. Its logits
are 512 wide over the same 512-token tokenizer; the text is decoded by the ``tokenizers``
library, independently of llguidance.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from engine.generation.grammar import GrammarError
from engine.generation.penalties import PENALTY_FEATURES
from engine.generation.request import (
    FinishReason,
    FunctionSchema,
    GenerationRequest,
    JsonConstraint,
    SamplingParams,
    ToolCallConstraint,
)
from engine.paged.constraints import NoGrammarTokenizerError
from engine.paged.coordinator import BatchCoordinator
from engine.paged.speculation import SpeculationConfig, Speculator
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect_events, run

POOL = 16 << 20
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "size": {"enum": [1, 2, 3]}},
          "required": ["ok", "color", "size"], "additionalProperties": False}
CONSTRAINT = JsonConstraint(json.dumps(SCHEMA), "shape", strict=True)
SEEDS = range(4)


@pytest.fixture(scope="module")
def export(tiny_export):
    return tiny_export("llama", 2)


@pytest.fixture(scope="module")
def text(export):
    tok = Tokenizer.from_file(str(export / "tokenizer" / "tokenizer.json"))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def local(export, **kw) -> BatchCoordinator:
    return BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL, **kw)


def ids(events) -> list[int]:
    return [e.token_id for e in events]


def ask(constraint=CONSTRAINT, *, n=60, temperature=0.0, seed=None, prompt=PROMPT_IDS, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, n, SamplingParams(temperature=temperature, seed=seed), constraint=constraint,
                             **kw)


def test_greedy_and_sampled_streams_give_schema_valid_json_and_the_grammar_ends_them(export, text):
    """Greedy and seeded sampling streams in one batch with free ones: every constrained stream
    stops (its JSON is whole) with a schema-valid object, without an end-of-sequence token; the free
    streams' tokens are their solo runs'."""
    free = [ask(None, n=10, ignore_eos=True, prompt=p) for p in (PROMPT_IDS, PROMPT_IDS[4:])]

    async def main():
        async with local(export, slots=8) as c:
            solo = [ids(await collect_events(c, r)) for r in free]
            runs = await asyncio.gather(*(collect_events(c, r) for r in [
                ask(), *(ask(temperature=1.0, seed=s) for s in SEEDS), ask(JsonConstraint(), temperature=0.8, seed=9),
                *free]))
            await c.async_wait_idle()
            return solo, runs, c.metrics()

    solo, runs, metrics = run(main())
    *constrained, free_a, free_b = runs
    assert [ids(free_a), ids(free_b)] == solo, "a constrained neighbour changed a free stream's tokens"
    for events in constrained[:-1]:
        assert events[-1].finish is FinishReason.STOP
        assert events[-1].token_id not in (2,), "the grammar's end should finish the stream, not an EOS step"
        jsonschema.validate(json.loads(text(ids(events))), SCHEMA)
    last = constrained[-1]  # any JSON object: it may run out of tokens inside a string
    if last[-1].finish is FinishReason.STOP:
        assert isinstance(json.loads(text(ids(last))), dict)
    sampled = {text(ids(e)) for e in constrained[1:-1]}
    assert len(sampled) > 1, "seeded sampling under the mask should differ between seeds"
    assert metrics["requests_finished_total"] == len(runs) + len(solo) and metrics["requests_cancelled_total"] == 0
    assert metrics["kv_blocks_used"] == 0


def test_seeded_constrained_sampling_repeats(export, text):
    async def main():
        async with local(export) as c:
            return [text(ids(await collect_events(c, ask(temperature=1.2, seed=5)))) for _ in range(2)]

    first, again = run(main())
    assert first == again


def test_speculation_under_a_constraint_keeps_the_greedy_answer(export):
    """Prompt lookup proposes what followed in the prompt, which the grammar and the model partly
    refuse: refused drafts are rejected and never consumed by the grammar, kept ones advance it by
    several tokens at once, and the answer equals the run without speculation."""
    tool = ToolCallConstraint((FunctionSchema("paint", json.dumps({
        "type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
        "additionalProperties": False})),))
    tok = Tokenizer.from_file(str(export / "tokenizer" / "tokenizer.json"))
    prompt = tuple(tok.encode('{"ok": true, "color": "red", "size": 1} <tool_call>\n{"name": "paint", '
                              '"arguments": {"color": "green"}}\n</tool_call>').ids)
    requests = [ask(prompt=prompt), ask(tool, prompt=prompt), ask(JsonConstraint(), n=30, prompt=prompt)]

    async def main(speculation):
        async with local(export, speculation=speculation) as c:
            out = [ids(await collect_events(c, r)) for r in requests]
            return out, c.metrics()

    plain, _ = run(main(None))
    fast, metrics = run(main(Speculator(SpeculationConfig("lookup", k=4), exact=True)))
    assert fast == plain
    assert metrics["speculation_proposed_total"] > metrics["speculation_accepted_total"] > 0, \
        "the drafter should have had drafts both kept and refused"


def test_a_forced_tool_call_is_one_call_the_api_parses(export, text):
    from engine.generation.tool_calls import parse_tool_calls

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2]}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = ToolCallConstraint((FunctionSchema("weather", json.dumps(schema)), FunctionSchema("noop", "{}")))

    async def main():
        async with local(export) as c:
            return [await collect_events(c, ask(tools, n=150, temperature=1.0, seed=s)) for s in range(3)]

    for events in run(main()):
        assert events[-1].finish is FinishReason.STOP
        content, calls = parse_tool_calls(text(ids(events)))
        assert not content and len(calls) == 1 and calls[0].name in ("weather", "noop")
        if calls[0].name == "weather":
            jsonschema.validate(json.loads(calls[0].arguments), schema)


def test_logprobs_equal_an_independent_log_softmax_of_the_stages_logits(export):
    """The log-probabilities the events carry are the log-softmax (temperature 1) of the last
    stage's logits after the mask: compared with the logits a want_logits run returns, for a greedy
    stream (top-k section) and a sampling one (chosen token from its logits)."""
    k = 4
    seen: list = []

    async def main():
        async with local(export) as c:
            run_step = c.path.run

            def recording(step):
                outcome = run_step(step)
                seen.append((step, outcome))
                return outcome

            c.path.run = recording
            greedy = await collect_events(c, ask(n=20, logprobs=k, want_logits=True))
            plain = await collect_events(c, ask(n=20, logprobs=k))
            sampled = await collect_events(c, ask(n=20, logprobs=k, temperature=1.0, seed=3, want_logits=True))
            free = await collect_events(c, ask(None, n=8, logprobs=0, ignore_eos=True))
            return greedy, plain, sampled, free

    greedy, plain, sampled, free = run(main())
    assert ids(plain) == ids(greedy) and [e.logprob for e in plain] == pytest.approx([e.logprob for e in greedy],
                                                                                      abs=1e-5)
    logits = [o.logits[-1].astype(np.float64) for s, o in seen if o.logits is not None]  # one answered row each
    for events, rows in ((greedy, logits[:len(greedy)]), (sampled, logits[len(greedy):])):
        assert len(rows) == len(events)
        for event, row in zip(events, rows, strict=True):
            logp = row - row.max() - np.log(np.exp(row - row.max()).sum())  # -inf where masked
            assert event.logprob == pytest.approx(logp[event.token_id], abs=1e-4)
            best = np.argsort(-logp, kind="stable")[:k]
            got = dict(event.top_logprobs)
            assert len(got) == min(k, int(np.isfinite(logp).sum()))
            for token, value in got.items():
                assert value == pytest.approx(logp[token], abs=1e-4) and np.isfinite(logp[token])
            assert min(got.values()) >= logp[best[len(got) - 1]] - 1e-4  # they are the k likeliest
    assert all(e.logprob is not None and e.logprob <= 0 and e.top_logprobs == () for e in free)


def test_preempted_and_replayed_constrained_streams_keep_their_answers(export, text):
    """A pool too small for every stream preempts the newest (they re-prefill later), and a
    failover replays every stream on a fresh pool: the grammar follows only emitted tokens, so
    each answer is its solo run's."""
    prompts = [PROMPT_IDS * 5, PROMPT_IDS[2:] * 6, PROMPT_IDS[::-1] * 5, PROMPT_IDS[5:] * 7]  # ~90 tokens
    requests = [ask(prompt=p) for p in prompts]

    async def solo():
        async with local(export) as c:
            return [ids(await collect_events(c, r)) for r in requests]

    async def crowded():
        async def same_path(path, reason):
            return path

        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=1 << 18, slots=4) as c:
            c.recover = same_path
            streams = [asyncio.ensure_future(collect_events(c, r)) for r in requests]
            while c.metrics()["tokens_generated_total"] < 12:
                await asyncio.sleep(0.01)
            c.request_failover("a test pulls the ring")
            out = [ids(await s) for s in streams]
            return out, c.metrics()

    expected = run(solo())
    got, metrics = run(crowded())
    assert got == expected
    assert metrics["sched_preemptions_total"] > 0 and metrics["failovers_total"] == 1
    for answer in got:
        jsonschema.validate(json.loads(text(answer)), SCHEMA)


def test_a_schema_that_does_not_compile_is_refused_before_the_stream_starts(export):
    async def main():
        async with local(export) as c:
            with pytest.raises(GrammarError, match="response_format.json_schema.schema"):
                await collect_events(c, ask(JsonConstraint('{"type": "nope"}', "bad", strict=True)))
            assert c.scheduler.idle
            return c.features

    assert run(main()) >= {"logprobs", "response_format", "forced_tool_call"}


def test_without_its_tokenizer_a_coordinator_serves_logprobs_only(export):
    async def main():
        async with local(export) as c:
            c.use_grammar(None)
            with pytest.raises(NoGrammarTokenizerError):
                await collect_events(c, ask())
            events = await collect_events(c, ask(None, n=3, logprobs=2))
            return c.features, events

    features, events = run(main())
    assert features == {"logprobs"} | PENALTY_FEATURES  # penalties need no tokenizer
    assert all(len(e.top_logprobs) == 2 for e in events)
