"""Hosts on one machine (mooncaked/cluster/hosts.py): namespaces on a private bridge, a
shaped link that delivers its rate to 1 MiB transfers, silent cuts that heal, and clean-up
on stop and after the owner was killed -9. Needs root (CI runs as root here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mooncaked.cluster.hosts import (GATEWAY, Hosts, HostsError, parse_rate, pick_subnet,
                                     tbf_params)

# A peer run inside a host: `serve ADDR` listens and prints its port, then for each
# connection reads blocks of 8-byte-length-prefixed data and answers each with one byte;
# `send ADDR PORT N SIZE TIMEOUT` connects and sends N blocks of SIZE bytes back to back
# (as a batch of transfers), waits for the N answers, and prints {"connect_s", "seconds"} or {"error"}.
PEER = r"""
import json, socket, struct, sys, time
if sys.argv[1] == "serve":
    s = socket.socket(); s.bind((sys.argv[2], 0)); s.listen()
    print(s.getsockname()[1], flush=True)
    while True:
        c, _ = s.accept()
        try:
            while True:
                head = c.recv(8, socket.MSG_WAITALL)
                if len(head) < 8: break
                n = struct.unpack("!Q", head)[0]
                while n:
                    n -= len(c.recv(min(n, 1 << 20)))
                c.sendall(b"k")
        except OSError:
            pass
        c.close()
else:
    addr, port, n, size, timeout = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    t0 = time.perf_counter()
    try:
        c = socket.create_connection((addr, port), timeout=timeout)
    except OSError as e:
        print(json.dumps({"error": type(e).__name__})); sys.exit()
    t1 = time.perf_counter()
    block = b"x" * size
    for _ in range(n):
        c.sendall(struct.pack("!Q", size))
        c.sendall(block)
    got = 0
    while got < n:
        got += len(c.recv(n - got))
    print(json.dumps({"connect_s": t1 - t0, "seconds": time.perf_counter() - t1}))
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")


def _serve(hosts: Hosts, name: str) -> tuple[subprocess.Popen, int]:
    proc = hosts.popen(name, [sys.executable, "-c", PEER, "serve", hosts.address(name)],
                       stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def _send(hosts: Hosts | None, name: str, addr: str, port: int, n: int = 1,
          size: int = 1 << 10, timeout: float = 1.0) -> dict:
    cmd = [sys.executable, "-c", PEER, "send", addr, str(port), str(n), str(size), str(timeout)]
    out = subprocess.run(hosts.command(name, cmd) if name != GATEWAY else cmd,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def _netns() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              check=True).stdout.split())


def _links() -> str:
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True,
                          check=True).stdout


def test_rates_and_subnets():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("2.5gbit") == 2_500_000_000
    with pytest.raises(ValueError):
        parse_rate("1gb")
    assert tbf_params(10**9) == (250_000, "20ms")        # 2 ms of 125 MB/s
    assert tbf_params(10**8) == (128 << 10, "20ms")       # at least two GSO packets
    import ipaddress
    taken = [ipaddress.ip_network("10.0.0.0/8")]
    with pytest.raises(HostsError):
        pick_subnet(taken)
    net = pick_subnet([ipaddress.ip_network("192.168.0.0/16")])
    assert net.prefixlen == 24 and net.subnet_of(ipaddress.ip_network("10.0.0.0/8"))


