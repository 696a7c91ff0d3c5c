"""engine/stop.py: the stop check the engine and a CPP group's last stage share."""

from __future__ import annotations

from mooncaked.engine.stop import finish_reason
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
