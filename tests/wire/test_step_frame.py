"""The paged path's step frame (protocol version 4): Step and StepReply round trip for many plans (token
masks and top-k requests included), and every field rule is refused with FrameError, from the
constructor and from hand-built bytes.

Frames are built here from the layout tables of docs/PROTOCOL.md ("Step", "StepReply"), not with the
codec's own structs, so a codec that drifted from the document fails these tests.
"""

from __future__ import annotations

import struct
from dataclasses import fields

import numpy as np
import pytest

from engine.errors import GenerationError
from engine.wire.codec import decode, decode_header, encode
from engine.wire.format import (
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    PROTOCOL_VERSION,
    DType,
    FrameError,
    FrameKind,
    StreamId,
)
from engine.wire.messages import Step, StepReply
from engine.wire.step_codec import step_frame_bound, step_reply_bound
from engine.wire.step_plan import PlanRow, StepPlan, plan
from tests.wire.wire_helpers import (
    CONSTRAINED_MASK,
    CONSTRAINED_PLAN,
    STEP_PLAN,
    assert_same,
    patch_header,
    random_plan,
    random_step,
    random_step_reply,
    step,
    step_reply,
)

# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_steps_and_replies_round_trip_canonically(seed):
    rng = np.random.default_rng(seed)
    the_plan = random_plan(rng, rows=seed % 8 + 1)
    for msg in (random_step(rng, the_plan), random_step_reply(rng, the_plan)):
        frame = encode(msg)
        back = decode(frame)
        assert_same(back, msg)
        assert encode(back) == frame
    assert decode(encode(random_step(rng, the_plan))).plan == the_plan  # StepPlan equality, rows and all


def test_a_step_of_every_row_kind_keeps_its_plan():
    msg = step(dtype=np.float16, stage_ms=(0.5, 12.25))
    back = decode(encode(msg))
    assert isinstance(back, Step) and back.plan == STEP_PLAN
    assert back.tensor.dtype == np.float16 and back.tensor.shape == (32, 8)
    assert back.stage_ms == (0.5, 12.25)
    assert [r.new_tokens for r in back.plan.rows] == [24, 1, 4] and back.plan.copies == ((6, 10),)
    assert back.plan.sampled_indices() == [23, 24, 25, 26, 27, 28]


def test_stage_times_are_carried_as_float32_and_appended_by_each_stage():
    first = step(hidden=False, stage_ms=())
    hidden = np.ones((first.plan.padded_tokens, 8), np.float32)
    second = first.passed_on(hidden, 0.1).passed_on(hidden, 2.5)
    assert second.stage_ms == (float(np.float32(0.1)), 2.5)  # normalised: a message round trips exactly
    assert decode(encode(second)).stage_ms == second.stage_ms
    assert (second.session, second.seq, second.plan) == (first.session, first.seq, first.plan)


def test_a_reply_without_logits_has_no_payload():
    frame = encode(step_reply(logits=False))
    header = decode_header(frame[:HEADER_SIZE])
    assert (header.dtype, header.shape, header.payload_len) == (DType.NONE, (), 0)
    empty = decode(encode(StepReply(StreamId(1), 0, np.zeros(0, np.int64), np.zeros(0, np.float32))))
    assert isinstance(empty, StepReply) and empty.ids.shape == (0,) and empty.logits is None


def test_a_reply_says_whether_it_answers_a_plan():
    assert step_reply().mismatch(STEP_PLAN) is None
    assert "with 6 rows, 0 rows of logits and top-0; its plan asks for 6, 1 and top-0" in \
        step_reply(logits=False).mismatch(STEP_PLAN)
    fewer = StepReply(StreamId(1), 0, np.zeros(5, np.int64), np.zeros(5, np.float32), np.zeros((1, 3), np.float32))
    assert "asks for 6, 1 and top-0" in fewer.mismatch(STEP_PLAN)
    no_top = StepReply(StreamId(1), 0, np.zeros(5, np.int64), np.zeros(5, np.float32), np.zeros((1, 3), np.float32))
    assert "top-0; its plan asks for 5, 1 and top-5" in no_top.mismatch(CONSTRAINED_PLAN)


