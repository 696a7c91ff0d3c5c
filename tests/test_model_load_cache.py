"""The load cache (model/load_cache.py, gguf_index.py, tokenizer.py): what a node derives
from the GGUF file is the same whether parsed now or read back, a damaged entry is
rebuilt, and a cache that cannot be written only costs time."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from mooncaked.model import load_cache
from mooncaked.model.gguf_index import MAX_ARRAY_LEN, read_index
from mooncaked.model.quant import KEPT_TYPES, Q4_1, Q8_0, QuantizedWeight
from mooncaked.model.tokenizer import Tokenizer

TEXTS = ["The capital of France is", "  leading spaces, tabs\tand\nnewlines",
         "ça va? 東京 🙂 <|im_start|> x", "12345 + 678 = 7023", ""]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh, empty load cache for this test only."""
    monkeypatch.setenv("MOONCAKED_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def reader(bundled_model):
    """gguf-py's own parse of the bundled model (the reference)."""
    return gguf.GGUFReader(str(bundled_model))


def test_the_index_gives_gguf_py_s_metadata_bytes_and_values(bundled_model, reader):
    index = read_index(bundled_model)          # the run's cache (parsed if it is cold)
    for key, f in reader.fields.items():
        if len(f.data) <= MAX_ARRAY_LEN:
            value = f.contents()
            assert index.field(key) == (value.tolist() if isinstance(value, np.ndarray) else value), key
        else:                                   # the tokenizer's arrays stay out
            assert key not in index.metadata
    assert index.field("llama.block_count") == 30
    ours = {t.name: t for t in index.tensors}
    assert sorted(ours) == sorted(t.name for t in reader.tensors)
    seen_types = set()
    for t in reader.tensors:
        info = ours[t.name]
        data = index.data(info)
        assert info.shape == tuple(int(x) for x in reversed(t.shape))
        assert data.dtype == t.data.dtype and data.shape == t.data.shape
        assert np.array_equal(data.view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name
        if info.qtype in seen_types or len(info.shape) != 2 or info.qtype not in KEPT_TYPES:
            continue
        seen_types.add(info.qtype)          # one matrix of each block type
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        mine = QuantizedWeight(info.qtype, np.array(data), info.shape).dequantize().numpy()
        assert np.array_equal(mine.view(np.uint32), theirs.reshape(info.shape).view(np.uint32)), t.name
    assert seen_types == {Q4_1, Q8_0}       # the bundled file's block types


def _small_gguf(path):
    """A two-tensor GGUF file written by gguf-py (parses in milliseconds)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_uint32("test.answer", 42)
    w.add_array("test.short", [1, 2, 3])
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", np.ones((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_entry_is_read_back_and_a_damaged_one_rebuilt(tmp_path, empty_cache):
    f = _small_gguf(tmp_path / "small.gguf")
    parsed = read_index(f)
    entries = list((empty_cache / "gguf").glob("*.json"))
    assert len(entries) == 1
    assert read_index(f) == parsed
    assert (parsed.field("test.answer"), parsed.field("test.short")) == (42, [1, 2, 3])
    a = {t.name: t for t in parsed.tensors}["a.weight"]
    assert a.shape == (3, 4) and parsed.data(a).tolist() == np.arange(12.0).reshape(3, 4).tolist()

    good = entries[0].read_bytes()
    entries[0].write_bytes(good[:len(good) // 2])     # a torn or damaged entry
    assert read_index(f) == parsed
    assert entries[0].read_bytes() == good            # rewritten whole


def test_tokenizer_from_the_cache_equals_the_converted_one(bundled_model, empty_cache):
    converted = Tokenizer(bundled_model, [2])            # converted from the GGUF file, saved
    assert len(list((empty_cache / "tokenizers").iterdir())) == 1
    cached = Tokenizer(bundled_model, [2])               # read back from the cache
    for text in TEXTS:
        ids = converted.encode(text)
        assert cached.encode(text) == ids, text
        assert cached.decode(ids) == converted.decode(ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert cached.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        converted.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert cached.eos_token_ids == converted.eos_token_ids == {2}
    assert cached.has_chat_template and cached.accepts_tools == converted.accepts_tools
    assert [cached.token_bytes(i) for i in range(0, 49152, 997)] == \
        [converted.token_bytes(i) for i in range(0, 49152, 997)]


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("MOONCAKED_CACHE_DIR", str(blocker))
    assert load_cache.cache_dir() == blocker
    assert load_cache.write_file(load_cache.entry("gguf", "k.json"), b"{}") is False
    with load_cache.building_dir(load_cache.entry("tokenizers", "k")) as build:
        assert build is None


def test_the_key_follows_the_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 60)
    first = load_cache.file_key(f, "lib 1")
    assert load_cache.file_key(f, "lib 1") == first
    assert load_cache.file_key(f, "lib 2") != first          # another library version
    f.write_bytes(b"GGUF" + b"\1" * 61)                        # the file replaced
    assert load_cache.file_key(f, "lib 1") != first
