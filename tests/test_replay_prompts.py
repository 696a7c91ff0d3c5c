"""Prompt construction from hash ids (mooncaked.replay.prompts)."""

import pytest

from mooncaked.replay import PromptBuilder, TraceRequest


def req(index, input_length, hash_ids, output_length=10):
    return TraceRequest(index=index, timestamp_ms=0.0, input_length=input_length,
                        output_length=output_length, hash_ids=tuple(hash_ids))


def test_same_id_same_block_across_builders():
    a, b = PromptBuilder(vocab_size=49152), PromptBuilder(vocab_size=49152)
    assert a.block(7) == b.block(7)
    assert len(a.block(7)) == 512
    # Pinned value: the block of an id must not change between versions, or replays
    # against a warm server would stop matching earlier runs.
    assert a.block(0)[:4] == (14027, 19857, 10900, 2415)


def test_different_ids_differ():
    b = PromptBuilder(vocab_size=49152)
    blocks = {b.block(i) for i in range(50)}
    assert len(blocks) == 50
    # Two random blocks should agree on about 1/48152 of their positions, not most of them.
    same = sum(x == y for x, y in zip(b.block(1), b.block(2)))
    assert same < 5


def test_token_range():
    b = PromptBuilder(vocab_size=1100, token_low=1000)
    toks = [t for i in range(20) for t in b.block(i)]
    assert min(toks) >= 1000 and max(toks) < 1100
    assert len(set(toks)) > 90  # covers most of the 100-token range


def test_shared_hash_prefix_gives_shared_token_prefix():
    b = PromptBuilder(vocab_size=49152)
    p1 = b.prompt(req(0, 1500, [0, 1, 2]))
    p2 = b.prompt(req(1, 1400, [0, 1, 9]))
    assert p1[:1024] == p2[:1024]
    assert p1[1024:1400] != p2[1024:1400]
    assert p1[:512] == list(b.block(0)) and p1[512:1024] == list(b.block(1))


def test_cut_to_input_length():
    b = PromptBuilder(vocab_size=49152)
    p = b.prompt(req(0, 600, [3, 4]))
    assert len(p) == 600
    assert p == list(b.block(3)) + list(b.block(4))[:88]


def test_length_scale():
    b = PromptBuilder(vocab_size=49152, length_scale=32)
    assert b.block_len == 16
    r = req(0, 6758, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], output_length=500)
    p = b.prompt(r)
    assert len(p) == 212 == b.input_length(r)  # ceil(6758 / 32)
    assert b.output_length(r) == 16  # ceil(500 / 32)
    assert b.output_length(req(0, 10, [0], output_length=3)) == 1
    # A scaled block is the start of the full block: same prefixes at every scale.
    assert list(b.block(5)) == list(PromptBuilder(vocab_size=49152).block(5))[:16]
    assert p[16:32] == list(b.block(1))


def test_tail_when_ids_are_short():
    b = PromptBuilder(vocab_size=49152)
    p1 = b.prompt(req(0, 700, [5]))
    p2 = b.prompt(req(1, 700, [5]))
    assert len(p1) == len(p2) == 700
    assert p1[:512] == p2[:512] == list(b.block(5))
    assert p1[512:] != p2[512:]  # the filler is unique to each request
    assert len(b.prompt(req(2, 30, []))) == 30


@pytest.mark.parametrize("kw", [dict(length_scale=0), dict(token_low=49152),
                                dict(token_low=-1), dict(block_tokens=0)])
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        PromptBuilder(vocab_size=49152, **kw)