def test_a_constrained_step_carries_its_masks_and_top_k():
    back = decode(encode(step(plan=CONSTRAINED_PLAN, hidden=False)))
    assert back.plan == CONSTRAINED_PLAN
    rows = back.plan.rows
    assert [r.top_k for r in rows] == [5, 2, 0] and back.plan.top_k == 5
    assert rows[0].mask.tolist() == CONSTRAINED_MASK.tolist() and rows[1].mask.shape == (3, 3) and rows[2].mask is None
    assert (back.plan.mask_words, back.plan.mask_rows) == (3, 4)
    changed = PlanRow(21, 7, 1, (4,), 1, top_k=5, mask=np.array([[0b1011, 0, 1 << 30]], "<u4"))
    assert changed != CONSTRAINED_PLAN.rows[0] and hash(changed) == hash(CONSTRAINED_PLAN.rows[0])


def test_the_mask_costs_a_bit_per_token_of_each_answered_row():
    """8 decoding streams under a 49,152-token mask: 6 KiB of mask each on top of the unmasked frame."""
    words = 49152 // 32
    rows = [PlanRow(i + 1, 100, 1, (4 + 4 * i, 5 + 4 * i, 6 + 4 * i, 7 + 4 * i)) for i in range(8)]
    plain = StepPlan(32, 64, tuple(rows))
    masked = StepPlan(32, 64, tuple(PlanRow(r.stream_id, r.past_len, 1, r.blocks, mask=np.ones((1, words), "<u4"))
                                    for r in rows))
    tensor = np.zeros((8, 64), np.float32)
    assert len(encode(Step(StreamId(1), 0, masked, tensor))) - len(encode(Step(StreamId(1), 0, plain, tensor))) \
        == 8 * 4 * words


def test_frame_bounds_are_the_largest_legitimate_frames():
    rows, blocks_per_row, hidden = 8, 16, 64
    the_plan = StepPlan(16, 4096, tuple(PlanRow(i + 1, 16 * blocks_per_row - 64, 64, tuple(
        range(4 + i * blocks_per_row, 4 + (i + 1) * blocks_per_row))) for i in range(rows)),
        copies=tuple((4000 + i, 4010 + i) for i in range(rows)), padded_tokens=512)
    msg = Step(StreamId(1), 0, the_plan, np.zeros((512, hidden), np.float32), (1.0,) * 256)
    assert len(encode(msg)) == step_frame_bound(hidden, 512, rows, rows * blocks_per_row)
    masked = StepPlan(16, 4096, tuple(PlanRow(r.stream_id, r.past_len, 64, r.blocks, 64,
                                              mask=np.ones((64, 157), "<u4")) for r in the_plan.rows),
                      copies=the_plan.copies, padded_tokens=512)
    msg = Step(StreamId(1), 0, masked, np.zeros((512, hidden), np.float32), (1.0,) * 256)
    assert len(encode(msg)) == step_frame_bound(hidden, 512, rows, rows * blocks_per_row, vocab_size=5000)
    reply = StepReply(StreamId(1), 0, np.zeros(8, np.int64), np.zeros(8, np.float32),
                      np.zeros((8, 5000), np.float32), (1.0,) * 256)
    assert len(encode(reply)) == step_reply_bound(5000, 8, 8, top_k=0)
    top = StepReply(StreamId(1), 0, np.zeros(8, np.int64), np.zeros(8, np.float32),
                    np.zeros((8, 5000), np.float32), (1.0,) * 256, np.zeros((8, 20), np.int64),
                    np.zeros((8, 20), np.float32))
    assert len(encode(top)) == step_reply_bound(5000, 8, 8)  # by default, room for the top 20 of every row
    assert step_frame_bound(16, 1, 1, 1) == 64 * 1024  # never below the smallest bound a node may announce
    # counts beyond what one frame may carry are clipped: 4096 rows, 4 Mi block ids, 65536 tokens
    assert step_frame_bound(64, 10**6, 10**6, 10**9) == step_frame_bound(64, 65536, 4096, 1 << 22)
    assert step_frame_bound(64, 65536, 4096, (1 << 22) - 1) == step_frame_bound(64, 65536, 4096, 1 << 22) - 4
    assert step_reply_bound(10, 10**6, 10**6) == step_reply_bound(10, 65536, 65536)
    assert step_reply_bound(10, 100, 10**6) == step_reply_bound(10, 100, 100)  # logit rows are answered rows


