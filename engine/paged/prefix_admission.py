"""Prefix sharing at admission, for :class:`~engine.paged.scheduler.BatchScheduler`.

A waiting stream is admitted onto the longest prefix the index holds
(:mod:`engine.paged.prefix_blocks`): full blocks by reference, part of a block by copy;
an admitted stream catches up on full blocks another stream computed since (users with one
system prompt); a block a step in flight is computing is waited for and shared, never computed
twice. Pure bookkeeping over the scheduler's pool, prefix index, stream states and counters: the
scheduler owns them all and lends them here (``computing``: chain hash of a full block a prefill
row in flight completes -> that step's seq).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from engine.paged.block_pool import BlockPool
from engine.paged.prefix_blocks import PrefixBlocks, PrefixMatch, chain_hash
from engine.paged.state import StreamState
from engine.wire.step_plan import blocks_needed


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

    def catch_up(self, s: StreamState) -> bool:
        """Share the full blocks another stream computed since ``s`` was admitted (users with one
        system prompt), replacing ``s``'s own partial copy of such a block and leaving it at least
        one token to compute. False when the next block ``s`` would compute is being computed by
        a step in flight or planned: ``s`` sits this step out and shares it next time."""
        if self.prefix is None:
            return True
        bs = self.block_size
        j = s.cached // bs
        while (j + 1) * bs < len(s.tokens):
            digest = chain_hash(s.hashes[-1] if s.hashes else s.root, s.tokens[j * bs:(j + 1) * bs])
            block = self.pool.find(("full", digest))
            if block is None:
                return digest not in self.computing
            self.pool.share(block)
            if len(s.blocks) > j:  # its own partial block: the shared one holds the same KV and more
                self.pool.release(s.blocks[j])
                s.blocks[j] = block
            else:
                s.blocks.append(block)
            s.hashes.append(digest)
            self.counters["prefix_tokens_reused"] += (j + 1) * bs - s.cached
            s.cached = (j + 1) * bs
            j += 1
        return True

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

    def admit(self, s: StreamState, budget: int, copies: list[tuple[int, int]], pins: list[int]) -> int | None:
        """Attach the longest reusable prefix to a waiting stream and the blocks of its first chunk;
        the chunk's size, 0 when the block after the prefix is being computed by another stream
        (it is admitted and shares that block next step), or None (nothing changed) when the pool
        cannot take it without preempting."""
        bs = self.block_size
        hit = self.prefix.match(s.tokens, len(s.tokens) - 1, s.root) if self.prefix is not None else PrefixMatch()
        if self.prefix is not None and hit.copy_src is None and hit.tokens + bs < len(s.tokens):
            parent = hit.hashes[-1] if hit.hashes else s.root
            if chain_hash(parent, s.tokens[hit.tokens:hit.tokens + bs]) in self.computing:
                for b in hit.blocks:
                    self.pool.share(b)
                s.blocks, s.hashes, s.cached = list(hit.blocks), list(hit.hashes), hit.tokens
                self._count_hit(hit)
                return 0
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
        s.blocks, s.hashes, s.cached = list(hit.blocks), list(hit.hashes), hit.tokens
        if hit.copy_src is not None:
            self.pool.share(hit.copy_src)
            pins.append(hit.copy_src)
            dst = self.pool.allocate(1)[0]
            copies.append((hit.copy_src, dst))
            s.copying = True
            self.counters["prefix_copies"] += 1
            s.blocks.append(dst)
        s.blocks.extend(self.pool.allocate(blocks_needed(s.cached + n, bs) - len(s.blocks)))
        self._count_hit(hit)
        return n

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
