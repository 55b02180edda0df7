"""The context a placement uses when the admin leaves it to the service: the model's maximum
(``max_position_embeddings`` in its export manifest), capped by what the fleet's memory can hold,
and the reason in words for the Placement page ("model maximum", "capped by memory: …").

Pure arithmetic, counted as the solver counts memory (`engine.placement.planner`): every agent
offers ``headroom`` of its free memory; the model needs its weights once (the decoder layers,
the embedding and the head) plus, per token of context and per stream, the KV cache of every
layer. The tokens the memory holds are rounded down to a multiple of ``ROUND``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROUND = 256
MIN_CONTEXT = 128  # the Placement page's smallest context
NO_ROOM_CONTEXT = 1024  # the weights alone do not fit: a small context, and the solver explains


@dataclass(frozen=True)
class ContextChoice:
    """``tokens`` the placement uses; ``capped`` when memory, not the model, set it; ``reason``
    for a person; ``model_max`` and ``memory_tokens`` (None: no agent's memory known) as figures."""

    tokens: int
    reason: str
    capped: bool
    model_max: int
    memory_tokens: int | None


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def choose_context(model_max: int, *, kv_bytes_per_token: int, weight_bytes: int,
                   free: Sequence[tuple[str, int]], streams: int = 1, headroom: float = 0.8) -> ContextChoice:
    """The context for ``model_max`` over agents ``free`` = [(name, free bytes)] serving
    ``streams`` streams. ``kv_bytes_per_token``: the KV cache of one token over every layer."""
    if model_max < 1 or kv_bytes_per_token < 1 or streams < 1:
        raise ValueError(f"model_max {model_max}, kv_bytes_per_token {kv_bytes_per_token} and streams {streams} "
                         "must be positive")
    if not free:
        return ContextChoice(model_max, f"model maximum ({model_max:,} tokens; no agent's free memory known yet)",
                             False, model_max, None)
    usable = headroom * sum(b for _, b in free)
    room = usable - weight_bytes
    tokens = max(0, int(room // (kv_bytes_per_token * streams)))
    tokens = tokens // ROUND * ROUND if tokens >= ROUND else tokens
    per = "stream" if streams == 1 else f"each of {streams} streams"
    where = ", ".join(f"{name} {_gb(headroom * b)}" for name, b in sorted(free, key=lambda x: -x[1])[:3])
    where += f" and {len(free) - 3} more" if len(free) > 3 else ""
    if tokens >= model_max:
        return ContextChoice(model_max, f"model maximum ({model_max:,} tokens); the agents' memory would hold "
                             f"{tokens:,}", False, model_max, tokens)
    if tokens < MIN_CONTEXT:
        small = min(model_max, NO_ROOM_CONTEXT)
        return ContextChoice(small, f"the memory cannot hold the model with {MIN_CONTEXT} tokens of context: "
                             f"{_gb(usable)} usable ({where}) for {_gb(weight_bytes)} of weights; {small:,} tokens "
                             f"tried (model maximum {model_max:,})", True, model_max, tokens)
    return ContextChoice(tokens, f"capped by memory: {_gb(usable)} usable ({where}) less {_gb(weight_bytes)} of "
                         f"weights holds {tokens:,} tokens for {per} (model maximum {model_max:,})",
                         True, model_max, tokens)