# --- field rules, from the constructor -----------------------------------------------------------


def unchecked_plan(**changes) -> StepPlan:
    """STEP_PLAN with ``changes``, built without StepPlan's own checks (as a bug or a hand-made
    object could): Step must refuse it with FrameError all the same."""
    bad = object.__new__(StepPlan)
    for f in fields(StepPlan):
        object.__setattr__(bad, f.name, changes.get(f.name, getattr(STEP_PLAN, f.name)))
    return bad


def rows_with(index: int, **changes) -> tuple[PlanRow, ...]:
    """STEP_PLAN's rows with row ``index`` changed (PlanRow itself checks nothing at init)."""
    rows = list(STEP_PLAN.rows)
    values = {f.name: getattr(rows[index], f.name) for f in fields(PlanRow)} | changes
    rows[index] = PlanRow(**values)
    return tuple(rows)


def step_of(the_plan=STEP_PLAN, tensor=None, stage_ms=(), session=1, seq=0) -> Step:
    tensor = np.zeros((32, 4), np.float32) if tensor is None else tensor
    return Step(StreamId(session), seq, the_plan, tensor, stage_ms)


STEP_FIELD_CASES = [
    (lambda: step_of(session=0), "session|stream_id must be >= 1"),
    (lambda: step_of(seq=-1), "seq"),
    (lambda: step_of(seq=2**64), "seq"),
    (lambda: step_of(the_plan="plan"), "must be a StepPlan"),
    (lambda: step_of(tensor=np.zeros((32, 4), np.int32)), "astype"),
    (lambda: step_of(tensor=np.zeros((32, 4), ">f4")), "astype"),
    (lambda: step_of(tensor=np.zeros((31, 4), np.float32)), "Tb = 32"),
    (lambda: step_of(tensor=np.zeros(32, np.float32)), r"hidden states \[Tb, H\]"),
    (lambda: step_of(tensor=np.zeros((32, 1), np.int64)), r"token ids \[Tb\]"),
    (lambda: step_of(tensor=np.full(32, -1, np.int64)), "token ids must be >= 0"),
    (lambda: step_of(tensor=[0] * 32), "numpy array"),
    (lambda: step_of(stage_ms=(float("nan"),)), "finite"),
    (lambda: step_of(stage_ms=(-1.0,)), "non-negative"),
    (lambda: step_of(stage_ms=(1e39,)), "float32"),
    (lambda: step_of(stage_ms=("1.0",)), "times in ms"),
    (lambda: step_of(stage_ms=(True,)), "times in ms"),
    (lambda: step_of(stage_ms=(1.0,) * 257), "at most 256"),
    (lambda: step_of(stage_ms=1.0), "times in ms"),
    (lambda: step_of(unchecked_plan(token_budget=2**32)), "token_budget"),
    (lambda: step_of(unchecked_plan(token_budget=-1)), "token_budget"),
    (lambda: step_of(unchecked_plan(block_size=32.0)), "integers"),
    (lambda: step_of(unchecked_plan(rows=list(STEP_PLAN.rows))), "tuple of PlanRow"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, blocks=(4.0, 5)))), "must hold integers"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, blocks=[4, 5]))), "must hold integers"),
    (lambda: step_of(unchecked_plan(rows=rows_with(1, want_logits=1))), "must hold integers"),
    (lambda: step_of(unchecked_plan(copies=((6, 10, 11),))), "integer pairs"),
    (lambda: step_of(unchecked_plan(copies=((6, 10),) * 65536)), "at most 65535"),
    # StepPlan's and PlanRow's own rules, bypassed at the plan's construction: still a FrameError
    (lambda: step_of(unchecked_plan(block_size=8)), "Step plan: block size 8"),
    (lambda: step_of(unchecked_plan(pool_blocks=4)), "Step plan: a pool of 4 blocks"),
    (lambda: step_of(unchecked_plan(rows=())), "Step plan: a step has 1.."),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, top_k=21))), "top 21 tokens; top_k is 0..20"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, top_k=-1))), "top -1 tokens"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, sample=0, top_k=3))), "top 3 tokens of no row"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, mask=True))), "a numpy mask or None"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, mask=np.ones((1, 3), np.int32)))), "little-endian uint32"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, mask=np.ones((1, 3), ">u4")))), "little-endian uint32"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, mask=np.ones(3, "<u4")))), "2-dim"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, sample=0, mask=np.ones((1, 3), "<u4")))), "mask for no row"),
    (lambda: step_of(unchecked_plan(rows=rows_with(2, mask=np.ones((3, 3), "<u4")))), r"\[sample=4, W\]"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, mask=np.ones((1, 2**15 + 1), "<u4")))), "W = ceil"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, mask=np.array([[0, 0]], "<u4")))), "allows no token"),
    (lambda: step_of(unchecked_plan(rows=(rows_with(1, mask=np.ones((1, 3), "<u4"))[:2]
                                          + rows_with(2, mask=np.ones((4, 2), "<u4"))[2:]))), "one width"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, blocks=(4,)))), "need 2 blocks"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, blocks=(4, 4)))), "lists a block twice"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, blocks=(0, 5)))), "outside the pool"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, blocks=(4, 64)))), "outside the pool"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, stream_id=0))), "stream ids are 1"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, stream_id=12))), "one stream twice"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, sample=25))), "sample 25"),
    (lambda: step_of(unchecked_plan(rows=rows_with(0, sample=0, want_logits=True))), "logits for no row"),
    (lambda: step_of(unchecked_plan(copies=((6, 6),))), "onto itself"),
    (lambda: step_of(unchecked_plan(copies=((6, 64),))), "outside the pool"),
    (lambda: step_of(unchecked_plan(padded_tokens=28)), "cannot be padded"),
    (lambda: step_of(unchecked_plan(padded_tokens=29 + 129), np.zeros((158, 4), np.float32)), "cannot be padded"),
]


