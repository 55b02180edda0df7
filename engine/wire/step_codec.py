"""Bytes <-> messages for the paged path's two frames, Step (kind 21) and StepReply (kind 22).

Part of the codec (``engine.wire.codec`` registers these functions in its tables and checks the
header first); docs/PROTOCOL.md ("Step", "StepReply") is the normative layout. Every count is
bounded before the bytes it announces are read, the meta length must be exactly what the counts
imply, and the arrays are read-only views of the frame: decoding allocates no more than a small
multiple of the frame it was given. Messages are built through their constructors, so every
field rule of ``engine.wire.messages`` and ``engine.wire.step_plan`` applies to received frames.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from engine.errors import GenerationError
from engine.wire.format import (
    HEADER_SIZE,
    MAX_FRAME_BYTES,
    MAX_STEP_BLOCK_IDS,
    MAX_STEP_COPIES,
    MAX_STEP_STAGES,
    MIN_FRAME_BOUND,
    STEP_META,
    STEP_REPLY_META,
    STEP_ROW_COLUMNS,
    STEP_ROW_MASK,
    STEP_ROW_WANT_LOGITS,
    FrameError,
    StreamId,
)
from engine.wire.messages import Step, StepReply, remember_checked_plan
from engine.wire.step_plan import MAX_POOL_BLOCKS, MAX_STEP_ROWS, MAX_STEP_TOKENS, PlanRow, StepPlan

_ROW_BYTES = 8 * STEP_ROW_COLUMNS
_ROW_FLAGS = STEP_ROW_WANT_LOGITS | STEP_ROW_MASK
# The largest meta sections, for the header check (a frame announcing more is refused unread).
MAX_STEP_META = (STEP_META.size + _ROW_BYTES * MAX_STEP_ROWS + 4 * MAX_STEP_BLOCK_IDS + 8 * MAX_STEP_COPIES
                 + 4 * MAX_STEP_STAGES)
MAX_STEP_REPLY_META = STEP_REPLY_META.size + 12 * MAX_STEP_TOKENS + 4 * MAX_STEP_STAGES


def step_frame_bound(hidden_size: int, max_tokens: int, max_rows: int, max_blocks: int,
                     max_copies: int | None = None) -> int:
    """The largest Step frame a paged stage's upstream can legitimately send it: ``max_tokens``
    padded rows of float32 hidden states [Tb, H] (or int64 ids), ``max_rows`` streams holding
    ``max_blocks`` block ids in all, ``max_copies`` block copies (default: one per row) and a
    stage time for every stage. Each count is first clipped to what one frame may carry (a larger
    one could never be legal), the result to [MIN_FRAME_BOUND, MAX_FRAME_BYTES]."""
    rows = min(max_rows, MAX_STEP_ROWS)
    copies = min(rows if max_copies is None else max_copies, MAX_STEP_COPIES)
    meta = STEP_META.size + _ROW_BYTES * rows + 4 * min(max_blocks, MAX_STEP_BLOCK_IDS) + 8 * copies \
        + 4 * MAX_STEP_STAGES
    payload = min(max_tokens, MAX_STEP_TOKENS) * max(4 * hidden_size, 8)
    return min(MAX_FRAME_BYTES, max(MIN_FRAME_BOUND, HEADER_SIZE + meta + payload))


def step_reply_bound(vocab_size: int, max_answered: int, max_logit_rows: int) -> int:
    """The largest StepReply a last stage sends: ``max_answered`` top-1 rows, ``max_logit_rows``
    rows of float32 logits [L, V], a stage time for every stage. Clipped like step_frame_bound."""
    answered = min(max_answered, MAX_STEP_TOKENS)
    meta = STEP_REPLY_META.size + 12 * answered + 4 * MAX_STEP_STAGES
    logits = 4 * min(max_logit_rows, answered) * vocab_size
    return min(MAX_FRAME_BYTES, max(MIN_FRAME_BOUND, HEADER_SIZE + meta + logits))


# --- Step -------------------------------------------------------------------------------------


def encode_step(msg: Step) -> bytes:
    """The Step meta section; the payload is ``msg.tensor`` (fields were checked at init)."""
    plan = msg.plan
    table = np.array(
        [(r.stream_id, r.past_len, r.new_tokens, len(r.blocks), r.sample,
          (STEP_ROW_WANT_LOGITS if r.want_logits else 0) | (STEP_ROW_MASK if r.mask else 0), r.top_k, 0)
         for r in plan.rows], "<u8")  # [S, 8]
    blocks = np.fromiter(chain.from_iterable(r.blocks for r in plan.rows), "<i4")
    copies = np.array(plan.copies, "<i4").reshape(len(plan.copies), 2)
    times = np.array(msg.stage_ms, "<f4")
    fixed = STEP_META.pack(plan.block_size, len(plan.rows), len(plan.copies), len(times), plan.pool_blocks,
                           plan.tokens, plan.padded_tokens, plan.token_budget, 0, 0)
    return b"".join((fixed, table.tobytes(), blocks.tobytes(), copies.tobytes(), times.tobytes()))


def decode_step(session: StreamId, seq: int, meta: memoryview, tensor: np.ndarray | None) -> Step:
    """A Step from its meta section and payload tensor (the header was checked for the kind)."""
    if tensor is None:
        raise FrameError("a Step frame carries the rows' input tensor")
    if len(meta) < STEP_META.size:
        raise FrameError(f"Step meta section is shorter than its {STEP_META.size}-byte descriptor")
    block_size, rows, copies, stages, pool, tokens, padded, budget, flags, reserved = STEP_META.unpack_from(meta)
    if flags or reserved:
        raise FrameError(f"Step flags {flags:#x} and reserved field {reserved:#x} must be 0 in this protocol version")
    if not 1 <= rows <= MAX_STEP_ROWS or stages > MAX_STEP_STAGES:
        raise FrameError(f"a Step has 1..{MAX_STEP_ROWS} rows and at most {MAX_STEP_STAGES} stage times; this one "
                         f"says {rows} and {stages}")
    if padded != tensor.shape[0]:
        raise FrameError(f"Step meta says Tb={padded} padded tokens, its payload has {tensor.shape[0]} rows")
    table_end = STEP_META.size + _ROW_BYTES * rows
    if len(meta) < table_end:
        raise FrameError(f"Step meta of {len(meta)} bytes cannot hold its {rows}-row table ({table_end} bytes)")
    table = np.frombuffer(meta[STEP_META.size : table_end], "<u8").reshape(rows, STEP_ROW_COLUMNS)
    if (table[:, 3] > MAX_POOL_BLOCKS).any():  # checked before summing: no row holds more than a pool
        raise FrameError(f"a Step row claims more than {MAX_POOL_BLOCKS} blocks")
    block_ids = int(table[:, 3].sum())
    if block_ids > MAX_STEP_BLOCK_IDS:
        raise FrameError(f"Step rows claim {block_ids} block ids; one step carries at most {MAX_STEP_BLOCK_IDS}")
    blocks_end = table_end + 4 * block_ids
    copies_end = blocks_end + 8 * copies
    want = copies_end + 4 * stages
    if len(meta) != want:
        raise FrameError(f"Step meta is {len(meta)} bytes; {rows} rows with {block_ids} block ids, {copies} "
                         f"copies and {stages} stage times need {want}")
    if (table[:, 5] & ~np.uint64(_ROW_FLAGS)).any() or table[:, 7].any():
        raise FrameError("Step row flags have unknown bits set, or a row's reserved column is not 0")
    ids = np.frombuffer(meta[table_end:blocks_end], "<i4").tolist()
    plan_rows, begin = [], 0
    for stream_id, past_len, new_tokens, count, sample, row_flags, top_k, _ in table.tolist():
        plan_rows.append(PlanRow(stream_id, past_len, new_tokens, tuple(ids[begin : begin + count]), sample,
                                 bool(row_flags & STEP_ROW_WANT_LOGITS), top_k, bool(row_flags & STEP_ROW_MASK)))
        begin += count
    pairs = np.frombuffer(meta[blocks_end:copies_end], "<i4").reshape(copies, 2).tolist()
    try:
        plan = StepPlan(block_size, pool, tuple(plan_rows), tuple(map(tuple, pairs)), budget, padded)
    except GenerationError as exc:
        raise FrameError(f"Step plan: {exc}") from None
    if plan.tokens != tokens:
        raise FrameError(f"Step meta says T={tokens} real tokens; its rows bring {plan.tokens}")
    remember_checked_plan(plan)
    times = np.frombuffer(meta[copies_end:], "<f4").tolist()
    return Step(session, seq, plan, tensor, tuple(times))


# --- StepReply --------------------------------------------------------------------------------


def encode_step_reply(msg: StepReply) -> bytes:
    """The StepReply meta section; the payload is ``msg.logits`` (none when no stream wanted them)."""
    rows, vocab = msg.logits.shape if msg.logits is not None else (0, 0)
    fixed = STEP_REPLY_META.pack(msg.ids.shape[0], rows, vocab, len(msg.stage_ms), 0)
    ids = np.ascontiguousarray(msg.ids, "<i8")
    probs = np.ascontiguousarray(msg.probs, "<f4")
    return b"".join((fixed, ids.tobytes(), probs.tobytes(), np.array(msg.stage_ms, "<f4").tobytes()))


def decode_step_reply(session: StreamId, seq: int, meta: memoryview, tensor: np.ndarray | None) -> StepReply:
    """A StepReply from its meta section and its logits payload (or None)."""
    if len(meta) < STEP_REPLY_META.size:
        raise FrameError(f"StepReply meta section is shorter than its {STEP_REPLY_META.size}-byte descriptor")
    answered, logit_rows, vocab, stages, top_k = STEP_REPLY_META.unpack_from(meta)
    if top_k:
        raise FrameError("StepReply top-k returns are not part of this protocol version (top_k must be 0)")
    if answered > MAX_STEP_TOKENS or stages > MAX_STEP_STAGES:
        raise FrameError(f"a StepReply answers at most {MAX_STEP_TOKENS} rows with {MAX_STEP_STAGES} stage "
                         f"times; this one says {answered} and {stages}")
    shape = tensor.shape if tensor is not None else (0, 0)
    if (logit_rows, vocab) != shape:
        raise FrameError(f"StepReply meta says logits [{logit_rows}, {vocab}], its payload is {list(shape)}")
    probs_at = STEP_REPLY_META.size + 8 * answered
    times_at = probs_at + 4 * answered
    want = times_at + 4 * stages
    if len(meta) != want:
        raise FrameError(f"StepReply meta is {len(meta)} bytes; {answered} answered rows and {stages} stage "
                         f"times need {want}")
    ids = np.frombuffer(meta[STEP_REPLY_META.size : probs_at], "<i8")
    probs = np.frombuffer(meta[probs_at:times_at], "<f4")
    times = np.frombuffer(meta[times_at:], "<f4").tolist()
    return StepReply(session, seq, ids, probs, tensor, tuple(times))
