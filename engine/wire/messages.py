"""The data-plane messages: one frozen dataclass per frame kind, its fields checked at init.

A message that exists is valid: every constructor raises FrameError for a field the protocol
refuses, so the encoder can trust its input and the decoder gets the same checks for free by
building messages from what it read. docs/PROTOCOL.md states the rules.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from engine.errors import GenerationError
from engine.wire.format import (
    MAX_DIMS,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_FINGERPRINT_BYTES,
    MAX_FRAME_BYTES,
    MAX_FRAME_STAGES,
    MAX_STEP_BLOCK_IDS,
    MAX_STEP_COPIES,
    MAX_STEP_STAGES,
    MAX_TOP_K,
    MIN_FRAME_BOUND,
    PROTOCOL_VERSION,
    U16_MAX,
    U32_MAX,
    U64_MAX,
    ErrorCode,
    FrameError,
    Role,
    StreamId,
    WireError,
)
from engine.wire.plan_frame import PlanFrame
from engine.wire.step_plan import MAX_STEP_TOKENS, PlanRow, StepPlan

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_INT64 = np.dtype("<i8")
_FLOAT32 = np.dtype("<f4")
_FLOAT16 = np.dtype("<f2")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_ROW_NUMBERS = ("stream_id", "past_len", "new_tokens", "sample", "top_k")


def _shape_repr(msg: DataclassInstance) -> str:
    """repr of a tensor message that shows dtypes and shapes, not megabytes of numbers."""
    parts = []
    for f in fields(msg):
        v = getattr(msg, f.name)
        shown = f"{v.dtype}{list(v.shape)}" if isinstance(v, np.ndarray) else repr(v)
        parts.append(f"{f.name}={shown}")
    return f"{type(msg).__name__}({', '.join(parts)})"


@dataclass(frozen=True, eq=False, repr=False)
class Tokens:
    """The last stage's top-1 answer: ids int64 [S] (or [B,S]) and their probabilities float32;
    ``stage_ms`` every stage's compute ms for this step, in ring order (the Packed frame's, plus its own)."""

    stream_id: StreamId
    seq: int
    ids: np.ndarray
    probs: np.ndarray
    stage_ms: tuple[float, ...] = ()
    __repr__ = _shape_repr

    def __post_init__(self) -> None:
        _check_stream(self.stream_id, self.seq, "Tokens")
        object.__setattr__(self, "stage_ms", _check_stage_ms(self.stage_ms, "Tokens.stage_ms", MAX_FRAME_STAGES))
        _check_array(self.ids, "Tokens.ids", (_INT64,), ndims=(1, 2))
        _check_array(self.probs, "Tokens.probs", (_FLOAT32,), ndims=(1, 2))
        if self.probs.shape != self.ids.shape:
            raise FrameError(f"Tokens.probs shape {self.probs.shape} != ids {self.ids.shape}")
        if self.ids.min() < 0:
            raise FrameError("Tokens.ids must be >= 0")
        if not ((self.probs >= 0) & (self.probs <= 1)).all():  # NaN fails both comparisons
            raise FrameError("Tokens.probs must be probabilities in [0, 1]")


@dataclass(frozen=True, eq=False, repr=False)
class Logits:
    """Full-vocabulary logits float32/float16 [B,V] or [B,S,V], sent when a Packed frame wanted
    them; ``stage_ms`` as :class:`Tokens`."""

    stream_id: StreamId
    seq: int
    logits: np.ndarray
    stage_ms: tuple[float, ...] = ()
    __repr__ = _shape_repr

    def __post_init__(self) -> None:
        _check_stream(self.stream_id, self.seq, "Logits")
        object.__setattr__(self, "stage_ms", _check_stage_ms(self.stage_ms, "Logits.stage_ms", MAX_FRAME_STAGES))
        _check_array(self.logits, "Logits.logits", (_FLOAT32, _FLOAT16), ndims=(2, 3))


@dataclass(frozen=True, eq=False, repr=False)
class Packed:
    """One inference of a packed static ring (NPU-target export): stage 0's plan and the rows' input.

    ``plan`` says, per row, which slot it serves, at which true absolute position, and how much
    of the slot's previous sequence its request reuses; every stage derives its mask and KV writes
    from it, so the stages' host KV rings stay in lockstep. ``tensor`` is int64 token ids [1,S]
    (into stage 0) or float32/float16 hidden states [1,S,H], S = the plan's rows. The last stage
    answers with **Tokens** [S] (each row's top-1), or with **Logits** [S,V] when ``want_logits``
    (constrained output and log-probabilities, decided at the coordinator), under the same
    ``stream_id`` and ``seq``; one stream id names one packed session, and **Release** of it empties
    every slot. ``stage_ms``: every stage's compute ms already passed, in ring order (each
    stage appends its own; at most 255).
    """

    stream_id: StreamId
    seq: int
    plan: PlanFrame
    tensor: np.ndarray
    want_logits: bool = False
    stage_ms: tuple[float, ...] = ()
    __repr__ = _shape_repr

    def __post_init__(self) -> None:
        _check_stream(self.stream_id, self.seq, "Packed")
        object.__setattr__(self, "stage_ms", _check_stage_ms(self.stage_ms, "Packed.stage_ms", MAX_FRAME_STAGES))
        if not isinstance(self.plan, PlanFrame):
            raise FrameError(f"Packed.plan must be a PlanFrame, got {type(self.plan).__name__}")
        rows = self.plan.rows
        if rows > U16_MAX:
            raise FrameError(f"Packed plan has {rows} rows; at most {U16_MAX}")
        t = self.tensor
        _check_array(t, "Packed.tensor", (_INT64, _FLOAT32, _FLOAT16))
        want = "[1,S]" if t.dtype == np.int64 else "[1,S,H]"
        if t.ndim != (2 if t.dtype == np.int64 else 3) or t.shape[0] != 1 or t.shape[1] != rows:
            raise FrameError(f"Packed {'token ids' if t.dtype == np.int64 else 'hidden states'} must be "
                             f"{want} with S = {rows} plan rows, got shape {t.shape}")
        if t.dtype == np.int64 and t.min() < 0:
            raise FrameError("Packed token ids must be >= 0")


@dataclass(frozen=True, eq=False, repr=False)
class Step:
    """One paged step of session ``session``: the coordinator's plan and the receiving stage's input.

    ``tensor`` is int64 token ids [Tb] (into stage 0) or float32/float16 hidden states [Tb, H],
    Tb = ``plan.padded_tokens`` (rows T..Tb-1 are the padding subsequence). ``stage_ms`` holds the
    compute time in ms of every stage already passed, in ring order: each stage passes on
    :meth:`passed_on` its output with its own time appended. The last stage answers with a
    :class:`StepReply` of the same session and seq. Arrays are shared: treat them as immutable.
    """

    session: StreamId
    seq: int
    plan: StepPlan
    tensor: np.ndarray
    stage_ms: tuple[float, ...] = ()
    __repr__ = _shape_repr

    def __post_init__(self) -> None:
        _check_stream(self.session, self.seq, "Step")
        _check_step_plan(self.plan)
        t = self.tensor
        _check_array(t, "Step.tensor", (_INT64, _FLOAT32, _FLOAT16))
        ids = t.dtype == np.int64
        if t.ndim != (1 if ids else 2) or t.shape[0] != self.plan.padded_tokens:
            want = "token ids [Tb]" if ids else "hidden states [Tb, H]"
            raise FrameError(f"Step {want} must have Tb = {self.plan.padded_tokens} (the plan's padded "
                             f"tokens) rows, got shape {t.shape}")
        if ids and t.min() < 0:
            raise FrameError("Step token ids must be >= 0")
        object.__setattr__(self, "stage_ms", _check_stage_ms(self.stage_ms, "Step.stage_ms"))

    def passed_on(self, tensor: np.ndarray, compute_ms: float) -> Step:
        """The Step this stage sends on: its output ``tensor`` [Tb, H], its compute time appended."""
        return Step(self.session, self.seq, self.plan, tensor, (*self.stage_ms, compute_ms))


@dataclass(frozen=True, eq=False, repr=False)
class StepReply:
    """The last stage's answer to a Step (same ``session`` and ``seq``).

    ``ids`` int64 [R] and ``probs`` float32 [R] in [0, 1]: the top-1 of every answered row and its
    probability (over the row's allowed tokens when the row carries a mask), R = ``plan.sampled``
    in plan order (0 for a step of prefill chunks only); ``logits`` float32 [L, V] for the answered
    rows of ``want_logits`` streams (masked rows: -inf where not allowed; L = ``plan.logit_rows``
    <= R), or None when no stream wanted them; ``stage_ms`` every stage's compute time in ms, in
    ring order. ``top_ids`` int64 [R, k] and ``top_logprobs`` float32 [R, k], k = ``plan.top_k``
    (both None when k = 0): per answered row its k likeliest tokens, best first, with their
    log-softmax of the raw logits after the mask; an entry past the row's own ``top_k`` (or past
    its allowed tokens) is id -1 with log-probability -inf.
    """

    session: StreamId
    seq: int
    ids: np.ndarray
    probs: np.ndarray
    logits: np.ndarray | None = None
    stage_ms: tuple[float, ...] = ()
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    __repr__ = _shape_repr

    def __post_init__(self) -> None:
        _check_stream(self.session, self.seq, "StepReply")
        for name, dtype in (("ids", _INT64), ("probs", _FLOAT32)):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1:
                raise FrameError(f"StepReply.{name} must be a 1-dim {dtype} numpy array, got "
                                 f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', ()))}")
        r = self.ids.shape[0]
        if self.probs.shape != (r,) or r > MAX_STEP_TOKENS:
            raise FrameError(f"StepReply.probs {self.probs.shape} must match ids ({r},), at most {MAX_STEP_TOKENS}")
        if r and self.ids.min() < 0:
            raise FrameError("StepReply.ids must be >= 0")
        if not ((self.probs >= 0) & (self.probs <= 1)).all():  # NaN fails both comparisons
            raise FrameError("StepReply.probs must be probabilities in [0, 1]")
        if self.logits is not None:
            _check_array(self.logits, "StepReply.logits", (_FLOAT32,), ndims=(2,))
            if self.logits.shape[0] > r:
                raise FrameError(f"StepReply.logits has {self.logits.shape[0]} rows, more than the {r} "
                                 "answered rows")
        object.__setattr__(self, "stage_ms", _check_stage_ms(self.stage_ms, "StepReply.stage_ms"))
        if self.top_ids is not None or self.top_logprobs is not None:
            self._check_top(r)

    def _check_top(self, r: int) -> None:
        top, logp = self.top_ids, self.top_logprobs
        if top is None or logp is None:
            raise FrameError("StepReply.top_ids and top_logprobs come together (both arrays or both None)")
        _check_array(top, "StepReply.top_ids", (_INT64,), ndims=(2,))
        _check_array(logp, "StepReply.top_logprobs", (_FLOAT32,), ndims=(2,))
        if top.shape != logp.shape or top.shape[0] != r or top.shape[1] > MAX_TOP_K:
            raise FrameError(f"StepReply.top_ids {list(top.shape)} and top_logprobs {list(logp.shape)} must both be "
                             f"[R={r}, k] with k in 1..{MAX_TOP_K}")
        if top.min() < -1:
            raise FrameError("StepReply.top_ids must be token ids >= 0, or -1 for an entry the row did not ask for")
        if not (logp <= 0).all() or (np.isneginf(logp) != (top == -1)).any():  # NaN fails the comparison
            raise FrameError("StepReply.top_logprobs must be log-probabilities <= 0, -inf exactly where top_ids "
                             "is -1")

    @property
    def top_k(self) -> int:
        """k of the top-k section (0: none)."""
        return 0 if self.top_ids is None else int(self.top_ids.shape[1])

    def mismatch(self, plan: StepPlan) -> str | None:
        """Why this reply cannot be the answer to a Step of ``plan`` (its rows are not the plan's
        answered rows, its logits not the wanted ones, or its top-k not the plan's k), or None."""
        rows = self.logits.shape[0] if self.logits is not None else 0
        if (self.ids.shape[0], rows, self.top_k) == (plan.sampled, plan.logit_rows, plan.top_k):
            return None
        return (f"step {self.seq} was answered with {self.ids.shape[0]} rows, {rows} rows of logits and top-"
                f"{self.top_k}; its plan asks for {plan.sampled}, {plan.logit_rows} and top-{plan.top_k}: the last "
                "stage is out of step with the coordinator")


@dataclass(frozen=True)
class Release:
    """The stream is finished: free its KV state on every stage that holds one."""

    stream_id: StreamId
    seq: int = 0

    def __post_init__(self) -> None:
        _check_stream(self.stream_id, self.seq, "Release")


@dataclass(frozen=True)
class Ping:
    """Liveness probe; the receiver answers with a Pong carrying the same ``seq``."""

    seq: int = 0

    def __post_init__(self) -> None:
        _check_u64(self.seq, "Ping.seq")


@dataclass(frozen=True)
class Pong:
    """Answer to a Ping with the same ``seq``."""

    seq: int = 0

    def __post_init__(self) -> None:
        _check_u64(self.seq, "Pong.seq")


@dataclass(frozen=True)
class Error:
    """A failure as data. After a connection-level code (1-31, 48-49) the sender closes the
    connection; ``stream_id`` (0: none) names the stream concerned."""

    code: ErrorCode
    message: str
    stream_id: StreamId = StreamId(0)
    seq: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.code, ErrorCode):
            raise FrameError(f"Error.code must be an ErrorCode, got {self.code!r}")
        _check_u64(self.stream_id, "Error.stream_id")
        _check_u64(self.seq, "Error.seq")
        if len(self.message.encode("utf-8")) > MAX_ERROR_MESSAGE_BYTES:
            raise FrameError(f"Error.message exceeds {MAX_ERROR_MESSAGE_BYTES} UTF-8 bytes")