@pytest.mark.parametrize(("build", "words"), STEP_FIELD_CASES, ids=[w for _, w in STEP_FIELD_CASES])
def test_step_field_rule_is_refused_by_the_constructor(build, words):
    with pytest.raises(FrameError, match=words):
        build()


def reply_of(ids=(5, 6), probs=(0.5, 1.0), logits=None, stage_ms=(), top_ids=None, top_logprobs=None):
    ids = np.array(ids, np.int64) if isinstance(ids, tuple) else ids
    probs = np.array(probs, np.float32) if isinstance(probs, tuple) else probs
    return StepReply(StreamId(1), 0, ids, probs, logits, stage_ms, top_ids, top_logprobs)


REPLY_FIELD_CASES = [
    (lambda: StepReply(StreamId(0), 0, np.zeros(0, np.int64), np.zeros(0, np.float32)), "stream_id must be >= 1"),
    (lambda: reply_of(ids=np.array([5, 6], np.int32)), "StepReply.ids must be a 1-dim int64"),
    (lambda: reply_of(ids=np.array([[5, 6]], np.int64), probs=np.array([[0.5, 0.5]], np.float32)), "1-dim"),
    (lambda: reply_of(probs=np.array([0.5, 1.0], np.float64)), "StepReply.probs must be a 1-dim float32"),
    (lambda: reply_of(probs=(0.5,)), "must match ids"),
    (lambda: reply_of(ids=(5, -6)), "ids must be >= 0"),
    (lambda: reply_of(probs=(0.5, 1.5)), r"\[0, 1\]"),
    (lambda: reply_of(probs=(0.5, float("nan"))), r"\[0, 1\]"),
    (lambda: reply_of(ids=np.zeros(65537, np.int64), probs=np.zeros(65537, np.float32)), "at most 65536"),
    (lambda: reply_of(logits=np.zeros((2, 4), np.float16)), "astype"),
    (lambda: reply_of(logits=np.zeros(4, np.float32)), "2 dims"),
    (lambda: reply_of(logits=np.zeros((3, 4), np.float32)), "more than the 2 answered rows"),
    (lambda: reply_of(logits=np.zeros((0, 4), np.float32)), "every dim"),
    (lambda: reply_of(stage_ms=(-0.5,)), "non-negative"),
    (lambda: reply_of(stage_ms=[1.0] * 257), "at most 256"),
    (lambda: reply_of(top_ids=np.zeros((2, 1), np.int64)), "come together"),
    (lambda: reply_of(top_logprobs=np.zeros((2, 1), np.float32)), "come together"),
    (lambda: reply_of(top_ids=np.zeros((2, 1), np.int32), top_logprobs=np.zeros((2, 1), np.float32)), "astype"),
    (lambda: reply_of(top_ids=np.zeros((2, 1), np.int64), top_logprobs=np.zeros((2, 1), np.float64)), "astype"),
    (lambda: reply_of(top_ids=np.zeros(2, np.int64), top_logprobs=np.zeros(2, np.float32)), "2 dims"),
    (lambda: reply_of(top_ids=np.zeros((1, 2), np.int64), top_logprobs=np.zeros((1, 2), np.float32)), r"\[R=2, k\]"),
    (lambda: reply_of(top_ids=np.zeros((2, 2), np.int64), top_logprobs=np.zeros((2, 1), np.float32)), r"\[R=2, k\]"),
    (lambda: reply_of(top_ids=np.zeros((2, 21), np.int64), top_logprobs=np.zeros((2, 21), np.float32)), "1..20"),
    (lambda: reply_of(top_ids=np.full((2, 1), -2, np.int64), top_logprobs=np.zeros((2, 1), np.float32)), ">= 0, or -1"),
    (lambda: reply_of(top_ids=np.zeros((2, 1), np.int64), top_logprobs=np.full((2, 1), 0.5, np.float32)), "<= 0"),
    (lambda: reply_of(top_ids=np.zeros((2, 1), np.int64), top_logprobs=np.full((2, 1), np.nan, np.float32)), "<= 0"),
    (lambda: reply_of(top_ids=np.full((2, 1), -1, np.int64), top_logprobs=np.zeros((2, 1), np.float32)),
     "-inf exactly where"),
    (lambda: reply_of(top_ids=np.zeros((2, 1), np.int64), top_logprobs=np.full((2, 1), -np.inf, np.float32)),
     "-inf exactly where"),
]


