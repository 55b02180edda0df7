"""What a client asks the coordinator for, and what comes back: token ids only.

Text (chat templates, detokenisation, stop strings, tool-call parsing) is the API layer's
business; the coordinator and the ring see ids, masks and positions. Two things a request
may add for the generators (issue 17): ``logprobs`` (log-probabilities of the chosen token and
the k most likely ones, carried back on each :class:`TokenEvent`) and ``constraint`` (the
output must match a grammar: :class:`JsonConstraint` or :class:`ToolCallConstraint`, compiled
by :mod:`engine.generation.grammar` into a per-stream token mask).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from engine.errors import GenerationError
from engine.generation.principal import ANONYMOUS, Principal

RequestId = NewType("RequestId", int)


MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (OpenAI's range: -100 bans a token, +100 forces it)
PENALTY_LIMIT = 2.0  # |frequency_penalty|, |presence_penalty| at most this (OpenAI's range)
REPETITION_PENALTY_MAX = 10.0  # repetition_penalty in (0, this]; 1.0 is off


@dataclass(frozen=True)
class SamplingParams:
    """How a stream's next token is chosen from its logits (:mod:`engine.generation.penalties`,
    then :mod:`engine.generation.sampling`).

    temperature 0 means greedy; top_k 0, top_p 1.0 and min_p 0.0 disable those filters.
    ``frequency_penalty`` / ``presence_penalty`` (OpenAI's, -2..2, over the generated tokens),
    ``repetition_penalty`` (HF's / vLLM's / llama.cpp's, > 0, 1.0 off, over prompt and generated
    tokens) and ``logit_bias`` ((token id, bias) pairs, ids ascending, bias -100..100) adjust the
    logits before any of that; a stream with one of them set is :attr:`penalised`."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise GenerationError(f"temperature must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise GenerationError(f"min_p must be between 0 and 1, got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise GenerationError(f"{name} must be between -{PENALTY_LIMIT} and {PENALTY_LIMIT}, "
                                      f"got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= REPETITION_PENALTY_MAX:
            raise GenerationError(f"repetition_penalty must be above 0 and at most {REPETITION_PENALTY_MAX} "
                                  f"(1.0 is off), got {self.repetition_penalty}")
        ids = [t for t, _ in self.logit_bias]
        if len(ids) > MAX_LOGIT_BIAS or ids != sorted(set(ids)) or any(t < 0 for t in ids):
            raise GenerationError(f"logit_bias must name at most {MAX_LOGIT_BIAS} distinct token ids >= 0, "
                                  "in ascending order")
        if any(not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT for _, b in self.logit_bias):
            raise GenerationError(f"logit_bias values must be between -{LOGIT_BIAS_LIMIT} and {LOGIT_BIAS_LIMIT}")

    @property
    def greedy(self) -> bool:
        """The token is the top of the (penalised) logits: no draw."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether the logits are adjusted per stream before choosing (a penalty or a bias): its
        tokens are then chosen by the coordinator from the row's logits, never the last stage's top-1."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))


MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's limit; the step frame's top_k)


@dataclass(frozen=True)
class JsonConstraint:
    """The output must be one JSON value: any JSON object (``schema`` None, OpenAI's
    ``{"type": "json_object"}``) or one valid for ``schema`` (JSON Schema as compact JSON text,
    OpenAI's ``{"type": "json_schema"}``; ``name`` is the schema's name there)."""

    schema: str | None = None
    name: str = ""
    strict: bool = False


@dataclass(frozen=True)
class FunctionSchema:
    """A function a constrained tool call may name, with its arguments' JSON Schema (compact JSON text)."""

    name: str
    parameters: str


@dataclass(frozen=True)
class ToolCallConstraint:
    """The output must be exactly one tool call: ``opening`` + ``{"name": N, "arguments": A}`` +
    ``closing``, N one of ``functions`` (one for a named ``tool_choice``, all of them for
    ``required``) and A valid for that function's ``parameters``."""

    functions: tuple[FunctionSchema, ...]
    opening: str = "<tool_call>\n"
    closing: str = "\n</tool_call>"

    def __post_init__(self) -> None:
        if not self.functions:
            raise GenerationError("a tool-call constraint needs at least one function")


Constraint = JsonConstraint | ToolCallConstraint


@dataclass(frozen=True)
class GenerationRequest:
    """``logprobs``: None for none, else k (0..20): each token event carries the chosen token's
    log-probability and the k most likely tokens' (log-softmax of the raw logits at temperature 1,
    after the constraint's mask). ``constraint``: the grammar the output must match (None: free).
    ``cache_scope``: whose prompt this is (the API puts the key's scope here): cached KV and prefix
    routing are shared only between requests of one scope, so no key learns what another's prompts
    hold from reused tokens or their timing ("" for a server without keys: one user). ``principal``:
    who the request counts against in the paged scheduler's fair share (the API sets it beside
    ``cache_scope``; a request's choices share it)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    want_logits: bool = False
    logprobs: int | None = None
    constraint: Constraint | None = None
    cache_scope: str = ""
    principal: Principal = ANONYMOUS

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise GenerationError("the prompt is empty")
        if self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}")


class FinishReason(enum.Enum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_new_tokens or the context limit
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; ``finish`` is set on the last event of a request.

    ``logprob`` and ``top_logprobs`` ((id, logprob) pairs, most likely first) are filled when the
    request asked for ``logprobs`` (see :class:`GenerationRequest`); None and () otherwise."""

    token_id: int
    index: int
    probability: float | None = None
    finish: FinishReason | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
