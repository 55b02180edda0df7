"""The block pool (free list, reference counts, LRU of cached blocks) and the prefix-block index."""

from __future__ import annotations

import pytest

from engine.errors import GenerationError
from engine.paged.block_pool import BlockPool, PoolExhausted
from engine.paged.prefix_blocks import PARTIALS_PER_PARENT, PrefixBlocks, chain_hash, root_hash
from engine.wire.step_plan import SCRATCH_BLOCKS


def test_scratch_blocks_are_never_handed_out_and_exhaustion_is_named() -> None:
    pool = BlockPool(SCRATCH_BLOCKS + 3)
    assert (pool.capacity, pool.free, pool.used) == (3, 3, 0)
    got = pool.allocate(3)
    assert sorted(got) == [SCRATCH_BLOCKS, SCRATCH_BLOCKS + 1, SCRATCH_BLOCKS + 2]
    with pytest.raises(PoolExhausted, match="1 KV blocks asked for but only 0 of 3 are free"):
        pool.allocate(1)
    assert issubclass(PoolExhausted, GenerationError)
    for b in got:
        pool.release(b)
    assert pool.free == 3 and pool.used == 0
    pool.audit()
    with pytest.raises(GenerationError, match="outside"):
        BlockPool(SCRATCH_BLOCKS)


def test_reference_counts_share_and_release() -> None:
    pool = BlockPool(SCRATCH_BLOCKS + 4)
    (b,) = pool.allocate(1)
    pool.share(b)
    assert pool.refcount(b) == 2 and pool.used == 1
    pool.release(b)
    assert pool.refcount(b) == 1 and pool.used == 1
    pool.release(b)
    assert pool.refcount(b) == 0 and pool.free == 4
    with pytest.raises(GenerationError, match="released more often"):
        pool.release(b)
    with pytest.raises(GenerationError, match="free and holds nothing"):
        pool.share(b)
    with pytest.raises(GenerationError, match="outside the pool"):
        pool.share(0)
    pool.audit()


def test_cached_blocks_are_reusable_until_the_free_list_runs_out_then_evicted_lru() -> None:
    pool = BlockPool(SCRATCH_BLOCKS + 3)
    a, b, c = pool.allocate(3)
    assert pool.set_key(a, "A") and pool.set_key(b, "B")
    assert not pool.set_key(c, "A") and not pool.set_key(a, "other")  # one block per key, one key per block
    pool.release(b)
    pool.release(a)  # released after b: b is the least recently released
    pool.release(c)
    assert (pool.free, pool.cached, pool.used) == (3, 2, 0)
    assert pool.find("A") == a and pool.find("B") == b
    pool.share(a)  # a prefix hit revives a cached block
    assert pool.cached == 1 and pool.used == 1
    (d,) = pool.allocate(1)
    assert d == c and pool.evictions == 0  # free blocks go first
    (e,) = pool.allocate(1)
    assert e == b and pool.evictions == 1 and pool.find("B") is None  # then the LRU cached one
    pool.audit()
    pool.drop_key(a)
    assert pool.find("A") is None
    pool.release(a)
    assert pool.cached == 0 and pool.free == 1
    pool.audit()
    pool.reset()
    assert pool.free == 3 and pool.find("A") is None
    pool.audit()


def test_a_key_goes_only_on_a_held_block() -> None:
    pool = BlockPool(SCRATCH_BLOCKS + 2)
    with pytest.raises(GenerationError, match="not held"):
        pool.set_key(SCRATCH_BLOCKS, "k")