@pytest.mark.parametrize(("build", "words"), REPLY_FIELD_CASES, ids=[w for _, w in REPLY_FIELD_CASES])
def test_step_reply_field_rule_is_refused_by_the_constructor(build, words):
    with pytest.raises(FrameError, match=words):
        build()


def test_a_bad_plan_is_a_generation_error_where_it_is_built():
    """StepPlan keeps its own error type for the scheduler; only the wire turns it into FrameError."""
    with pytest.raises(GenerationError, match="top_k is 0..20"):
        plan(32, 64, [PlanRow(1, 0, 1, (4,), top_k=21)])


# --- field rules, from bytes built after docs/PROTOCOL.md -------------------------------------------

# The plan of the raw frames: two rows (a prefill chunk of 3 over 30 cached, answered; a decode that
# wants logits), one copy; T = 4, Tb = 4; hidden states float32 [4, 2].
ROWS = [[7, 30, 3, 2, 1, 0, 0, 0], [9, 5, 1, 1, 1, 1, 0, 0]]
BLOCKS = [4, 5, 6]


def raw_frame(kind, meta, payload=b"", *, dtype=DType.NONE, shape=(), stream=1, seq=0, flags=0):
    dims = list(shape) + [0] * (4 - len(shape))
    head = HEADER_STRUCT.pack(MAGIC, PROTOCOL_VERSION, kind, flags, stream, seq, dtype, len(shape), 0, *dims,
                              len(meta), len(payload))
    return head + meta + payload


