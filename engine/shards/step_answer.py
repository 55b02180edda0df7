"""What the last paged stage answers: top-1, logits, top-k log-probabilities, under the rows' masks.

Pure numpy over the logits [R, V] of a step's answered rows (plan order) and the step's plan: the
packed allowed-token masks (:class:`engine.wire.step_plan.PlanRow.mask`) set the disallowed logits
to -inf first, so the top-1 is the constrained greedy pick, a returned logits row is the masked
distribution the coordinator samples from, and the log-probabilities are those of the masked
distribution. Log-probabilities are the log-softmax of the raw logits (temperature 1): the API
reports them as OpenAI does, whatever temperature the stream samples at. docs/PROTOCOL.md
("Step", "StepReply") is the normative description.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from engine.errors import GenerationError
from engine.wire.format import StreamId
from engine.wire.messages import StepReply
from engine.wire.step_plan import StepPlan


class TokenMaskError(GenerationError):
    """A step's token mask does not fit the last stage's vocabulary (its width is not ceil(V/32),
    or it allows a token id >= V): coordinator and last stage disagree on the model."""


def mask_words(vocab: int) -> int:
    """W, the u32 words of a packed mask over a vocabulary of ``vocab`` tokens."""
    return -(-vocab // 32)


def unpack_mask(mask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [..., V] from packed uint32 [..., ceil(V/32)]: token t is allowed iff bit t % 32 of word t // 32."""
    bits = np.unpackbits(np.ascontiguousarray(mask, "<u4").view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab].view(bool)


@functools.cache
def _float_bits(dtype: np.dtype) -> tuple[np.dtype, np.ndarray]:
    """(the signed integer dtype as wide as the float ``dtype``, the bits of -inf in it)."""
    as_int = np.dtype(f"i{dtype.itemsize}")
    return as_int, np.array(-np.inf, dtype).view(as_int)


def check_mask(mask: np.ndarray, vocab: int, stream_id: int = 0) -> None:
    """TokenMaskError unless ``mask`` [n, W] is ceil(V/32) words wide with no bit set at or past V."""
    want = mask_words(vocab)
    if mask.shape[1] != want:
        raise TokenMaskError(f"stream {stream_id}: its token mask has {mask.shape[1]} words per row; the last "
                             f"stage's vocabulary of {vocab} needs {want} (ceil(V/32)): the mask was built for "
                             "another model or tokenizer width")
    spare = vocab % 32
    if spare and (mask[:, -1] >> np.uint32(spare)).any():
        raise TokenMaskError(f"stream {stream_id}: its token mask allows a token id >= the vocabulary size {vocab}")


def mask_row(row: np.ndarray, words: np.ndarray) -> None:
    """-inf into the float logits ``row`` [V] (contiguous) where the packed ``words`` [ceil(V/32)] disallow.

    With bit operations on the floats' bits, not a boolean select: inside a JSON string a mask has
    no pattern, and a branch per logit mispredicts half the time (where/copyto/putmask: 2-3x slower
    at V=49152). Any float width (an integer of the same width holds its bits).
    """
    as_int, neg_inf = _float_bits(row.dtype)
    keep = unpack_mask(words, row.shape[0]).astype(as_int)  # 1 allowed, 0 refused
    keep -= 1  # 0 allowed, all bits refused
    bits = row.view(as_int)
    np.bitwise_and(bits, ~keep, out=bits)  # refused -> 0
    keep &= neg_inf
    bits |= keep  # refused -> the bits of -inf


