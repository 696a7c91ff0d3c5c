"""The device page allocator (mooncaked/engine/block_manager.py) on its own: page
accounting, reference counts of shared prefix blocks, the prefix cache (hits, misses,
re-registration after eviction) and the exact LRU order in which cached free blocks are
evicted. No model: sequences are driven by hand the way the scheduler and engine drive
them (allocate -> mark computed -> commit_full_blocks -> free_seq).

Block size 4 throughout, so "8 tokens" is exactly two full blocks.
"""

from __future__ import annotations

import pytest

from mooncaked.engine.block_manager import BlockManager
from mooncaked.engine.sequence import Sequence
from mooncaked.engine.types import SamplingParams
from mooncaked.store.keys import block_keys, make_salt

BS = 4
SALT = make_salt("test-model", BS, "float32")


def make_seq(tokens: list[int], rid: str = "s", salt: bytes = SALT) -> Sequence:
    """A sequence whose prompt is `tokens` (the detokenizer is never used here)."""
    return Sequence(rid, tokens, SamplingParams(), salt, max_tokens=16, detokenizer=None)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does on admission: share the cached prefix. Returns blocks hit."""
    n = bm.match_prefix(seq)
    bm.allocate_prefix(seq, n)
    return n


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> list[tuple[bytes, int]]:
    """What one engine step does for `seq`: pages for n more tokens (default: all that lack
    K/V), the tokens computed, full blocks published. Returns the (key, block id) pairs
    commit_full_blocks published, in order."""
    n = seq.num_tokens - seq.num_computed_tokens if n is None else n
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    return commit(bm, seq)


def commit(bm: BlockManager, seq: Sequence) -> list[tuple[bytes, int]]:
    """bm.commit_full_blocks(seq); returns the (key, block id) pairs it newly published."""
    before = dict(bm.key_to_block)
    bm.commit_full_blocks(seq)
    return [(k, b) for k, b in bm.key_to_block.items() if before.get(k) != b]


def run_to_cache(bm: BlockManager, tokens: list[int], rid: str = "s") -> Sequence:
    """Admits, computes and frees a sequence, leaving its full blocks cached. Returns it
    (its block_keys stay; its block_table is empty after free_seq)."""
    seq = make_seq(tokens, rid)
    admit(bm, seq)
    compute(bm, seq)
    table = list(seq.block_table)
    bm.free_seq(seq)
    seq.freed_table = table  # for the test's own bookkeeping
    return seq


def lru_blocks(bm: BlockManager) -> list[int]:
    """Cached free block ids, the next one to be evicted first."""
    return list(bm.cached_free.values())


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """Every page is exactly one of: free (no key, no refs), cached free (key, no refs) or
    used (refs = number of live sequences holding it); keys map both ways."""
    holders = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            holders[b] += 1
    assert bm.ref_count == holders
    free, cached = set(bm.free), set(bm.cached_free.values())
    assert len(free) == len(bm.free) and not free & cached
    for b in range(bm.num_blocks):
        if b in free:
            assert holders[b] == 0 and bm.block_key[b] is None
        elif b in cached:
            assert holders[b] == 0 and bm.block_key[b] is not None
        else:
            assert holders[b] > 0
    for key, b in bm.key_to_block.items():
        assert bm.block_key[b] == key
    for key, b in bm.cached_free.items():
        assert bm.key_to_block[key] == b
    assert bm.num_free_blocks == len(free) + len(cached)
    assert bm.num_used_blocks == sum(1 for h in holders if h)


# ---------------------------------------------------------------------------- accounting


def test_blocks_needed_and_all_or_nothing_allocation():
    bm = BlockManager(num_blocks=3, block_size=BS)
    s = make_seq(list(range(10)))
    assert bm.blocks_needed(s, 10) == 3              # ceil(10 / 4)
    assert bm.blocks_needed(s, 4) == 1
    assert bm.blocks_needed(s, 0) == 0
    assert bm.allocate(s, 5)                          # a chunk of 5 tokens: 2 pages
    assert s.block_table == [0, 1] and bm.ref_count == [1, 1, 0]
    s.num_computed_tokens = 5
    assert bm.blocks_needed(s, 3) == 0                # tokens 5..7 fit the second page
    assert bm.blocks_needed(s, 4) == 1
    # 13 more tokens need 3 more pages; only 1 is free: refused, nothing handed out
    assert not bm.allocate(s, 13)
    assert s.block_table == [0, 1] and bm.num_free_blocks == 1 and bm.num_used_blocks == 2
    check_invariants(bm, [s])


def test_free_blocks_are_handed_out_before_any_cached_block_is_evicted():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = run_to_cache(bm, list(range(8)))               # 2 cached blocks, 2 never used
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    s = make_seq(list(range(100, 108)))
    compute(bm, s)
    assert sorted(s.block_table) == [2, 3]             # the never-keyed pages
    assert bm.num_evictions == 0
    assert bm.match_prefix(make_seq(list(range(8)) + [9])) == 2   # a's blocks still cached
    assert lru_blocks(bm) == [a.freed_table[1], a.freed_table[0]]
    check_invariants(bm, [s])


# ---------------------------------------------------------------------------- keys


def test_commit_publishes_only_full_computed_blocks_with_chained_keys():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]       # 2 full blocks + 2 tokens
    want = block_keys(tokens, BS, SALT)
    assert len(want) == 2
    s = make_seq(tokens)
    assert compute(bm, s, 5) == [(want[0], s.block_table[0])]   # chunk 1: block 0 full
    assert s.num_committed_blocks == 1
    assert commit(bm, s) == []                                 # nothing new: idempotent
    assert compute(bm, s, 5) == [(want[1], s.block_table[1])]   # chunk 2: block 1 full
    assert s.block_keys == want
    assert bm.block_key[s.block_table[2]] is None              # partial block: no key
    # decoding fills the third block: its key chains on the first two
    s.token_ids += [15, 16]
    got = compute(bm, s, 2)
    assert got == [(block_keys(s.token_ids, BS, SALT)[2], s.block_table[2])]
    assert s.block_keys == block_keys(s.token_ids, BS, SALT)
    check_invariants(bm, [s])


def test_match_prefix_never_covers_the_last_token():
    bm = BlockManager(num_blocks=4, block_size=BS)
    run_to_cache(bm, list(range(8)))
    # An 8-token prompt fully cached still computes its last token: 1 block, not 2.
    assert bm.match_prefix(make_seq(list(range(8)))) == 1
    assert bm.match_prefix(make_seq(list(range(9)))) == 2
    # a prompt that differs inside block 1 shares block 0 only (keys are chained)
    assert bm.match_prefix(make_seq([0, 1, 2, 3, 4, 5, 6, 99, 8])) == 1
    # a prompt that differs inside block 0 shares nothing, even if block 1 is equal
    assert bm.match_prefix(make_seq([99, 1, 2, 3, 4, 5, 6, 7, 8])) == 0


def test_different_salts_never_share_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    run_to_cache(bm, list(range(8)))
    other = make_seq(list(range(9)), salt=make_salt("test-model", BS, "float32", "tenant-b"))
    assert bm.match_prefix(other) == 0
    assert bm.match_prefix(make_seq(list(range(9)))) == 2


# ---------------------------------------------------------------------------- hits and refs


def test_hit_reuses_the_cached_pages_after_free():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = run_to_cache(bm, list(range(10)))             # 2 keyed blocks + 1 partial
    partial = a.freed_table[2]
    assert list(bm.free).count(partial) == 1          # the partial page went back unkeyed
    assert bm.num_used_blocks == 0
    b = make_seq(list(range(10)) + [42, 43])
    assert admit(bm, b) == 2
    assert b.block_table == a.freed_table[:2]          # the very same pages
    assert b.num_computed_tokens == 8 and b.num_committed_blocks == 2
    assert [bm.ref_count[x] for x in b.block_table] == [1, 1]
    assert lru_blocks(bm) == []                        # no longer evictable
    assert compute(bm, b) == [(block_keys(b.token_ids, BS, SALT)[2], b.block_table[2])]
    check_invariants(bm, [b])


def test_shared_prefix_refcount_is_the_number_of_sequences_using_it():
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(list(range(8)) + [100, 101], "first")
    compute(bm, first)
    shared = first.block_table[:2]
    others = [make_seq(list(range(8)) + [200 + i], f"o{i}") for i in range(2)]
    for s in others:
        assert admit(bm, s) == 2
        compute(bm, s)
        assert s.block_table[:2] == shared
    live = [first, *others]
    assert [bm.ref_count[b] for b in shared] == [3, 3]
    assert all(bm.ref_count[s.block_table[2]] == 1 for s in live)   # own tail pages
    check_invariants(bm, live)
    # Freeing one user keeps the shared blocks: still referenced, not cached, not free.
    bm.free_seq(others[0])
    live.remove(others[0])
    assert [bm.ref_count[b] for b in shared] == [2, 2]
    assert not set(shared) & (set(bm.free) | set(bm.cached_free.values()))
    check_invariants(bm, live)
    bm.free_seq(first)
    live.remove(first)
    assert [bm.ref_count[b] for b in shared] == [1, 1]
    bm.free_seq(others[1])
    assert [bm.ref_count[b] for b in shared] == [0, 0]
    assert set(shared) <= set(bm.cached_free.values())
    check_invariants(bm, [])


def test_referenced_blocks_are_never_evicted():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(8)), "a")
    compute(bm, a)
    b = make_seq(list(range(8)) + [9], "b")
    assert admit(bm, b) == 2                         # b shares a's 2 keyed pages
    bm.free_seq(a)                                   # refcount 2 -> 1: not evictable
    assert lru_blocks(bm) == []
    c = make_seq(list(range(50, 62)), "c")           # 12 tokens: 3 pages, 2 exist
    assert not bm.allocate(c, 12)                    # refuses rather than evict b's pages
    assert c.block_table == [] and bm.num_evictions == 0
    assert bm.allocate(c, 8)
    assert sorted(c.block_table) == [2, 3] and not set(c.block_table) & set(b.block_table)
    assert bm.num_evictions == 0
    check_invariants(bm, [b, c])


def test_identical_prompts_computed_concurrently_keep_the_first_copy():
    bm = BlockManager(num_blocks=6, block_size=BS)
    x, y = make_seq(list(range(8)), "x"), make_seq(list(range(8)), "y")
    assert admit(bm, x) == 0 and admit(bm, y) == 0   # nothing cached yet: both compute
    keys = block_keys(list(range(8)), BS, SALT)
    assert compute(bm, x) == list(zip(keys, x.block_table))
    assert compute(bm, y) == []                       # same keys already published
    assert [bm.key_to_block[k] for k in keys] == x.block_table
    assert all(bm.block_key[b] is None for b in y.block_table)
    y_pages = list(y.block_table)
    bm.free_seq(y)                                    # y's duplicate pages go back unkeyed
    assert set(y_pages) <= set(bm.free)
    assert lru_blocks(bm) == []
    check_invariants(bm, [x])


# ---------------------------------------------------------------------------- LRU eviction


def test_eviction_order_is_least_recently_freed_first_tail_blocks_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = run_to_cache(bm, list(range(8)), "a")         # pages a0, a1
    b = run_to_cache(bm, list(range(100, 108)), "b")  # pages b0, b1
    a0, a1 = a.freed_table
    b0, b1 = b.freed_table
    # free_seq releases a sequence's tail first, so within one sequence the deeper block
    # (useless without the ones before it) is evicted before the prefix block.
    assert lru_blocks(bm) == [a1, a0, b1, b0]
    assert len(bm.free) == 2
    c = make_seq(list(range(200, 216)), "c")           # 4 pages: 2 free, then 2 evicted
    compute(bm, c)
    assert c.block_table[2:] == [a1, a0]
    assert not {a.block_keys[0], a.block_keys[1]} & set(bm.key_to_block)   # their keys dropped
    assert bm.num_evictions == 2
    assert bm.match_prefix(make_seq(list(range(9)))) == 0          # a is gone
    assert bm.match_prefix(make_seq(list(range(100, 109)))) == 2   # b is still cached
    check_invariants(bm, [c])


def test_a_hit_refreshes_lru_position():
    bm = BlockManager(num_blocks=7, block_size=BS)
    a = run_to_cache(bm, list(range(8)), "a")
    b = run_to_cache(bm, list(range(100, 108)), "b")
    a0, a1 = a.freed_table
    b0, b1 = b.freed_table
    assert lru_blocks(bm) == [a1, a0, b1, b0]
    again = make_seq(list(range(8)) + [9], "again")    # uses a's blocks: most recent now
    assert admit(bm, again) == 2
    compute(bm, again)
    bm.free_seq(again)
    assert lru_blocks(bm) == [b1, b0, a1, a0]
    free_before = len(bm.free)
    assert free_before == 3
    c = make_seq(list(range(300, 320)), "c")            # 5 pages: 3 free, then b1, b0
    compute(bm, c)
    assert c.block_table[3:] == [b1, b0]
    assert not {b.block_keys[0], b.block_keys[1]} & set(bm.key_to_block)
    assert bm.match_prefix(make_seq(list(range(9)))) == 2   # a survived
    check_invariants(bm, [c])


def test_reuse_after_eviction_is_a_miss_then_the_key_is_registered_again():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = run_to_cache(bm, list(range(8)), "a")
    big = make_seq(list(range(500, 512)), "big")        # 3 pages: 1 free + evicts a's 2
    compute(bm, big)
    assert bm.num_evictions == 2 and not set(a.block_keys) & set(bm.key_to_block)
    bm.free_seq(big)
    # The same prefix again: a miss, recomputed from scratch into fresh pages ...
    again = make_seq(list(range(8)) + [9], "again")
    assert admit(bm, again) == 0 and again.num_computed_tokens == 0
    got = compute(bm, again)
    # ... and its blocks are published under the same keys as before.
    assert [k for k, _ in got] == a.block_keys
    assert [bm.key_to_block[k] for k in a.block_keys] == again.block_table[:2]
    bm.free_seq(again)
    assert bm.match_prefix(make_seq(list(range(8)) + [7])) == 2    # a hit again
    check_invariants(bm, [])


def test_a_prefix_block_shared_more_recently_outlives_the_tail():
    """A prefix block another sequence kept using is freed last, so the tail blocks of the
    longer sequence are evicted before it; the surviving prefix still matches."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    long = make_seq(list(range(12)), "long")
    compute(bm, long)
    p0, p1, p2 = long.block_table
    hit = make_seq(list(range(4)) + [77], "hit")       # shares only block 0
    assert admit(bm, hit) == 1
    bm.free_seq(long)                                  # p2, p1 cached (p0 still used)
    bm.free_seq(hit)                                   # p0 cached last: most recent
    assert lru_blocks(bm) == [p2, p1, p0]
    # One fresh page (3) then one eviction: p2 goes first.
    s = make_seq(list(range(900, 908)), "s")
    compute(bm, s)
    assert s.block_table == [3, p2]
    assert bm.match_prefix(make_seq(list(range(13)))) == 2
    check_invariants(bm, [s])


