"""free_port picks beside the kernel's ephemeral range, where no bind(0) and no outgoing
connection lands (a restarted node once found its port taken: CI, address already in use)."""

from __future__ import annotations

import socket

import pytest

from mooncaked.ports import candidate_range, ephemeral_range, free_port


def _range_file(tmp_path, text: str):
    path = tmp_path / "range"
    path.write_text(text)
    return path


def test_the_kernel_range_is_read_and_the_gap_beside_it_chosen(tmp_path):
    assert ephemeral_range(_range_file(tmp_path, "20000\t60999\n")) == (20000, 60999)
    assert ephemeral_range(_range_file(tmp_path, "garbage\n")) == (32768, 60999)
    assert ephemeral_range(tmp_path / "absent") == (32768, 60999)
    assert candidate_range(_range_file(tmp_path, "32768 60999")) == (10000, 32768)
    # the range starts too low for a gap below it: above it
    assert candidate_range(_range_file(tmp_path, "10500 60999")) == (61000, 65536)
    assert candidate_range(_range_file(tmp_path, "1024 65535")) is None     # no gap: bind(0)


def test_free_port_is_beside_the_ephemeral_range_bindable_and_not_excluded():
    span = candidate_range()
    if span is None:
        pytest.skip(f"ephemeral range {ephemeral_range()}: free_port falls back to bind(0)")
    low, high = ephemeral_range()
    picked = set()
    for _ in range(20):
        port = free_port(exclude=picked)
        assert span[0] <= port < span[1] and not low <= port <= high and port not in picked
        picked.add(port)
        with socket.socket() as s:          # it is free: a server can listen on it
            s.bind(("127.0.0.1", port))
    assert len(picked) == 20


def test_free_port_raises_when_every_candidate_is_excluded_or_the_host_is_not_ours():
    span = candidate_range()
    if span is None:
        pytest.skip(f"ephemeral range {ephemeral_range()}: free_port falls back to bind(0)")
    with pytest.raises(OSError, match="no free port"):
        free_port(exclude=range(*span))
    # TEST-NET-1 (RFC 5737): never an address of this machine; the first bind says so
    with pytest.raises(OSError, match="cannot bind a port on '192.0.2.1'"):
        free_port("192.0.2.1")
