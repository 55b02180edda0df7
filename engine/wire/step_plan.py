"""The plan of one paged step: which streams take part, how many new tokens each, where their KV lives.

The coordinator decides it (it owns every stream's block table) and it travels with the step, so
every stage of a paged ring runs the same PagedAttention call on its own cache tensors and the
stages' block pools stay in lockstep. A stage holds no policy: it turns a plan into the
PagedAttention inputs (:mod:`engine.paged.stage`) and runs one infer for all its rows.

Rows are the new tokens of the step, stream after stream in plan order (T real rows). The payload
is padded to :func:`bucket_tokens` (T) rows so OpenVINO sees few distinct shapes; the padding rows
form one extra subsequence that writes into the scratch blocks ``0 .. SCRATCH_BLOCKS-1``, which
the coordinator never gives to a stream. docs/PROTOCOL.md ("Step") is the normative description.

A row may also carry what the last stage needs to answer a constrained or a logprobs request: an
allowed-token mask per answered row (structured output: the top-1 is then picked among the allowed
tokens, and any logits returned are masked) and a top-k count (the ids and log-probabilities of the
k likeliest tokens of every answered row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.errors import GenerationError
from engine.wire.format import MAX_MASK_WORDS, MAX_STEP_MASK_WORDS, MAX_TOP_K

# The CPU plugin's PagedAttention block (openvino.genai: cpu_block_size = 32); the GPU's is 16.
CPU_BLOCK_SIZE = 32
GPU_BLOCK_SIZE = 16
# Blocks 0..SCRATCH_BLOCKS-1 of every pool hold the padding subsequence's junk, never a stream's KV.
SCRATCH_BLOCKS = 4
# Protocol limits of one step (the frame's u16/u32 fields and a sane bound on a block table).
MAX_STEP_ROWS = 4096  # streams in one step
MAX_STEP_TOKENS = 1 << 16  # new tokens in one step (after padding)
MAX_POOL_BLOCKS = 1 << 24


def bucket_tokens(tokens: int) -> int:
    """The padded row count for ``tokens`` real rows: a power of two up to 16, a multiple of 32 up
    to 512, then a multiple of 128. The padding never needs more than SCRATCH_BLOCKS * 32 rows."""
    if tokens < 1:
        raise GenerationError("a step carries at least one token")
    if tokens <= 16:
        return 1 << (tokens - 1).bit_length()
    if tokens <= 512:
        return -(-tokens // 32) * 32
    return -(-tokens // 128) * 128


def blocks_needed(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` cached positions."""
    return -(-tokens // block_size)


_MASK_DTYPE = np.dtype("<u4")


@dataclass(frozen=True, eq=False)
class PlanRow:
    """One stream's part of a step.

    ``past_len`` tokens of the stream are already in its blocks; the step brings ``new_tokens``
    more (a decode 1, a speculative verify 1+K, a prefill chunk C), at positions ``past_len ..``.
    ``blocks`` are the physical block ids covering ``past_len + new_tokens`` positions in logical
    order. The last stage answers for the trailing ``sample`` rows (0: a prefill chunk that is not
    the last; its reply carries nothing) with top-1, plus full logits when ``want_logits``.
    ``top_k`` (0..MAX_TOP_K) asks for the ids and log-probabilities of the k likeliest tokens of
    every answered row. ``mask`` uint32 [sample, W] is an allowed-token bitmask per answered row
    (token t allowed iff bit t % 32 of word t // 32 is set; W = ceil(V / 32) of the last stage's
    logits width V): the top-1, the top-k and any logits returned are taken over allowed tokens only.
    """

    stream_id: int
    past_len: int
    new_tokens: int
    blocks: tuple[int, ...]
    sample: int = 1
    want_logits: bool = False
    top_k: int = 0
    mask: np.ndarray | None = None

    def _key(self) -> tuple:
        return (self.stream_id, self.past_len, self.new_tokens, self.blocks, self.sample, self.want_logits,
                self.top_k)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlanRow):
            return NotImplemented
        if self._key() != other._key():
            return False
        if self.mask is None or other.mask is None:
            return self.mask is other.mask
        return self.mask.shape == other.mask.shape and bool(np.array_equal(self.mask, other.mask))

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def mask_words(self) -> int:
        """W, the u32 words of this row's mask per answered row (0 without a mask)."""
        return 0 if self.mask is None else int(self.mask.shape[1])

    def check(self, block_size: int, pool_blocks: int) -> None:
        """GenerationError unless the row is one a stage can run."""
        if not 1 <= self.stream_id < 2**64:
            raise GenerationError(f"a plan row names stream {self.stream_id}; stream ids are 1..2**64-1")
        if self.past_len < 0 or self.new_tokens < 1:
            raise GenerationError(f"stream {self.stream_id}: past_len {self.past_len} must be >= 0 and "
                                  f"new_tokens {self.new_tokens} >= 1")
        if not 0 <= self.sample <= self.new_tokens:
            raise GenerationError(f"stream {self.stream_id}: sample {self.sample} must be between 0 and "
                                  f"its {self.new_tokens} new tokens")
        if self.want_logits and not self.sample:
            raise GenerationError(f"stream {self.stream_id} wants logits for no row")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise GenerationError(f"stream {self.stream_id} asks for the top {self.top_k} tokens; top_k is "
                                  f"0..{MAX_TOP_K}")
        if self.top_k and not self.sample:
            raise GenerationError(f"stream {self.stream_id} asks for the top {self.top_k} tokens of no row "
                                  "(sample 0)")
        if self.mask is not None:
            self._check_mask()
        want = blocks_needed(self.past_len + self.new_tokens, block_size)
        if len(self.blocks) != want:
            raise GenerationError(f"stream {self.stream_id} holds {self.past_len + self.new_tokens} positions, "
                                  f"which need {want} blocks of {block_size}; the plan gives {len(self.blocks)}")
        for b in self.blocks:
            if not SCRATCH_BLOCKS <= b < pool_blocks:
                raise GenerationError(f"stream {self.stream_id}: block {b} is outside the pool's stream blocks "
                                      f"{SCRATCH_BLOCKS}..{pool_blocks - 1}")
        if len(set(self.blocks)) != len(self.blocks):
            raise GenerationError(f"stream {self.stream_id} lists a block twice")

    def _check_mask(self) -> None:
        m = self.mask
        if not isinstance(m, np.ndarray) or m.dtype != _MASK_DTYPE or m.ndim != 2:
            raise GenerationError(f"stream {self.stream_id}: a token mask is a 2-dim little-endian uint32 numpy "
                                  f"array [sample, ceil(V/32)], got {getattr(m, 'dtype', type(m).__name__)}"
                                  f"{list(getattr(m, 'shape', ()))}")
        if not self.sample:
            raise GenerationError(f"stream {self.stream_id} carries a token mask for no row (sample 0)")
        if m.shape[0] != self.sample or not 1 <= m.shape[1] <= MAX_MASK_WORDS:
            raise GenerationError(f"stream {self.stream_id}: its token mask is {list(m.shape)}; it must be "
                                  f"[sample={self.sample}, W] with W = ceil(V/32) in 1..{MAX_MASK_WORDS}")
        if not m.any(axis=1).all():
            raise GenerationError(f"stream {self.stream_id}: a row of its token mask allows no token")


