"""Free TCP ports for processes a launcher starts later (local clusters, etcd, tests).

A port is picked at random *below* the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), not by binding port 0.
Why: a port from bind(0) lies in that range, and the kernel hands the same range out to
every other bind(0) and to the source port of every outgoing connection. A node killed and
restarted on its old port then found it taken by another test's server in between (CI,
`address already in use`). Below the range only another random pick like this one can
collide: odds of about 1 in 20,000 a pick.

The random source is the OS's (SystemRandom), not `random`: pytest-randomly seeds
`random` alike in every xdist worker, which would make two workers pick the same ports.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

LOWEST_PORT = 10000          # below: well-known and registered services cluster
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768
TRIES = 200

_rng = random.SystemRandom()


def ephemeral_low(path: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The lowest port of the kernel's ephemeral range (its first field), 32768 when the
    file is absent or unreadable (not Linux, a sandbox without /proc)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    """True when a TCP socket can bind host:port right now (without SO_REUSEADDR, so a
    port still in TIME_WAIT counts as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    """A TCP port that `host` can bind right now, drawn at random from [10000, the
    ephemeral range's low end) and not one of `exclude` (ports handed out already but not
    bound yet). When the ephemeral range starts at or below 11000, falls back to bind(0).

    Raises: OSError when TRIES draws all land on taken or excluded ports."""
    low = ephemeral_low()
    if low <= LOWEST_PORT + 1000:          # no room below the range: let the OS choose
        for _ in range(TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in exclude:
                return port
    else:
        for _ in range(TRIES):
            port = _rng.randrange(LOWEST_PORT, low)
            if port not in exclude and _bindable(host, port):
                return port
    raise OSError(f"no free port on {host} in {TRIES} tries ({len(exclude)} excluded)")


__all__ = ["ephemeral_low", "free_port"]
