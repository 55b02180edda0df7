"""The data-plane codec: messages to frame bytes and back (no sockets).

docs/PROTOCOL.md is the normative description; this module is its only implementation.
Decoding never trusts a length it has not checked against the kind's layout and the size
bound, and raises only ``WireError`` subclasses. Decoded messages are built through their
constructors, so every field rule of ``engine.wire.messages`` applies to received frames too.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.errors import GenerationError
from engine.wire.format import (
    DTYPE_CODE,
    ERROR_META,
    HEADER_SIZE,
    HEADER_STRUCT,
    HELLO_ACK_META,
    HELLO_META,
    MAGIC,
    MAX_DIMS,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_FINGERPRINT_BYTES,
    MAX_FRAME_BYTES,
    MAX_FRAME_STAGES,
    NUMPY_DTYPE,
    PACKED_META,
    PROTOCOL_VERSION,
    RESERVED_KINDS,
    U16_MAX,
    DType,
    ErrorCode,
    FrameError,
    FrameFlag,
    FrameKind,
    FrameTooLargeError,
    ProtocolVersionError,
    Role,
    StreamId,
    TruncatedFrameError,
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
from engine.wire.step_codec import (
    MAX_STEP_META,
    MAX_STEP_REPLY_META,
    decode_step,
    decode_step_reply,
    encode_step,
    encode_step_reply,
)

# --- header -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrameHeader:
    """A decoded, validated header: enough to bound and read the rest of the frame."""

    kind: FrameKind
    flags: int
    stream_id: StreamId
    seq: int
    dtype: DType
    shape: tuple[int, ...]
    meta_len: int
    payload_len: int

    @property
    def body_len(self) -> int:
        """Bytes that follow the header: meta then payload."""
        return self.meta_len + self.payload_len


@dataclass(frozen=True)
class _KindRule:
    """What a kind allows in the header. Checked before a single body byte is read."""

    dtypes: frozenset[DType]
    ndims: frozenset[int]
    flags: int = 0
    stream: str = "none"  # "none": must be 0; "required": >= 1; "any"
    max_meta: int | None = 0  # None: bounded only by the frame size bound
    seq: bool = True  # False: seq must be 0


_NO_TENSOR = (frozenset({DType.NONE}), frozenset({0}))
_FLOATS = frozenset({DType.FLOAT32, DType.FLOAT16})
_KIND_RULES: dict[FrameKind, _KindRule] = {
    FrameKind.HELLO: _KindRule(
        *_NO_TENSOR, max_meta=HELLO_META.size + MAX_FINGERPRINT_BYTES, seq=False
    ),
    FrameKind.HELLO_ACK: _KindRule(
        *_NO_TENSOR, max_meta=HELLO_ACK_META.size + MAX_FINGERPRINT_BYTES, seq=False
    ),
    FrameKind.ERROR: _KindRule(
        *_NO_TENSOR, stream="any", max_meta=ERROR_META.size + MAX_ERROR_MESSAGE_BYTES
    ),
    FrameKind.PING: _KindRule(*_NO_TENSOR),
    FrameKind.PONG: _KindRule(*_NO_TENSOR),
    FrameKind.PACKED: _KindRule(
        _FLOATS | {DType.INT64}, frozenset({2, 3}), FrameFlag.WANT_LOGITS, "required",
        PACKED_META.size + 3 * 8 * U16_MAX + 4 * MAX_FRAME_STAGES
    ),
    FrameKind.STEP: _KindRule(_FLOATS | {DType.INT64}, frozenset({1, 2}), 0, "required", MAX_STEP_META),
    FrameKind.STEP_REPLY: _KindRule(
        frozenset({DType.NONE, DType.FLOAT32}), frozenset({0, 2}), 0, "required", MAX_STEP_REPLY_META
    ),
    FrameKind.TOKENS: _KindRule(frozenset({DType.INT64}), frozenset({1, 2}), 0, "required", None),
    FrameKind.LOGITS: _KindRule(_FLOATS, frozenset({2, 3}), 0, "required", 4 * MAX_FRAME_STAGES),
    FrameKind.RELEASE: _KindRule(*_NO_TENSOR, stream="required"),
}


def _check_frame_size(kind: FrameKind, total: int, max_frame_bytes: int) -> None:
    """The size bound, applied by the sender (peer's bound) and the receiver (its own)."""
    if total > max_frame_bytes:
        raise FrameTooLargeError(
            f"{kind.name} frame of {total} bytes exceeds the {max_frame_bytes}-byte bound; send "
            "long prefills in chunks, or raise max_frame_bytes on every node"
        )


def decode_header(
    data: bytes | memoryview, *, max_frame_bytes: int = MAX_FRAME_BYTES
) -> FrameHeader:
    """Decode and validate the fixed header in ``data`` (exactly HEADER_SIZE bytes).

    Raises ProtocolVersionError, FrameTooLargeError, TruncatedFrameError or FrameError; it never
    allocates according to an unchecked length.
    """
    if len(data) != HEADER_SIZE:
        raise TruncatedFrameError(f"a frame header is {HEADER_SIZE} bytes, got {len(data)}")
    (
        magic,
        version,
        kind_no,
        flags,
        stream_id,
        seq,
        dtype_no,
        ndim,
        reserved,
        *dims,
        meta_len,
        payload_len,
    ) = HEADER_STRUCT.unpack(data)
    if magic != MAGIC:
        raise FrameError(
            f"not a Deskfleet data-plane frame (magic {bytes(magic)!r}); check that the peer "
            "dialled the data port, and that both sides agree on TLS"
        )
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"peer speaks data-plane protocol version {version}, this node speaks "
            f"{PROTOCOL_VERSION}; install the same Deskfleet release on every node of the fleet"
        )
    try:
        kind = FrameKind(kind_no)
    except ValueError:
        raise FrameError(f"unknown frame kind {kind_no}") from None
    if kind in RESERVED_KINDS:
        raise FrameError(f"frame kind {kind.name} was retired (with the stateful runtime) and is not part of "
                         f"protocol version {PROTOCOL_VERSION}")
    rule = _KIND_RULES[kind]
    unknown_flags = flags & ~int(rule.flags)  # int(): ~ on an IntFlag keeps only known bits
    if unknown_flags:
        raise FrameError(f"{kind.name} frame has unknown flag bits {unknown_flags:#04x}")
    if reserved:
        raise FrameError("reserved header bytes must be zero")
    if rule.stream == "none" and stream_id:
        raise FrameError(f"{kind.name} frame must have stream id 0, got {stream_id}")
    if rule.stream == "required" and not stream_id:
        raise FrameError(f"{kind.name} frame needs a stream id >= 1")
    if not rule.seq and seq:
        raise FrameError(f"{kind.name} frame must have seq 0, got {seq}")
    try:
        dtype = DType(dtype_no)
    except ValueError:
        raise FrameError(f"unknown dtype code {dtype_no}") from None
    if dtype not in rule.dtypes:
        raise FrameError(f"{kind.name} frame cannot carry dtype {dtype.name}")
    if ndim not in rule.ndims:
        raise FrameError(f"{kind.name} frame cannot carry a {ndim}-dim tensor")
    if (dtype is DType.NONE) != (ndim == 0):
        raise FrameError(f"{kind.name} frame: dtype {dtype.name} with a {ndim}-dim tensor (none means ndim 0)")
    shape = tuple(dims[:ndim])
    if any(d == 0 for d in shape) or any(dims[ndim:]):
        raise FrameError(f"bad dims {dims} for ndim {ndim}: used dims >= 1, unused dims 0")
    itemsize = NUMPY_DTYPE[dtype].itemsize if dtype is not DType.NONE else 0
    if payload_len != math.prod(shape) * itemsize:
        raise FrameError(
            f"payload_len {payload_len} != {math.prod(shape)} elements x {itemsize} bytes "
            f"for {dtype.name} {list(shape)}"
        )
    if rule.max_meta is not None and meta_len > rule.max_meta:
        raise FrameError(f"{kind.name} meta section of {meta_len} bytes exceeds {rule.max_meta}")
    _check_frame_size(kind, HEADER_SIZE + meta_len + payload_len, max_frame_bytes)
    return FrameHeader(kind, flags, StreamId(stream_id), seq, dtype, shape, meta_len, payload_len)


