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
    MAX_MASK_WORDS,
    MAX_STEP_BLOCK_IDS,
    MAX_STEP_COPIES,
    MAX_STEP_MASK_WORDS,
    MAX_STEP_STAGES,
    MAX_TOP_K,
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
                 + 4 * MAX_STEP_STAGES + 4 * MAX_STEP_MASK_WORDS)
MAX_STEP_REPLY_META = STEP_REPLY_META.size + 12 * (1 + MAX_TOP_K) * MAX_STEP_TOKENS + 4 * MAX_STEP_STAGES


def step_frame_bound(hidden_size: int, max_tokens: int, max_rows: int, max_blocks: int,
                     max_copies: int | None = None, vocab_size: int = 0) -> int:
    """The largest Step frame a paged stage's upstream can legitimately send it: ``max_tokens``
    padded rows of float32 hidden states [Tb, H] (or int64 ids), ``max_rows`` streams holding
    ``max_blocks`` block ids in all, ``max_copies`` block copies (default: one per row), a stage
    time for every stage and, when ``vocab_size`` V is given, an allowed-token mask of ceil(V/32)
    words on every token (a step of masked verifies). Each count is first clipped to what one frame
    may carry (a larger one could never be legal), the result to [MIN_FRAME_BOUND, MAX_FRAME_BYTES]."""
    rows = min(max_rows, MAX_STEP_ROWS)
    copies = min(rows if max_copies is None else max_copies, MAX_STEP_COPIES)
    tokens = min(max_tokens, MAX_STEP_TOKENS)
    masks = min(tokens * min(-(-vocab_size // 32), MAX_MASK_WORDS), MAX_STEP_MASK_WORDS)
    meta = STEP_META.size + _ROW_BYTES * rows + 4 * min(max_blocks, MAX_STEP_BLOCK_IDS) + 8 * copies \
        + 4 * MAX_STEP_STAGES + 4 * masks
    payload = tokens * max(4 * hidden_size, 8)
    return min(MAX_FRAME_BYTES, max(MIN_FRAME_BOUND, HEADER_SIZE + meta + payload))


def step_reply_bound(vocab_size: int, max_answered: int, max_logit_rows: int, top_k: int = MAX_TOP_K) -> int:
    """The largest StepReply a last stage sends: ``max_answered`` top-1 rows, ``max_logit_rows``
    rows of float32 logits [L, V], a stage time for every stage, and the top-``top_k`` ids and
    log-probabilities of every answered row (default: the most a row may ask for). Clipped like
    step_frame_bound."""
    answered = min(max_answered, MAX_STEP_TOKENS)
    meta = STEP_REPLY_META.size + 12 * (1 + min(top_k, MAX_TOP_K)) * answered + 4 * MAX_STEP_STAGES
    logits = 4 * min(max_logit_rows, answered) * vocab_size
    return min(MAX_FRAME_BYTES, max(MIN_FRAME_BOUND, HEADER_SIZE + meta + logits))


# --- Step -------------------------------------------------------------------------------------


def encode_step(msg: Step) -> bytes:
    """The Step meta section; the payload is ``msg.tensor`` (fields were checked at init)."""
    plan = msg.plan
    table = np.array(
        [(r.stream_id, r.past_len, r.new_tokens, len(r.blocks), r.sample,
          (STEP_ROW_WANT_LOGITS if r.want_logits else 0) | (STEP_ROW_MASK if r.mask is not None else 0), r.top_k, 0)
         for r in plan.rows], "<u8")  # [S, 8]
    blocks = np.fromiter(chain.from_iterable(r.blocks for r in plan.rows), "<i4")
    copies = np.array(plan.copies, "<i4").reshape(len(plan.copies), 2)
    times = np.array(msg.stage_ms, "<f4")
    masks = [np.ascontiguousarray(r.mask, "<u4").tobytes() for r in plan.rows if r.mask is not None]
    fixed = STEP_META.pack(plan.block_size, len(plan.rows), len(plan.copies), len(times), plan.pool_blocks,
                           plan.tokens, plan.padded_tokens, plan.token_budget, 0, plan.mask_words)
    return b"".join((fixed, table.tobytes(), blocks.tobytes(), copies.tobytes(), times.tobytes(), *masks))


def decode_step(session: StreamId, seq: int, meta: memoryview, tensor: np.ndarray | None) -> Step:
    """A Step from its meta section and payload tensor (the header was checked for the kind)."""
    if tensor is None:
        raise FrameError("a Step frame carries the rows' input tensor")
    if len(meta) < STEP_META.size:
        raise FrameError(f"Step meta section is shorter than its {STEP_META.size}-byte descriptor")
    block_size, rows, copies, stages, pool, tokens, padded, budget, flags, words = STEP_META.unpack_from(meta)
    if flags:
        raise FrameError(f"Step flags {flags:#x} must be 0 in this protocol version")
    if not 1 <= rows <= MAX_STEP_ROWS or stages > MAX_STEP_STAGES or words > MAX_MASK_WORDS:
        raise FrameError(f"a Step has 1..{MAX_STEP_ROWS} rows, at most {MAX_STEP_STAGES} stage times and token masks "
                         f"of at most {MAX_MASK_WORDS} words; this one says {rows}, {stages} and {words}")
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
    if (table[:, 5] & ~np.uint64(_ROW_FLAGS)).any() or table[:, 7].any():
        raise FrameError("Step row flags have unknown bits set, or a row's reserved column is not 0")
    masked = (table[:, 5] & np.uint64(STEP_ROW_MASK)) != 0
    if (table[:, 4] > MAX_STEP_TOKENS).any():  # checked before summing, as block counts are
        raise FrameError(f"a Step row answers more than {MAX_STEP_TOKENS} rows")
    mask_rows = int(table[masked, 4].sum())
    if bool(masked.any()) != bool(words) or mask_rows * words > MAX_STEP_MASK_WORDS:
        raise FrameError(f"Step mask width W={words} does not fit its rows: W is 0 exactly when no row has the MASK "
                         f"flag, and the {mask_rows} masked rows may hold at most {MAX_STEP_MASK_WORDS} words")
    blocks_end = table_end + 4 * block_ids
    copies_end = blocks_end + 8 * copies
    times_end = copies_end + 4 * stages
    want = times_end + 4 * words * mask_rows
    if len(meta) != want:
        raise FrameError(f"Step meta is {len(meta)} bytes; {rows} rows with {block_ids} block ids, {copies} "
                         f"copies, {stages} stage times and {mask_rows} token masks of {words} words need {want}")
    ids = np.frombuffer(meta[table_end:blocks_end], "<i4").tolist()
    masks = np.frombuffer(meta[times_end:], "<u4").reshape(mask_rows, words)
    plan_rows, begin, at = [], 0, 0
    for stream_id, past_len, new_tokens, count, sample, row_flags, top_k, _ in table.tolist():
        mask = None
        if row_flags & STEP_ROW_MASK:
            mask, at = masks[at : at + sample], at + sample
        plan_rows.append(PlanRow(stream_id, past_len, new_tokens, tuple(ids[begin : begin + count]), sample,
                                 bool(row_flags & STEP_ROW_WANT_LOGITS), top_k, mask))
        begin += count
    pairs = np.frombuffer(meta[blocks_end:copies_end], "<i4").reshape(copies, 2).tolist()
    try:
        plan = StepPlan(block_size, pool, tuple(plan_rows), tuple(map(tuple, pairs)), budget, padded)
    except GenerationError as exc:
        raise FrameError(f"Step plan: {exc}") from None
    if plan.tokens != tokens:
        raise FrameError(f"Step meta says T={tokens} real tokens; its rows bring {plan.tokens}")
    remember_checked_plan(plan)
    times = np.frombuffer(meta[copies_end:times_end], "<f4").tolist()
    return Step(session, seq, plan, tensor, tuple(times))


# --- StepReply --------------------------------------------------------------------------------


def encode_step_reply(msg: StepReply) -> bytes:
    """The StepReply meta section; the payload is ``msg.logits`` (none when no stream wanted them)."""
    rows, vocab = msg.logits.shape if msg.logits is not None else (0, 0)
    fixed = STEP_REPLY_META.pack(msg.ids.shape[0], rows, vocab, len(msg.stage_ms), msg.top_k)
    parts = [fixed, np.ascontiguousarray(msg.ids, "<i8").tobytes(), np.ascontiguousarray(msg.probs, "<f4").tobytes(),
             np.array(msg.stage_ms, "<f4").tobytes()]
    if msg.top_k:
        parts += [np.ascontiguousarray(msg.top_ids, "<i8").tobytes(),
                  np.ascontiguousarray(msg.top_logprobs, "<f4").tobytes()]
    return b"".join(parts)


def decode_step_reply(session: StreamId, seq: int, meta: memoryview, tensor: np.ndarray | None) -> StepReply:
    """A StepReply from its meta section and its logits payload (or None)."""
    if len(meta) < STEP_REPLY_META.size:
        raise FrameError(f"StepReply meta section is shorter than its {STEP_REPLY_META.size}-byte descriptor")
    answered, logit_rows, vocab, stages, top_k = STEP_REPLY_META.unpack_from(meta)
    if answered > MAX_STEP_TOKENS or stages > MAX_STEP_STAGES or top_k > MAX_TOP_K:
        raise FrameError(f"a StepReply answers at most {MAX_STEP_TOKENS} rows with {MAX_STEP_STAGES} stage "
                         f"times and top-{MAX_TOP_K}; this one says {answered}, {stages} and top-{top_k}")
    if top_k and not answered:
        raise FrameError(f"a StepReply of no answered row has no top-k section (it says top-{top_k})")
    shape = tensor.shape if tensor is not None else (0, 0)
    if (logit_rows, vocab) != shape:
        raise FrameError(f"StepReply meta says logits [{logit_rows}, {vocab}], its payload is {list(shape)}")
    probs_at = STEP_REPLY_META.size + 8 * answered
    times_at = probs_at + 4 * answered
    top_at = times_at + 4 * stages
    logp_at = top_at + 8 * answered * top_k
    want = logp_at + 4 * answered * top_k
    if len(meta) != want:
        raise FrameError(f"StepReply meta is {len(meta)} bytes; {answered} answered rows, {stages} stage "
                         f"times and top-{top_k} need {want}")
    ids = np.frombuffer(meta[STEP_REPLY_META.size : probs_at], "<i8")
    probs = np.frombuffer(meta[probs_at:times_at], "<f4")
    times = np.frombuffer(meta[times_at:top_at], "<f4").tolist()
    top_ids = top_logprobs = None
    if top_k:
        top_ids = np.frombuffer(meta[top_at:logp_at], "<i8").reshape(answered, top_k)
        top_logprobs = np.frombuffer(meta[logp_at:want], "<f4").reshape(answered, top_k)
    return StepReply(session, seq, ids, probs, tensor, tuple(times), top_ids, top_logprobs)
