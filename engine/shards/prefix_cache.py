"""The prefix cache (paper §8.4): captured KV states on the stages, and the coordinator's index.

At the end of a generation each stage keeps a compacted copy of the stream's KV state under a
capture id (:class:`CaptureStore`, LRU, bounded in bytes). The coordinator remembers which
token sequence each capture holds (:class:`PrefixIndex`); a new prompt whose longest cached
prefix is long enough is restored on every stage and only its suffix is prefilled. A stage
that has evicted the capture refuses the restore, and the coordinator falls back to a cold
prefill: the two sides never need to agree on eviction.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class CaptureStore:
    """Captured KV states of one stage, least recently used evicted first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[int, list[np.ndarray]] = collections.OrderedDict()
        self.bytes = 0

    def put(self, capture_id: int, tensors: list[np.ndarray]) -> bool:
        size = sum(t.nbytes for t in tensors)
        if size > self.max_bytes:
            return False
        self.drop(capture_id)
        while self.bytes + size > self.max_bytes and self._items:
            _, old = self._items.popitem(last=False)
            self.bytes -= sum(t.nbytes for t in old)
        self._items[capture_id] = tensors
        self.bytes += size
        return True

    def get(self, capture_id: int) -> list[np.ndarray] | None:
        tensors = self._items.get(capture_id)
        if tensors is not None:
            self._items.move_to_end(capture_id)
        return tensors

    def capture(self, stream, capture_id: int, keep: np.ndarray) -> None:
        """Keep ``stream``'s KV (a :class:`engine.shards.stage.StageStream`) compacted to ``keep``."""
        self.put(capture_id, stream.snapshot(keep))

    def restore(self, stage, capture_id: int, length: int):
        """A new stream of ``stage`` holding the first ``length`` positions of the capture, or
        None if this store no longer holds it. Runs on the stage's compute thread."""
        snapshot = self.get(capture_id)
        if snapshot is None:
            return None
        stream = stage.new_stream()
        stream.load(snapshot, length)
        return stream

    def holds(self, capture_id: int) -> bool:
        return capture_id in self._items

    def drop(self, capture_id: int) -> None:
        old = self._items.pop(capture_id, None)
        if old is not None:
            self.bytes -= sum(t.nbytes for t in old)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True)
class PrefixHit:
    capture_id: int
    length: int  # leading positions to restore; the prompt's remaining tokens are prefilled


class PrefixIndex:
    """Which token sequence each capture holds, and whose (coordinator side, pure): a capture is
    found only by a prompt of the scope it was taken for (one API key,
    :attr:`~engine.generation.request.GenerationRequest.cache_scope`), so no key reuses, or times,
    another key's prompts."""

    def __init__(self, max_entries: int = 64, min_length: int = 16, fingerprint: str = ""):
        self.max_entries = max_entries
        self.min_length = min_length
        self.fingerprint = fingerprint  # the model every capture in this index was taken from
        self._entries: collections.OrderedDict[int, tuple[str, tuple[int, ...]]] = collections.OrderedDict()
        self._next_id = 1

    def new_id(self) -> int:
        capture_id, self._next_id = self._next_id, self._next_id + 1
        return capture_id

    def add(self, capture_id: int, tokens: Sequence[int], scope: str = "") -> None:
        self._entries[capture_id] = (scope, tuple(tokens))
        self._entries.move_to_end(capture_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, capture_id: int) -> None:
        self._entries.pop(capture_id, None)

    def lookup(self, prompt: Sequence[int], fingerprint: str = "", scope: str = "") -> PrefixHit | None:
        """The capture of ``scope`` sharing the longest prefix with ``prompt`` (at least
        ``min_length`` tokens, and always leaving one prompt token to prefill, whose logits start
        the answer).

        A ``fingerprint`` other than the index's (the ring now serves another export) empties the
        index: its captures belong to a model that is gone, so everything prefills cold.
        """
        if fingerprint and fingerprint != self.fingerprint:
            self._entries.clear()
            self.fingerprint = fingerprint
            return None
        best: PrefixHit | None = None
        for capture_id, (owner, tokens) in self._entries.items():
            if owner != scope:
                continue
            n = _common_prefix(tokens, prompt)
            n = min(n, len(prompt) - 1)
            if n >= self.min_length and (best is None or n > best.length):
                best = PrefixHit(capture_id, n)
        if best is not None:
            self._entries.move_to_end(best.capture_id)
        return best

    def __len__(self) -> int:
        return len(self._entries)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(np.argmax(x)) if x.any() else n