def raw_step(*, block_size=32, rows=None, copies=((8, 9),), times=(1.5,), pool=64, tokens=None, padded=4,
             budget=256, flags=0, words=0, table=ROWS, blocks=BLOCKS, counts=None, tensor=None, masks=(),
             extra=b""):
    """A Step frame: the fixed fields (block_size u16, S u16, C u16, n u16, pool u32, T u32, Tb u32,
    budget u32, flags u32, mask words W u32), the u64 row table [S, 8], int32 block ids, int32 copies
    [C, 2], float32 stage times [n], u32 masks [M, W]; ``rows``/``counts`` override what the fixed
    fields say."""
    tensor = np.zeros((4, 2), np.float32) if tensor is None else tensor
    table = np.array(table, "<u8").reshape(-1, 8)
    tokens = int(table[:, 2].sum()) if tokens is None else tokens
    fixed = struct.pack("<HHHHIIIIII", block_size, len(table) if rows is None else rows,
                        len(copies) if counts is None else counts, len(times), pool, tokens, padded, budget,
                        flags, words)
    meta = (fixed + table.tobytes() + np.array(blocks, "<i4").tobytes()
            + np.array(copies, "<i4").reshape(-1, 2).tobytes() + np.array(times, "<f4").tobytes()
            + np.array(masks, "<u4").tobytes() + extra)
    code = {np.dtype("<i8"): DType.INT64, np.dtype("<f4"): DType.FLOAT32, np.dtype("<f2"): DType.FLOAT16}
    return raw_frame(FrameKind.STEP, meta, tensor.tobytes(), dtype=code[tensor.dtype], shape=tensor.shape)


def row(index, column, value):
    """ROWS with one cell changed."""
    table = [list(r) for r in ROWS]
    table[index][column] = value
    return table


def raw_reply(*, ids=(3, 4), probs=(0.25, 1.0), times=(1.0, 2.0), top_k=None, answered=None, logit_rows=None,
              vocab=None, logits=None, top=(), logprobs=(), extra=b""):
    """A StepReply frame: R u32, L u32, V u32, n u16, top_k u16, ids int64 [R], probs float32 [R],
    stage times float32 [n], top ids int64 [R, k], top log-probabilities float32 [R, k]; the payload
    is ``logits`` float32 [L, V] or none. k is the width of ``top`` unless ``top_k`` says otherwise."""
    k = (len(top[0]) if len(top) else 0) if top_k is None else top_k
    shape = () if logits is None else logits.shape
    r = len(ids) if answered is None else answered
    ell = (shape[0] if shape else 0) if logit_rows is None else logit_rows
    v = (shape[1] if shape else 0) if vocab is None else vocab
    meta = (struct.pack("<IIIHH", r, ell, v, len(times), k) + np.array(ids, "<i8").tobytes()
            + np.array(probs, "<f4").tobytes() + np.array(times, "<f4").tobytes() + np.array(top, "<i8").tobytes()
            + np.array(logprobs, "<f4").tobytes() + extra)
    if logits is None:
        return raw_frame(FrameKind.STEP_REPLY, meta)
    code = {np.dtype("<f4"): DType.FLOAT32, np.dtype("<f2"): DType.FLOAT16}[logits.dtype]
    return raw_frame(FrameKind.STEP_REPLY, meta, logits.tobytes(), dtype=code, shape=shape)


# Row 0 of ROWS under a 2-word mask, asking the top 3; its valid reply's top section.
MASKED = row(0, 5, 2)
MASKED[0][6] = 3
MASK = [[5, 1 << 31]]
TOP, LOGPROBS = [[3, 9, -1], [4, -1, -1]], [[-0.5, -1.25, -np.inf], [0.0, -np.inf, -np.inf]]