@dataclass(frozen=True)
class StepPlan:
    """Everything every stage needs for one paged step, besides the rows' inputs.

    ``pool_blocks`` is the pool size the coordinator assumes (a stage whose pool is smaller
    refuses the step); ``copies`` are (source, destination) block copies every stage makes
    before the infer (copy-on-write of a shared partial block). ``token_budget`` is the budget
    the coordinator composed the step under (a stage may report it with its timing). Rows of
    one step name distinct streams.
    """

    block_size: int
    pool_blocks: int
    rows: tuple[PlanRow, ...]
    copies: tuple[tuple[int, int], ...] = ()
    token_budget: int = 0
    padded_tokens: int = field(default=0)

    def __post_init__(self) -> None:
        if self.block_size not in (CPU_BLOCK_SIZE, GPU_BLOCK_SIZE):
            raise GenerationError(f"block size {self.block_size} is neither the CPU's {CPU_BLOCK_SIZE} nor the "
                                  f"GPU's {GPU_BLOCK_SIZE}")
        if not SCRATCH_BLOCKS < self.pool_blocks <= MAX_POOL_BLOCKS:
            raise GenerationError(f"a pool of {self.pool_blocks} blocks is outside {SCRATCH_BLOCKS + 1}.."
                                  f"{MAX_POOL_BLOCKS}")
        if not 1 <= len(self.rows) <= MAX_STEP_ROWS:
            raise GenerationError(f"a step has 1..{MAX_STEP_ROWS} rows, got {len(self.rows)}")
        for row in self.rows:
            row.check(self.block_size, self.pool_blocks)
        if len({row.stream_id for row in self.rows}) != len(self.rows):
            raise GenerationError("a step names one stream twice")
        widths = {row.mask_words for row in self.rows if row.mask is not None}
        if len(widths) > 1:
            raise GenerationError(f"the token masks of one step must have one width (one vocabulary); this step's "
                                  f"have {sorted(widths)} words")
        if self.mask_rows * self.mask_words > MAX_STEP_MASK_WORDS:
            raise GenerationError(f"a step's token masks hold {self.mask_rows} x {self.mask_words} words; at most "
                                  f"{MAX_STEP_MASK_WORDS}")
        real = self.tokens
        padded = self.padded_tokens or bucket_tokens(real)
        if not real <= padded <= MAX_STEP_TOKENS or padded - real > SCRATCH_BLOCKS * self.block_size:
            raise GenerationError(f"a step of {real} tokens cannot be padded to {padded}")
        object.__setattr__(self, "padded_tokens", padded)
        for src, dst in self.copies:
            if not (SCRATCH_BLOCKS <= src < self.pool_blocks and SCRATCH_BLOCKS <= dst < self.pool_blocks) \
                    or src == dst:
                raise GenerationError(f"block copy {src} -> {dst} is outside the pool or onto itself")

    @property
    def tokens(self) -> int:
        """Real new-token rows T (before padding)."""
        return sum(row.new_tokens for row in self.rows)

    @property
    def sampled(self) -> int:
        """Rows the last stage answers for (top-1 ids and probabilities), in plan order."""
        return sum(row.sample for row in self.rows)

    @property
    def logit_rows(self) -> int:
        """Rows whose full logits the reply carries, in plan order."""
        return sum(row.sample for row in self.rows if row.want_logits)

    @property
    def top_k(self) -> int:
        """k of the reply's top-k section: the largest ``top_k`` a row asks for (0: no section)."""
        return max(row.top_k for row in self.rows)

    @property
    def mask_words(self) -> int:
        """W, the u32 words per masked row (one vocabulary per step; 0 when no row carries a mask)."""
        return max(row.mask_words for row in self.rows)

    @property
    def mask_rows(self) -> int:
        """M, the answered rows that carry a mask (the frame's mask section is u32 [M, W])."""
        return sum(row.sample for row in self.rows if row.mask is not None)

    def sampled_indices(self) -> list[int]:
        """Row indices (into the T real rows) of every answered row, in plan order."""
        out: list[int] = []
        begin = 0
        for row in self.rows:
            end = begin + row.new_tokens
            out.extend(range(end - row.sample, end))
            begin = end
        return out


def plan(block_size: int, pool_blocks: int, rows: Sequence[PlanRow], **kwargs) -> StepPlan:
    """A checked plan (shorthand for tests and the scheduler)."""
    return StepPlan(block_size, pool_blocks, tuple(rows), **kwargs)