@dataclass(frozen=True)
class Hello:
    """The dialer's first frame: what it speaks, which model, which stage it expects to reach,
    and the largest frame it accepts (so the listener never sends it one it must refuse)."""

    model_fingerprint: str
    stage_index: int
    role: Role
    max_frame_bytes: int = MAX_FRAME_BYTES
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_identity(self, "Hello")
        if not isinstance(self.role, Role):
            raise FrameError(f"Hello.role must be a Role, got {self.role!r}")


@dataclass(frozen=True)
class HelloAck:
    """The listener's acceptance: its own identity and the largest frame it will accept."""

    model_fingerprint: str
    stage_index: int
    max_frame_bytes: int = MAX_FRAME_BYTES
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_identity(self, "HelloAck")


Message: TypeAlias = (
    Packed | Step | StepReply | Tokens | Logits | Release | Ping | Pong | Error
    | Hello | HelloAck
)


def error_frame(exc: BaseException, stream_id: int = 0, seq: int = 0) -> Error:
    """The Error frame that reports ``exc`` to the peer (message clipped to the wire limit).

    A WireError keeps its code; anything else is reported as INTERNAL.
    """
    code = exc.code if isinstance(exc, WireError) else ErrorCode.INTERNAL
    text = str(exc) if isinstance(exc, WireError) else f"internal error: {exc}"
    clipped = text.encode("utf-8")[:MAX_ERROR_MESSAGE_BYTES].decode("utf-8", "ignore")
    return Error(code, clipped, StreamId(stream_id), seq)