# --- bodies -----------------------------------------------------------------------------------

# Every decoder takes (header, meta, payload tensor or None) and returns the message.
_BodyDecoder = Callable[[FrameHeader, memoryview, np.ndarray | None], Message]


def _stage_times(meta: memoryview, kind: str) -> tuple[float, ...]:
    """The float32 stage times [n] that end a Packed/Tokens/Logits meta section."""
    if len(meta) % 4:
        raise FrameError(f"{kind} stage times take 4 bytes each; {len(meta)} bytes are left for them")
    return tuple(np.frombuffer(meta, "<f4").tolist())


def _times_bytes(stage_ms: tuple[float, ...]) -> bytes:
    return np.array(stage_ms, "<f4").tobytes()


def _decode_packed(header: FrameHeader, meta: memoryview, tensor: np.ndarray | None) -> Message:
    assert tensor is not None
    if len(meta) < PACKED_META.size:
        raise FrameError(f"Packed meta section is shorter than its {PACKED_META.size}-byte descriptor")
    rows, times = PACKED_META.unpack_from(meta)
    if times > MAX_FRAME_STAGES:
        raise FrameError(f"Packed carries {times} stage times; at most {MAX_FRAME_STAGES}")
    plan_end = PACKED_META.size + 3 * 8 * rows
    want = plan_end + 4 * times
    if len(meta) != want:
        raise FrameError(f"Packed meta is {len(meta)} bytes; a {rows}-row plan needs {want} with {times} stage times")
    plan = np.frombuffer(meta[PACKED_META.size : plan_end], "<i8").reshape(3, rows)
    try:
        frame = PlanFrame(plan[0], plan[1], plan[2])
    except GenerationError as exc:
        raise FrameError(f"Packed plan: {exc}") from None
    return Packed(header.stream_id, header.seq, frame, tensor, bool(header.flags & FrameFlag.WANT_LOGITS),
                  _stage_times(meta[plan_end:], "Packed"))


