"""The data-plane codec: round trips of every message, header and body validation on decode,
field validation before encode, and the pure handshake decisions."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from engine.errors import DeskfleetError
from engine.wire.codec import decode, decode_body, decode_header, encode
from engine.wire.format import (
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    PROTOCOL_VERSION,
    RESERVED_KINDS,
    DType,
    ErrorCode,
    FrameError,
    FrameKind,
    FrameTooLargeError,
    ProtocolVersionError,
    Role,
    StreamId,
    TruncatedFrameError,
    WireError,
)
from engine.wire.handshake import (
    HandshakeError,
    LocalIdentity,
    check_hello,
    check_hello_ack,
    handshake_error_from,
)
from engine.wire.messages import (
    Error,
    Hello,
    HelloAck,
    Logits,
    Packed,
    Ping,
    Release,
    Tokens,
)
from engine.wire.plan_frame import PlanFrame
from tests.wire.wire_helpers import (
    FP,
    HELLO,
    SAMPLES,
    TENSOR_FRAME,
    TOKENS_1D,
    assert_same,
    patch_header,
    tensor_frame,
)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    frame = encode(msg)
    assert_same(decode(frame), msg)
    header = decode_header(frame[:HEADER_SIZE])
    assert header.body_len == len(frame) - HEADER_SIZE
    assert_same(decode_body(header, frame[HEADER_SIZE:]), msg)


def test_every_kind_has_a_sample():
    kinds = {decode_header(encode(m)[:HEADER_SIZE]).kind for m in SAMPLES}
    assert kinds == set(FrameKind) - RESERVED_KINDS
    assert {k.name for k in RESERVED_KINDS} == {"FORWARD", "CAPTURE", "RESTORE"}  # retired in version 6
    assert issubclass(WireError, DeskfleetError)


# --- header validation ---------------------------------------------------------------------------

TOKENS_FRAME, HELLO_FRAME, PING_FRAME = encode(TOKENS_1D), encode(HELLO), encode(Ping(1))
HEADER_CASES = [
    (TENSOR_FRAME, {"magic": b"GET "}, FrameError, "magic"),
    (TENSOR_FRAME, {"version": PROTOCOL_VERSION + 1}, ProtocolVersionError, f"version {PROTOCOL_VERSION + 1}"),
    (TENSOR_FRAME, {"kind": 99}, FrameError, "unknown frame kind 99"),
    (TENSOR_FRAME, {"kind": int(FrameKind.TOKENS)}, FrameError, "TOKENS frame cannot carry dtype FLOAT32"),
    (TENSOR_FRAME, {"kind": int(FrameKind.FORWARD)}, FrameError, "FORWARD was retired"),
    (TENSOR_FRAME, {"kind": int(FrameKind.RESTORE)}, FrameError, "RESTORE was retired"),
    (TENSOR_FRAME, {"flags": 0x02}, FrameError, "flag"),
    (TOKENS_FRAME, {"flags": 0x01}, FrameError, "flag"),
    (TENSOR_FRAME, {"reserved": 1}, FrameError, "reserved header"),
    (TENSOR_FRAME, {"stream_id": 0}, FrameError, "stream id"),
    (PING_FRAME, {"stream_id": 5}, FrameError, "stream id 0"),
    (HELLO_FRAME, {"seq": 1}, FrameError, "seq 0"),
    (TENSOR_FRAME, {"dtype": 9}, FrameError, "unknown dtype"),
    (TENSOR_FRAME, {"dtype": int(DType.NONE)}, FrameError, "cannot carry dtype"),
    (TOKENS_FRAME, {"dtype": int(DType.FLOAT32)}, FrameError, "cannot carry dtype"),
    (TENSOR_FRAME, {"ndim": 5}, FrameError, "5-dim"),
    (TENSOR_FRAME, {"ndim": 4, "dim3": 1}, FrameError, "4-dim"),
    (TENSOR_FRAME, {"dim1": 0}, FrameError, "bad dims"),
    (TOKENS_FRAME, {"dim2": 1}, FrameError, "bad dims"),
    (TENSOR_FRAME, {"payload_len": 63}, FrameError, "payload_len"),
    (TENSOR_FRAME, {"dim2": 2**32 - 1}, FrameError, "payload_len"),
    (
        TENSOR_FRAME,
        {"dim2": 2**32 - 1, "payload_len": 2 * (2**32 - 1) * 4},
        FrameTooLargeError,
        "bound",
    ),
    (TOKENS_FRAME, {"meta_len": 2**32 - 1}, FrameTooLargeError, "bound"),
    (TENSOR_FRAME, {"meta_len": 2**32 - 1}, FrameError, "PACKED meta section"),
    (PING_FRAME, {"meta_len": 1}, FrameError, "meta section"),
    (HELLO_FRAME, {"meta_len": 1000}, FrameError, "meta section"),
]


@pytest.mark.parametrize(
    ("frame", "changes", "exc", "words"), HEADER_CASES, ids=[f"{c}" for _, c, _, _ in HEADER_CASES]
)
def test_header_field_is_validated(frame, changes, exc, words):
    bad = patch_header(frame, **changes)
    with pytest.raises(exc, match=words):
        decode_header(bad[:HEADER_SIZE])
    with pytest.raises(exc):
        decode(bad)


def test_size_bound_is_configurable_and_checked_on_both_sides():
    msg = tensor_frame(s=64, h=1024)  # 256 KiB of hidden states
    with pytest.raises(FrameTooLargeError, match="chunks"):
        encode(msg, max_frame_bytes=128 * 1024)
    frame = encode(msg)
    with pytest.raises(FrameTooLargeError, match="bound"):
        decode(frame, max_frame_bytes=128 * 1024)
    assert_same(decode(frame, max_frame_bytes=len(frame)), msg)


def test_truncated_and_overlong_frames():
    with pytest.raises(TruncatedFrameError):
        decode(TENSOR_FRAME[: HEADER_SIZE - 1])
    with pytest.raises(TruncatedFrameError, match="announced"):
        decode(TENSOR_FRAME[:-1])
    with pytest.raises(FrameError, match="unexpected bytes"):
        decode(TENSOR_FRAME + b"\0")


# --- body validation ---------------------------------------------------------------------------
# Frames are built here from the layouts in docs/PROTOCOL.md, not with the codec's own structs.


def raw_frame(kind, meta=b"", payload=b"", *, dtype=DType.NONE, shape=(), stream=1, seq=0, flags=0):
    """A frame with a well-formed header around arbitrary (possibly invalid) meta and payload."""
    dims = list(shape) + [0] * (4 - len(shape))
    head = HEADER_STRUCT.pack(
        MAGIC, PROTOCOL_VERSION, kind, flags, stream, seq, dtype, len(shape), 0, *dims, len(meta), len(payload)
    )
    return head + meta + payload


def raw_packed(plan=((0, 5, 0), (-1, 0, 0)), *, rows=None, reserved=0, tensor=None, extra=b""):
    """A Packed frame: the ``plan`` columns (slot, position, reuse) per row, over ``tensor``."""
    plan = np.array(plan, "<i8").T  # [3, S]
    tensor = np.zeros((1, plan.shape[1], 2), np.float32) if tensor is None else tensor
    meta = struct.pack("<HH", plan.shape[1] if rows is None else rows, reserved) + plan.tobytes() + extra
    code = {np.dtype("<i8"): DType.INT64, np.dtype("<f4"): DType.FLOAT32}[tensor.dtype]
    return raw_frame(FrameKind.PACKED, meta, tensor.tobytes(), dtype=code, shape=tensor.shape)


def raw_tokens(probs, ids=(1, 2), extra=b""):
    """A Tokens frame carrying ``ids`` (int64) with ``probs`` (float32) and ``extra`` as its meta."""
    ids = np.array(ids, "<i8")
    meta = np.array(probs, "<f4").tobytes() + extra
    return raw_frame(FrameKind.TOKENS, meta, ids.tobytes(), dtype=DType.INT64, shape=ids.shape)


def raw_hello(version=1, stage=0, bound=1 << 20, role=2, fp=b"abc", fp_len=None):
    """A Hello frame with the given field values, the fingerprint length defaulting to len(fp)."""
    meta = struct.pack("<HHQBB", version, stage, bound, role, len(fp) if fp_len is None else fp_len)
    return raw_frame(FrameKind.HELLO, meta + fp, stream=0)


BODY_CASES = [
    (raw_packed(), None),  # the valid baseline of the cases below
    (raw_frame(FrameKind.LOGITS, b"", b"\0" * 8, dtype=DType.FLOAT32, shape=(2,)), "2-dim|1-dim"),
    (raw_tokens([0.0]), "probs"),  # one probability for two ids
    (raw_tokens([0.5, 1.5]), r"\[0, 1\]"),
    (raw_tokens([0.5, np.nan]), r"\[0, 1\]"),
    (raw_packed(reserved=1), "needs 56 with 1 stage times"),  # the stage-time count without its times
    (raw_packed(reserved=256, extra=b"\0" * 1024), "at most 255"),
    (raw_tokens([0.5, 0.5], extra=b"\0" * 3), "stage times"),
    (raw_tokens([0.5, 0.5], extra=np.array([-1.0], "<f4").tobytes()), "non-negative ms"),
    (raw_packed(rows=3), "3-row plan needs"),
    (raw_packed(extra=b"\0" * 8), "2-row plan needs"),
    (raw_packed(((0, 5, 6), (-1, 0, 0))), "reuse length exceeds"),
    (raw_packed(((0, 5, 0), (-1, 3, 0))), "idle rows"),
    (raw_packed(((0, 5, 0), (0, 7, 0))), "consecutive positions"),
    (raw_packed(((-2, 5, 0), (-1, 0, 0))), "slots must be >= -1"),
    (raw_packed(tensor=np.zeros((1, 3, 2), np.float32)), "S = 2 plan rows"),
    (raw_packed(tensor=np.zeros((2, 2, 2), np.float32)), r"\[1,S,H\]"),
    (raw_packed(tensor=np.array([[4, -4]], "<i8")), "token ids must be >= 0"),
    (raw_tokens([0.5, 0.5], ids=(-1, -2)), "ids must be >= 0"),
    (raw_frame(FrameKind.ERROR, b"\x07", stream=0), "shorter than its 2-byte code"),
    (raw_frame(FrameKind.ERROR, b"\x63\x00oops", stream=0), "unknown error code 99"),
    (raw_frame(FrameKind.ERROR, b"\x01\x00\xff\xfe", stream=0), "UTF-8"),
    (raw_hello(role=9), "unknown Hello role 9"),
    (raw_hello(fp=b"ab\xffc"), "ASCII"),
    (raw_hello(fp=b"a b"), "printable"),
    (raw_hello(fp=b""), "printable"),
    (raw_hello(fp_len=7), "fingerprint length"),
    (raw_hello(bound=100), "max_frame_bytes"),
    (raw_hello(version=0), "protocol_version"),
    (raw_frame(FrameKind.HELLO, b"\0" * 5, stream=0), "shorter than its 14-byte"),
]


@pytest.mark.parametrize(("frame", "words"), BODY_CASES, ids=[str(w) for _, w in BODY_CASES])
def test_body_field_is_validated(frame, words):
    if words is None:
        assert isinstance(decode(frame), Packed)
        return
    with pytest.raises(FrameError, match=words):
        decode(frame)


# --- field validation before encoding ------------------------------------------------------------


def packed_of(tensor):
    """Packed(stream 1, seq 0) of a 2-row plan over ``tensor`` (each case breaks the tensor)."""
    return Packed(StreamId(1), 0, PlanFrame.of([(0, 0, 0), (1, 0, 0)], 2), tensor)


ENCODE_CASES = [
    (lambda: tensor_frame(dtype=np.int32), "astype"),
    (lambda: packed_of(np.zeros((1, 2, 4), ">f4")), "astype"),
    (lambda: tensor_frame(stream=0), "stream_id must be >= 1"),
    (lambda: tensor_frame(seq=-1), "seq"),
    (lambda: tensor_frame(seq=2**64), "seq"),
    (lambda: packed_of([[1, 2]]), "numpy array"),
    (lambda: Tokens(StreamId(1), 0, np.array([1, 2], "<i8"), np.ones(3, np.float32)), "shape"),
    (lambda: Logits(StreamId(1), 0, np.zeros(4, np.float32)), "dims"),
    (lambda: Error(ErrorCode.INTERNAL, "x" * 5000), "4096"),
    (lambda: Error(3, "x"), "ErrorCode"),
    (lambda: Hello("f" * 129, 0, Role.STAGE), "printable"),
    (lambda: Hello(FP, 70000, Role.STAGE), "stage_index"),
    (lambda: Hello(FP, 0, 2), "Role"),
    (lambda: HelloAck(FP, 0, max_frame_bytes=10), "max_frame_bytes"),
    (lambda: Ping(-1), "Ping.seq"),
    (lambda: Release(StreamId(0)), "stream_id"),
]


@pytest.mark.parametrize(("build", "words"), ENCODE_CASES, ids=[w for _, w in ENCODE_CASES])
def test_invalid_message_is_refused_before_encoding(build, words):
    with pytest.raises(FrameError, match=words):
        encode(build())


def test_encode_refuses_a_non_message():
    with pytest.raises(FrameError, match="not a data-plane message"):
        encode(object())  # type: ignore[arg-type]


# --- pure handshake decisions --------------------------------------------------------------------


def test_check_hello_names_every_mismatching_field():
    local = LocalIdentity(FP, 2, accepted_roles=frozenset({Role.STAGE}))
    assert check_hello(Hello(FP, 2, Role.STAGE), local) is None
    refusal = check_hello(Hello("other", 3, Role.COORDINATOR, protocol_version=7), local)
    assert refusal.code is ErrorCode.PROTOCOL_VERSION_MISMATCH
    for name in ("protocol_version", "model_fingerprint", "stage_index", "role"):
        assert f"{name} mismatch" in refusal.message


def test_check_hello_ack_and_refusals_name_the_field():
    hello = Hello(FP, 2, Role.STAGE)
    check_hello_ack(hello, HelloAck(FP, 2))  # the identity asked for: accepted
    with pytest.raises(HandshakeError, match="stage_index mismatch") as wrong_stage:
        check_hello_ack(hello, HelloAck(FP, 3))
    assert wrong_stage.value.field == "stage_index"
    assert wrong_stage.value.code is ErrorCode.STAGE_INDEX_MISMATCH
    refusal = check_hello(Hello(FP, 2, Role.COORDINATOR), LocalIdentity(FP, 2, frozenset()))
    error = handshake_error_from(refusal)
    assert (error.field, error.code) == ("role", ErrorCode.ROLE_REFUSED)
    assert handshake_error_from(Error(ErrorCode.INTERNAL, "boom"), sent=True).field == "frame"
