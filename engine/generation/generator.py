"""The seam between the OpenAI API (or the chat window) and whatever generates tokens.

The coordinator implements it, whether its stages run in this process or in a ring of
workers; the API layer depends only on this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.errors import DeskfleetError
from engine.generation.request import GenerationRequest, TokenEvent

if TYPE_CHECKING:
    from engine.shards.manifest import Manifest


class OverloadedError(DeskfleetError):
    """Every slot is busy and the waiting queue is full; retry later (HTTP 429)."""


class UnavailableError(DeskfleetError):
    """The fleet cannot serve right now (a stage is down, the coordinator is stopping): HTTP 503."""


@dataclass(frozen=True)
class ModelCard:
    name: str
    context_length: int
    eos_token_ids: tuple[int, ...]
    stages: int
    fingerprint: str = ""
    vocab_size: int | None = None  # the model's embedding rows: the prompt ids it takes (None: not known)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> ModelCard:
        """What a ring serving ``manifest``'s export tells the API about its model."""
        m = manifest.model
        return cls(name=m.name, context_length=m.max_position_embeddings, eos_token_ids=m.eos_token_ids,
                   stages=len(manifest.stages), fingerprint=m.fingerprint, vocab_size=m.vocab_size)


class Generator(Protocol):
    """Generates token ids for requests, several at once."""

    @property
    def model(self) -> ModelCard: ...

    def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """Yield the request's tokens as they come; the last event carries ``finish``.

        Raises :class:`OverloadedError` or :class:`UnavailableError` before the first token.
        Closing the iterator (``aclose()``) or cancelling its consumer cancels the request and
        frees its slot on every stage.
        """
        ...

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for /metrics (names without the ``deskfleet_`` prefix)."""
        ...
