"""Mooncake trace parsing (mooncaked.replay.trace)."""

import pytest

from mooncaked.replay import TraceError, load_trace


def write(tmp_path, text):
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    return p


def test_parse_fields_sort_and_text_input(tmp_path):
    p = write(tmp_path, '{"timestamp": 30, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}\n'
                        "\n"
                        '{"timestamp": 10, "input_length": 3, "output_length": 2, "hash_ids": [], '
                        '"text_input": "Hello there"}\n'
                        '{"timestamp": 10, "input_length": 512, "output_length": 1, "hash_ids": [0]}\n')
    reqs = load_trace(p)
    assert [r.index for r in reqs] == [1, 2, 0]  # by timestamp, ties in file order
    assert reqs[0].text_input == "Hello there" and reqs[0].hash_ids == ()
    assert reqs[2].hash_ids == (0, 1) and reqs[2].input_length == 700
    assert reqs[2].timestamp_ms == 30.0 and reqs[2].output_length == 5 and reqs[2].text_input is None


def test_limit_takes_the_first_lines(tmp_path):
    p = write(tmp_path, "".join(f'{{"timestamp": {100 - i}, "input_length": 10, "output_length": 1, '
                                f'"hash_ids": [{i}]}}\n' for i in range(10)))
    reqs = load_trace(p, limit=3)
    assert sorted(r.hash_ids[0] for r in reqs) == [0, 1, 2]
    with pytest.raises(ValueError):
        load_trace(p, limit=0)


@pytest.mark.parametrize("line,needle", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"input_length": 5, "output_length": 1}', "timestamp"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1}', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 0}', "output_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "text_input": 3}', "text_input"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, needle):
    p = write(tmp_path, '{"timestamp": 0, "input_length": 5, "output_length": 1}\n' + line + "\n")
    with pytest.raises(TraceError) as e:
        load_trace(p)
    assert f"{p}:2" in str(e.value) and needle in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path, "\n\n"))


def test_reads_the_conversation_trace(shared_trace):
    reqs = load_trace(shared_trace)
    assert len(reqs) == 12031  # shared/traces/README.md
    assert reqs[0].hash_ids[:2] == (0, 1) and reqs[0].input_length == 6758
    assert all(len(r.hash_ids) * 512 >= r.input_length for r in reqs[:1000])