def _encode_packed(msg: Packed) -> bytes:
    """The Packed meta section: row count and stage-time count, the plan's slot, position and
    reuse rows, the stage times."""
    plan = np.stack([msg.plan.slot, msg.plan.position, msg.plan.reuse]).astype("<i8", copy=False)
    return PACKED_META.pack(msg.plan.rows, len(msg.stage_ms)) + plan.tobytes() + _times_bytes(msg.stage_ms)


def _decode_tokens(header: FrameHeader, meta: memoryview, tensor: np.ndarray | None) -> Message:
    assert tensor is not None
    extra = len(meta) - tensor.size * 4
    if extra < 0 or extra % 4 or extra // 4 > MAX_FRAME_STAGES:
        raise FrameError(f"Tokens meta must hold {tensor.size} float32 probs and at most {MAX_FRAME_STAGES} "
                         f"float32 stage times, got {len(meta)} B")
    probs = np.frombuffer(meta[: tensor.size * 4], "<f4").reshape(tensor.shape)
    return Tokens(header.stream_id, header.seq, tensor, probs, _stage_times(meta[tensor.size * 4 :], "Tokens"))


def _decode_logits(header: FrameHeader, meta: memoryview, tensor: np.ndarray | None) -> Message:
    assert tensor is not None
    return Logits(header.stream_id, header.seq, tensor, _stage_times(meta, "Logits"))


def _decode_error(header: FrameHeader, meta: memoryview, tensor: np.ndarray | None) -> Message:
    if len(meta) < ERROR_META.size:
        raise FrameError("Error meta section is shorter than its 2-byte code")
    (code_no,) = ERROR_META.unpack_from(meta)
    try:
        code = ErrorCode(code_no)
    except ValueError:
        raise FrameError(f"unknown error code {code_no}") from None
    try:
        text = bytes(meta[ERROR_META.size :]).decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError("Error message is not valid UTF-8") from None
    return Error(code, text, header.stream_id, header.seq)