def _indexed(pool: BlockPool, prefix: PrefixBlocks, tokens: list[int], bs: int, scope: str = "") -> list[int]:
    """Blocks holding ``tokens`` (full ones indexed), as a stream of ``scope`` would leave them."""
    blocks = pool.allocate(-(-len(tokens) // bs))
    parent = prefix.root_for(scope)
    for i in range(len(tokens) // bs):
        parent = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
        prefix.register_full(blocks[i], parent)  # False when that prefix is indexed already
    if len(tokens) % bs:
        prefix.register_partial(blocks[-1], parent, tokens[len(tokens) // bs * bs:])
    return blocks


def test_full_blocks_match_by_the_whole_prefix_and_leave_a_token_to_compute() -> None:
    bs = 16
    pool = BlockPool(64)
    prefix = PrefixBlocks(pool, bs, "model")
    tokens = list(range(1, 49))  # 3 full blocks
    blocks = _indexed(pool, prefix, tokens, bs)
    hit = prefix.match(tokens + [7], len(tokens))
    assert hit.blocks == tuple(blocks) and hit.tokens == 48 and hit.copy_src is None
    # the whole prompt cached: the last block is copied for all but its last token
    hit = prefix.match(tokens, len(tokens) - 1)
    assert hit.blocks == tuple(blocks[:2]) and (hit.copy_src, hit.copy_tokens, hit.tokens) == (blocks[2], 15, 47)
    # the same second block after another first block: no match beyond the first difference
    other = [99] + tokens[1:]
    assert prefix.match(other, 48).tokens == 0
    assert prefix.match(tokens[:16] + [5] * 32, 47).blocks == (blocks[0],)
    # another model's index never matches
    assert PrefixBlocks(pool, bs, "other").match(tokens + [1], 48).tokens == 0
    assert root_hash("model") != root_hash("other")


def test_one_keys_blocks_never_match_another_keys_prompt() -> None:
    """The prefix cache is scoped (issue 29, M1): the same tokens under another scope share nothing,
    full blocks or partial tails, so reuse cannot tell one key what another's prompts hold."""
    bs = 16
    pool = BlockPool(64)
    prefix = PrefixBlocks(pool, bs, "model")
    tokens = list(range(1, 41))  # 2 full blocks and a partial tail
    blocks = _indexed(pool, prefix, tokens, bs, scope="key:victim")
    victim, bob = prefix.root_for("key:victim"), prefix.root_for("key:bob")
    assert len({victim, bob, prefix.root}) == 3 and prefix.root_for("") == prefix.root == root_hash("model", "")
    assert prefix.match(tokens + [7], 40, bob).tokens == 0
    assert prefix.match(tokens + [7], 40).tokens == 0  # nor to a server without keys
    hit = prefix.match(tokens + [7], 40, victim)
    assert hit.blocks == tuple(blocks[:2]) and (hit.copy_src, hit.tokens) == (blocks[2], 40)


def test_the_best_partial_tail_is_copied() -> None:
    bs = 16
    pool = BlockPool(64)
    prefix = PrefixBlocks(pool, bs, "m")
    head = list(range(1, 17))
    a = _indexed(pool, prefix, head + [1, 2, 3], bs)
    b = _indexed(pool, prefix, head + [1, 2, 9, 9, 9], bs)
    assert a[0] != b[0] and pool.find(("full", chain_hash(prefix.root, head))) == a[0]  # the first one indexed
    hit = prefix.match(head + [1, 2, 9, 9, 4, 4], 21)
    assert hit.blocks == (a[0],) and (hit.copy_src, hit.copy_tokens) == (b[1], 4)
    hit = prefix.match(head + [1, 2, 9, 9, 9, 9], 18)  # capped by what may be reused
    assert hit.copy_tokens == 2 and hit.tokens == 18
    for blk in a + b:
        pool.release(blk)
    (_, _, *rest) = pool.allocate(pool.free)  # everything evicted: the stale entries are pruned
    assert prefix.match(head + [1, 2, 9], 18).tokens == 0
    del rest


def test_partial_tails_per_prefix_are_bounded() -> None:
    pool = BlockPool(64)
    prefix = PrefixBlocks(pool, 16, "m")
    blocks = pool.allocate(PARTIALS_PER_PARENT + 1)
    for i, blk in enumerate(blocks):
        assert prefix.register_partial(blk, prefix.root, [i + 1, 5])
    assert pool.key_of(blocks[0]) is None  # the oldest tail was dropped
    assert all(pool.key_of(blk) is not None for blk in blocks[1:])
    pool.audit()
