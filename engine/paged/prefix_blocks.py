"""The prefix cache of the paged path: full KV blocks shared by reference, partial ones copied.

A full block's KV depends on every token before its end, so it is indexed under a chained hash
``h_i = H(h_{i-1}, tokens of block i)`` with ``h_{-1} = H(model fingerprint, scope)``: two streams
of one scope (one API key: :attr:`GenerationRequest.cache_scope`) whose token sequences agree up
to a block's end may share that block as it is (the pool's reference count). Streams of different
scopes never match, so a key holder cannot tell from reused tokens (or their timing) what another
key's prompts hold. The last, partly filled block of a stream that leaves is indexed under its parent's
hash and its own tokens; a new stream matching some of those tokens gets a **copy** of it
(the plan's ``copies``, made on every stage before the infer), since it will write the rest.

Indexed blocks nobody holds stay in the pool's cache until the pool needs them (LRU), so a
second turn of a chat (prompt = first prompt + answer + more) finds the first turn's blocks.
Pure bookkeeping over :class:`~engine.paged.block_pool.BlockPool`; no OpenVINO.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.paged.block_pool import BlockPool

PARTIALS_PER_PARENT = 8  # distinct partial tails kept after one full-block prefix


def root_hash(fingerprint: str, scope: str = "") -> bytes:
    """The hash before the first block: blocks of different models, or of different scopes, never match."""
    salt = b"\0scope\0" + scope.encode("utf-8", "surrogateescape") if scope else b""
    return hashlib.blake2b(b"deskfleet-kv\0" + fingerprint.encode() + salt, digest_size=16).digest()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block whose tokens are ``tokens`` after the prefix hashed as ``parent``."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class PrefixMatch:
    """What a new stream can reuse: ``blocks`` (full, to share, in logical order) with their chain
    ``hashes``, then optionally ``copy_tokens`` tokens of block ``copy_src`` (to copy into a
    block of its own). ``tokens`` = positions the stream need not compute."""

    blocks: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    copy_src: int | None = None
    copy_tokens: int = 0
    tokens: int = 0


class PrefixBlocks:
    """The index of reusable blocks of one pool, for one model."""

    def __init__(self, pool: BlockPool, block_size: int, fingerprint: str):
        self.pool = pool
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.root = root_hash(fingerprint)  # the scope-less root ("": a server without keys)
        # parent hash -> the partial keys indexed after it (oldest first); stale keys are pruned lazily
        self._partials: dict[bytes, collections.OrderedDict[tuple, None]] = {}

    def reset(self) -> None:
        """Forget every partial entry (the pool's reset forgets the keys themselves)."""
        self._partials.clear()

    def root_for(self, scope: str) -> bytes:
        """The root of ``scope``'s chains (see the module docstring)."""
        return root_hash(self.fingerprint, scope) if scope else self.root

    def match(self, tokens: Sequence[int], usable: int, root: bytes | None = None) -> PrefixMatch:
        """The longest reusable prefix of ``tokens`` covering at most ``usable`` positions (a stream
        must compute at least one position itself, so callers pass ``len(tokens) - 1``), among the
        blocks chained from ``root`` (the stream's scope; None: the scope-less root)."""
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = self.root if root is None else root
        for i in range(len(tokens) // bs):
            digest = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
            block = self.pool.find(("full", digest))
            if block is None:
                break
            if (i + 1) * bs > usable:  # a full match that would leave nothing to compute: copy part of it
                take = usable - i * bs
                if take > 0:
                    return PrefixMatch(tuple(blocks), tuple(hashes), block, take, usable)
                break
            blocks.append(block)
            hashes.append(digest)
            parent = digest
        done = len(blocks) * bs
        src, take = self._best_partial(parent, tokens[done:usable])
        return PrefixMatch(tuple(blocks), tuple(hashes), src, take, done + take)

    def _best_partial(self, parent: bytes, tail: Sequence[int]) -> tuple[int | None, int]:
        entries = self._partials.get(parent)
        if not entries or not tail:
            return None, 0
        best, best_len = None, 0
        for key in list(entries):
            block = self.pool.find(key)
            if block is None:  # evicted since
                del entries[key]
                continue
            stored = key[2]
            n = 0
            for a, b in zip(stored, tail, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block, n
        if not entries:
            del self._partials[parent]
        return best, best_len

    def register_full(self, block: int, digest: bytes) -> bool:
        """Index a held block that just filled; False when that prefix is already indexed."""
        return self.pool.set_key(block, ("full", digest))

    def register_partial(self, block: int, parent: bytes, tokens: Sequence[int]) -> bool:
        """Index a held, partly filled last block holding ``tokens`` after the prefix ``parent``."""
        key = ("part", parent, tuple(int(t) for t in tokens))
        if not self.pool.set_key(block, key):
            return False
        entries = self._partials.setdefault(parent, collections.OrderedDict())
        entries[key] = None
        while len(entries) > PARTIALS_PER_PARENT:
            old, _ = entries.popitem(last=False)
            old_block = self.pool.find(old)
            if old_block is not None:
                self.pool.drop_key(old_block)
        return True
