"""Stage 0's slot policy for static graphs: admission, rows per step, retirement (pure).

Decisions are functions over a frozen tuple of :class:`Slot`: :func:`admit` puts a request in a
free slot (or refuses a prompt its region cannot hold), :func:`plan` chooses the rows of the next
inference, :func:`update` applies the sampled tokens and frees the slots that finished. The
infer loop around them (:mod:`engine.static.packed_stage`) only runs graphs and samples.

Rows per step, in this order (Sarathi-style stall-free batching from the mask alone):
1. every decoding slot gets one row, so a long prompt never stalls running generations;
2. the remaining rows go to prefilling slots in admission order, a causal chunk each.

Prefix reuse: a finished slot's region still holds its sequence's K/V at their own columns (all
of them until the region wrapped, then only the sinks). A new request whose prompt starts with
that prefix is admitted there and skips prefilling it; the plan frame's reuse length tells every
stage to keep those columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from engine.errors import GenerationError
from engine.static.packing import SlotGeometry
from engine.wire.plan_frame import PlanFrame


class PromptTooLong(GenerationError):
    """A prompt does not fit the region of one slot; it is refused at admission."""


@dataclass(frozen=True)
class SlotRequest:
    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass(frozen=True)
class Slot:
    """One slot: the request it serves (None when free) and how far its sequence got.

    ``fed`` tokens of ``prompt + generated`` are in the ring (``reuse`` of them kept from the
    previous sequence). ``kept`` are the tokens whose K/V a future request could reuse.
    """

    request: SlotRequest | None = None
    reuse: int = 0
    fed: int = 0
    generated: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()

    @property
    def stream(self) -> tuple[int, ...]:
        return (self.request.prompt if self.request else ()) + self.generated

    @property
    def pending(self) -> int:
        """Tokens of the sequence not yet fed (1 while decoding)."""
        return len(self.stream) - self.fed if self.request else 0


@dataclass(frozen=True, eq=False)
class Schedule:
    """One inference: the frame for every stage, stage 0's token per row, the rows to sample."""

    frame: PlanFrame
    tokens: np.ndarray  # int64 [S]; 0 on idle rows
    take: Mapping[int, int] = field(default_factory=dict)  # slot -> rows fed this step
    sample: Mapping[int, int] = field(default_factory=dict)  # slot -> row whose logits it samples


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    token: int
    finished: bool


def empty_slots(geometry: SlotGeometry) -> tuple[Slot, ...]:
    return (Slot(),) * geometry.slots


def _reusable(slot: Slot, geometry: SlotGeometry) -> tuple[int, ...]:
    if slot.fed <= geometry.region:
        return slot.kept
    return slot.kept[: min(geometry.sinks, geometry.region - 1)]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def admit(slots: tuple[Slot, ...], request: SlotRequest,
          geometry: SlotGeometry) -> tuple[tuple[Slot, ...], int | None]:
    """Put ``request`` in the free slot that reuses the longest prefix; None if none is free.

    Raises :class:`PromptTooLong` when the prompt exceeds a slot's region: a prompt must fit
    outright (a generation that outgrows the region slides within it instead).
    """
    n = len(request.prompt)
    if n == 0:
        raise GenerationError("the prompt is empty")
    if request.max_new_tokens < 1:
        raise GenerationError("max_new_tokens must be at least 1")
    if n > geometry.region:
        raise PromptTooLong(
            f"the prompt has {n} tokens but a slot holds {geometry.region} (a {geometry.window}-position "
            f"window shared by {geometry.slots} slot(s)); shorten the prompt, or export with a larger "
            "--context or fewer --slots")
    free = [k for k, s in enumerate(slots) if s.request is None]
    if not free:
        return slots, None
    # Keep at least one prompt token to feed: its logits give the first new token.
    reuse_of = {k: min(_common_prefix(_reusable(slots[k], geometry), request.prompt), n - 1) for k in free}
    best = max(free, key=lambda k: (reuse_of[k], -k))
    r = reuse_of[best]
    out = list(slots)
    out[best] = Slot(request=request, reuse=r, fed=r, kept=request.prompt[:r])
    return tuple(out), best


def admit_queued(slots: tuple[Slot, ...], queue: list[SlotRequest],
                 geometry: SlotGeometry) -> tuple[Slot, ...]:
    """Admit requests from the head of ``queue`` (in order, removing them) while a slot is free."""
    while queue:
        slots, k = admit(slots, queue[0], geometry)
        if k is None:
            break
        queue.pop(0)
    return slots


def retire(slots: tuple[Slot, ...], request_id: int, geometry: SlotGeometry) -> tuple[Slot, ...]:
    """Free the slot serving ``request_id`` (a cancelled request); what it fed stays for reuse."""
    return tuple(_freed(s, geometry) if s.request and s.request.request_id == request_id else s for s in slots)


def _freed(s: Slot, geometry: SlotGeometry) -> Slot:
    return Slot(fed=s.fed, kept=s.stream[: min(s.fed, geometry.region)])


def plan(slots: Sequence[Slot], row_options: Sequence[int]) -> Schedule | None:
    """The next inference over ``slots`` with one of the graphs' row counts; None when idle.

    With several options (an unpacked export: decode 1 row, prefill C rows) the smallest that
    holds every wanted row is used, else the largest.
    """
    decoding = [k for k, s in enumerate(slots) if s.request and s.pending == 1]
    prefilling = [k for _, k in sorted((s.request.request_id, k) for k, s in enumerate(slots)
                                       if s.request and s.pending > 1)]  # oldest request first
    wanted = len(decoding) + sum(slots[k].pending for k in prefilling)
    if wanted == 0:
        return None
    options = sorted(row_options)
    rows = next((o for o in options if o >= wanted), options[-1])
    if len(decoding) > rows:
        raise GenerationError(f"{len(decoding)} decoding slots do not fit a {rows}-row graph")
    take = {k: 1 for k in decoding}
    budget = rows - len(decoding)
    for k in prefilling:
        n = min(slots[k].pending, budget)
        if n:
            take[k] = n
            budget -= n
    live: list[tuple[int, int, int]] = []
    tokens: list[int] = []
    sample: dict[int, int] = {}
    for k in sorted(take):
        s = slots[k]
        for j in range(take[k]):
            live.append((k, s.fed + j, s.reuse))
            tokens.append(s.stream[s.fed + j])
        if s.fed + take[k] == len(s.stream):
            sample[k] = len(live) - 1
    frame = PlanFrame.of(live, rows)
    tok = np.zeros(rows, dtype=np.int64)
    tok[: len(tokens)] = tokens
    return Schedule(frame=frame, tokens=tok, take=take, sample=sample)


def update(slots: tuple[Slot, ...], schedule: Schedule, sampled: Mapping[int, int],
           geometry: SlotGeometry) -> tuple[tuple[Slot, ...], list[TokenEvent]]:
    """Apply one inference: advance fed counts, append ``sampled`` (row -> token), retire finishers."""
    out = list(slots)
    events: list[TokenEvent] = []
    for k, n in schedule.take.items():
        s = replace(out[k], fed=out[k].fed + n)
        if k in schedule.sample:
            token = int(sampled[schedule.sample[k]])
            s = replace(s, generated=s.generated + (token,))
            req = s.request
            assert req is not None
            done = len(s.generated) >= req.max_new_tokens or (token in req.eos_ids and not req.ignore_eos)
            events.append(TokenEvent(req.request_id, token, done))
            if done:  # free the region at once; its prefix stays for reuse
                s = _freed(s, geometry)
        out[k] = s
    return tuple(out), events
