"""Many rings, many models, one :class:`Generator`: the router the API (and the fleet service) serve.

A *ring* is anything that generates for one model: a paged :class:`BatchCoordinator` over a
ring of workers, a stateful coordinator, an in-process generator. The router holds rings by id,
each serving a model by name; several rings may serve the same model (replicas). A request
names its model (``stream_for``; None means the first model added) and the pure policy in
:mod:`engine.generation.routing_policy` ranks that model's rings (ok before recovering, the one
holding the conversation's prefix, else the least loaded); the router tries them in that order
until one admits the request (a ring that is overloaded or unavailable *before its first token*
hands the request to the next), then relays that ring's tokens unchanged.

Adding a ring is immediate; :meth:`Router.remove_ring` stops new requests going to it and waits
for the streams in flight there to finish. Neither touches another ring's streams. The router
does not start or stop rings: whoever built one (the fleet service, ``serve``, a test) owns its
lifetime and stops it after removing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field

from engine.errors import DeskfleetError
from engine.generation.generator import Generator, ModelCard, OverloadedError, UnavailableError
from engine.generation.request import GenerationRequest, TokenEvent
from engine.generation.ring_report import Reporting, RingReport, RingStatus
from engine.generation.routing_policy import (
    DEFAULT_POLICY,
    PrefixMemory,
    RingView,
    RoutingPolicy,
    block_hashes,
    rank_rings,
)
from engine.wire.step_plan import CPU_BLOCK_SIZE

log = logging.getLogger("deskfleet.router")

WORST_FIRST = (RingStatus.DOWN, RingStatus.RECOVERING, RingStatus.OK)


class RouterError(DeskfleetError):
    """A ring was added or removed wrongly (a duplicate id, an unknown id, a model card that
    disagrees with the other rings of the same model)."""


class UnknownModelError(DeskfleetError):
    """A request named a model that no ring serves (the API answers 404 ``model_not_found``)."""

    def __init__(self, model: str, served: tuple[str, ...]):
        listed = ", ".join(repr(m) for m in served) or "none right now"
        super().__init__(f"model {model!r} is not served here; served models: {listed} (see /v1/models)")
        self.model = model
        self.served = served


@dataclass
class _Ring:
    ring_id: str
    generator: Generator
    model: str  # the served name
    card: ModelCard  # the generator's card, named ``model``
    memory: PrefixMemory
    inflight: int = 0
    served: int = 0
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def report(self) -> RingReport:
        """This ring's state under its router id and served name (the worst of what it reports)."""
        reports = self.generator.ring_reports() if isinstance(self.generator, Reporting) else ()
        if not reports:
            return RingReport(self.ring_id, self.model, RingStatus.OK, active=self.inflight)
        worst = min(reports, key=lambda r: WORST_FIRST.index(r.status))
        return dataclasses.replace(worst, ring=self.ring_id, model=self.model,
                                   active=sum(r.active for r in reports), waiting=sum(r.waiting for r in reports))


