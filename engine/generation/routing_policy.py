"""Which ring serves a request: pure code over what the router knows (no sockets, no asyncio).

A model may be served by several rings (replicas of one export). For each request the router
ranks that model's rings and tries them in order until one admits the request:

1. rings whose status is *ok* first; a *recovering* ring only when none is ok; a *down* ring last
   (it answers with an error naming its stage, which is the clearest thing left to say);
2. within a tier, the ring that holds the conversation's prefix, when it holds enough of it
   (more than ``min_match_ratio`` of the prompt's full blocks) and is not much busier than the
   least loaded (at most ``balance_slack`` more requests); a shared system prompt alone is too
   short a match to pin every new conversation to one ring;
3. otherwise the least loaded (active + waiting, or the router's own count of streams in flight
   when that is higher), then the one that served fewer requests, then the order rings were added.

"Holds the prefix" is remembered, not asked: per ring, :class:`PrefixMemory` keeps the
block-aligned chained hashes of recent prompts and answers (bounded, least recently used first
out), the same shape as the paged coordinator's prefix cache so a second turn of a chat finds
the ring that computed the first.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.generation.ring_report import RingStatus

TIER = {RingStatus.OK: 0, RingStatus.RECOVERING: 1, RingStatus.DOWN: 2}
ROOT = hashlib.blake2b(b"deskfleet-route\0", digest_size=16).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, scope: str = "") -> tuple[bytes, ...]:
    """Chained hashes of the full blocks of ``token_ids``: ``h_i = H(h_{i-1}, block i)``, from a root
    of ``scope`` (a request's cache scope: one key's prompts never route by another's).

    A partial last block has no hash (it will be written on, so it cannot be shared as it is)."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    ids = np.asarray(token_ids, dtype=np.int64)
    out: list[bytes] = []
    parent = ROOT if not scope else hashlib.blake2b(ROOT + scope.encode("utf-8", "surrogateescape"),
                                                    digest_size=16).digest()
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + ids[start:start + block_size].tobytes(), digest_size=16).digest()
        out.append(parent)
    return tuple(out)


class PrefixMemory:
    """The block hashes one ring has seen lately: a bounded LRU set (``capacity`` hashes)."""

    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"PrefixMemory capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def remember(self, hashes: Iterable[bytes]) -> None:
        """Record ``hashes`` as most recently used, dropping the oldest beyond the capacity."""
        for h in hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def matched(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` this ring holds (a chain: the first miss ends it)."""
        n = 0
        for h in hashes:
            if h not in self._seen:
                break
            n += 1
        if n:  # a match is a use: keep what a live conversation needs
            self.remember(hashes[:n])
        return n


@dataclass(frozen=True)
class RoutingPolicy:
    """The knobs of :func:`rank_rings`."""

    min_match_ratio: float = 0.5  # a prefix pins a request only past this share of its full blocks
    balance_slack: int = 4  # ... and only while its ring has at most this many more requests than the least loaded

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_match_ratio < 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1), got {self.min_match_ratio}")
        if self.balance_slack < 0:
            raise ValueError(f"balance_slack must be 0 or more, got {self.balance_slack}")


DEFAULT_POLICY = RoutingPolicy()


@dataclass(frozen=True)
class RingView:
    """What the policy sees of one candidate ring for one request."""

    ring: str
    status: RingStatus
    load: int  # requests on it now (active + waiting)
    matched: int = 0  # leading prompt blocks it holds
    served: int = 0  # requests it has been given so far


def rank_rings(views: Sequence[RingView], prompt_blocks: int,
               policy: RoutingPolicy = DEFAULT_POLICY) -> tuple[str, ...]:
    """The rings to try for a request whose prompt has ``prompt_blocks`` full blocks, best first."""
    order = {v.ring: i for i, v in enumerate(views)}
    ranked: list[str] = []
    for tier in sorted(set(TIER[v.status] for v in views)):
        members = [v for v in views if TIER[v.status] == tier]
        by_load = sorted(members, key=lambda v: (v.load, v.served, order[v.ring]))
        least = by_load[0].load
        sticky = [v for v in members if v.matched and v.matched > policy.min_match_ratio * prompt_blocks
                  and v.load <= least + policy.balance_slack]
        if sticky:
            best = max(sticky, key=lambda v: (v.matched, -v.load, -order[v.ring]))
            by_load.remove(best)
            by_load.insert(0, best)
        ranked += [v.ring for v in by_load]
    return tuple(ranked)
