"""Property tests of the codec: generated messages round trip canonically, and random, truncated
or mutated bytes make the decoder raise only WireErrors.

Hypothesis runs derandomized (a fixed seed per test) with no example database, so CI sees the
same examples on every run (its .hypothesis/ scratch directory is git-ignored).
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.trust.peer_policy import PeerPolicyError, parse_policy_update
from engine.wire.codec import decode, decode_header, encode
from engine.wire.format import (
    HEADER_FIELDS,
    HEADER_SIZE,
    HEADER_STRUCT,
    HELLO_FRAME_BYTES,
    MAGIC,
    PROTOCOL_VERSION,
    U64_MAX,
    FrameTooLargeError,
    Role,
    StreamId,
    TruncatedFrameError,
    WireError,
)
from engine.wire.handshake import LocalIdentity, check_hello, handshake_error_from
from engine.wire.messages import Hello, Logits, Packed, Tokens
from engine.wire.plan_frame import PlanFrame
from tests.wire.wire_helpers import (
    CONTROL_SAMPLES,
    HEADER_FIELD_BOUNDS,
    assert_same,
    decode_or_wire_error,
    patch_header,
    random_step,
    random_step_reply,
)

pytestmark = pytest.mark.slow

FUZZ = settings(
    max_examples=400,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def messages(draw):
    """Any valid message; hypothesis picks kind, shapes and ids, a seed fills the arrays (fast)."""
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    stream, seq = StreamId(draw(st.integers(1, U64_MAX))), draw(st.integers(0, U64_MAX))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def any_bits(shape, dtype):  # every bit pattern, NaN and inf included: must survive exactly
        raw = rng.integers(0, 256, (*shape, np.dtype(dtype).itemsize), np.uint8)
        return raw.view(dtype)[..., 0]

    which = draw(st.sampled_from(["ids", "f32", "f16", "tokens", "logits", "packed", "step", "reply", "other"]))
    if which == "other":
        return draw(st.sampled_from(CONTROL_SAMPLES))
    if which == "step":  # a random plan of 1..8 rows; token ids or hidden states of any bit pattern
        return random_step(rng)
    if which == "reply":
        return random_step_reply(rng)
    if which == "packed":  # a valid plan: per slot consecutive positions in row order, one reuse length
        rows, nxt, reuse = [], {}, {}
        for _ in range(s):
            k = int(rng.integers(-1, 4))
            if k < 0:
                rows.append((-1, 0, 0))
                continue
            if k not in nxt:
                nxt[k] = int(rng.integers(0, 2**31))
                reuse[k] = int(rng.integers(0, nxt[k] + 1))
            rows.append((k, nxt[k], reuse[k]))
            nxt[k] += 1
        plan = PlanFrame(*(np.array(col, np.int64) for col in zip(*rows, strict=True)))
        tensor = (rng.integers(0, 2**40, (1, s), np.int64) if draw(st.booleans())
                  else any_bits((1, s, draw(st.integers(1, 6))), "<f4"))
        return Packed(stream, seq, plan, tensor)
    if which == "tokens":
        probs = rng.random(s, np.float32)
        return Tokens(stream, seq, rng.integers(0, 2**40, s, np.int64), probs)
    if which == "logits":
        return Logits(stream, seq, any_bits((b, s, 5), "<f2"))
    if which == "ids":  # a Packed frame of S fresh slots: token ids or hidden states of any bit pattern
        tensor = rng.integers(0, 2**40, (1, s), np.int64)
    else:
        tensor = any_bits((1, s, draw(st.integers(1, 6))), "<f4" if which == "f32" else "<f2")
    return Packed(stream, seq, PlanFrame.of([(i, 0, 0) for i in range(s)], s), tensor, draw(st.booleans()))


@FUZZ
@given(messages())
def test_fuzz_generated_messages_round_trip(msg):
    frame = encode(msg)
    assert_same(decode(frame), msg)
    assert encode(decode(frame)) == frame


@FUZZ
@given(
    st.one_of(st.binary(max_size=300),
              st.binary(max_size=300).map(lambda b: MAGIC + struct.pack("<H", PROTOCOL_VERSION) + b))
)
def test_fuzz_random_bytes_raise_only_wire_errors(data):
    assert isinstance(decode_or_wire_error(data), WireError)


@FUZZ
@given(messages(), st.data())
def test_fuzz_truncated_frames_are_refused(msg, data):
    frame = encode(msg)
    cut = data.draw(st.integers(0, len(frame) - 1))
    assert isinstance(decode_or_wire_error(frame[:cut]), TruncatedFrameError)


@FUZZ
@given(messages(), st.data())
def test_fuzz_header_fields_set_to_wrong_values_are_refused(msg, data):
    frame = encode(msg)
    original = dict(zip(HEADER_FIELDS, HEADER_STRUCT.unpack(frame[:HEADER_SIZE]), strict=True))
    name = data.draw(st.sampled_from(sorted(HEADER_FIELD_BOUNDS)))
    value = data.draw(
        st.integers(0, HEADER_FIELD_BOUNDS[name]).filter(lambda v: v != original[name])
    )
    mutated = patch_header(frame, **{name: value})
    result = decode_or_wire_error(mutated)
    if name in ("kind", "flags") and not isinstance(result, WireError):
        assert encode(result) == mutated  # e.g. Ping -> Pong, or WANT_LOGITS set: still canonical
    else:
        assert isinstance(result, WireError), f"{name}={value} was accepted: {result!r}"


@FUZZ
@given(
    messages(),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_fuzz_byte_flips_raise_only_wire_errors_or_decode_cleanly(msg, flips):
    frame = bytearray(encode(msg))
    for pos, value in flips:
        frame[pos % min(len(frame), HEADER_SIZE + 48)] = value  # header and meta are the risky part
    result = decode_or_wire_error(bytes(frame))
    if not isinstance(result, WireError):
        assert encode(result) == frame  # an accepted frame is canonical: no ignored bits


# -- the step frame: its meta is long and count-driven, so it is mangled anywhere, not only up front --

_EXTREMES = (0, 1, 2**15, 2**16 - 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1)


@st.composite
def step_frames(draw):
    """An encoded Step or StepReply and its meta length."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    msg = random_step(rng) if draw(st.booleans()) else random_step_reply(rng)
    frame = encode(msg)
    return frame, decode_header(frame[:HEADER_SIZE]).meta_len


