"""The data-plane wire format: its numbers, layouts, enums and exceptions (no code that runs).

Every frame is a fixed 56-byte little-endian header, then a kind-specific *meta* section, then
the raw bytes of at most one tensor (the *payload*)::

    | header (56 B) | meta (meta_len B) | payload (payload_len B = prod(dims) * itemsize) |

The header describes the payload tensor completely (dtype code, ndim, dims), so a receiver can
bound and check a frame before reading its body. docs/PROTOCOL.md is the normative description.
The typed messages live in ``engine.wire.messages``, bytes <-> messages in ``engine.wire.codec``, the
handshake decisions in ``engine.wire.handshake`` and sockets in ``engine.wire.transport``.
"""

from __future__ import annotations

import enum
import struct
from typing import ClassVar, NewType

import numpy as np

from engine.errors import DeskfleetError

# 1: Forward/Tokens/Logits/Release; 2 adds Capture/Restore and Packed; 3 adds Step/StepReply; 4 adds the
# Step's allowed-token masks and top-k requests and the StepReply's top-k ids and log-probabilities; 5 adds
# the stage times to Forward/Packed/Tokens/Logits and lets a Packed frame want Logits; 6 retires the stateful
# runtime's Forward, Capture and Restore (their kind numbers stay reserved) and the CAPTURE_MISSING error
PROTOCOL_VERSION = 6
MAGIC = b"DKFL"
MAX_FRAME_BYTES = 256 * 1024 * 1024  # default bound, header included; configurable per call
MIN_FRAME_BOUND = 64 * 1024  # a node refusing frames this small could not even send a prefill
MAX_DIMS = 4
MAX_FINGERPRINT_BYTES = 128
MAX_ERROR_MESSAGE_BYTES = 4096
U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
U16_MAX = 2**16 - 1
# The stage_index a dialer names when it dials the coordinator's token-return port.
COORDINATOR_STAGE = U16_MAX

StreamId = NewType("StreamId", int)  # 1..2**64-1 on stream frames; 0 means "the whole connection"

# --- layouts: docs/PROTOCOL.md has the tables ----------------------------------------------------

# The fixed header. Little-endian, no padding, 56 bytes.
HEADER_FIELDS = tuple(
    "magic version kind flags stream_id seq dtype ndim reserved dim0 dim1 dim2 dim3 "
    "meta_len payload_len".split()
)
HEADER_STRUCT = struct.Struct("<4sHBBQQBBH4IIQ")
HEADER_SIZE = HEADER_STRUCT.size
# protocol_version, stage_index, max_frame_bytes, [role,] fingerprint length; fingerprint follows
HELLO_META = struct.Struct("<HHQBB")
HELLO_ACK_META = struct.Struct("<HHQB")
PACKED_META = struct.Struct("<HH")  # rows S, stage times n; the int64 plan [3, S] and float32 times [n] follow
ERROR_META = struct.Struct("<H")  # error code; the UTF-8 message fills the rest of meta
# Step (paged step): block_size u16, rows S u16, copies C u16, stage times n u16, pool_blocks u32,
# real tokens T u32, padded tokens Tb u32, token_budget u32, flags u32 (0), mask words W u32 (0: no mask);
# then the row table u64 [S, STEP_ROW_COLUMNS], block ids int32, copies int32 [C, 2], stage times f32 [n],
# masks u32 [M, W] (M = the answered rows of the MASK rows, plan order)
STEP_META = struct.Struct("<4H6I")
STEP_ROW_COLUMNS = 8  # stream_id, past_len, new_tokens, block_count, sample, row flags, top_k, reserved
STEP_ROW_WANT_LOGITS = 0x1  # row flag: the reply carries this stream's answered rows' full logits
STEP_ROW_MASK = 0x2  # row flag: an allowed-token mask per answered row of this stream follows the stage times
MAX_TOP_K = 20  # top-k ids and log-probabilities one answered row may ask for (OpenAI's top_logprobs cap)
# Mask words W per row (ceil(V/32)): 2**15 words is a vocabulary of 1 Mi tokens, 4x the largest in use;
# the mask words of one step together at most 4 Mi (16 MiB: 2730 rows at V = 49152), so no count announces more.
MAX_MASK_WORDS = 1 << 15
MAX_STEP_MASK_WORDS = 1 << 22
# StepReply: answered rows R u32, logit rows L u32, vocabulary V u32, stage times n u16, top_k k u16; then
# ids int64 [R], probs float32 [R], stage times float32 [n], top ids int64 [R, k], top logprobs f32 [R, k];
# the payload is logits f32 [L, V]
STEP_REPLY_META = struct.Struct("<3IHH")
MAX_STEP_STAGES = 256  # stage times one step frame carries (one per stage passed)
MAX_FRAME_STAGES = 255  # stage times a Packed/Tokens/Logits frame carries
MAX_STEP_COPIES = U16_MAX  # block copies in one step (a u16 count)
MAX_STEP_BLOCK_IDS = 1 << 22  # block ids in one step's row table: 16 MiB of int32
# What a listener reads before the handshake: one Hello at most (a bigger first frame is refused
# after its header), and what a dialer reads for the answer: a HelloAck or a refusal's Error.
HELLO_FRAME_BYTES = HEADER_SIZE + HELLO_META.size + MAX_FINGERPRINT_BYTES
HANDSHAKE_REPLY_BYTES = HEADER_SIZE + ERROR_META.size + MAX_ERROR_MESSAGE_BYTES


