"""A draft model beside the coordinator: any 1-stage export sharing the target's tokenizer.

One :class:`DraftModelDrafter` per stream keeps its own KV state. Before each proposal it aligns
that state with the stream's context: positions that are no longer part of it (drafts the
target rejected, or a context that was rewritten) are hidden by mask rewind, exactly as on the
target, so the draft cache is never trimmed either. Then it feeds what is new and decodes K
tokens, greedily or by sampling with the request's settings (whose distributions it returns
as ``q`` for the rejection-sampling correction).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.errors import GenerationError
from engine.generation.request import SamplingParams
from engine.generation.sampling import probabilities
from engine.shards.kv_layout import KVLayout
from engine.shards.stage import LocalChain, StepInputs


class DraftModelDrafter:
    """Proposes tokens with a small model; implements :class:`engine.paged.speculation_policy.Drafter`."""

    def __init__(self, chain: LocalChain, sampling: SamplingParams | None = None,
                 rng: np.random.Generator | None = None):
        if len(chain.stages) != 1:
            raise GenerationError("a draft model must be a 1-stage export; export it with --stages 1")
        self.chain = chain
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        self.rng = rng or np.random.default_rng()
        self.streams = chain.new_streams()
        self.layout = KVLayout()
        self.fed: list[int] = []  # logical tokens whose KV the draft cache holds

    def _align(self, context: Sequence[int]) -> int:
        """Hide cached positions that left the context; return how many context tokens are cached."""
        keep = 0
        limit = min(len(self.fed), len(context) - 1)  # the last context token is always fed anew
        while keep < limit and self.fed[keep] == context[keep]:
            keep += 1
        if keep < len(self.fed):
            self.layout.mask_last(len(self.fed) - keep)
            del self.fed[keep:]
        return keep

    def _step(self, tokens: Sequence[int]) -> np.ndarray:
        mask, positions = self.layout.plan(len(tokens))
        logits = self.chain.forward(self.streams, StepInputs(np.asarray([tokens], dtype=np.int64), mask, positions, 1))
        self.layout.append(len(tokens))
        self.fed.extend(int(t) for t in tokens)
        return logits[0, -1]  # [V]

    def propose(self, context: Sequence[int], k: int) -> tuple[tuple[int, ...], np.ndarray | None]:
        if k <= 0 or not context:
            return (), None
        cached = self._align(context)
        logits = self._step(context[cached:])
        draft: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(k):
            if self.sampling is None:
                token = int(np.argmax(logits))
            else:
                q = probabilities(logits, self.sampling)
                token = int(self.rng.choice(q.shape[0], p=q))
                qs.append(q)
            draft.append(token)
            if i + 1 < k:
                logits = self._step([token])
        return tuple(draft), (np.stack(qs) if qs else None)
