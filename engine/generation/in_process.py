"""Greedy generation over a chain of stages in one process (the in-process baseline)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import GenerationError
from engine.shards.kv_layout import KVLayout
from engine.shards.stage import LocalChain, StepInputs


@dataclass(frozen=True)
class GenerationResult:
    tokens: tuple[int, ...]
    prompt_tokens: int
    ttft_s: float
    total_s: float
    stopped_on_eos: bool

    @property
    def decode_tok_per_s(self) -> float:
        """Tokens after the first, per second of decode (TTFT excluded)."""
        decode = self.total_s - self.ttft_s
        return (len(self.tokens) - 1) / decode if len(self.tokens) > 1 and decode > 0 else 0.0


def prefill_steps(n: int, chunk: int | None) -> list[int]:
    """Sizes of the prefill steps for an ``n``-token prompt (one step, or chunks of ``chunk``)."""
    if not chunk or chunk >= n:
        return [n]
    return [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])


def greedy_generate(chain: LocalChain, prompt_ids: Sequence[int], max_new_tokens: int, *,
                    eos_ids: Sequence[int] = (), ignore_eos: bool = False,
                    prefill_chunk: int | None = None,
                    on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Prefill ``prompt_ids`` then decode greedily; fresh KV state on every stage."""
    if not prompt_ids:
        raise GenerationError("the prompt is empty")
    if max_new_tokens < 1:
        raise GenerationError("max_new_tokens must be at least 1")
    limit = chain.manifest.model.max_position_embeddings
    if len(prompt_ids) + max_new_tokens > limit:
        raise GenerationError(
            f"prompt ({len(prompt_ids)} tokens) + {max_new_tokens} new tokens exceed the model's "
            f"context of {limit}; shorten the prompt or ask for fewer tokens"
        )
    streams = chain.new_streams()
    layout = KVLayout(len(prompt_ids) + max_new_tokens)
    eos = frozenset(eos_ids)
    tokens: list[int] = []
    started = time.perf_counter()
    ttft = 0.0
    pending = np.asarray(prompt_ids, dtype=np.int64)[None, :]
    sizes = prefill_steps(pending.shape[1], prefill_chunk)
    stopped = False
    while len(tokens) < max_new_tokens:
        offset = 0
        for size in sizes:
            mask, positions = layout.plan(size)
            logits = chain.forward(streams, StepInputs(pending[:, offset : offset + size], mask, positions, 1))
            layout.append(size)
            offset += size
        token = int(np.argmax(logits[0, -1]))
        if not tokens:
            ttft = time.perf_counter() - started
        tokens.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos and not ignore_eos:
            stopped = True
            break
        pending = np.array([[token]], dtype=np.int64)
        sizes = [1]
    return GenerationResult(tuple(tokens), len(prompt_ids), ttft, time.perf_counter() - started, stopped)