def test_hosts_reach_cut_heal_and_stop(tmp_path):
    hosts = Hosts(["a", "b", "c"], record_dir=tmp_path)
    procs = []
    try:
        hosts.start()
        assert {h.netns for h in hosts.hosts.values()} <= _netns()
        assert hosts.record_path.exists()
        addrs = {hosts.address(n) for n in ["a", "b", "c", GATEWAY]}
        assert len(addrs) == 4 and all(a.startswith("10.") for a in addrs)
        (pb, port_b), (pc, port_c) = _serve(hosts, "b"), _serve(hosts, "c")
        procs += [pb, pc]
        assert "connect_s" in _send(hosts, "a", hosts.address("b"), port_b)
        assert "connect_s" in _send(None, GATEWAY, hosts.address("b"), port_b)
        # b listens on its own address only: not reachable on a's loopback
        assert "error" in _send(hosts, "a", "127.0.0.1", port_b, timeout=0.5)

        hosts.cut("a", "b")
        assert hosts.cuts() == {("a", "b")}
        t0 = time.monotonic()
        assert _send(hosts, "a", hosts.address("b"), port_b, timeout=1.0) == {"error": "TimeoutError"}
        assert time.monotonic() - t0 < 5.0           # silent: a timeout, not a refusal
        assert "connect_s" in _send(hosts, "a", hosts.address("c"), port_c)
        assert "connect_s" in _send(None, GATEWAY, hosts.address("b"), port_b)
        hosts.heal()
        assert hosts.cuts() == set()
        assert "connect_s" in _send(hosts, "a", hosts.address("b"), port_b, timeout=3.0)

        hosts.isolate("c")
        assert "error" in _send(None, GATEWAY, hosts.address("c"), port_c, timeout=0.5)
        assert "error" in _send(hosts, "b", hosts.address("c"), port_c, timeout=0.5)
        hosts.heal("c", GATEWAY)
        assert "connect_s" in _send(None, GATEWAY, hosts.address("c"), port_c, timeout=3.0)
        assert "error" in _send(hosts, "b", hosts.address("c"), port_c, timeout=0.5)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        hosts.stop()
    assert not ({h.netns for h in hosts.hosts.values()} & _netns())
    assert hosts.bridge not in _links()
    assert not hosts.record_path.exists()


def test_shaped_link_delivers_rate_to_1mib_blocks(tmp_path):
    with Hosts(["a", "b"], link_rate="1gbit", record_dir=tmp_path) as hosts:
        proc, port = _serve(hosts, "b")
        try:
            rates = []
            for _ in range(3):
                r = _send(hosts, "a", hosts.address("b"), port, n=32, size=1 << 20, timeout=5)
                rates.append(32 * (1 << 20) * 8 / r["seconds"])
            # what the link delivers: the best of three rounds (on two cores shared with
            # other work the sender itself is starved at times); at least 90% of the rate,
            # and shaped: never loopback speed (several Gbit/s)
            assert 0.9e9 <= max(rates) and all(r <= 1.2e9 for r in rates), rates
            hosts.shape("b", "100mbit")
            r = _send(hosts, "a", hosts.address("b"), port, n=4, size=1 << 20, timeout=5)
            assert 0.9e8 <= 4 * (1 << 20) * 8 / r["seconds"] <= 1.2e8, r
        finally:
            proc.kill()
            proc.wait(10)


def test_second_start_sweeps_a_killed_run(tmp_path):
    script = ("import sys, time\n"
              "from pathlib import Path\n"
              "from mooncaked.cluster.hosts import Hosts\n"
              f"h = Hosts(['x', 'y'], record_dir=Path({str(tmp_path)!r})).start()\n"
              "print(h.tag, h.bridge, *[v.netns for v in h.hosts.values()], flush=True)\n"
              "time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        tag, bridge, *namespaces = child.stdout.readline().split()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert set(namespaces) <= _netns() and bridge in _links()     # left behind by kill -9
    with Hosts(["z"], record_dir=tmp_path) as hosts:
        assert not (set(namespaces) & _netns())
        assert bridge not in _links()
        assert not (tmp_path / f"{tag}.json").exists()
        assert hosts.record_path.exists()             # its own run is recorded and kept


def test_not_root_says_so_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)     # what an unprivileged user sees
    with pytest.raises(HostsError) as e:
        Hosts(["a"], record_dir=tmp_path).start()
    assert str(e.value).startswith("--hosts needs root") and "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())                    # nothing was made