def _encode_identity(fixed: struct.Struct, *values: int, fingerprint: str) -> bytes:
    """Hello/HelloAck meta: the ``fixed`` fields, the fingerprint length, the fingerprint."""
    fp = fingerprint.encode("ascii")
    return fixed.pack(*values, len(fp)) + fp


def _decode_identity(meta: memoryview, fixed: struct.Struct) -> tuple[tuple[int, ...], str]:
    """Inverse of _encode_identity: (the fixed fields without the length, the fingerprint)."""
    if len(meta) < fixed.size:
        raise FrameError(f"handshake meta section is shorter than its {fixed.size}-byte fields")
    *values, fp_len = fixed.unpack_from(meta)
    if len(meta) != fixed.size + fp_len:
        raise FrameError(f"handshake meta is {len(meta)} bytes, fingerprint length says otherwise")
    try:
        fingerprint = bytes(meta[fixed.size :]).decode("ascii")
    except UnicodeDecodeError:
        raise FrameError("model fingerprint is not ASCII") from None
    return tuple(values), fingerprint


def _decode_hello(header: FrameHeader, meta: memoryview, tensor: np.ndarray | None) -> Message:
    (version, stage, bound, role_no), fingerprint = _decode_identity(meta, HELLO_META)
    try:
        role = Role(role_no)
    except ValueError:
        raise FrameError(f"unknown Hello role {role_no}") from None
    return Hello(fingerprint, stage, role, bound, version)


def _decode_hello_ack(header: FrameHeader, meta: memoryview, tensor: np.ndarray | None) -> Message:
    (version, stage, bound), fingerprint = _decode_identity(meta, HELLO_ACK_META)
    return HelloAck(fingerprint, stage, bound, version)


_DECODERS: dict[FrameKind, _BodyDecoder] = {
    FrameKind.PACKED: _decode_packed,
    FrameKind.STEP: lambda header, meta, tensor: decode_step(header.stream_id, header.seq, meta, tensor),
    FrameKind.STEP_REPLY: lambda header, meta, tensor: decode_step_reply(header.stream_id, header.seq, meta, tensor),
    FrameKind.TOKENS: _decode_tokens,
    FrameKind.LOGITS: _decode_logits,
    FrameKind.RELEASE: lambda header, meta, tensor: Release(header.stream_id, header.seq),
    FrameKind.PING: lambda header, meta, tensor: Ping(header.seq),
    FrameKind.PONG: lambda header, meta, tensor: Pong(header.seq),
    FrameKind.ERROR: _decode_error,
    FrameKind.HELLO: _decode_hello,
    FrameKind.HELLO_ACK: _decode_hello_ack,
}


def _encode_body(msg: Message) -> tuple[FrameKind, int, int, int, bytes, np.ndarray | None]:
    """(kind, flags, stream_id, seq, meta, tensor) for one message; fields were checked at init."""
    match msg:
        case Packed():
            flags = FrameFlag.WANT_LOGITS if msg.want_logits else 0
            return FrameKind.PACKED, flags, msg.stream_id, msg.seq, _encode_packed(msg), msg.tensor
        case Step():
            return FrameKind.STEP, 0, msg.session, msg.seq, encode_step(msg), msg.tensor
        case StepReply():
            return FrameKind.STEP_REPLY, 0, msg.session, msg.seq, encode_step_reply(msg), msg.logits
        case Tokens():
            meta = np.ascontiguousarray(msg.probs).tobytes() + _times_bytes(msg.stage_ms)
            return FrameKind.TOKENS, 0, msg.stream_id, msg.seq, meta, msg.ids
        case Logits():
            return FrameKind.LOGITS, 0, msg.stream_id, msg.seq, _times_bytes(msg.stage_ms), msg.logits
        case Release():
            return FrameKind.RELEASE, 0, msg.stream_id, msg.seq, b"", None
        case Ping():
            return FrameKind.PING, 0, 0, msg.seq, b"", None
        case Pong():
            return FrameKind.PONG, 0, 0, msg.seq, b"", None
        case Error():
            meta = ERROR_META.pack(msg.code) + msg.message.encode("utf-8")
            return FrameKind.ERROR, 0, msg.stream_id, msg.seq, meta, None
        case Hello():
            meta = _encode_identity(
                HELLO_META,
                msg.protocol_version,
                msg.stage_index,
                msg.max_frame_bytes,
                msg.role,
                fingerprint=msg.model_fingerprint,
            )
            return FrameKind.HELLO, 0, 0, 0, meta, None
        case HelloAck():
            meta = _encode_identity(
                HELLO_ACK_META,
                msg.protocol_version,
                msg.stage_index,
                msg.max_frame_bytes,
                fingerprint=msg.model_fingerprint,
            )
            return FrameKind.HELLO_ACK, 0, 0, 0, meta, None
    raise FrameError(f"cannot encode {type(msg).__name__}: not a data-plane message")


