"""Per-stream generation policy, pure: what a stream computes next and what a reply means.

The coordinator owns one :class:`StreamState` per request and calls :func:`plan_step` when the
stream has nothing in flight and :func:`apply_reply` when the last stage answers. Masks and
position ids come from the stream's :class:`KVLayout`; nothing here touches sockets or devices.

Constrained output and log-probabilities (issue 17): a stream with a grammar
(:attr:`StreamState.matcher`) or asking for ``logprobs`` has every answering step ask for its
logits (the stateful reply carries them whole: docs/PROTOCOL.md, Forward ``WANT_LOGITS``), so the
policy masks and ranks them here: :func:`plan_step` keeps only the drafts the grammar allows and
records the allowed-token mask of each answered position (the grammar state after each draft,
:meth:`~engine.generation.grammar.GrammarMatcher.draft_masks`, which never advances the matcher);
:func:`apply_reply` sets the refused logits to -inf before the greedy pick or speculative
verification, consumes only the emitted tokens (a rejected draft never reaches the grammar), gives
each its log-probabilities (log-softmax of the raw logits at temperature 1, after the mask) and
finishes the stream with STOP once the grammar is complete with nothing left to add.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.coordinator.speculation_policy import Verdict, verify_greedy, verify_sampling
from engine.errors import GenerationError
from engine.generation.grammar import GrammarMatcher, GrammarStateError
from engine.generation.logprobs import token_logprobs
from engine.generation.request import FinishReason, GenerationRequest, TokenEvent
from engine.generation.sampling import choose, make_rng, probabilities
from engine.shards.kv_layout import KVLayout
from engine.shards.prefix_cache import PrefixHit
from engine.shards.stage import StepInputs
from engine.shards.step_answer import apply_mask
from engine.shards.step_path import CacheStep, StepRequest, StepResult
from engine.wire.format import StreamId


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
    draft: tuple[int, ...] = ()  # drafts in the step in flight
    draft_probs: np.ndarray | None = None  # their q distributions [K, V] (sampling), or None
    proposed_total: int = 0
    accepted_total: int = 0
    last_accepted: int = 0
    restoring: PrefixHit | None = None  # a prefix-cache restore is in flight
    capturing: int | None = None  # the capture id being taken at the end of the stream
    replay: tuple[int, ...] = ()  # after a failover: the tokens to prefill again on the new ring
    failovers: int = 0
    matcher: GrammarMatcher | None = None  # the request's constraint, followed token by token
    masks: np.ndarray | None = None  # uint32 [K+1, W]: allowed tokens of the step in flight's answered rows

    def __post_init__(self) -> None:
        if len(self.request.prompt_ids) >= self.context_length:
            raise GenerationError(
                f"the prompt has {len(self.request.prompt_ids)} tokens but the model's context is "
                f"{self.context_length}; shorten the conversation"
            )
        self.layout = KVLayout(len(self.request.prompt_ids) + self.request.max_new_tokens)
        self.rng = make_rng(self.request.sampling)

    @property
    def prefill_source(self) -> tuple[int, ...]:
        """What prefill steps feed: the prompt, or after a failover everything fed before it."""
        return self.replay or self.request.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.prompt_done < len(self.prefill_source)

    @property
    def ranks_logits(self) -> bool:
        """The policy needs the answered rows' logits: sampling, a grammar, or log-probabilities."""
        return (self.request.want_logits or not self.request.sampling.greedy or self.matcher is not None
                or self.request.logprobs is not None)


def plan_step(state: StreamState, prefill_chunk: int, draft: Sequence[int] = (),
              draft_probs: np.ndarray | None = None) -> StepRequest:
    """The stream's next step: the next prompt chunk, or the last token plus ``draft`` to verify.

    A decode step with K drafts sends ``[last, d_1 .. d_K]`` and asks the last stage for all
    K + 1 positions; :func:`apply_reply` keeps the accepted prefix and masks the rest. A stream
    with a grammar sends only the drafts it allows (the target's masked pick would reject the
    rest) and keeps the K + 1 masks in :attr:`StreamState.masks`; GrammarStateError when the
    matcher cannot build them (the stream then fails).
    """
    state.masks = None
    if state.prefilling:
        source = state.prefill_source
        end = min(len(source), state.prompt_done + prefill_chunk)
        ids = tuple(source[state.prompt_done : end])
        state.prompt_done = end
        state.draft, state.draft_probs = (), None
        if state.matcher is not None and end == len(source):  # the chunk that answers the first token
            state.masks = state.matcher.mask()[None, :]
    else:
        room = max(0, state.context_length - state.layout.logical_len - 2)  # logical positions left
        drafts = [int(t) for t in draft[:room]]
        if state.matcher is not None and drafts:
            drafts = drafts[: int(state.matcher.llg.validate_tokens(drafts))]
        state.draft = tuple(drafts)
        state.draft_probs = draft_probs[: len(state.draft)] if draft_probs is not None else None
        ids = (state.generated[-1], *state.draft)
        if state.matcher is not None:
            state.masks = state.matcher.draft_masks(state.draft) if state.draft else state.matcher.mask()[None, :]
    mask, positions = state.layout.plan(len(ids))
    state.layout.append(len(ids))
    state.seq += 1
    state.in_flight = True
    return StepRequest(
        stream_id=state.stream_id,
        seq=state.seq,
        inputs=StepInputs(np.asarray([ids], dtype=np.int64), mask, positions, len(state.draft) + 1),
        reply_last=len(state.draft) + 1,
        want_logits=state.ranks_logits,
    )