# --- field checks ---------------------------------------------------------------------------------


def _check_u64(value: int, name: str) -> None:
    if not isinstance(value, int) or not 0 <= value <= U64_MAX:
        raise FrameError(f"{name} must be an integer in 0..2**64-1, got {value!r}")


def _check_stream(stream_id: int, seq: int, kind: str) -> None:
    _check_u64(stream_id, f"{kind}.stream_id")
    _check_u64(seq, f"{kind}.seq")
    if stream_id == 0:
        raise FrameError(f"{kind}.stream_id must be >= 1 (0 is reserved for the connection)")


def _check_array(
    a: object, name: str, dtypes: tuple[np.dtype, ...], ndims: tuple[int, ...] | None = None
) -> None:
    if not isinstance(a, np.ndarray):
        raise FrameError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype not in dtypes:
        wanted = " or ".join(str(d) for d in dtypes)
        raise FrameError(f"{name} has dtype {a.dtype}; convert it with .astype() to {wanted}")
    if ndims is not None and a.ndim not in ndims:
        raise FrameError(f"{name} must have {' or '.join(map(str, ndims))} dims, got {a.shape}")
    if not 1 <= a.ndim <= MAX_DIMS or not all(1 <= d <= U32_MAX for d in a.shape):
        raise FrameError(f"{name} has shape {a.shape}; every dim must be in 1..2**32-1")