# --- frames -----------------------------------------------------------------------------------


def encode_parts(
    msg: Message, *, max_frame_bytes: int = MAX_FRAME_BYTES
) -> tuple[bytes, bytes, memoryview]:
    """Encode ``msg`` as (header, meta, payload) without copying the tensor.

    Hand the parts to ``writer.writelines``. Raises FrameTooLargeError if the frame would exceed
    ``max_frame_bytes`` (use the bound the peer announced in its HelloAck).
    """
    kind, flags, stream_id, seq, meta, tensor = _encode_body(msg)
    if tensor is None:
        dtype, shape, payload = DType.NONE, (), memoryview(b"")
    else:
        dtype = DTYPE_CODE[tensor.dtype]
        shape = tensor.shape
        payload = np.ascontiguousarray(tensor).data.cast("B")  # the array's own buffer, as bytes
    _check_frame_size(kind, HEADER_SIZE + len(meta) + len(payload), max_frame_bytes)
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    header = HEADER_STRUCT.pack(
        MAGIC,
        PROTOCOL_VERSION,
        kind,
        int(flags),
        stream_id,
        seq,
        dtype,
        len(shape),
        0,
        *dims,
        len(meta),
        len(payload),
    )
    return header, meta, payload


def encode(msg: Message, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Encode ``msg`` as one contiguous frame (header + meta + payload)."""
    return b"".join(encode_parts(msg, max_frame_bytes=max_frame_bytes))


def decode_body(header: FrameHeader, body: bytes | memoryview) -> Message:
    """Decode the ``header.body_len`` bytes after a validated header into a message.

    The returned arrays are read-only views of ``body``. Raises TruncatedFrameError if ``body`` is
    short and FrameError for any other violation (including values, e.g. negative token ids).
    """
    view = memoryview(body).cast("B")
    if len(view) < header.body_len:
        raise TruncatedFrameError(
            f"{header.kind.name} frame body is {len(view)} bytes, header announced "
            f"{header.body_len}; the peer closed or stalled mid-frame"
        )
    if len(view) > header.body_len:
        raise FrameError(f"{len(view) - header.body_len} unexpected bytes after the frame body")
    meta = view[: header.meta_len]
    tensor = None
    if header.dtype is not DType.NONE:
        raw = np.frombuffer(view[header.meta_len :], NUMPY_DTYPE[header.dtype])
        tensor = raw.reshape(header.shape)
    try:
        return _DECODERS[header.kind](header, meta, tensor)
    except (ValueError, struct.error) as exc:  # belt and braces: only WireErrors leave the codec
        raise FrameError(f"malformed {header.kind.name} body: {exc}") from exc


def decode(data: bytes | memoryview, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Decode exactly one complete frame held in ``data``."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise TruncatedFrameError(f"a frame is at least {HEADER_SIZE} bytes, got {len(view)}")
    header = decode_header(view[:HEADER_SIZE], max_frame_bytes=max_frame_bytes)
    return decode_body(header, view[HEADER_SIZE:])