def mask_in_place(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Set float logits ``rows`` [V] or [n, V] to -inf where ``mask`` uint32 [ceil(V/32)] or
    [n, ceil(V/32)] disallows (one mask row applies to every logits row); returns ``rows``.

    Row by row, so each row is unpacked and masked while it is in cache.
    """
    if rows.ndim == 1:
        mask_row(rows, mask)
        return rows
    for row, words in zip(rows, np.broadcast_to(mask, (rows.shape[0], mask.shape[-1])), strict=True):
        mask_row(row, words)
    return rows


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``logits`` [V] or [n, V] (float32 unless already floating) with -inf where ``mask`` (uint32
    [ceil(V/32)] or [n, ceil(V/32)]) disallows, as a new array."""
    x = np.asarray(logits)
    return mask_in_place(np.array(x, dtype=x.dtype if np.issubdtype(x.dtype, np.floating) else np.float32), mask)


def _row_spread(row: np.ndarray, scratch: np.ndarray) -> tuple[int, float, float]:
    """(argmax, max, sum exp(l - max)) of one logits row [V], through a scratch row of its dtype
    that stays in cache. The last stage's float32 rows sum in float32 (l - max <= 0, so every term
    is in [0, 1]: finite for any logits, and numpy's pairwise sum keeps it within a few ulp;
    float64 exp costs ~15x more here); a float64 row sums in float64."""
    best = int(row.argmax())
    top = row[best]
    np.subtract(row, top, out=scratch)
    np.exp(scratch, out=scratch)
    return best, float(top), float(scratch.sum(dtype=scratch.dtype))


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Log-softmax of float logits ``rows`` [V] or [n, V] along V, in their dtype (-inf stays -inf:
    a masked token has log-probability -inf). ValueError when a row has no finite logit."""
    x = np.asarray(rows)
    x = x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)
    out = np.empty(x.shape, x.dtype)
    scratch = np.empty(x.shape[-1], x.dtype)
    for row, dest in zip(x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1]), strict=True):
        with np.errstate(invalid="ignore"):  # a row of -inf: -inf - -inf, refused just below
            _, top, total = _row_spread(row, scratch)
        if not np.isfinite(top):
            raise ValueError("no token is allowed (every logit is masked or -inf)")
        np.subtract(row, top, out=dest)
        dest -= np.log(total)
    return out


def _spread(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(argmax ids int64 [n], max float32 [n], sum exp(l - max) float32 [n]) of logits rows [n, V]."""
    n = rows.shape[0]
    ids, top, total = np.empty(n, np.int64), np.empty(n, np.float32), np.empty(n, np.float32)
    scratch = np.empty(rows.shape[-1], np.float32)
    for i, row in enumerate(rows):
        ids[i], top[i], total[i] = _row_spread(row, scratch)
    return ids, top, total


def top1(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [n], probs float32 [n]) of logits rows [n, V]; -inf entries have probability 0."""
    ids, _, total = _spread(rows)
    return ids.astype(np.int64), (1 / total).astype(np.float32)


_TOP_K_GROUP = 64  # logits per group whose maxima bound the k-th largest from below


def row_top_k(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [<= k], values [<= k]) of one logits row's k largest finite values, best first.

    The k-th largest of the maxima of any partition of the row into groups is a lower bound of its
    k-th largest value (those k maxima are k distinct logits at least that large), so only the
    logits reaching it are sorted: tens instead of V. The groups are strided (logit j joins group
    j mod V/64), so their maxima are one elementwise max over 64 contiguous slices. np.argpartition
    over the whole row costs ~10x more, and far more on a masked row, whose many equal -inf slow
    its selection down."""
    full = row.shape[0] - row.shape[0] % _TOP_K_GROUP
    maxima = row[:full].reshape(_TOP_K_GROUP, -1).max(axis=0)
    if full < row.shape[0]:
        maxima = np.append(maxima, row[full:].max())
    bound = np.partition(maxima, -k)[-k] if maxima.size > k else -np.inf
    cand = np.flatnonzero(row >= bound) if bound > -np.inf else np.flatnonzero(row > -np.inf)
    vals = row[cand]
    best = np.argsort(-vals, kind="stable")[:k]
    return cand[best], vals[best]


def _top_k(rows: np.ndarray, k: int, top: np.ndarray, total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids int64 [n, k] and log-softmax float32 [n, k] of rows [n, V] (max ``top``, sum
    exp(l - max) ``total`` per row); padded with -1 / -inf past a row's finite logits."""
    k = min(k, rows.shape[1])
    ids = np.full((rows.shape[0], k), -1, np.int64)
    logp = np.full((rows.shape[0], k), -np.inf, np.float32)
    for i, row in enumerate(rows):
        got, vals = row_top_k(row, k)
        ids[i, :got.size] = got
        logp[i, :got.size] = vals.astype(np.float64) - float(top[i]) - np.log(float(total[i]))
    return ids, logp


def top_logprobs(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k likeliest tokens of logits rows [n, V], best first: ids int64 [n, k] and their
    log-softmax float32 [n, k]; an entry past the row's finite logits (a mask allowing fewer than
    k tokens) is id -1 with log-probability -inf. Ties keep no particular order."""
    _, top, total = _spread(rows)
    return _top_k(rows, k, top, total)


@dataclass(frozen=True, eq=False)
class StepAnswer:
    """The last stage's answer to one step, in the StepReply's shapes (see :class:`StepReply`)."""

    ids: np.ndarray  # int64 [R]
    probs: np.ndarray  # float32 [R]
    logits: np.ndarray | None  # float32 [L, V], masked
    top_ids: np.ndarray | None  # int64 [R, k]
    top_logprobs: np.ndarray | None  # float32 [R, k]

    def reply(self, session: StreamId, seq: int, stage_ms: tuple[float, ...]) -> StepReply:
        """The StepReply frame of this answer."""
        return StepReply(session, seq, self.ids, self.probs, self.logits, stage_ms, self.top_ids, self.top_logprobs)


def check_masks(plan: StepPlan, vocab: int) -> None:
    """TokenMaskError unless every mask of ``plan`` fits a vocabulary of ``vocab`` (the last
    stage checks before it answers: the codec cannot know V)."""
    for row in plan.rows:
        if row.mask is not None:
            check_mask(row.mask, vocab, row.stream_id)


def answer_step(logits: np.ndarray, plan: StepPlan) -> StepAnswer:
    """The answer to ``plan`` from the logits float32 [R, V] of its answered rows (plan order).

    Masked rows are set to -inf where disallowed (in place: ``logits`` is the stage's private
    copy); then top-1 and probabilities of every row, the rows of ``want_logits`` streams, and
    when any row asks for top-k, k = ``plan.top_k`` ids and log-probabilities per row (rows asking
    fewer padded with -1 / -inf).
    """
    logits = np.asarray(logits, dtype=np.float32)
    if plan.mask_rows and not logits.flags.writeable:  # a view of a received frame: mask a copy
        logits = logits.copy()
    n, vocab = logits.shape
    check_masks(plan, vocab)
    k = plan.top_k
    ids, probs = np.empty(n, np.int64), np.empty(n, np.float32)
    top_ids = np.full((n, k), -1, np.int64) if k else None
    top_lp = np.full((n, k), -np.inf, np.float32) if k else None
    scratch = np.empty(vocab, np.float32)
    i = 0
    for plan_row in plan.rows:  # row by row, each answered row masked, summed and ranked while in cache
        for j in range(plan_row.sample):
            row = logits[i]
            if plan_row.mask is not None:
                mask_row(row, plan_row.mask[j])
            ids[i], top, total = _row_spread(row, scratch)
            probs[i] = 1 / total
            if plan_row.top_k and top_ids is not None and top_lp is not None:
                got, vals = row_top_k(row, min(plan_row.top_k, vocab))
                top_ids[i, :got.size] = got
                top_lp[i, :got.size] = vals.astype(np.float64) - top - np.log(total)
            i += 1
    kept = None
    if plan.logit_rows:
        keep = np.concatenate([np.full(row.sample, row.want_logits, dtype=bool) for row in plan.rows])
        kept = np.ascontiguousarray(logits[keep], dtype=np.float32)
    return StepAnswer(ids, probs, kept, top_ids, top_lp)
