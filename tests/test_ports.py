"""free_port picks below the kernel's ephemeral range, where no bind(0) and no outgoing
connection lands (a restarted node once found its port taken: CI, address already in use)."""

from __future__ import annotations

import socket

import pytest

from mooncaked.ports import LOWEST_PORT, ephemeral_low, free_port


def test_ephemeral_low_reads_the_kernel_range_and_defaults_when_unreadable(tmp_path):
    good = tmp_path / "range"
    good.write_text("20000\t60999\n")
    assert ephemeral_low(good) == 20000
    bad = tmp_path / "bad"
    bad.write_text("garbage\n")
    assert ephemeral_low(bad) == 32768
    assert ephemeral_low(tmp_path / "absent") == 32768


def test_free_port_is_below_the_ephemeral_range_bindable_and_not_excluded():
    low = ephemeral_low()
    if low <= LOWEST_PORT + 1000:
        pytest.skip(f"ephemeral range starts at {low}: free_port falls back to bind(0)")
    picked = set()
    for _ in range(20):
        port = free_port(exclude=picked)
        assert LOWEST_PORT <= port < low and port not in picked
        picked.add(port)
        with socket.socket() as s:          # it is free: a server can listen on it
            s.bind(("127.0.0.1", port))
    assert len(picked) == 20


def test_free_port_raises_when_every_candidate_is_excluded():
    low = ephemeral_low()
    if low <= LOWEST_PORT + 1000:
        pytest.skip(f"ephemeral range starts at {low}: free_port falls back to bind(0)")
    with pytest.raises(OSError, match="no free port"):
        free_port(exclude=range(LOWEST_PORT, low))