BYTE_CASES = [
    (raw_step(), None),  # the valid baseline of the cases below
    (raw_step(table=MASKED, words=2, masks=MASK), None),
    (raw_step(table=row(0, 6, 20)), None),  # top-20, no mask
    (raw_reply(), None),
    (raw_reply(logits=np.zeros((1, 5), np.float32)), None),
    (raw_reply(top=TOP, logprobs=LOGPROBS), None),
    # fixed fields
    (raw_step(flags=1), "flags"),
    (raw_step(words=1), "mask width W=1 does not fit its rows"),
    (raw_step(table=MASKED, masks=MASK), "mask width W=0 does not fit"),
    (raw_step(table=MASKED, words=2**15 + 1, masks=MASK), "masks of at most 32768 words"),
    (raw_step(table=[[i + 1, 0, 1, 1, 1, 2, 0, 0] for i in range(3)], blocks=[4, 5, 6], padded=4, words=2**15,
              masks=[[1] * 2**15] * 3), None),  # three rows of the widest mask: valid
    (raw_step(table=[[i + 1, 0, 1, 1, (1 << 16) + 1, 2, 0, 0] for i in range(4)], blocks=[4, 5, 6, 7], words=1),
     "answers more than 65536 rows"),
    (raw_step(table=[[i + 1, 0, 1 << 16, 2049, 1 << 16, 2, 0, 0] for i in range(2)], blocks=[], words=2**15),
     "may hold at most 4194304 words"),  # never an over-read
    (raw_step(table=MASKED, words=2, masks=[[0, 0]]), "allows no token"),
    (raw_step(table=MASKED, words=2, masks=MASK + MASK), "Step meta is"),
    (raw_step(table=MASKED, words=2, masks=MASK, extra=b"\0" * 4), "Step meta is"),
    (raw_step(table=np.zeros((0, 8)), blocks=[], tokens=0), "1..4096 rows"),
    (raw_step(rows=4097), "1..4096 rows"),
    (raw_step(times=(1.0,) * 257), "at most 256 stage times"),
    (raw_step(padded=8), "Tb=8 padded tokens"),
    (raw_step(tokens=5), "T=5 real tokens"),
    (raw_step(block_size=8), "block size 8"),
    (raw_step(pool=4), "a pool of 4 blocks"),
    (raw_step(padded=2, tensor=np.zeros((2, 2), np.float32)), "cannot be padded"),
    # declared lengths: short, long, lying counts
    (raw_frame(FrameKind.STEP, b"\0" * 31, b"\0" * 8, dtype=DType.FLOAT32, shape=(2, 1)), "descriptor"),
    (raw_step(rows=3), "cannot hold its 3-row table"),
    (raw_step(rows=1), "Step meta is"),
    (raw_step(extra=b"\0"), "Step meta is"),
    (raw_step(blocks=BLOCKS[:2]), "Step meta is"),
    (raw_step(counts=2), "Step meta is"),
    (raw_step(table=row(0, 3, 2**63)), "more than 16777216 blocks"),  # never an over-read
    (raw_step(table=row(0, 3, 2**64 - 1)), "more than 16777216 blocks"),
    (raw_step(table=[[i + 1, 0, 1, 1 << 24, 1, 0, 0, 0] for i in range(4)]), "at most 4194304"),
    # the row table
    (raw_step(table=row(0, 5, 4)), "unknown bits"),
    (raw_step(table=row(0, 7, 1)), "reserved column"),
    (raw_step(table=row(0, 6, 21)), "top 21 tokens; top_k is 0..20"),
    (raw_step(table=row(0, 0, 0)), "stream ids are 1"),
    (raw_step(table=row(1, 0, 7)), "one stream twice"),
    (raw_step(table=row(0, 4, 4)), "sample 4"),
    (raw_step(table=row(1, 4, 0)), "logits for no row"),
    (raw_step(table=row(0, 1, 62)), "which need 3 blocks of 32; the plan gives 2"),
    (raw_step(blocks=[4, 4, 6]), "lists a block twice"),
    (raw_step(blocks=[3, 5, 6]), "outside the pool"),
    (raw_step(blocks=[4, 5, 64]), "outside the pool"),
    (raw_step(blocks=[4, 5, -1]), "outside the pool"),
    (raw_step(copies=((8, 8),)), "onto itself"),
    (raw_step(copies=((2, 9),)), "outside the pool"),
    (raw_step(times=(float("nan"),)), "finite"),
    (raw_step(times=(-1.0,)), "non-negative"),
    (raw_step(times=(float("inf"),)), "finite"),
    # the payload
    (raw_step(tensor=np.array([1, 2, 3, -4], "<i8")), "token ids must be >= 0"),
    (raw_step(tensor=np.zeros((4, 1), "<i8")), r"token ids \[Tb\]"),
    (raw_step(tensor=np.zeros(4, "<f4")), r"hidden states \[Tb, H\]"),
    # StepReply
    (raw_reply(top_k=1), "StepReply meta is"),
    (raw_reply(top_k=21), "top-21"),
    (raw_reply(ids=(), probs=(), top_k=1), "no answered row has no top-k"),
    (raw_reply(top=TOP, logprobs=LOGPROBS, extra=b"\0" * 4), "StepReply meta is"),
    (raw_reply(top=TOP, logprobs=[[-0.5, -1.25, -np.inf], [0.5, -np.inf, -np.inf]]), "<= 0"),
    (raw_reply(top=[[3, 9, -1], [4, 1, -1]], logprobs=LOGPROBS), "-inf exactly where"),
    (raw_reply(top=[[3, 9, -2], [4, -1, -1]], logprobs=LOGPROBS), ">= 0, or -1"),
    (raw_reply(answered=65537), "at most 65536 rows"),
    (raw_reply(times=(1.0,) * 257), "256 stage"),
    (raw_reply(answered=3), "StepReply meta is"),
    (raw_reply(extra=b"\0" * 4), "StepReply meta is"),
    (raw_reply(logit_rows=1, vocab=5), r"logits \[1, 5\], its payload is \[0, 0\]"),
    (raw_reply(logits=np.zeros((1, 5), np.float32), vocab=4), r"logits \[1, 4\]"),
    (raw_reply(logits=np.zeros((3, 5), np.float32)), "more than the 2 answered rows"),
    (raw_reply(ids=(3, -4)), "ids must be >= 0"),
    (raw_reply(probs=(0.25, 1.01)), r"\[0, 1\]"),
    (raw_reply(times=(-2.0, 1.0)), "non-negative"),
    (raw_frame(FrameKind.STEP_REPLY, b"\0" * 15), "descriptor"),
]


