"""The coordinator's view of every paged stage's KV pool: which block ids are free, shared or cached.

All stages of a paged ring hold the same block ids (the plan carries the block tables), so one
:class:`BlockPool` in the coordinator accounts for every stage's pool. Blocks
``0 .. SCRATCH_BLOCKS-1`` take the padding rows of a step and are never handed out.

A block is in exactly one of three places:

- **held**: reference count >= 1 (one per stream whose block table lists it; a full block of a
  shared prefix has one per sharing stream);
- **cached**: reference count 0 but indexed under a key (a prefix block that may be reused);
  evicted least recently released first when the free list is empty;
- **free**: reference count 0, no key.

``free`` counts free and cached blocks (both can be allocated); ``used`` the held ones.
Pure bookkeeping: no OpenVINO, no I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

from engine.errors import GenerationError
from engine.wire.step_plan import MAX_POOL_BLOCKS, SCRATCH_BLOCKS


class PoolExhausted(GenerationError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free (or evictable) than asked for;
    the scheduler preempts a stream or waits, a caller that sees it asked without checking ``free``."""


class BlockPool:
    """Free list, reference counts and the key index of one pool of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int):
        if not SCRATCH_BLOCKS < num_blocks <= MAX_POOL_BLOCKS:
            raise GenerationError(f"a pool of {num_blocks} blocks is outside {SCRATCH_BLOCKS + 1}..{MAX_POOL_BLOCKS} "
                                  f"(blocks 0..{SCRATCH_BLOCKS - 1} are scratch); size the pool larger")
        self.num_blocks = num_blocks
        self.evictions = 0
        self._refs = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque()
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self.reset()

    @property
    def capacity(self) -> int:
        """Blocks a stream can ever hold (the pool minus the scratch blocks)."""
        return self.num_blocks - SCRATCH_BLOCKS

    @property
    def free(self) -> int:
        """Blocks :meth:`allocate` can hand out now (free plus evictable cached ones)."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Blocks held by at least one stream."""
        return self.capacity - self.free

    @property
    def cached(self) -> int:
        """Blocks held by nobody but kept for their key (reusable until evicted)."""
        return len(self._cached)

    def reset(self) -> None:
        """Every block free, the index empty: the stages' pools are new (a new ring)."""
        self._refs = [0] * self.num_blocks
        self._free = collections.deque(range(SCRATCH_BLOCKS, self.num_blocks))
        self._cached.clear()
        self._key_of.clear()
        self._block_of.clear()

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each with reference count 1: free ones first, then the least recently
        released cached ones (their keys are dropped). PoolExhausted if fewer than ``n`` are free."""
        if n > self.free:
            raise PoolExhausted(f"{n} KV blocks asked for but only {self.free} of {self.capacity} are free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                self._drop_key(block)
                self.evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def share(self, block: int) -> None:
        """One more holder of ``block``; a cached block comes back into use."""
        self._check(block)
        if self._refs[block] == 0:
            if block not in self._cached:
                raise GenerationError(f"block {block} is free and holds nothing to share")
            del self._cached[block]
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; at zero the block is cached (if it has a key) or free."""
        self._check(block)
        if self._refs[block] <= 0:
            raise GenerationError(f"block {block} released more often than it was held")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def set_key(self, block: int, key: Hashable) -> bool:
        """Index a held block under ``key``; False (and nothing changes) when the key already names
        a block or the block already has a key."""
        self._check(block)
        if self._refs[block] <= 0:
            raise GenerationError(f"block {block} is not held; only a held block can be indexed")
        if key in self._block_of or block in self._key_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def find(self, key: Hashable) -> int | None:
        """The block indexed under ``key`` (held or cached), or None."""
        return self._block_of.get(key)

    def key_of(self, block: int) -> Hashable | None:
        return self._key_of.get(block)

    def drop_key(self, block: int) -> None:
        """Forget ``block``'s key; a cached block becomes free."""
        if block in self._cached:
            del self._cached[block]
            self._free.append(block)
        self._drop_key(block)

    def _drop_key(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]

    def _check(self, block: int) -> None:
        if not SCRATCH_BLOCKS <= block < self.num_blocks:
            raise GenerationError(f"block {block} is outside the pool's stream blocks "
                                  f"{SCRATCH_BLOCKS}..{self.num_blocks - 1}")

    def audit(self) -> None:
        """GenerationError unless the three places partition the pool (tests call it after every step)."""
        free, cached = set(self._free), set(self._cached)
        held = {b for b in range(SCRATCH_BLOCKS, self.num_blocks) if self._refs[b] > 0}
        problems = []
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        if free & cached or free & held or cached & held:
            problems.append(f"blocks in two places: {sorted((free & cached) | (free & held) | (cached & held))}")
        if len(free) + len(cached) + len(held) != self.capacity:
            problems.append(f"free {len(free)} + cached {len(cached)} + held {len(held)} != {self.capacity}")
        if any(self._refs[b] < 0 for b in range(self.num_blocks)) or any(self._refs[:SCRATCH_BLOCKS]):
            problems.append("a negative reference count or a held scratch block")
        if any(b not in self._key_of for b in cached) or any(b in self._key_of for b in free):
            problems.append("a cached block without a key or a free block with one")
        if {self._block_of[k] for k in self._block_of} != set(self._key_of) or len(self._block_of) != len(self._key_of):
            problems.append("the key index and its reverse disagree")
        if problems:
            raise GenerationError("block pool inconsistent: " + "; ".join(problems))