def _all_integers(values: Iterable[object]) -> bool:
    """Every value a Python or numpy integer, none a bool (checked over the set of their types: fast)."""
    return all(issubclass(t, int | np.integer) and not issubclass(t, bool | np.bool_) for t in set(map(type, values)))


# Plans already checked, by identity (plans are frozen): a Step passed on from stage to stage, or many
# Steps of one plan, check it once. The decoder enters the plans it builds (see remember_checked_plan).
_CHECKED_PLANS: weakref.WeakValueDictionary[int, StepPlan] = weakref.WeakValueDictionary()


def remember_checked_plan(plan: StepPlan) -> None:
    """For engine.wire.step_codec only: ``plan`` was just built by StepPlan from decoded integers
    whose widths the frame bounds, so a Step of it need not check it again."""
    _CHECKED_PLANS[id(plan)] = plan


def _check_step_plan(plan: object) -> None:
    """The plan's types and wire widths, then StepPlan's own rules again (GenerationError becomes
    FrameError: a plan that breaks them is a malformed frame, however it was built)."""
    if not isinstance(plan, StepPlan):
        raise FrameError(f"Step.plan must be a StepPlan, got {type(plan).__name__}")
    if _CHECKED_PLANS.get(id(plan)) is plan:
        return
    scalars = (plan.block_size, plan.pool_blocks, plan.token_budget, plan.padded_tokens)
    if not _all_integers(scalars):
        raise FrameError(f"Step plan fields must be integers, got {scalars}")
    if not 0 <= plan.token_budget <= U32_MAX:
        raise FrameError(f"Step plan token_budget {plan.token_budget} must be in 0..{U32_MAX}")
    rows = plan.rows
    if not isinstance(rows, tuple) or set(map(type, rows)) - {PlanRow}:
        raise FrameError("Step plan rows must be a tuple of PlanRow")
    blocks = tuple(map(attrgetter("blocks"), rows))
    flag_types = set(map(type, map(attrgetter("want_logits"), rows)))
    mask_types = set(map(type, map(attrgetter("mask"), rows)))
    if not _all_integers(chain.from_iterable(map(attrgetter(*_ROW_NUMBERS), rows))) or flag_types - {bool} \
            or mask_types - {type(None), np.ndarray} \
            or set(map(type, blocks)) - {tuple} or not _all_integers(chain.from_iterable(blocks)):
        raise FrameError(f"Step plan rows must hold integers ({', '.join(_ROW_NUMBERS)}), a tuple of integer "
                         "block ids, a bool want_logits and a numpy mask or None")
    block_ids = sum(map(len, blocks))
    if block_ids > MAX_STEP_BLOCK_IDS:
        raise FrameError(f"Step plan lists {block_ids} block ids; one step carries at most {MAX_STEP_BLOCK_IDS}")
    copies = plan.copies
    if not isinstance(copies, tuple) or len(copies) > MAX_STEP_COPIES or set(map(type, copies)) - {tuple} \
            or set(map(len, copies)) - {2} or not _all_integers(chain.from_iterable(copies)):
        raise FrameError(f"Step plan copies must be at most {MAX_STEP_COPIES} (source, destination) integer pairs")
    try:
        replace(plan)  # re-runs StepPlan's checks (and every row's)
    except GenerationError as exc:
        raise FrameError(f"Step plan: {exc}") from None
    _CHECKED_PLANS[id(plan)] = plan