@pytest.mark.parametrize(("frame", "words"), BYTE_CASES, ids=[str(w) for _, w in BYTE_CASES])
def test_step_frame_field_rule_is_refused_from_bytes(frame, words):
    if words is None:
        msg = decode(frame)
        assert isinstance(msg, Step | StepReply) and encode(msg) == frame
        return
    with pytest.raises(FrameError, match=words):
        decode(frame)


HEADER_CASES = [
    (raw_step(), {"flags": 1}, "flag"),
    (raw_step(), {"stream_id": 0}, "stream id"),
    (raw_step(), {"meta_len": 40_000_000}, "meta section of 40000000 bytes exceeds"),
    (raw_step(), {"ndim": 3, "dim2": 1}, "3-dim"),
    (raw_step(), {"dtype": int(DType.NONE)}, "cannot carry dtype NONE"),
    (raw_reply(), {"ndim": 2, "dim0": 1, "dim1": 5}, "dtype NONE with a 2-dim"),
    (raw_reply(logits=np.zeros((1, 5), np.float32)), {"ndim": 0, "dim0": 0, "dim1": 0}, "FLOAT32 with a 0-dim"),
    (raw_reply(logits=np.zeros((1, 5), np.float16)), {}, "cannot carry dtype FLOAT16"),
    (raw_reply(), {"meta_len": 20_000_000}, "exceeds"),
    (raw_reply(), {"stream_id": 0}, "stream id"),
]


@pytest.mark.parametrize(("frame", "changes", "words"), HEADER_CASES, ids=[w for _, _, w in HEADER_CASES])
def test_step_frame_header_is_refused_before_its_body_is_read(frame, changes, words):
    bad = patch_header(frame, **changes)
    with pytest.raises(FrameError, match=words):
        decode_header(bad[:HEADER_SIZE])
