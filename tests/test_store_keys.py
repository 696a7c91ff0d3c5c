"""Block keys: chaining, salts, full blocks only, speed-independent properties."""

import hashlib

import numpy as np
import pytest

from mooncaked.store.keys import KEY_BYTES, block_keys, make_salt

SALT = make_salt("smollm2-135m", 16, "float32")


def test_full_blocks_only_and_prefix_property():
    toks = list(range(100, 150))  # 3 full blocks of 16 + 2 tokens
    keys = block_keys(toks, 16, SALT)
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 3
    # A shared prefix gives shared keys up to the first differing block.
    other = toks[:20] + [7] + toks[21:]
    k2 = block_keys(other, 16, SALT)
    assert k2[0] == keys[0] and k2[1] != keys[1] and k2[2] != keys[2]
    assert block_keys(toks[:15], 16, SALT) == []


def test_chain_definition_matches_spec():
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    keys = block_keys(toks, 4, SALT)
    k0 = hashlib.blake2b(np.array([1, 2, 3, 4], "<u4").tobytes(), key=SALT, digest_size=16).digest()
    k1 = hashlib.blake2b(k0 + np.array([5, 6, 7, 8], "<u4").tobytes(), key=SALT,
                         digest_size=16).digest()
    assert keys == [k0, k1]
    # Continuing a chain from a parent key gives the same keys as one call.
    assert block_keys(toks[4:], 4, SALT, parent=k0) == [k1]


def test_numpy_and_list_agree_and_salts_separate():
    toks = np.random.default_rng(0).integers(0, 49152, 1000)
    assert block_keys(toks, 16, SALT) == block_keys(toks.tolist(), 16, SALT)
    for other in (make_salt("smollm2-135m", 16, "bfloat16"), make_salt("other", 16, "float32"),
                  make_salt("smollm2-135m", 16, "float32", "tenant-a")):
        assert other != SALT
        assert block_keys(toks, 16, other)[0] != block_keys(toks, 16, SALT)[0]
    assert make_salt("m", 16, "f", None) == make_salt("m", 16, "f", "")


def test_bad_input():
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, SALT)
    with pytest.raises(ValueError):
        block_keys([-1, 2], 2, SALT)
    with pytest.raises(ValueError):
        block_keys(np.array([-1, 2]), 2, SALT)
    with pytest.raises(ValueError):
        block_keys([1, 2], 2, b"")
    with pytest.raises(ValueError):
        make_salt("", 16, "float32")


def test_slice_key_names_a_layer_range_of_a_block():
    from mooncaked.store.keys import slice_key
    k1, k2 = block_keys(list(range(32)), 16, make_salt("m", 16, "float32"))
    s = slice_key(k1, 0, 15)
    assert len(s) == KEY_BYTES and s == slice_key(k1, 0, 15)          # deterministic
    others = {k1, k2, slice_key(k1, 15, 30), slice_key(k1, 0, 30), slice_key(k2, 0, 15),
              slice_key(k1, 0, 14)}
    assert s not in others and len(others) == 6                          # all distinct
    for bad in ((k1, 5, 5), (k1, -1, 3), (k1, 3, 2), (b"", 0, 1)):
        with pytest.raises(ValueError):
            slice_key(*bad)