def _check_stage_ms(times: object, name: str, most: int = MAX_STEP_STAGES) -> tuple[float, ...]:
    """``times`` as the float32 values the wire carries (finite, >= 0), so a message round trips."""
    if not isinstance(times, tuple | list) or len(times) > most or not all(
            isinstance(v, float | int | np.floating | np.integer) and not isinstance(v, bool) for v in times):
        raise FrameError(f"{name} must be a tuple of at most {most} times in ms, got {times!r:.80}")
    if not all(0 <= v <= _FLOAT32_MAX for v in times):  # NaN fails the comparison
        raise FrameError(f"{name} must be finite, non-negative ms (as float32), got {times!r:.80}")
    return tuple(np.array(times, np.float32).tolist())


def _check_identity(msg: Hello | HelloAck, kind: str) -> None:
    """The fields Hello and HelloAck share: version, stage, fingerprint and frame bound."""
    version, stage_index = msg.protocol_version, msg.stage_index
    fingerprint, bound = msg.model_fingerprint, msg.max_frame_bytes
    if not isinstance(version, int) or not 1 <= version <= U16_MAX:
        raise FrameError(f"{kind}.protocol_version must be in 1..65535, got {version!r}")
    if not isinstance(stage_index, int) or not 0 <= stage_index <= U16_MAX:
        raise FrameError(f"{kind}.stage_index must be in 0..65535, got {stage_index!r}")
    if (
        not isinstance(fingerprint, str)
        or not 1 <= len(fingerprint) <= MAX_FINGERPRINT_BYTES
        or not all("!" <= c <= "~" for c in fingerprint)
    ):
        raise FrameError(
            f"{kind}.model_fingerprint must be 1..{MAX_FINGERPRINT_BYTES} printable ASCII "
            f"characters (e.g. the manifest sha256 in hex), got {fingerprint!r:.80}"
        )
    if not isinstance(bound, int) or not MIN_FRAME_BOUND <= bound <= U64_MAX:
        raise FrameError(f"max_frame_bytes must be >= {MIN_FRAME_BOUND}, got {bound!r}")