def fed_tokens(state: StreamState) -> tuple[int, ...]:
    """The logical token sequence whose KV the stages hold (the last generated token is not fed)."""
    sequence = state.request.prompt_ids + tuple(state.generated)
    return sequence[: state.layout.logical_len]


def reset_for_replay(state: StreamState) -> None:
    """The stream's KV is gone (a stage was lost): start over on a new ring by prefilling every
    token it had fed — the prompt and all generated tokens but the last, which the next decode
    step feeds as it would have. The prediction of the replay's last position is the token
    already emitted, so it is dropped (:func:`apply_reply`); under greedy decoding the stream
    then continues exactly as it would have. A step in flight is forgotten (its ``seq`` no
    longer matches), and so are its drafts.
    """
    state.layout.reset()
    state.seq += 1
    state.in_flight = False
    state.draft, state.draft_probs = (), None
    state.restoring = None
    state.failovers += 1
    state.replay = (state.request.prompt_ids + tuple(state.generated[:-1])) if state.generated else ()
    state.prompt_done = 0


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


def _verify(state: StreamState, result: StepResult, logits: np.ndarray | None) -> tuple[Verdict, list[float]]:
    """Accepted drafts + one target token, with each emitted token's probability (``logits``:
    the reply's, masked by the stream's grammar)."""
    params = state.request.sampling
    if logits is not None:
        if params.greedy:  # logits were wanted for another reason: greedy still decides
            top1 = logits.argmax(axis=-1)
            verdict = verify_greedy(state.draft, top1)
            return verdict, [1.0] * len(verdict.tokens)
        target = np.stack([probabilities(row, params) for row in logits])  # [K+1, V]
        verdict = verify_sampling(state.draft, state.draft_probs, target, state.rng)
        return verdict, [float(target[i, t]) for i, t in enumerate(verdict.tokens)]
    assert result.ids is not None and result.probs is not None
    verdict = verify_greedy(state.draft, result.ids)
    return verdict, [float(result.probs[i]) for i in range(len(verdict.tokens))]


def apply_reply(state: StreamState, result: StepResult) -> list[TokenEvent]:
    """Update the stream with the last stage's reply; the events of the tokens it produced."""
    state.in_flight = False
    if result.error is not None:
        raise GenerationError(f"stream {state.stream_id} failed in the pipeline: {result.error}")
    if state.replay and not state.prefilling:  # the last replay chunk: it predicts a token already sent
        state.replay, state.prompt_done = (), len(state.request.prompt_ids)
        return []
    if state.prefilling or state.cancelled:
        return []  # a prompt chunk that is not the last: its reply carries no token
    logits = result.logits
    if state.ranks_logits and logits is None:
        raise GenerationError(f"stream {state.stream_id}: the last stage answered without the logits the step "
                              "asked for")
    if logits is not None and state.masks is not None:
        if state.masks.shape[0] != logits.shape[0]:
            raise GenerationError(f"stream {state.stream_id}: {logits.shape[0]} logits rows answer a step "
                                  f"of {state.masks.shape[0]} masked positions")
        logits = apply_mask(logits, state.masks)  # [K+1, V], -inf where the grammar refuses
    if not state.draft and logits is not None and not state.request.sampling.greedy:
        token, prob = choose(logits[-1], state.request.sampling, state.rng)
        verdict, probs = Verdict(0, (token,)), [prob]
    else:
        verdict, probs = _verify(state, result, logits)
    rejected = len(state.draft) - verdict.accepted
    if rejected:
        state.layout.mask_last(rejected)  # the device cache keeps them; the mask hides them
    state.accepted_total += verdict.accepted
    state.proposed_total += len(state.draft)
    state.last_accepted = verdict.accepted
    events = []
    for row, (token, prob) in enumerate(zip(verdict.tokens, probs, strict=True)):
        _consume(state, token)
        state.generated.append(token)
        if state.first_token_at is None:
            state.first_token_at = time.perf_counter()
        finish = None
        if not state.request.ignore_eos and (token in state.eos_ids or token in state.request.stop_token_ids):
            finish = FinishReason.STOP
        elif state.matcher is not None and state.matcher.is_stopped:  # complete, nothing may follow
            finish = FinishReason.STOP
        elif (len(state.generated) >= state.request.max_new_tokens
              or state.layout.logical_len + 1 >= state.context_length):
            finish = FinishReason.LENGTH
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if state.request.logprobs is not None:
            assert logits is not None  # ranks_logits: the reply carried them
            logprob, top = token_logprobs(logits[row], token, state.request.logprobs)
        events.append(TokenEvent(token_id=token, index=len(state.generated) - 1, probability=prob, finish=finish,
                                 logprob=logprob, top_logprobs=top))
        if finish is not None:
            state.finish = finish
            unused = len(verdict.tokens) - len(events)  # accepted drafts after the stop stay hidden
            if unused:
                state.layout.mask_last(unused)
            break
    return events


def _consume(state: StreamState, token: int) -> None:
    """Commit an emitted token to the stream's grammar (a GenerationError if it refuses it: the
    reply was not masked as planned)."""
    if state.matcher is None:
        return
    try:
        state.matcher.consume([token])
    except GrammarStateError as exc:
        raise GenerationError(f"stream {state.stream_id}: token {token} breaks the request's constraint: "
                              f"{exc}") from exc
