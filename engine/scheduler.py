"""Per-stream generation policy, pure: what a stream computes next and what a reply means.

The coordinator owns one :class:`StreamState` per request and calls :func:`plan_step` when the
stream has nothing in flight and :func:`apply_reply` when the last stage answers. Masks and
position ids come from the stream's :class:`KVLayout`; nothing here touches sockets or devices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from engine.errors import GenerationError
from engine.kv_layout import KVLayout
from engine.path import CacheStep, StepRequest, StepResult
from engine.prefix_cache import PrefixHit
from engine.request import FinishReason, GenerationRequest, TokenEvent
from engine.sampling import choose, make_rng
from engine.shard import StepInputs
from engine.wire import StreamId


@dataclass
class StreamState:
    """Everything the coordinator knows about one running request (mutable, loop-owned)."""

    stream_id: StreamId
    request: GenerationRequest
    context_length: int
    eos_ids: frozenset[int]
    layout: KVLayout = field(init=False)
    rng: np.random.Generator = field(init=False)
    prompt_done: int = 0  # prompt tokens already sent
    generated: list[int] = field(default_factory=list)
    seq: int = 0
    in_flight: bool = False
    cancelled: bool = False
    finish: FinishReason | None = None
    admitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    restoring: PrefixHit | None = None  # a prefix-cache restore is in flight
    capturing: int | None = None  # the capture id being taken at the end of the stream

    def __post_init__(self) -> None:
        if len(self.request.prompt_ids) >= self.context_length:
            raise GenerationError(
                f"the prompt has {len(self.request.prompt_ids)} tokens but the model's context is "
                f"{self.context_length}; shorten the conversation"
            )
        self.layout = KVLayout(len(self.request.prompt_ids) + self.request.max_new_tokens)
        self.rng = make_rng(self.request.sampling)

    @property
    def prefilling(self) -> bool:
        return self.prompt_done < len(self.request.prompt_ids)


def plan_step(state: StreamState, prefill_chunk: int) -> StepRequest:
    """The stream's next step: the next prompt chunk, or the last generated token."""
    if state.prefilling:
        end = min(len(state.request.prompt_ids), state.prompt_done + prefill_chunk)
        ids = state.request.prompt_ids[state.prompt_done : end]
        state.prompt_done = end
    else:
        ids = (state.generated[-1],)
    mask, positions = state.layout.plan(len(ids))
    state.layout.append(len(ids))
    state.seq += 1
    state.in_flight = True
    want_logits = state.request.want_logits or not state.request.sampling.greedy
    return StepRequest(
        stream_id=state.stream_id,
        seq=state.seq,
        inputs=StepInputs(np.asarray([ids], dtype=np.int64), mask, positions),
        reply_last=1,
        want_logits=want_logits,
    )


def fed_tokens(state: StreamState) -> tuple[int, ...]:
    """The logical token sequence whose KV the stages hold (the last generated token is not fed)."""
    sequence = state.request.prompt_ids + tuple(state.generated)
    return sequence[: state.layout.logical_len]


def plan_restore(state: StreamState, hit: PrefixHit) -> CacheStep:
    state.restoring = hit
    state.seq += 1
    state.in_flight = True
    return CacheStep(state.stream_id, state.seq, hit.capture_id, length=hit.length)


def apply_restore(state: StreamState, result: StepResult) -> bool:
    """Account for a restore's outcome; False means fall back to a cold prefill from token 0."""
    hit, state.restoring, state.in_flight = state.restoring, None, False
    assert hit is not None
    if result.ack:
        state.layout.append(hit.length)
        state.prompt_done = hit.length
        return True
    state.layout.reset()
    state.prompt_done = 0
    return False


def plan_capture(state: StreamState, capture_id: int) -> CacheStep:
    state.capturing = capture_id
    state.seq += 1
    state.in_flight = True
    return CacheStep(state.stream_id, state.seq, capture_id, keep=state.layout.visible_positions().astype(np.int64))


def apply_reply(state: StreamState, result: StepResult) -> TokenEvent | None:
    """Update the stream with the last stage's reply; the new token's event, if there is one."""
    state.in_flight = False
    if result.error is not None:
        raise GenerationError(f"stream {state.stream_id} failed in the pipeline: {result.error}")
    if state.prefilling or state.cancelled:
        return None  # a prompt chunk that is not the last: its reply carries no token
    if result.logits is not None:
        token, prob = choose(result.logits[-1], state.request.sampling, state.rng)
    else:
        assert result.ids is not None and result.probs is not None
        token, prob = int(result.ids[-1]), float(result.probs[-1])
    state.generated.append(token)
    if state.first_token_at is None:
        state.first_token_at = time.perf_counter()
    finish = None
    if not state.request.ignore_eos and (token in state.eos_ids or token in state.request.stop_token_ids):
        finish = FinishReason.STOP
    elif len(state.generated) >= state.request.max_new_tokens or state.layout.logical_len + 1 >= state.context_length:
        finish = FinishReason.LENGTH
    state.finish = finish
    return TokenEvent(token_id=token, index=len(state.generated) - 1, probability=prob, finish=finish)