class Router:
    """Serves every model of its rings; implements :class:`Generator` and :class:`Reporting`.

    ``block_size``: the token block the prefix memory hashes (the rings' KV block size, so a
    remembered block is one a ring can share); ``memory_blocks``: hashes remembered per ring.
    """

    def __init__(self, *, block_size: int = CPU_BLOCK_SIZE, memory_blocks: int = 4096,
                 policy: RoutingPolicy = DEFAULT_POLICY):
        self.block_size = block_size
        self.memory_blocks = memory_blocks
        self.policy = policy
        self._rings: dict[str, _Ring] = {}

    # -- the rings -------------------------------------------------------------------------------

    def add_ring(self, ring_id: str, generator: Generator, *, model_name: str | None = None) -> None:
        """Serve ``generator`` as ring ``ring_id`` for the model ``model_name`` (default: its card's name).

        New requests may go to it at once. Raises :class:`RouterError` for a duplicate id or a card
        that disagrees (context length, end tokens, fingerprint) with another ring of that model."""
        if not ring_id:
            raise RouterError("a ring needs a non-empty id")
        if ring_id in self._rings:
            raise RouterError(f"ring {ring_id!r} is already served; remove it first or pick another id")
        card = generator.model
        name = model_name or card.name
        card = dataclasses.replace(card, name=name)
        for other in self._rings.values():
            if other.model == name and not _same_model(other.card, card):
                raise RouterError(f"ring {ring_id!r} serves {name!r} with a different model card than ring "
                                  f"{other.ring_id!r} ({card} vs {other.card}); give it another model name")
        self._rings[ring_id] = _Ring(ring_id, generator, name, card, PrefixMemory(self.memory_blocks))
        log.info("ring %s serves %s (%d stages)", ring_id, name, card.stages)

    async def remove_ring(self, ring_id: str, *, timeout: float | None = None) -> Generator:
        """Stop routing new requests to ``ring_id``, wait for its streams in flight to finish, forget
        it and return its generator (the caller stops it). Other rings are not touched.

        ``timeout`` (seconds) bounds the wait: the ring is forgotten anyway and its remaining
        streams keep running to their end."""
        ring = self._rings.get(ring_id)
        if ring is None:
            raise RouterError(f"no ring {ring_id!r} is served (rings: {', '.join(self._rings) or 'none'})")
        ring.draining = True
        try:
            await asyncio.wait_for(ring.idle.wait(), timeout)
        except TimeoutError:
            log.warning("ring %s still has %d streams after %.1f s; removed anyway", ring_id, ring.inflight, timeout)
        finally:
            self._rings.pop(ring_id, None)
        log.info("ring %s removed", ring_id)
        return ring.generator

    def rings(self) -> Mapping[str, Generator]:
        """The served rings by id (not the draining ones)."""
        return {r.ring_id: r.generator for r in self._rings.values() if not r.draining}

    def models(self) -> tuple[ModelCard, ...]:
        """One card per served model, named as served, in the order models were first added."""
        out: dict[str, ModelCard] = {}
        for ring in self._rings.values():
            if not ring.draining:
                out.setdefault(ring.model, ring.card)
        return tuple(out.values())

    def card_for(self, model: str | None) -> ModelCard:
        """The card of ``model`` (None: the first); :class:`UnknownModelError` if nothing serves it,
        :class:`UnavailableError` when the router serves no model at all."""
        cards = self.models()
        if model is None:
            if not cards:
                raise UnavailableError("no ring is serving yet; retry once the fleet has formed a ring")
            return cards[0]
        for card in cards:
            if card.name == model:
                return card
        raise UnknownModelError(model, tuple(c.name for c in cards))

    # -- Generator ---------------------------------------------------------------------------------

    @property
    def model(self) -> ModelCard:
        """The first served model's card (what a one-model client sees)."""
        return self.card_for(None)

    def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        return self.stream_for(None, request)

    async def stream_for(self, model: str | None, request: GenerationRequest, *,
                         placed: Callable[[str], None] | None = None) -> AsyncGenerator[TokenEvent, None]:
        """Stream ``request`` on a ring of ``model`` (None: the first model).

        Raises :class:`UnknownModelError` for a model nobody serves, and the last ring's
        :class:`OverloadedError` / :class:`UnavailableError` when no ring of the model admits the
        request. Closing the iterator cancels the request on its ring. ``placed(ring_id)`` is
        called once the ring that serves it has produced its first token (the audit's "ring")."""
        name = self.card_for(model).name
        hashes = block_hashes(request.prompt_ids, self.block_size, request.cache_scope)
        candidates = [r for r in self._rings.values() if r.model == name and not r.draining]
        last_error: BaseException | None = None
        for ring_id in rank_rings(self._views(candidates, hashes), len(hashes), self.policy):
            ring = self._rings.get(ring_id)
            if ring is None or ring.draining:
                continue
            emitted: list[int] = []
            ring.inflight += 1
            ring.idle.clear()
            try:
                async with contextlib.aclosing(ring.generator.stream(request)) as tokens:
                    try:
                        first = await anext(tokens)
                    except StopAsyncIteration:
                        return
                    except (OverloadedError, UnavailableError) as exc:
                        log.info("ring %s refused a request (%s); trying the next ring of %s", ring_id, exc, name)
                        last_error = exc
                        continue
                    ring.served += 1  # admitted: a ring that refused it does not count it
                    ring.memory.remember(hashes)
                    if placed is not None:
                        placed(ring_id)
                    emitted.append(first.token_id)
                    yield first
                    async for event in tokens:
                        emitted.append(event.token_id)
                        yield event
                return
            finally:
                ring.inflight -= 1
                if emitted:
                    ring.memory.remember(block_hashes((*request.prompt_ids, *emitted), self.block_size,
                                                      request.cache_scope))
                if ring.inflight == 0:
                    ring.idle.set()
        if last_error is not None:
            raise last_error
        raise UnavailableError(f"no ring is serving {name!r} right now; retry shortly")

    def _views(self, rings: list[_Ring], hashes: tuple[bytes, ...]) -> list[RingView]:
        views = []
        for ring in rings:
            report = ring.report()
            views.append(RingView(ring.ring_id, report.status, max(ring.inflight, report.active + report.waiting),
                                  ring.memory.matched(hashes), ring.served))
        return views

    def metrics(self) -> dict[str, float]:
        """A lone ring's metrics as they are; with several, each ring's under a ``ring`` label,
        plus the router's ``router_streams{ring=...}`` and ``router_requests_total{ring=...}``."""
        live = list(self._rings.values())
        if len(live) == 1:
            return dict(live[0].generator.metrics())
        out: dict[str, float] = {}
        for ring in live:
            label = f'ring="{ring.ring_id}",model="{ring.model}"'
            for key, value in ring.generator.metrics().items():
                base, brace, rest = key.partition("{")
                out[f"{base}{{{label},{rest}" if brace else f"{base}{{{label}}}"] = value
            out[f"router_streams{{{label}}}"] = ring.inflight
            out[f"router_requests_total{{{label}}}"] = ring.served
        return out

    # -- Reporting ---------------------------------------------------------------------------------

    def ring_reports(self) -> tuple[RingReport, ...]:
        """Every ring's report under its router id and served model name, in the order added."""
        return tuple(ring.report() for ring in self._rings.values())


def _same_model(a: ModelCard, b: ModelCard) -> bool:
    """Two rings may serve one name only if a request is answered the same on either."""
    return (a.context_length, a.eos_token_ids, a.fingerprint) == (b.context_length, b.eos_token_ids, b.fingerprint)
