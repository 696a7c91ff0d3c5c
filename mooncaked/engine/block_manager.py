"""Device page allocator with automatic prefix caching.

Pages are fixed-size blocks of `block_size` tokens. A full block whose tokens
are known gets a block key (mooncaked.store.keys: chained over the prefix and
salted per model and tenant); a later request whose prompt starts with the
same keys reuses those blocks instead of recomputing them. Blocks that no
running request references but that still hold keyed KV stay cached and are
evicted least-recently-freed first, only when a free block is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from mooncaked.store.keys import block_keys
from mooncaked.utils import cdiv

from .sequence import Sequence


class BlockManager:
    """Reference-counted pages, a key -> block map and an LRU of cached free blocks.

    Args:
        num_blocks: pages in the KV cache.
        block_size: tokens per page.
        enable_prefix_caching: when False, blocks are never shared or kept.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_key: list[bytes | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))           # no key, no refs
        self.cached_free: OrderedDict[bytes, int] = OrderedDict()  # keyed, no refs; LRU first
        self.key_to_block: dict[bytes, int] = {}
        self._num_evictions = 0

    # -- accounting

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self.free) + len(self.cached_free)

    @property
    def num_evictions(self) -> int:
        """Cached free blocks evicted so far (their keys dropped to hand the page out), a
        monotonic count since construction; read-only."""
        return self._num_evictions

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra pages `seq` needs to hold `num_new_tokens` more tokens of K/V."""
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table))

    # -- prefix caching

    def ensure_keys(self, seq: Sequence) -> None:
        """Extends seq.block_keys to every full block of its tokens (chained, incremental)."""
        n_full = seq.num_tokens // self.block_size
        if len(seq.block_keys) < n_full:
            parent = seq.block_keys[-1] if seq.block_keys else b""
            start = len(seq.block_keys) * self.block_size
            seq.block_keys += block_keys(seq.token_ids[start:n_full * self.block_size],
                                         self.block_size, seq.salt, parent)

    def match_prefix(self, seq: Sequence) -> int:
        """Number of leading blocks of `seq` whose K/V is cached in pages.

        At most (num_tokens - 1) // block_size blocks: the last token is always
        computed, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return 0
        self.ensure_keys(seq)
        limit = (seq.num_tokens - 1) // self.block_size
        n = 0
        while n < limit and seq.block_keys[n] in self.key_to_block:
            n += 1
        return n

    def allocate_prefix(self, seq: Sequence, num_blocks: int) -> None:
        """Gives `seq` the first `num_blocks` cached blocks of its prefix (from match_prefix)."""
        assert not seq.block_table
        seq.block_table = self.pin_cached(seq.block_keys[:num_blocks])
        assert len(seq.block_table) == num_blocks
        seq.num_computed_tokens = num_blocks * self.block_size
        seq.num_committed_blocks = num_blocks

    # -- by block key: the sequence-level methods above and below are built on these, and a
    # CPP stage (engine/stage.py), which keeps its own per-request books, uses them directly

    def pin_cached(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` (in order) that this cache holds,
        each given one more reference (a block nobody used leaves the eviction LRU).
        [] with prefix caching off."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for key in keys:
            b = self.key_to_block.get(key)
            if b is None:
                break
            if self.ref_count[b] == 0:
                del self.cached_free[key]
            self.ref_count[b] += 1
            blocks.append(b)
        return blocks

    def publish(self, block: int, key: bytes) -> bool:
        """Keys `block` (its K/V computed) under `key` so later requests share it. False (the
        block stays a plain page) when prefix caching is off, the block has a key already,
        or another page holds `key` (computed twice concurrently: the first copy is kept)."""
        if not self.enable_prefix_caching or self.block_key[block] is not None \
                or key in self.key_to_block:
            return False
        self.block_key[block] = key
        self.key_to_block[key] = block
        return True

    def release(self, blocks: list[int]) -> None:
        """Drops one reference to each of `blocks`, last first: a keyed block nobody uses
        stays cached (evictable, so the tail of a prefix goes before its head), any other
        becomes free."""
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                key = self.block_key[b]
                if key is not None:
                    self.cached_free[key] = b
                else:
                    self.free.append(b)

    # -- allocation

    def take_block(self) -> int:
        """A page with one reference: a free one, else the least recently freed cached one
        (its key dropped: an eviction). Raises IndexError when every page is in use."""
        if self.free:
            b = self.free.popleft()
        elif not self.cached_free:
            raise IndexError("every KV page is in use")
        else:
            key, b = self.cached_free.popitem(last=False)  # least recently freed
            del self.key_to_block[key]
            self.block_key[b] = None
            self._num_evictions += 1
        self.ref_count[b] = 1
        return b

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Adds pages so `seq` can hold `num_new_tokens` more tokens; False if not enough."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self.take_block())
        return True

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Publishes keys of `seq`'s blocks that became full with computed K/V, so later
        requests with the same prefix share them (match_prefix). A block whose key another
        page already holds stays unkeyed (freed as a plain page)."""
        if not self.enable_prefix_caching:
            return
        n_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if n_full <= seq.num_committed_blocks:
            return
        self.ensure_keys(seq)
        for i in range(seq.num_committed_blocks, n_full):
            self.publish(seq.block_table[i], seq.block_keys[i])
        seq.num_committed_blocks = n_full

    def free_seq(self, seq: Sequence) -> None:
        """Drops `seq`'s references; keyed blocks stay cached, last block evicted first."""
        self.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
