"""The last paged stage's answer under token masks and top-k requests: the pure functions against
independent numpy (a Python bit loop, a float64 log-softmax), then a real tiny model's two paged
stages with the step travelling between them as encoded frames: the masked top-1 lies in the mask
and is the best allowed token of the unmasked logits; the top-k are a log-softmax of those logits
after the mask; a mask of the wrong width is refused by the last stage; and the same over a ring of
real paged workers on loopback."""

from __future__ import annotations

import numpy as np
import pytest

from engine.paged.stage import LocalPagedPath, top1_reply
from engine.shards.step_answer import (
    TokenMaskError,
    answer_step,
    apply_mask,
    check_mask,
    mask_in_place,
    mask_words,
    top1,
    top_logprobs,
    unpack_mask,
)
from engine.shards.step_answer import (
    log_softmax as stage_log_softmax,
)
from engine.wire.codec import decode, encode
from engine.wire.format import ErrorCode, StreamId
from engine.wire.messages import Error, Step, StepReply
from engine.wire.step_plan import SCRATCH_BLOCKS, PlanRow, plan
from tests.support.asyncutil import run
from tests.worker.test_paged_worker import next_reply, paged_ring

BS = 32
POOL = 32
BUDGET = 1 << 30


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [n, V] -> packed uint32 [n, ceil(V/32)], one bit at a time (independent of unpack_mask)."""
    n, vocab = allowed.shape
    out = np.zeros((n, mask_words(vocab)), np.uint64)
    for r, t in zip(*np.nonzero(allowed), strict=True):
        out[r, t // 32] |= np.uint64(1) << np.uint64(t % 32)
    return out.astype("<u4")


def log_softmax(rows: np.ndarray) -> np.ndarray:
    x = rows.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def allowed_sets(rng: np.random.Generator, n: int, vocab: int, per_row: int) -> np.ndarray:
    allowed = np.zeros((n, vocab), bool)
    for r in range(n):
        allowed[r, rng.choice(vocab, per_row, replace=False)] = True
    return allowed


# --- pure --------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 49152])
def test_a_packed_mask_allows_token_t_by_bit_t_mod_32_of_word_t_div_32(vocab):
    rng = np.random.default_rng(vocab)
    allowed = rng.random((3, vocab)) < 0.4
    allowed[:, 0] = True
    mask = pack(allowed)
    assert mask.shape == (3, -(-vocab // 32))
    assert (unpack_mask(mask, vocab) == allowed).all()
    check_mask(mask, vocab)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    masked = apply_mask(logits, mask)
    assert masked.dtype == np.float32 and (masked[allowed] == logits[allowed]).all()
    assert np.isneginf(masked[~allowed]).all()


def test_a_mask_that_does_not_fit_the_vocabulary_is_refused():
    with pytest.raises(TokenMaskError, match="3 words per row; the last stage's vocabulary of 100 needs 4"):
        check_mask(np.ones((1, 3), "<u4"), 100, 7)
    check_mask(np.array([[1, 0, 0, 0b1111]], "<u4"), 100)  # tokens 96..99: the last ones that exist
    with pytest.raises(TokenMaskError, match="stream 7: its token mask allows a token id >= the vocabulary size 100"):
        check_mask(np.array([[1, 0, 0, 0b10000]], "<u4"), 100, 7)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_one_mask_row_applies_to_every_logits_row_of_any_float_width(dtype):
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((3, 70)).astype(dtype)
    allowed = rng.random((1, 70)) < 0.5
    want = np.where(allowed, rows, -np.inf)
    assert mask_in_place(rows, pack(allowed)[0]) is rows
    np.testing.assert_array_equal(rows, want)
    one = rows[1].copy()
    np.testing.assert_array_equal(mask_in_place(one, pack(allowed)[0]), want[1])


def test_the_shared_log_softmax_keeps_the_rows_precision_and_masked_tokens_at_minus_inf():
    rng = np.random.default_rng(6)
    rows = (rng.standard_normal((2, 1000)) * 4).astype(np.float64)
    rows[1, rng.random(1000) < 0.7] = -np.inf
    got = stage_log_softmax(rows)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, log_softmax(rows), rtol=1e-13, atol=0)
    assert (np.isneginf(got) == np.isneginf(rows)).all()
    single = stage_log_softmax(rows[0].astype(np.float32))
    assert single.dtype == np.float32
    np.testing.assert_allclose(single, log_softmax(rows[:1])[0], rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="no token is allowed"):
        stage_log_softmax(np.full((1, 8), -np.inf, np.float32))


def test_top_k_log_probabilities_are_a_log_softmax_best_first():
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((4, 500)) * 4).astype(np.float32)
    ids, logp = top_logprobs(rows, 20)
    want = log_softmax(rows)
    assert ids.tolist() == np.argsort(-want, axis=-1)[:, :20].tolist()
    np.testing.assert_allclose(logp, np.take_along_axis(want, ids, axis=-1), rtol=0, atol=2e-6)
    assert (np.diff(logp, axis=-1) <= 0).all()


@pytest.mark.parametrize("vocab", [1, 20, 63, 64, 65, 1000, 49152])
def test_top_k_finds_the_k_largest_whatever_the_ties_masks_and_widths(vocab):
    rng = np.random.default_rng(vocab)
    for trial in range(12):
        k = int(rng.integers(1, 21))
        rows = rng.integers(-3, 4, (3, vocab)).astype(np.float32) if trial % 2 else \
            rng.standard_normal((3, vocab)).astype(np.float32)  # odd trials: many ties
        allowed = rng.random((3, vocab)) < [[1.0], [0.3], [0.001]]  # none, some, nearly all refused
        allowed[:, int(rng.integers(vocab))] = True
        rows[~allowed] = -np.inf
        ids, logp = top_logprobs(rows, k)
        want = log_softmax(rows)
        for r in range(3):
            n = min(k, int(allowed[r].sum()))
            assert (ids[r, n:] == -1).all() and np.isneginf(logp[r, n:]).all()
            got = ids[r, :n]
            assert len(set(got.tolist())) == n and allowed[r, got].all()
            assert rows[r, got].tolist() == sorted(rows[r][allowed[r]].tolist(), reverse=True)[:n]
            np.testing.assert_allclose(logp[r, :n], want[r, got], rtol=0, atol=2e-6)


def test_a_row_allowing_fewer_tokens_than_asked_pads_with_minus_one():
    rows = np.full((1, 64), -np.inf, np.float32)
    rows[0, [3, 40]] = [1.0, 2.0]
    ids, logp = top_logprobs(rows, 4)
    assert ids.tolist() == [[40, 3, -1, -1]]
    np.testing.assert_allclose(logp[0, :2], np.log([np.e / (np.e + 1), 1 / (np.e + 1)]), rtol=1e-6)
    assert np.isneginf(logp[0, 2:]).all()


def test_the_answer_to_a_mixed_step_masks_picks_and_ranks_each_row_as_it_asked():
    """Rows: a masked decode asking the top 5 and its logits; an unmasked verify of 1+2 asking the top 2;
    a masked decode asking nothing; a plain decode. One step: R = 6, k = 5."""
    vocab = 300
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal((6, vocab)) * 3).astype(np.float32)
    raw = logits.copy()
    allowed = allowed_sets(rng, 6, vocab, 12)
    allowed[0] = False
    allowed[0, [7, 8, 9]] = True  # fewer allowed tokens than the 5 asked
    rows = [PlanRow(1, 0, 1, (4,), 1, want_logits=True, top_k=5, mask=pack(allowed[:1])),
            PlanRow(2, 0, 3, (5,), 3, top_k=2),
            PlanRow(3, 0, 1, (6,), 1, mask=pack(allowed[4:5])),
            PlanRow(4, 0, 1, (7,), 1)]
    the_plan = plan(BS, POOL, rows)
    answer = answer_step(logits, the_plan)
    masked = raw.copy()
    masked[0, ~allowed[0]] = -np.inf
    masked[4, ~allowed[4]] = -np.inf
    assert answer.ids.tolist() == masked.argmax(axis=-1).tolist()
    assert allowed[0, answer.ids[0]] and allowed[4, answer.ids[4]]
    want_lp = log_softmax(masked)
    np.testing.assert_allclose(answer.probs, np.exp(want_lp.max(axis=-1)), rtol=1e-6)
    assert answer.logits is not None and answer.logits.shape == (1, vocab)
    assert (answer.logits[0] == masked[0]).all()  # the logits a sampled stream gets are masked too
    assert answer.top_ids.shape == answer.top_logprobs.shape == (6, 5)
    assert answer.top_ids[0].tolist() == np.argsort(-masked[0])[:3].tolist() + [-1, -1]
    for r in (1, 2, 3):  # the verify's three answered rows: top 2, then padding
        assert answer.top_ids[r].tolist() == np.argsort(-raw[r])[:2].tolist() + [-1, -1, -1]
    assert (answer.top_ids[4:] == -1).all() and np.isneginf(answer.top_logprobs[4:]).all()
    finite = answer.top_ids >= 0
    np.testing.assert_allclose(answer.top_logprobs[finite],
                               np.take_along_axis(want_lp, np.maximum(answer.top_ids, 0), axis=-1)[finite],
                               rtol=0, atol=2e-6)
    reply = decode(encode(answer.reply(StreamId(3), 1, (1.0,))))
    assert isinstance(reply, StepReply) and reply.mismatch(the_plan) is None and reply.top_k == 5
    assert reply.top_ids.tolist() == answer.top_ids.tolist()


def test_an_unconstrained_step_answers_as_before():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    the_plan = plan(BS, POOL, [PlanRow(1, 0, 2, (4,), 2), PlanRow(2, 0, 1, (5,), want_logits=True)])
    ids, probs, kept = top1_reply(logits.copy(), the_plan)
    want_ids, want_probs = top1(logits)
    assert ids.tolist() == want_ids.tolist() and (probs == want_probs).all() and (kept == logits[2:]).all()
    assert answer_step(logits.copy(), the_plan).top_ids is None


# --- a real tiny model, two paged stages, the step as frames between them -------------------------


@pytest.fixture(scope="module")
def two_stages(tiny_export):
    return LocalPagedPath.load(tiny_export("llama", 2), POOL, BUDGET, exact=True).stages


def run_as_frames(stages, the_plan, ids: list[int]) -> tuple[np.ndarray, StepReply]:
    """Stage 0 on the ids, its Step encoded and decoded, the last stage on what arrived: (the last
    stage's logits [R, V], the decoded StepReply of its answer)."""
    tensor = np.zeros(the_plan.padded_tokens, np.int64)
    tensor[:len(ids)] = ids
    first = Step(StreamId(1), 0, the_plan, tensor)
    hop = decode(encode(first.passed_on(stages[0].run(first.plan, first.tensor), 1.0)))
    assert isinstance(hop, Step) and hop.plan == the_plan
    logits = stages[1].run(hop.plan, hop.tensor)
    raw = logits.copy()
    reply = decode(encode(answer_step(logits, hop.plan).reply(hop.session, hop.seq, (*hop.stage_ms, 1.0))))
    assert isinstance(reply, StepReply) and reply.mismatch(the_plan) is None
    return raw, reply


def test_a_masked_step_through_real_stages_picks_inside_the_mask_and_ranks_by_log_softmax(two_stages):
    vocab = two_stages[1].manifest.model.vocab_size
    rng = np.random.default_rng(17)
    prompts = [rng.integers(3, vocab, n).tolist() for n in (9, 4)]
    blocks = [(SCRATCH_BLOCKS,), (SCRATCH_BLOCKS + 1,)]
    rows = [PlanRow(1, 0, 9, blocks[0], 3, want_logits=True), PlanRow(2, 0, 4, blocks[1], 1, want_logits=True)]
    raw, plain = run_as_frames(two_stages, plan(BS, POOL, rows), prompts[0] + prompts[1])
    assert raw.shape == (4, vocab)
    allowed = allowed_sets(rng, 4, vocab, 6)
    allowed[0, raw[0].argmax()] = False  # the unconstrained pick is not allowed: the mask must change it
    masks = pack(allowed)
    rows = [PlanRow(1, 0, 9, blocks[0], 3, top_k=20, mask=masks[:3]),
            PlanRow(2, 0, 4, blocks[1], 1, want_logits=True, top_k=3, mask=masks[3:])]
    raw_again, reply = run_as_frames(two_stages, plan(BS, POOL, rows), prompts[0] + prompts[1])
    np.testing.assert_allclose(raw_again, raw, rtol=0, atol=1e-5)  # the same positions, rewritten
    masked = np.where(allowed, raw, -np.inf)
    assert allowed[np.arange(4), reply.ids].all()
    assert reply.ids.tolist() == masked.argmax(axis=-1).tolist() and reply.ids[0] != plain.ids[0]
    want = log_softmax(masked)
    np.testing.assert_allclose(np.log(reply.probs), want.max(axis=-1), rtol=0, atol=1e-5)
    assert reply.top_ids.shape == (4, 20)
    assert (reply.top_ids[:, 6:] == -1).all()  # six tokens allowed: the rest of the top 20 is padding
    assert (reply.top_ids[3, 3:] == -1).all()  # the second stream asked for 3
    assert reply.top_ids[:3, :6].tolist() == np.argsort(-want[:3], axis=-1)[:, :6].tolist()
    finite = reply.top_ids >= 0
    np.testing.assert_allclose(reply.top_logprobs[finite],
                               np.take_along_axis(want, np.maximum(reply.top_ids, 0), axis=-1)[finite],
                               rtol=0, atol=1e-5)
    assert reply.logits is not None and reply.logits.shape == (1, vocab)
    assert (np.isneginf(reply.logits[0]) == ~allowed[3]).all()


def test_the_last_stage_refuses_a_mask_built_for_another_vocabulary(two_stages):
    vocab = two_stages[1].manifest.model.vocab_size
    wrong = np.ones((1, mask_words(vocab) + 1), "<u4")
    the_plan = plan(BS, POOL, [PlanRow(1, 0, 2, (SCRATCH_BLOCKS,), 1, mask=wrong)])
    hidden = two_stages[0].run(the_plan, np.array([5, 6], np.int64))
    with pytest.raises(TokenMaskError, match=f"vocabulary of {vocab} needs {mask_words(vocab)}"):
        two_stages[1].run(the_plan, hidden)


def test_masks_cross_a_ring_of_real_paged_workers_and_a_wrong_width_fails_the_step(two_stages):
    """The Step's masks over loopback sockets to the last worker, whose reply picks inside them; a mask
    built for another vocabulary is a STREAM_FAILED naming the widths, and the ring keeps serving."""
    vocab = two_stages[1].manifest.model.vocab_size
    rng = np.random.default_rng(23)
    prompt = rng.integers(3, vocab, 6).tolist()
    unmasked = [PlanRow(1, 0, 6, (SCRATCH_BLOCKS,), 2, want_logits=True)]
    raw, _ = run_as_frames(two_stages, plan(BS, POOL, unmasked), prompt)
    allowed = allowed_sets(rng, 2, vocab, 4)
    masked = plan(BS, POOL, [PlanRow(1, 0, 6, (SCRATCH_BLOCKS,), 2, mask=pack(allowed))])
    wrong = plan(BS, POOL, [PlanRow(1, 0, 6, (SCRATCH_BLOCKS,), 2, mask=np.ones((2, mask_words(vocab) - 1), "<u4"))])
    ids = np.zeros(masked.padded_tokens, np.int64)
    ids[:6] = prompt

    async def main():
        async with paged_ring(two_stages) as (dial, replies, _):
            conn = await dial()
            got = []
            for seq, the_plan in enumerate((masked, wrong, masked)):
                await conn.async_send(Step(StreamId(5), seq, the_plan, ids))
                got.append(await next_reply(replies))
            return got

    first, refused, again = run(main(), 120)
    assert isinstance(first, StepReply) and isinstance(again, StepReply), (first, again)
    want = np.where(allowed, raw, -np.inf).argmax(axis=-1)
    assert first.ids.tolist() == again.ids.tolist() == want.tolist() and allowed[[0, 1], first.ids].all()
    assert isinstance(refused, Error) and (refused.code, refused.seq) == (ErrorCode.STREAM_FAILED, 1), refused
    assert f"needs {mask_words(vocab)} (ceil(V/32))" in refused.message
