"""The stateful runtime's constrained decoding and log-probabilities (issue 17): the stream policy
(engine.coordinator.scheduler) on real llguidance matchers over the tiny test tokenizer (512 logits),
with replies built here so the raw logits prefer tokens the grammar refuses, and drafts the
target rejects. tests/api/test_constrained_stateful.py runs the same code on the real model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.coordinator.constrained import GrammarVocabulary, grammar_for
from engine.coordinator.scheduler import StreamState, apply_reply, plan_step
from engine.errors import GenerationError
from engine.generation.grammar import unpack_mask
from engine.generation.request import FinishReason, GenerationRequest, JsonConstraint, SamplingParams
from engine.shards.step_path import StepResult
from engine.wire.format import StreamId

V = 512
EOS = 2
BOOL = JsonConstraint(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}), name="b", strict=True)


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory) -> GrammarVocabulary:
    from tests.support.tiny_models import build_tiny_tokenizer

    directory = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return GrammarVocabulary(directory / "tokenizer.json", V, (EOS,))


def matcher(vocabulary, constraint=BOOL):
    return vocabulary.load().matcher(grammar_for(constraint))


def allowed(m) -> np.ndarray:
    return unpack_mask(m.mask(), V)


def state_of(m, logprobs=None, temperature=0.0, max_new=60) -> StreamState:
    request = GenerationRequest((1, 5, 6), max_new, SamplingParams(temperature=temperature, seed=7), logprobs=logprobs)
    return StreamState(StreamId(1), request, 512, frozenset({EOS}), matcher=m)


def logits_preferring(rng, refused: np.ndarray, rows: int, favour: list[int | None]) -> np.ndarray:
    """float32 [rows, V] whose raw argmax is a refused token, with ``favour[i]`` (if given) the
    best token of row i among the others."""
    x = rng.standard_normal((rows, V)).astype(np.float32)
    for i in range(rows):
        x[i, np.flatnonzero(refused[i])[0]] = 50.0  # the raw top-1 is always refused
        if favour[i] is not None:
            x[i, favour[i]] = 20.0
    return x


def independent_log_softmax(row: np.ndarray, ok: np.ndarray) -> np.ndarray:
    x = np.where(ok, row.astype(np.float64), -np.inf)
    top = x[ok].max()
    return x - top - np.log(np.exp(x[ok] - top).sum())


def test_a_constrained_stream_asks_for_logits_and_picks_the_masked_top1_with_its_logprobs(vocabulary):
    rng = np.random.default_rng(0)
    state = state_of(matcher(vocabulary), logprobs=3)
    step = plan_step(state, 256)
    assert step.want_logits and state.masks is not None and state.masks.shape == (1, -(-V // 32))
    ok = unpack_mask(state.masks, V)
    raw = logits_preferring(rng, ~ok, 1, [None])
    (event,) = apply_reply(state, StepResult(step.stream_id, step.seq, logits=raw))
    assert ok[0, event.token_id] and event.token_id != int(raw[0].argmax())
    assert event.token_id == int(np.where(ok[0], raw[0], -np.inf).argmax())  # greedy over the allowed
    want = independent_log_softmax(raw[0], ok[0])
    assert event.logprob == pytest.approx(want[event.token_id], abs=1e-5)
    expected = sorted(np.flatnonzero(ok[0]), key=lambda t: -want[t])[:3]
    assert [t for t, _ in event.top_logprobs] == expected[:len(event.top_logprobs)]
    assert [lp for _, lp in event.top_logprobs] == pytest.approx([want[t] for t in expected[:len(event.top_logprobs)]],
                                                                 abs=1e-5)
    assert state.matcher.consumed == 1


def test_drafts_the_grammar_refuses_are_not_sent_and_a_rejected_draft_is_never_consumed(vocabulary):
    rng = np.random.default_rng(1)
    free = JsonConstraint()  # any JSON object: positions with many allowed tokens
    m, shadow = matcher(vocabulary, free), matcher(vocabulary, free)
    state = state_of(m)
    first = plan_step(state, 256)
    ok = unpack_mask(state.masks, V)
    (event,) = apply_reply(state, StepResult(first.stream_id, first.seq,
                                             logits=logits_preferring(rng, ~ok, 1, [None])))
    shadow.consume([event.token_id])
    # two drafts the grammar allows (the first allowed id at each position), then one it refuses
    d1 = int(np.flatnonzero(allowed(shadow))[0])
    shadow.consume([d1])
    d2_choices = np.flatnonzero(allowed(shadow))
    assert d2_choices.size >= 2, "the test needs a position with two allowed tokens"
    d2, other = int(d2_choices[0]), int(d2_choices[-1])
    shadow.consume([d2])
    refused = int(np.flatnonzero(~allowed(shadow))[0])
    shadow.rollback(2)
    step = plan_step(state, 256, (d1, d2, refused))
    assert state.draft == (d1, d2) and step.reply_last == 3 and state.masks.shape[0] == 3
    oks = unpack_mask(state.masks, V)
    # the target keeps d1, then prefers `other` over d2: d2 is rejected
    raw = logits_preferring(rng, ~oks, 3, [d1, other, None])
    events = apply_reply(state, StepResult(step.stream_id, step.seq, logits=raw))
    assert [e.token_id for e in events] == [d1, other]
    assert m.consumed == 3  # the first token, d1, and the target's own: never d2
    shadow.consume([d1, other])
    assert np.array_equal(m.mask(), shadow.mask())


def test_a_sampled_constrained_stream_stays_in_its_grammar_and_stops_when_it_is_complete(vocabulary):
    rng = np.random.default_rng(2)
    state = state_of(matcher(vocabulary), temperature=1.5, logprobs=0)
    tokens = []
    while state.finish is None:
        step = plan_step(state, 256)
        assert step.want_logits
        ok = unpack_mask(state.masks, V)
        raw = logits_preferring(rng, ~ok, 1, [None])
        for e in apply_reply(state, StepResult(step.stream_id, step.seq, logits=raw)):
            assert ok[0, e.token_id] and e.logprob <= 0 and e.top_logprobs == ()
            tokens.append(e.token_id)
    assert state.finish is FinishReason.STOP and tokens[-1] != EOS  # complete: no step spent on EOS
    text = vocabulary.load().text(tokens)
    assert json.loads(text)["ok"] in (True, False)


def test_a_reply_without_the_logits_it_asked_for_fails_the_stream(vocabulary):
    state = state_of(matcher(vocabulary), logprobs=2)
    step = plan_step(state, 256)
    with pytest.raises(GenerationError, match="without the logits"):
        apply_reply(state, StepResult(step.stream_id, step.seq, ids=np.zeros(1, np.int64),
                                      probs=np.ones(1, np.float32)))


def test_logprobs_without_a_grammar_are_the_raw_log_softmax_and_greedy_still_decides(vocabulary):
    rng = np.random.default_rng(3)
    state = state_of(None, logprobs=5)
    step = plan_step(state, 256)
    assert step.want_logits and state.masks is None
    raw = rng.standard_normal((1, V)).astype(np.float32)
    (event,) = apply_reply(state, StepResult(step.stream_id, step.seq, logits=raw))
    want = independent_log_softmax(raw[0], np.ones(V, bool))
    assert event.token_id == int(raw[0].argmax())
    assert event.logprob == pytest.approx(want.max(), abs=1e-5)
    assert [t for t, _ in event.top_logprobs] == list(np.argsort(-want)[:5])


@pytest.mark.slow  # two coordinators over the real export (~8 s)
def test_speculation_on_the_real_model_gives_the_same_constrained_answer_with_drafts_rejected(tiny_export):
    """The stateful coordinator over the tiny 2-stage export with prompt-lookup drafts: the prompt
    holds JSON of the schema's shape, so the drafter proposes continuations the grammar allows and
    the (masked) target often disagrees with; greedy speculation must still give exactly the
    answer of plain decoding, valid for the schema, with the same log-probabilities."""
    from engine.coordinator.coordinator import Coordinator
    from engine.coordinator.speculation import SpeculationConfig, Speculator
    from engine.generation.tokenizer import ChatTokenizer
    from engine.shards.manifest import load_manifest
    from tests.support.asyncutil import run

    export = tiny_export("llama", 2)
    examples = " ".join(json.dumps({"ok": ok, "n": n, "tag": tag}) for ok, n, tag in
                        ((True, 2, "red"), (False, 3, "blue"), (True, 1, "green"), (False, 2, "red")))
    prompt = tuple(ChatTokenizer(export / "tokenizer").encode(examples))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                               "tag": {"enum": ["red", "green", "blue"]}},
              "required": ["ok", "n", "tag"], "additionalProperties": False}
    request = GenerationRequest(prompt, 80, constraint=JsonConstraint(json.dumps(schema), "s", True),
                                logprobs=1)

    async def answer(speculation):
        async with Coordinator.local(export, exact=True, speculation=speculation) as c:
            events = [e async for e in c.stream(request)]
            return events, c.metrics()

    plain, _ = run(answer(None))
    drafted, metrics = run(answer(Speculator(SpeculationConfig("lookup", k=4), exact=True)))
    assert [e.token_id for e in drafted] == [e.token_id for e in plain]
    assert [e.logprob for e in drafted] == pytest.approx([e.logprob for e in plain], abs=1e-5)
    assert plain[-1].finish is FinishReason.STOP
    vocabulary = GrammarVocabulary.of_export(export, load_manifest(export))
    text = vocabulary.load().text([e.token_id for e in plain if e.token_id not in vocabulary.eos_ids])
    assert set(json.loads(text)) == {"ok", "n", "tag"}
    assert metrics["speculation_proposed_total"] > metrics["speculation_accepted_total"] > 0