def test_prefix_caching_disabled_never_shares_or_keeps_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    s = make_seq(list(range(8)))
    assert compute(bm, s) == []
    bm.free_seq(s)
    assert len(bm.free) == 4 and lru_blocks(bm) == [] and bm.key_to_block == {}
    assert bm.match_prefix(make_seq(list(range(9)))) == 0
    assert s.block_table == [] and s.num_computed_tokens == 0 and s.num_committed_blocks == 0


def test_free_seq_resets_the_sequence_for_recompute():
    """After preemption (free_seq) the sequence holds no pages and restarts from its
    cached prefix: the scheduler's recompute path."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    s = make_seq(list(range(10)))
    compute(bm, s)
    s.token_ids.append(10)                             # one decoded token
    bm.free_seq(s)
    assert (s.block_table, s.num_computed_tokens, s.num_committed_blocks) == ([], 0, 0)
    assert admit(bm, s) == 2 and s.num_computed_tokens == 8   # 11 tokens: 2 blocks cached
    compute(bm, s)
    assert s.num_computed_tokens == 11 and len(s.block_table) == 3
    check_invariants(bm, [s])


@pytest.mark.parametrize("n_blocks", [1, 5])
def test_pool_size_is_respected(n_blocks):
    bm = BlockManager(num_blocks=n_blocks, block_size=BS)
    s = make_seq(list(range(BS * n_blocks + 1)))
    assert not bm.allocate(s, s.num_tokens)
    assert bm.allocate(s, BS * n_blocks)
    assert sorted(s.block_table) == list(range(n_blocks)) and bm.num_free_blocks == 0


def test_key_level_books_pin_publish_release_as_a_cpp_stage_uses_them():
    """The by-key API a CPP stage (engine/stage.py) keeps its pages with: pages taken,
    published under keys, released (tail first into the LRU), pinned again by key up to the
    first miss, and a full pool is an IndexError, not a silent eviction of a used page."""
    bm = BlockManager(3, BS)
    keys = block_keys(list(range(12)), BS, SALT)
    pages = [bm.take_block() for _ in range(3)]
    assert bm.num_free_blocks == 0
    with pytest.raises(IndexError):
        bm.take_block()
    assert [bm.publish(p, k) for p, k in zip(pages[:2], keys)] == [True, True]
    assert not bm.publish(pages[2], keys[0])       # another page holds the key
    assert not bm.publish(pages[0], keys[2])       # the page has a key already
    bm.release(pages)
    assert bm.num_free_blocks == 3
    assert bm.pin_cached([keys[0], keys[2], keys[1]]) == [pages[0]]   # stops at the miss
    assert bm.num_free_blocks == 2
    # the unkeyed page goes first, then the LRU's oldest: the tail block keys[1]
    assert bm.take_block() == pages[2]
    assert bm.take_block() == pages[1]
    assert bm.pin_cached(keys[:2]) == [pages[0]]   # keys[1] was evicted
    assert bm.ref_count[pages[0]] == 2