class FrameKind(enum.IntEnum):
    """What a frame carries. Numbers are stable forever; a new kind means a new number."""

    HELLO = 1
    HELLO_ACK = 2
    ERROR = 3
    PING = 4
    PONG = 5
    FORWARD = 16  # retired in version 6 (the stateful runtime's step); the number stays reserved
    TOKENS = 17
    LOGITS = 18
    RELEASE = 19
    PACKED = 20  # one inference of a static (NPU-target) ring: stage 0's plan frame + the rows' inputs
    STEP = 21  # one paged step: the coordinator's plan (rows, block tables, copies) + the rows' inputs
    STEP_REPLY = 22  # the last stage's answer to a Step: top-1 per answered row, logits when wanted
    CAPTURE = 32  # retired in version 6 (the stateful runtime's prefix cache); the number stays reserved
    RESTORE = 33  # retired in version 6, as CAPTURE


# Kinds no frame of this version may carry: numbers once used, never to mean anything else.
RESERVED_KINDS: frozenset[FrameKind] = frozenset({FrameKind.FORWARD, FrameKind.CAPTURE, FrameKind.RESTORE})


class FrameFlag(enum.IntFlag):
    """Per-frame flag bits; each kind accepts only the bits listed for it in docs/PROTOCOL.md."""

    WANT_LOGITS = 0x01  # Packed: the last stage answers with full Logits instead of top-1 Tokens


class DType(enum.IntEnum):
    """Payload element type codes. Payloads are always little-endian."""

    NONE = 0
    INT64 = 1
    FLOAT32 = 2
    FLOAT16 = 3


NUMPY_DTYPE: dict[DType, np.dtype] = {
    DType.INT64: np.dtype("<i8"),
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT16: np.dtype("<f2"),
}
DTYPE_CODE = {dt: code for code, dt in NUMPY_DTYPE.items()}


class Role(enum.IntEnum):
    """Who is dialling, as announced in Hello."""

    COORDINATOR = 1
    STAGE = 2  # an upstream stage worker (or the last stage returning tokens)


class ErrorCode(enum.IntEnum):
    """Why an Error frame was sent: 1-15 frame faults and 16-31 handshake refusals close the
    connection, as do 48-49; 32-35 concern one stream and leave the connection up."""

    MALFORMED_FRAME = 1
    FRAME_TOO_LARGE = 2
    TRUNCATED_FRAME = 3
    TIMEOUT = 4
    UNEXPECTED_FRAME = 5
    PROTOCOL_VERSION_MISMATCH = 16
    MODEL_FINGERPRINT_MISMATCH = 17
    STAGE_INDEX_MISMATCH = 18
    ROLE_REFUSED = 19
    PEER_REFUSED = 20  # handshake refused: the peer's certificate (node id) is not the one expected here
    STREAM_LIMIT = 35  # stream-level: the receiver holds as many streams as it accepts
    UNKNOWN_STREAM = 32  # stream-level: the connection stays usable
    STREAM_FAILED = 33
    # 34 (CAPTURE_MISSING) was retired in version 6 with Restore; the number stays unused
    INTERNAL = 48
    SHUTTING_DOWN = 49


# --- errors: engine.wire.handshake adds HandshakeError; engine.wire.transport adds FrameTimeoutError,
# ConnectionClosedError and DialError ----------------------------------------------------------


class WireError(DeskfleetError):
    """Base of every data-plane protocol or transport failure; ``code`` is what goes on the wire."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL


class FrameError(WireError):
    """A frame's bytes (received) or a message's fields (to send) break the protocol's rules."""

    code = ErrorCode.MALFORMED_FRAME


class FrameTooLargeError(FrameError):
    """A frame would exceed the size bound (``max_frame_bytes``) of the node that refuses it."""

    code = ErrorCode.FRAME_TOO_LARGE


class TruncatedFrameError(FrameError):
    """Fewer bytes arrived than the header announced (peer closed mid-frame, or a short buffer)."""

    code = ErrorCode.TRUNCATED_FRAME


class ProtocolVersionError(FrameError):
    """A frame header carries a protocol version this node does not speak."""

    code = ErrorCode.PROTOCOL_VERSION_MISMATCH


class UnexpectedFrameError(FrameError):
    """A well-formed frame arrived where the protocol does not allow it (a Step before Hello)."""

    code = ErrorCode.UNEXPECTED_FRAME
