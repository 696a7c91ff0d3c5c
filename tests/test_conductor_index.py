"""The conductor's global prefix index: events, tiers, prefix match, inventories."""

from types import SimpleNamespace

import pytest

from mooncaked.conductor.index import BlockEvent, PrefixIndex


def test_match_walks_until_first_miss_per_node():
    ix = PrefixIndex()
    ix.stored("a", [1, 2, 3, 4])
    ix.stored("b", [1, 2])
    ix.stored("c", [2, 3, 4])          # no head block: matches nothing
    keys = [1, 2, 3, 4, 5]
    assert ix.match(keys, ["a", "b", "c", "unknown"]) == [4, 2, 0, 0]
    assert ix.match(keys, ["b", "a"]) == [2, 4]
    assert ix.longest(keys) == 4
    assert ix.match([9], ["a"]) == [0]
    assert ix.match([], ["a", "b"]) == [0, 0]


def test_eviction_and_tiers():
    ix = PrefixIndex()
    ix.apply("a", [("stored", 1, "dram"), ("stored", 2, "dram"), ("stored", 2, "ssd")])
    ix.apply("b", [BlockEvent("stored", 1, "dram")])
    assert ix.replicas(1) == 2 and ix.holders(1) == ["a", "b"]
    assert ix.tiers(2) == {"a": ["dram", "ssd"]}
    assert ix.blocks_on("a") == 2 and len(ix) == 2
    # Evicted from DRAM but still on SSD: still held, still matched.
    ix.apply("a", [("evicted", 2, "dram")])
    assert ix.match([1, 2], ["a"]) == [2]
    assert ix.tiers(2) == {"a": ["ssd"]}
    ix.apply("a", [("evicted", 2, "ssd"), ("evicted", 7, "dram")])   # unknown key: ignored
    assert ix.match([1, 2], ["a", "b"]) == [1, 1]
    assert ix.blocks_on("a") == 1 and len(ix) == 1
    ix.evicted("b", [1])
    assert ix.replicas(1) == 1
    # Storing twice counts once.
    ix.stored("a", [1, 1])
    assert ix.blocks_on("a") == 1


def test_bad_batch_changes_nothing():
    ix = PrefixIndex()
    ix.stored("a", [1])
    with pytest.raises(ValueError, match="unknown kind 'moved'"):
        ix.apply("a", [("stored", 2, "dram"), ("moved", 3, "dram")])
    assert ix.match([1, 2], ["a"]) == [1]


def test_remove_node_and_bit_reuse():
    ix = PrefixIndex()
    ix.stored("a", [1, 2])
    ix.stored("b", [1])
    assert ix.remove_node("a") == 2
    assert ix.match([1, 2], ["a", "b"]) == [0, 1]
    assert len(ix) == 1 and ix.nodes() == ["b"]
    ix.stored("c", [5])                # takes a's free bit; must not inherit a's blocks
    assert ix.match([1, 2], ["c"]) == [0] and ix.holders(5) == ["c"]


def test_store_events_with_seq_gap_and_inventory():
    ix = PrefixIndex()
    ev = lambda kind, keys, seq, tier="dram": SimpleNamespace(  # noqa: E731
        kind=kind, tier=tier, keys=tuple(keys), node_id="n1", seq=seq)
    assert ix.apply_store_events([ev("stored", [b"k1", b"k2"], 1),
                                  ev("evicted", [b"k2"], 2)]) == set()
    assert ix.match([b"k1", b"k2"], ["n1"]) == [1]
    # seq 3 lost: the gap is reported; the old seq 2 replayed is skipped.
    assert ix.apply_store_events([ev("stored", [b"k2"], 2), ev("stored", [b"k9"], 4)]) == {"n1"}
    assert ix.match([b"k1", b"k2"], ["n1"]) == [1]
    inv = SimpleNamespace(node_id="n1", seq=4, tiers={"dram": [b"k1", b"k2"], "ssd": [b"k3"]})
    ix.load_inventory(inv)
    assert ix.match([b"k1", b"k2", b"k3", b"k9"], ["n1"]) == [3]
    assert ix.apply_store_events([ev("stored", [b"k9"], 4)]) == set()   # covered by inventory
    assert ix.match([b"k1", b"k2", b"k3", b"k9"], ["n1"]) == [3]
    assert ix.apply_store_events([ev("stored", [b"k9"], 5)]) == set()
    assert ix.match([b"k1", b"k2", b"k3", b"k9"], ["n1"]) == [4]


def test_real_store_events_feed_the_index():
    """Keys and events as mooncaked.store produces them."""
    from mooncaked.store.types import StoreEvent

    ix = PrefixIndex()
    gaps = ix.apply_store_events([StoreEvent("stored", "dram", (b"a", b"b"), "node-1", 1),
                                  StoreEvent("stored", "ssd", (b"c",), "node-1", 2)])
    assert gaps == set()
    assert ix.match([b"a", b"b", b"c", b"d"], ["node-1"]) == [3]
