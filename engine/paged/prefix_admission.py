"""Prefix sharing at admission, for :class:`~engine.paged.scheduler.BatchScheduler`.

A waiting stream is admitted onto the longest prefix the index holds
(:mod:`engine.paged.prefix_blocks`): full blocks by reference, part of a block by copy;
an admitted stream catches up on full blocks another stream computed since (users with one
system prompt); a block a step in flight is computing is waited for and shared, never computed
twice. Pure bookkeeping over the scheduler's pool, prefix index and counters, which the scheduler
owns and lends here (``computing``: chain hash of a full block a prefill row in flight completes ->
that step's seq). A stream's state is only read here: each step returns what to attach to it
(:class:`Attach`, :class:`CaughtUp`) and the scheduler writes it, the one writer of a
:class:`~engine.paged.state.StreamState`. The block references it hands over are already taken
on the lent pool.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from engine.paged.block_pool import BlockPool
from engine.paged.prefix_blocks import PrefixBlocks, PrefixMatch, chain_hash
from engine.paged.state import StreamState
from engine.wire.step_plan import blocks_needed


@dataclass(frozen=True)
class Attach:
    """A waiting stream's admission: its blocks (the prefix's, a copy's destination, its first
    chunk's), their chain hashes, the positions they already hold, whether a prefix block is
    copied into its last block by its first step, and its first chunk's rows (0: it waits for a
    block another stream is computing and shares it next step)."""

    first: int
    blocks: list[int]
    hashes: list[bytes]
    cached: int
    copying: bool = False


@dataclass(frozen=True)
class CaughtUp:
    """Full blocks an admitted stream now shares: ``blocks[i]`` replaces (or extends) its block
    ``start + i``, ``hashes[i]`` its chain hash; ``cached`` its positions with KV after them; ``wait``:
    the next block is being computed by a step in flight or planned (the stream sits this step out)."""

    start: int
    blocks: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    cached: int = 0
    wait: bool = False


@dataclass
class PrefixAdmission:
    """The scheduler's prefix-sharing steps; the scheduler reads its pool and prefix index here and
    owns the rest (``computing``, ``counters``)."""

    block_size: int
    prefill_chunk: int
    pool: BlockPool
    prefix: PrefixBlocks | None
    computing: dict[bytes, int]
    counters: collections.Counter[str]

    def catch_up(self, s: StreamState) -> CaughtUp:
        """The full blocks another stream computed since ``s`` was admitted (users with one system
        prompt), each already shared, that replace ``s``'s own partial copy of such a block or
        extend its table, leaving it at least one token to compute; ``wait`` when the next block
        ``s`` would compute is being computed by a step in flight or planned."""
        bs = self.block_size
        start = j = s.cached // bs
        if self.prefix is None:
            return CaughtUp(start, cached=s.cached)
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = s.hashes[-1] if s.hashes else s.root
        wait = False
        while (j + 1) * bs < len(s.tokens):
            digest = chain_hash(parent, s.tokens[j * bs:(j + 1) * bs])
            block = self.pool.find(("full", digest))
            if block is None:
                wait = digest in self.computing
                break
            self.pool.share(block)
            blocks.append(block)
            hashes.append(digest)
            parent = digest
            j += 1
        cached = j * bs if blocks else s.cached
        if blocks:
            self.counters["prefix_tokens_reused"] += cached - s.cached
        return CaughtUp(start, tuple(blocks), tuple(hashes), cached, wait)

    def computing_blocks(self, s: StreamState, past: int, n: int) -> list[bytes]:
        """Chain hashes of the blocks a chunk of ``n`` rows of ``s`` from position ``past`` completes."""
        if self.prefix is None:
            return []
        bs, out = self.block_size, []
        parent = s.hashes[-1] if s.hashes else s.root
        for j in range(len(s.hashes), (past + n) // bs):
            parent = chain_hash(parent, s.tokens[j * bs:(j + 1) * bs])
            if j >= past // bs:
                out.append(parent)
        return out

    def admit(self, s: StreamState, budget: int, copies: list[tuple[int, int]], pins: list[int]) -> Attach | None:
        """The longest reusable prefix of a waiting stream and the blocks of its first chunk (taken
        on the pool), or None (nothing changed) when the pool cannot take it without preempting."""
        bs = self.block_size
        hit = self.prefix.match(s.tokens, len(s.tokens) - 1, s.root) if self.prefix is not None else PrefixMatch()
        if self.prefix is not None and hit.copy_src is None and hit.tokens + bs < len(s.tokens):
            parent = hit.hashes[-1] if hit.hashes else s.root
            if chain_hash(parent, s.tokens[hit.tokens:hit.tokens + bs]) in self.computing:
                for b in hit.blocks:
                    self.pool.share(b)
                self._count_hit(hit)
                return Attach(0, list(hit.blocks), list(hit.hashes), hit.tokens)
        n = self._first_chunk(s, hit, budget)
        if n < 1 and hit.copy_src is not None:  # the copy's source and destination do not both fit: share only
            hit = PrefixMatch(hit.blocks, hit.hashes, tokens=len(hit.blocks) * bs)
            n = self._first_chunk(s, hit, budget)
        if n < 1 and hit.tokens:  # the cached blocks it would revive crowd out its own rows: start cold
            hit = PrefixMatch()
            n = self._first_chunk(s, hit, budget)
        if n < 1:
            return None
        for b in hit.blocks:
            self.pool.share(b)
        blocks = list(hit.blocks)
        if hit.copy_src is not None:
            self.pool.share(hit.copy_src)
            pins.append(hit.copy_src)
            dst = self.pool.allocate(1)[0]
            copies.append((hit.copy_src, dst))
            self.counters["prefix_copies"] += 1
            blocks.append(dst)
        blocks.extend(self.pool.allocate(blocks_needed(hit.tokens + n, bs) - len(blocks)))
        self._count_hit(hit)
        return Attach(n, blocks, list(hit.hashes), hit.tokens, copying=hit.copy_src is not None)

    def _count_hit(self, hit: PrefixMatch) -> None:
        if hit.tokens:
            self.counters["prefix_hits"] += 1
            self.counters["prefix_tokens_reused"] += hit.tokens

    def _first_chunk(self, s: StreamState, hit: PrefixMatch, budget: int) -> int:
        """Rows a stream reusing ``hit`` can bring now: the pool's free blocks, less the cached ones
        the hit takes back into use, must cover them."""
        revived = sum(1 for b in hit.blocks if self.pool.refcount(b) == 0)
        if hit.copy_src is not None and self.pool.refcount(hit.copy_src) == 0:
            revived += 1  # held while the destination is allocated
        room = (len(hit.blocks) + self.pool.free - revived) * self.block_size - hit.tokens
        return min(self.prefill_chunk, budget, len(s.tokens) - hit.tokens, room)