def _decode_within_memory(frame: bytes) -> object:
    """Decode ``frame`` and check that no more than a small multiple of it was allocated meanwhile
    (block ids become Python ints: ~11x; a claimed count must never be allocated for)."""
    tracemalloc.start()
    try:
        result = decode_or_wire_error(frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 16 * len(frame) + (1 << 16), f"decoding a {len(frame)}-byte frame allocated {peak} bytes"
    return result


@FUZZ
@given(step_frames(), st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=6))
def test_fuzz_step_frames_with_bytes_flipped_anywhere_in_header_or_meta(frame_meta, flips):
    frame, meta_len = frame_meta
    mutated = bytearray(frame)
    for pos, value in flips:
        mutated[pos % (HEADER_SIZE + meta_len)] = value
    result = _decode_within_memory(bytes(mutated))
    if not isinstance(result, WireError):
        assert encode(result) == mutated  # an accepted frame is canonical: no ignored bits


@FUZZ
@given(step_frames(), st.data())
def test_fuzz_step_meta_counts_and_cells_set_to_extremes_are_refused_or_canonical(frame_meta, data):
    """Any aligned u16/u32/u64 of the meta (a count, a row-table cell, a block id, a time) set to an
    extreme value: refused with a WireError, without over-reading or allocating for it, or canonical."""
    frame, meta_len = frame_meta
    width = data.draw(st.sampled_from([2, 4, 8]))
    at = HEADER_SIZE + width * data.draw(st.integers(0, meta_len // width - 1))
    value = data.draw(st.sampled_from([v for v in _EXTREMES if v < 2 ** (8 * width)]))
    mutated = frame[:at] + value.to_bytes(width, "little") + frame[at + width :]
    result = _decode_within_memory(mutated)
    if not isinstance(result, WireError):
        assert encode(result) == mutated


# -- before the handshake, and the peer policy it leads to ------------------------------------------


@FUZZ
@given(messages())
def test_fuzz_a_first_frame_bigger_than_a_hello_is_refused_from_its_header_alone(msg):
    """What the listener reads before the handshake: any frame announcing more than a Hello is
    refused by ``decode_header`` with the Hello bound, before a byte of its body is wanted."""
    frame = encode(msg)
    try:
        decode_header(frame[:HEADER_SIZE], max_frame_bytes=HELLO_FRAME_BYTES)
    except FrameTooLargeError:
        assert len(frame) > HELLO_FRAME_BYTES
    else:
        assert len(frame) <= HELLO_FRAME_BYTES


@FUZZ
@given(
    st.binary(min_size=8, max_size=64).map(bytes.hex),  # hex fingerprints, as exports make them
    st.binary(min_size=8, max_size=64).map(bytes.hex),
    st.integers(0, 65535),
    st.integers(0, 65535),
    st.sampled_from(list(Role)),
    st.sets(st.sampled_from(list(Role))),
)
def test_fuzz_handshake_refusals_never_state_the_listeners_identity(ours, theirs, stage, their_stage, role,
                                                                    accepted):
    local = LocalIdentity(ours, stage, frozenset(accepted))
    refusal = check_hello(Hello(theirs, their_stage, role), local)
    if refusal is None:
        assert (ours, stage) == (theirs, their_stage) and role in accepted
        return
    if ours not in theirs:  # a fingerprint containing ours would echo it by itself
        assert ours not in refusal.message
    assert handshake_error_from(refusal).field in ("model_fingerprint", "stage_index", "role")


_NODE = st.tuples(st.binary(min_size=30, max_size=33), st.booleans()).map(  # 60-66 hex digits, either case
    lambda t: t[0].hex().upper() if t[1] else t[0].hex())
_SCALAR = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | _NODE
_JSONISH = _SCALAR | st.lists(_SCALAR, max_size=3) | st.dictionaries(st.text(max_size=8), _SCALAR, max_size=3)


@FUZZ
@given(st.one_of(
    _JSONISH,
    st.fixed_dictionaries({}, optional={"expect_upstream": st.lists(_NODE, max_size=3) | _JSONISH,
                                        "expect_next": _NODE | _JSONISH, "deny": st.lists(_NODE, max_size=3),
                                        "extra": _JSONISH}),
))
def test_fuzz_peer_policy_updates_parse_to_a_policy_or_a_named_refusal(blob):
    """Whatever a stdin line decodes to, the worker gets a valid policy or PeerPolicyError (it keeps
    the old one), never another exception or a policy holding a malformed id."""
    try:
        policy = parse_policy_update(blob)
    except PeerPolicyError:
        return
    for node in (*policy.upstream, *policy.deny, *((policy.next,) if policy.next else ())):
        assert len(node) == 64 and node == node.lower()
