"""Sample messages and frame surgery shared by the wire codec, fuzz and live transport tests."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import numpy as np

from engine.wire.codec import decode, encode
from engine.wire.format import (
    HEADER_FIELDS,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAX_TOP_K,
    MIN_FRAME_BOUND,
    U64_MAX,
    ErrorCode,
    Role,
    StreamId,
    WireError,
)
from engine.wire.messages import (
    Error,
    Hello,
    HelloAck,
    Logits,
    Message,
    Packed,
    Ping,
    Pong,
    Release,
    Step,
    StepReply,
    Tokens,
)
from engine.wire.plan_frame import PlanFrame
from engine.wire.step_plan import MAX_STEP_TOKENS, SCRATCH_BLOCKS, PlanRow, StepPlan, blocks_needed

FP = "sha256-0f3a9c"  # a model fingerprint


def tensor_frame(stream=1, seq=0, s=2, h=8, dtype=np.float32, want_logits=False, rng=None) -> Packed:
    """A valid tensor frame of any size (a Packed frame, the static ring's step): token ids [1,S]
    (``dtype=np.int64``) or hidden states [1,S,H] of S rows, each a slot's first position."""
    rng = rng or np.random.default_rng(0)
    if dtype == np.int64:
        tensor = rng.integers(0, 49152, (1, s), dtype=np.int64)
    else:
        tensor = rng.standard_normal((1, s, h)).astype(dtype)
    return Packed(StreamId(stream), seq, PlanFrame.of([(i, 0, 0) for i in range(s)], s), tensor, want_logits)


def assert_same(a: Message, b: Message) -> None:
    """Field-by-field equality; arrays must match bit for bit, with dtype and shape."""
    assert type(a) is type(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), f.name
        elif is_dataclass(x):  # a PlanFrame inside a Packed
            assert_same(x, y)
        else:
            assert x == y, f.name


TOKENS_1D = Tokens(
    StreamId(3), 9, np.array([17, 4, 0], np.int64), np.array([0.5, 1.0, 0.0], np.float32)
)
HELLO = Hello(FP, 2, Role.STAGE)
# Three rows: slot 1 prefilling positions 4-5 over a kept prefix of 4, an idle row.
PLAN = PlanFrame.of([(1, 4, 4), (1, 5, 4)], total=3)


def packed(stream=8, seq=5, hidden=True, rng=None) -> Packed:
    rng = rng or np.random.default_rng(1)
    tensor = (rng.standard_normal((1, PLAN.rows, 8)).astype(np.float32) if hidden
              else rng.integers(0, 49152, (1, PLAN.rows), dtype=np.int64))
    return Packed(StreamId(stream), seq, PLAN, tensor)


# A step of three streams: a prefill chunk of 24 over 12 cached positions (answered: its last chunk), a
# decode row wanting logits, a verify of 1+3 drafts; a copy-on-write of a shared partial block. T=29, Tb=32.
STEP_PLAN = StepPlan(32, 64, (PlanRow(11, 12, 24, (4, 5), 1), PlanRow(12, 40, 1, (6, 7), 1, want_logits=True),
                              PlanRow(2**64 - 1, 31, 4, (9, 8), 4)), copies=((6, 10),), token_budget=256)


# Structured output and logprobs: a decode under a 3-word (V <= 96) mask asking the top 5, a verify of 1+2
# drafts with a mask on each answered row and the top 2, a plain decode wanting logits. T=5, Tb=8.
CONSTRAINED_MASK = np.array([[0b1011, 0, 1 << 31]], "<u4")
CONSTRAINED_PLAN = StepPlan(32, 64, (PlanRow(21, 7, 1, (4,), 1, top_k=5, mask=CONSTRAINED_MASK),
                                     PlanRow(22, 40, 3, (5, 6), 3, top_k=2,
                                             mask=np.array([[1, 0, 0], [0, 2, 0], [7, 7, 7]], "<u4")),
                                     PlanRow(23, 3, 1, (7,), 1, want_logits=True)))


def step(session=8, seq=5, hidden=True, dtype=np.float32, stage_ms=(1.25,), plan=STEP_PLAN, rng=None) -> Step:
    """A valid Step of ``plan``: hidden states [Tb, 8] (``hidden``) or token ids [Tb] into stage 0."""
    rng = rng or np.random.default_rng(2)
    tb = plan.padded_tokens
    tensor = (rng.standard_normal((tb, 8)).astype(dtype) if hidden
              else rng.integers(0, 49152, tb, dtype=np.int64))
    return Step(StreamId(session), seq, plan, tensor, stage_ms)


def step_reply(session=8, seq=5, logits=True, rng=None) -> StepReply:
    """A valid StepReply to STEP_PLAN: 6 answered rows, one row of logits over a vocabulary of 11."""
    rng = rng or np.random.default_rng(3)
    r = STEP_PLAN.sampled
    return StepReply(StreamId(session), seq, rng.integers(0, 49152, r, dtype=np.int64), rng.random(r, np.float32),
                     rng.standard_normal((STEP_PLAN.logit_rows, 11)).astype(np.float32) if logits else None,
                     (2.5, 0.0, 3.75))


def random_plan(rng: np.random.Generator, rows: int | None = None) -> StepPlan:
    """A valid plan of 1..8 rows (``rows``): prefill chunks (answered or not), decodes (some wanting
    logits) and verifies of 1+K drafts, over distinct streams; some rows share a prefix block, some
    steps copy blocks or are padded beyond their bucket."""
    block_size = int(rng.choice([32, 16]))
    pool = int(rng.integers(256, 4096))
    free = [int(b) for b in rng.permutation(np.arange(SCRATCH_BLOCKS, pool))]
    words = int(rng.integers(1, 9))  # one vocabulary (mask width) per step
    streams = [8 * int(v) + k + 1 for k, v in enumerate(rng.integers(0, 2**59, 8))]  # distinct: k = id mod 8
    plan_rows: list[PlanRow] = []
    for i in range(int(rng.integers(1, 9)) if rows is None else rows):
        kind = rng.choice(["prefill", "decode", "verify"])
        past = int(rng.integers(0, 400))
        new = {"prefill": int(rng.integers(2, 65)), "decode": 1, "verify": int(rng.integers(2, 6))}[kind]
        sample = {"prefill": int(rng.integers(0, 2)), "decode": 1, "verify": new}[kind]
        count = blocks_needed(past + new, block_size)
        blocks = free[:count]
        del free[:count]
        if plan_rows and past >= block_size and rng.random() < 0.3:  # a shared full prefix block
            blocks[0] = plan_rows[-1].blocks[0]
        if rng.random() < 0.05:
            streams[i] = 2**64 - 1 - i  # the top of the stream-id range
        plan_rows.append(PlanRow(streams[i], past, new, tuple(blocks), sample,
                                 want_logits=bool(sample and rng.random() < 0.3),
                                 top_k=int(rng.integers(1, MAX_TOP_K + 1)) if sample and rng.random() < 0.3 else 0,
                                 mask=random_mask(rng, sample, words) if sample and rng.random() < 0.3 else None))
    copies = tuple((free.pop(), free.pop()) for _ in range(int(rng.integers(0, 4))))
    tokens = sum(r.new_tokens for r in plan_rows)
    padded = 0 if rng.random() < 0.7 else min(MAX_STEP_TOKENS, tokens + int(rng.integers(0, 4 * block_size + 1)))
    return StepPlan(block_size, pool, tuple(plan_rows), copies, int(rng.integers(0, 2**32)), padded)


def random_mask(rng: np.random.Generator, rows: int, words: int) -> np.ndarray:
    """A packed allowed-token mask uint32 [rows, words] of random bits, every row allowing a token."""
    mask = rng.integers(0, 2**32, (rows, words), dtype=np.uint32) & rng.integers(0, 2**32, (rows, words),
                                                                                   dtype=np.uint32)
    mask[:, 0] |= np.uint32(1) << rng.integers(0, 32, rows).astype(np.uint32)
    return mask.astype("<u4")


def random_top(rng: np.random.Generator, plan: StepPlan) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A valid top-k section for ``plan``: k = plan.top_k, ids -1 / logprobs -inf past each row's k."""
    k, r = plan.top_k, plan.sampled
    if not k:
        return None, None
    ids = rng.integers(0, 2**40, (r, k), np.int64)
    logp = np.sort(-rng.exponential(3.0, (r, k)).astype(np.float32), axis=1)[:, ::-1].copy()
    asks = np.concatenate([np.full(row.sample, row.top_k) for row in plan.rows])
    past = np.arange(k)[None, :] >= asks[:, None]
    ids[past] = -1
    logp[past] = -np.inf
    return ids, logp


def random_step(rng: np.random.Generator, plan: StepPlan | None = None) -> Step:
    """A valid Step of ``plan`` (default: a random one): token ids, or float32/float16 hidden states with
    every bit pattern (NaN and inf included: they must survive exactly), and 0..3 stage times."""
    plan = plan or random_plan(rng)
    tb = plan.padded_tokens
    kind = rng.choice(["ids", "f32", "f16"])
    if kind == "ids":
        tensor = rng.integers(0, 2**40, tb, np.int64)
    else:
        dtype = np.dtype("<f4" if kind == "f32" else "<f2")
        tensor = rng.integers(0, 256, (tb, int(rng.integers(1, 7)), dtype.itemsize), np.uint8).view(dtype)[..., 0]
    stage_ms = tuple(float(v) for v in rng.random(int(rng.integers(0, 4))) * 100)
    return Step(StreamId(int(rng.integers(1, 2**63))), int(rng.integers(0, 2**63)), plan, tensor, stage_ms)


def random_step_reply(rng: np.random.Generator, plan: StepPlan | None = None) -> StepReply:
    """A valid StepReply to ``plan`` (default: a random one): R = plan.sampled, L = plan.logit_rows,
    top-k = plan.top_k."""
    plan = plan or random_plan(rng)
    r, rows = plan.sampled, plan.logit_rows
    logits = rng.standard_normal((rows, int(rng.integers(1, 40)))).astype(np.float32) if rows else None
    stage_ms = tuple(float(v) for v in rng.random(int(rng.integers(0, 4))) * 100)
    return StepReply(StreamId(int(rng.integers(1, 2**63))), int(rng.integers(0, 2**63)),
                     rng.integers(0, 2**40, r, np.int64), rng.random(r, np.float32), logits, stage_ms,
                     *random_top(rng, plan))


TENSOR_SAMPLES: list[Message] = [
    tensor_frame(),
    tensor_frame(s=3, dtype=np.float16, want_logits=True),
    tensor_frame(stream=U64_MAX, seq=U64_MAX, s=5, dtype=np.int64),
    TOKENS_1D,
    Tokens(StreamId(3), 9, np.array([[1, 2]], np.int64), np.array([[0.25, 0.75]], np.float32)),
    Logits(StreamId(4), 2, np.linspace(-3, 3, 2 * 11, dtype=np.float32).reshape(2, 11)),
    Logits(StreamId(4), 2, np.ones((1, 3, 7), np.float16)),
    packed(),
    packed(stream=U64_MAX, hidden=False),
    # protocol 5: the stage times of the stages passed, a Packed frame wanting Logits
    replace(tensor_frame(), stage_ms=(1.5, 0.25)),
    Tokens(StreamId(3), 9, np.array([17, 4], np.int64), np.array([0.5, 1.0], np.float32), (3.0, 4.5, 0.0)),
    Logits(StreamId(4), 2, np.ones((1, 7), np.float32), (12.75,)),
    replace(packed(), want_logits=True, stage_ms=(2.0,)),
    step(),
    step(session=U64_MAX, seq=U64_MAX, hidden=False, stage_ms=()),
    step(dtype=np.float16, stage_ms=(0.5, 7.0)),
    step(plan=CONSTRAINED_PLAN, hidden=False),
    step_reply(),
    StepReply(StreamId(2), 1, np.array([3, 33, 1, 2], np.int64), np.array([0.5, 0.25, 1.0, 0.125], np.float32),
              np.zeros((1, 96), np.float32), (1.0, 2.0),
              np.array([[3, 1, 0, 95, -1], [33, -1, -1, -1, -1], [1, 2, -1, -1, -1], [-1, -1, -1, -1, -1]], np.int64),
              np.array([[-0.7, -1.5, -2.0, -3.0, -np.inf], [0.0, -np.inf, -np.inf, -np.inf, -np.inf],
                        [-0.1, -3.0, -np.inf, -np.inf, -np.inf], [-np.inf] * 5],
                       np.float32)),
    step_reply(logits=False),
    StepReply(StreamId(1), 0, np.zeros(0, np.int64), np.zeros(0, np.float32)),  # a step of prefill chunks only
]
CONTROL_SAMPLES: list[Message] = [  # no tensor payload
    Release(StreamId(5), 12),
    Ping(7),
    Pong(7),
    Error(ErrorCode.UNKNOWN_STREAM, "stream 5 is unknown here — résumé", StreamId(5), 3),
    Error(ErrorCode.INTERNAL, ""),
    HELLO,
    # a peer's older version: encodable
    Hello(FP, 65535, Role.COORDINATOR, max_frame_bytes=MIN_FRAME_BOUND, protocol_version=1),
    HelloAck(FP, 0, max_frame_bytes=1 << 30),
]
SAMPLES = TENSOR_SAMPLES + CONTROL_SAMPLES  # every frame kind, some twice

TENSOR_FRAME = encode(tensor_frame(s=2, h=8))  # a Packed frame, float32 [1,2,8]: payload 64 bytes

# The largest value each patchable header field holds (magic, stream_id and seq excluded).
HEADER_FIELD_BOUNDS = {
    "version": 2**16 - 1,
    "kind": 255,
    "flags": 255,
    "dtype": 255,
    "ndim": 255,
    "reserved": 2**16 - 1,
    "dim0": 2**32 - 1,
    "dim1": 2**32 - 1,
    "dim2": 2**32 - 1,
    "dim3": 2**32 - 1,
    "meta_len": 2**32 - 1,
    "payload_len": U64_MAX,
}


def patch_header(frame: bytes, **changes) -> bytes:
    """``frame`` with the named header fields (see HEADER_FIELDS) replaced, body untouched."""
    values = dict(zip(HEADER_FIELDS, HEADER_STRUCT.unpack(frame[:HEADER_SIZE]), strict=True))
    values.update(changes)
    return HEADER_STRUCT.pack(*(values[f] for f in HEADER_FIELDS)) + frame[HEADER_SIZE:]


def decode_or_wire_error(data: bytes, bound: int = 1 << 20) -> Message | WireError:
    """Decode ``data``; the property under test is that only WireErrors ever come out."""
    try:
        return decode(data, max_frame_bytes=bound)
    except WireError as exc:
        return exc
