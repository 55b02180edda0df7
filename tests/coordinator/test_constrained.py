"""StreamConstraints, the paged coordinator's grammar and log-probability bookkeeping, on real
llguidance matchers over the tiny test model's tokenizer (512 logits). Steps and replies are built
here; tests/coordinator/test_constrained_decoding.py runs the same code on the real model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.generation.grammar import GrammarError, unpack_mask
from engine.generation.request import (
    FinishReason,
    FunctionSchema,
    GenerationRequest,
    JsonConstraint,
    SamplingParams,
    TokenEvent,
    ToolCallConstraint,
)
from engine.paged.constraints import GrammarVocabulary, StreamConstraints, grammar_for
from engine.paged.state import Emit, Failed, Finished
from engine.paged.step import PagedOutcome, PagedStep
from engine.wire.format import StreamId
from engine.wire.step_plan import PlanRow, StepPlan

V = 512
EOS = 2
BOOL_SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                          "additionalProperties": False})


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory) -> GrammarVocabulary:
    from tests.support.tiny_models import build_tiny_tokenizer

    directory = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return GrammarVocabulary(directory / "tokenizer.json", V, (EOS,))


@pytest.fixture(scope="module")
def text_of(vocabulary):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(vocabulary.tokenizer))
    return tok, lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def request(constraint=None, logprobs=None, temperature=0.0) -> GenerationRequest:
    return GenerationRequest((1, 5, 6), 50, SamplingParams(temperature=temperature, seed=3),
                             logprobs=logprobs, constraint=constraint)


def step_of(*rows: tuple[int, int, int], tokens=None) -> PagedStep:
    """rows of (stream id, new tokens, sample); every stream starts at position 0."""
    plan_rows, block = [], 4
    for sid, n, sample in rows:
        need = -(-n // 32)
        plan_rows.append(PlanRow(sid, 0, n, tuple(range(block, block + need)), sample))
        block += need
    plan = StepPlan(32, 64, tuple(plan_rows))
    ids = np.asarray(tokens if tokens is not None else [7] * plan.tokens, dtype=np.int64)
    return PagedStep(1, plan, ids)


def test_constraints_compile_to_grammars_and_bad_ones_name_the_field():
    assert "json_object" in grammar_for(JsonConstraint()).description
    assert "'person'" in grammar_for(JsonConstraint(BOOL_SCHEMA, "person", strict=True)).description
    call = grammar_for(ToolCallConstraint((FunctionSchema("get_weather", '{"type":"object"}'),)))
    assert "get_weather" in call.description
    with pytest.raises(GrammarError, match="response_format.json_schema.schema"):
        grammar_for(JsonConstraint('{"type": "no-such-type"}', "x", strict=True))
    with pytest.raises(GrammarError, match="'f'"):
        grammar_for(ToolCallConstraint((FunctionSchema("f", '{"type": 7}'),)))


def test_annotate_puts_masks_and_top_k_on_answered_rows_only(vocabulary, text_of):
    tok, _ = text_of
    book = StreamConstraints(vocabulary)
    book.track(StreamId(1), request(JsonConstraint()), book.build_matcher(JsonConstraint()))
    book.track(StreamId(2), request(JsonConstraint(), logprobs=3), book.build_matcher(JsonConstraint()))
    book.track(StreamId(3), request(logprobs=0), None)
    book.track(StreamId(4), request(), None)  # neither: not followed
    brace, quote = tok.token_to_id("{"), tok.token_to_id('"')
    # stream 2 verifies 2 drafts: '{' '"' (fed after its last token 9)
    step = step_of((1, 3, 1), (2, 3, 3), (3, 2, 1), (4, 5, 0), (5, 1, 1),
                   tokens=[7, 7, 7, 9, brace, quote, 7, 7, 7, 7, 7, 7, 7, 7])
    out = book.annotate(step).plan.rows
    assert [r.top_k for r in out] == [0, 3, 1, 0, 0]
    assert out[3] is step.plan.rows[3] and out[4] is step.plan.rows[4]
    assert out[2].mask is None and out[0].mask.shape == (1, 16) and out[1].mask.shape == (3, 16)
    first = unpack_mask(out[0].mask[0], V)
    assert first[brace] and not first[EOS]  # an object starts with '{'
    m2 = book.matcher(StreamId(2))
    assert m2.consumed == 0  # draft masks never advance the matcher
    m2.consume([brace])
    assert np.array_equal(out[1].mask[1], m2.mask())
    m2.consume([quote])
    assert np.array_equal(out[1].mask[2], m2.mask())


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(vocabulary, text_of):
    tok, _ = text_of
    book = StreamConstraints(vocabulary)
    book.track(StreamId(1), request(JsonConstraint()), book.build_matcher(JsonConstraint()))
    book.track(StreamId(2), request(logprobs=1), None)
    brace, quote, letter, close = (tok.token_to_id(t) for t in ("{", '"', "a", "}"))
    assert book.allowed_drafts(StreamId(1), [brace, quote, letter, quote, close, quote]) == 4  # '{"a"' then no ':'
    assert book.allowed_drafts(StreamId(1), [letter, brace]) == 0
    assert book.allowed_drafts(StreamId(2), [letter, brace]) == 2 and book.allowed_drafts(StreamId(3), [7]) == 1
    assert book.matcher(StreamId(1)).consumed == 0


def test_settle_consumes_emitted_tokens_adds_logprobs_and_ends_a_stopped_grammar(vocabulary, text_of):
    tok, decode = text_of
    book = StreamConstraints(vocabulary)
    constraint = JsonConstraint(BOOL_SCHEMA, "flag", strict=True)
    book.track(StreamId(1), request(constraint, logprobs=2), book.build_matcher(constraint))
    target = tok.encode('{"ok": true}').ids
    matcher = book.matcher(StreamId(1))
    for i, token in enumerate(target):  # one decode step per token, as a greedy stream's
        step = book.annotate(step_of((1, 1, 1)))
        assert unpack_mask(step.plan.rows[0].mask[0], V)[token]
        top_ids = np.array([[token, 0 if token else 1]], np.int64)
        outcome = PagedOutcome(1, np.array([token], np.int64), np.array([0.9], np.float32),
                               top_ids=top_ids, top_logprobs=np.array([[-0.1, -2.5]], np.float32))
        settled = book.settle(step.plan, outcome, [Emit(StreamId(1), TokenEvent(token, i, 0.9))])
        (emit,) = [a for a in settled.actions if isinstance(a, Emit)]
        assert emit.event.logprob == pytest.approx(-0.1)
        assert emit.event.top_logprobs == ((token, pytest.approx(-0.1)), (int(top_ids[0, 1]), pytest.approx(-2.5)))
        last = i == len(target) - 1
        assert (emit.event.finish is FinishReason.STOP) == last
        assert settled.ended == ({StreamId(1): Finished(StreamId(1), FinishReason.STOP)} if last else {})
    assert matcher.is_stopped and decode(target) == '{"ok": true}'


def test_settle_takes_only_the_emitted_tokens_of_a_verify(vocabulary, text_of):
    """Of two drafts the target keeps one and corrects the second: the matcher follows the two
    emitted tokens, never the rejected draft."""
    tok, _ = text_of
    book = StreamConstraints(vocabulary)
    book.track(StreamId(1), request(JsonConstraint()), book.build_matcher(JsonConstraint()))
    brace, quote, close = tok.token_to_id("{"), tok.token_to_id('"'), tok.token_to_id("}")
    step = book.annotate(step_of((1, 3, 3), tokens=[5, brace, quote]))
    emits = [Emit(StreamId(1), TokenEvent(brace, 0)), Emit(StreamId(1), TokenEvent(close, 1))]
    outcome = PagedOutcome(1, np.array([brace, close, 0], np.int64), np.ones(3, np.float32))
    settled = book.settle(step.plan, outcome, emits)
    matcher = book.matcher(StreamId(1))
    assert matcher.consumed == 2 and matcher.is_stopped  # '{}' is a whole object
    assert [a.event.finish for a in settled.actions] == [None, FinishReason.STOP]
    assert StreamId(1) in settled.ended


def test_settle_fails_a_stream_whose_token_the_grammar_refuses(vocabulary, text_of):
    tok, _ = text_of
    book = StreamConstraints(vocabulary)
    book.track(StreamId(1), request(JsonConstraint()), book.build_matcher(JsonConstraint()))
    step = book.annotate(step_of((1, 1, 1)))
    bad = tok.token_to_id("a")
    outcome = PagedOutcome(1, np.array([bad], np.int64), np.ones(1, np.float32))
    settled = book.settle(step.plan, outcome, [Emit(StreamId(1), TokenEvent(bad, 0))])
    assert settled.actions == []
    (failed,) = settled.ended.values()
    assert isinstance(failed, Failed) and "does not allow" in str(failed.error)
    assert book.matcher(StreamId(1)).consumed == 0


def test_a_sampling_streams_logprob_comes_from_its_masked_logits(vocabulary):
    book = StreamConstraints(vocabulary)
    book.track(StreamId(1), request(logprobs=0, temperature=1.0), None)
    plan_row = PlanRow(1, 0, 1, (4,), 1, want_logits=True)
    step = book.annotate(PagedStep(1, StepPlan(32, 64, (plan_row,)), np.array([5], np.int64)))
    assert step.plan.rows[0].top_k == 0  # the logits hold the chosen token's probability
    logits = np.random.default_rng(1).normal(size=(1, V)).astype(np.float32)
    outcome = PagedOutcome(1, np.array([int(logits.argmax())], np.int64), np.ones(1, np.float32), logits)
    settled = book.settle(step.plan, outcome, [Emit(StreamId(1), TokenEvent(17, 0, 0.01))])
    x = logits[0].astype(np.float64)
    assert settled.actions[0].event.logprob == pytest.approx(x[17] - np.log(np.exp(x).sum()), abs=1e-9)
    assert settled.actions[0].event.top_logprobs == ()


def test_a_reply_without_the_asked_top_k_fails_the_stream_by_name(vocabulary):
    book = StreamConstraints(vocabulary)
    book.track(StreamId(1), request(logprobs=2), None)
    step = book.annotate(step_of((1, 1, 1)))
    outcome = PagedOutcome(1, np.array([5], np.int64), np.ones(1, np.float32))
    settled = book.settle(step.plan, outcome, [Emit(StreamId(1), TokenEvent(5, 0))])
    assert "top-k" in str(settled.ended[StreamId(1)].error)


def test_without_a_tokenizer_logprobs_are_served_and_constraints_refused():
    from engine.paged.constraints import NoGrammarTokenizerError

    book = StreamConstraints(None)
    assert book.features == {"logprobs"}
    with pytest.raises(NoGrammarTokenizerError, match="tokenizer.json"):
        book.build_matcher(JsonConstraint())


def test_masks_are_computed_off_the_loop_and_a_stream_over_the_mask_budget_fails_by_name(vocabulary):
    """The step's masks on the ring's mask thread (issue 29, M5); a budget no mask meets ends the
    stream at its reply with the budget named, while the row still goes masked."""
    import asyncio
    import threading

    from engine.generation.grammar_pool import GrammarBudget, use_grammar_budget

    book = StreamConstraints(vocabulary)
    matcher = book.build_matcher(JsonConstraint())
    book.track(StreamId(1), request(JsonConstraint()), matcher)
    threads: list[str] = []
    mask = matcher.mask

    def spy():
        threads.append(threading.current_thread().name)
        return mask()

    matcher.mask = spy  # type: ignore[method-assign]
    use_grammar_budget(GrammarBudget(mask_budget_s=1e-9))
    try:
        step = asyncio.run(book.async_annotate(step_of((1, 1, 1))))
    finally:
        use_grammar_budget(GrammarBudget())
        book.close_mask_thread()
    assert threads and threads[0].startswith("deskfleet-masks")
    assert step.plan.rows[0].mask is not None
    brace = int(np.flatnonzero(unpack_mask(step.plan.rows[0].mask[0], V))[0])
    outcome = PagedOutcome(1, np.array([brace], np.int64), np.ones(1, np.float32))
    settled = book.settle(step.plan, outcome, [Emit(StreamId(1), TokenEvent(brace, 0))])
    (failed,) = settled.ended.values()
    assert isinstance(failed, Failed) and "per-step mask budget of 1e-09 s" in str(failed.error)
