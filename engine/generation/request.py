"""What a client asks the coordinator for, and what comes back: token ids only.

Text (chat templates, detokenisation, stop strings) is the API layer's business; the
coordinator and the ring see ids, masks and positions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from engine.errors import GenerationError

RequestId = NewType("RequestId", int)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise GenerationError(f"temperature must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be 0 (off) or positive, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    want_logits: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise GenerationError("the prompt is empty")
        if self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")


class FinishReason(enum.Enum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_new_tokens or the context limit
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; ``finish`` is set on the last event of a request."""

    token_id: int
    index: int
    probability: float | None = None
    finish: FinishReason | None = None
