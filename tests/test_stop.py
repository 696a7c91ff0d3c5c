"""engine/stop.py: the stop check the engine and a CPP group's last stage share."""

from __future__ import annotations

from mooncaked.engine.detokenizer import IncrementalDetokenizer
from mooncaked.engine.stop import finish_reason, held_back
from mooncaked.engine.types import SamplingParams

EOS = {2}


def check(token, *, stop_string=None, grammar_done=False, n=1, max_tokens=8, **params):
    return finish_reason(token, SamplingParams(**params), EOS, stop_string, grammar_done, n,
                         max_tokens)


def test_each_reason_in_vllms_order():
    assert check(2) == ("stop", None)                                   # end of sequence
    assert check(2, ignore_eos=True) == (None, None)
    assert check(2, ignore_eos=True, n=8) == ("length", None)
    assert check(7, stop_token_ids=[7]) == ("stop", 7)
    assert check(7, stop_string="END") == ("stop", "END")
    assert check(7, grammar_done=True, ignore_eos=True) == ("stop", None)
    assert check(7, n=7) == (None, None) and check(7, n=8) == ("length", None)
    # an end-of-sequence token that is also a stop token id is reported as end of sequence
    assert check(2, stop_token_ids=[2]) == ("stop", None)
    # a stop token at the length limit stops as a stop, not as length
    assert check(7, stop_token_ids=[7], n=8) == ("stop", 7)


class _Words:
    """A tokenizer over a word list: token i decodes to words[i] (decode only)."""

    def __init__(self, words):
        self.words = words

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words[i] for i in ids)


def test_held_back_is_what_the_detokenizer_releases_of_a_first_token():
    """held_back (what the API node sends with the prefill node's first token, and where a
    decode node's text starts) drops a trailing incomplete character and the longest
    suffix that could start a stop string; a fresh IncrementalDetokenizer releases the
    same text for one token."""
    assert held_back("Hello", []) == "Hello"
    assert held_back("Hello", ["lo!"]) == "Hel"          # "lo" may start "lo!"
    assert held_back("Hello", ["o!", "llo?"]) == "He"    # the longest suffix wins
    assert held_back("Hello", ["xyz", ""]) == "Hello"
    assert held_back("ab\ufffd", ["zz"]) == "ab"
    assert held_back("", ["a"]) == ""
    cases = [("Hello", ["lo!"]), ("Hello", ["o!", "llo?"]), ("abc", ["bcd"]), ("abc", []),
             (" the", ["e end", "x"])]
    for text, stop in cases:
        det = IncrementalDetokenizer(_Words([text]), stop)
        assert det.add(0) == held_back(text, stop), (text, stop)
