"""Free TCP ports for processes a launcher starts later (local clusters, etcd, tests).

A port is picked at random *below* the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default; above it when the range
starts too low), not by binding port 0.
Why: a port from bind(0) lies in that range, and the kernel hands the same range out to
every other bind(0) and to the source port of every outgoing connection. A node killed and
restarted on its old port then found it taken by another test's server in between (CI,
`address already in use`). Below the range only another random pick like this one can
collide: odds of about 1 in 22,000 a pick with the default range.

The random source is the OS's (SystemRandom), not `random`: pytest-randomly seeds
`random` alike in every xdist worker, which would make two workers pick the same ports.
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Collection
from pathlib import Path

LOWEST_PORT = 10000          # below: well-known and registered services cluster
HIGHEST_PORT = 65535
MIN_GAP = 1000               # a gap beside the ephemeral range narrower than this is not used
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
TRIES = 200

_rng = random.SystemRandom()


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (low, high), (32768, 60999) when the file is
    absent or unreadable (not Linux, a sandbox without /proc)."""
    try:
        low, high = (int(x) for x in path.read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE


def candidate_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The ports free_port draws from, [start, stop): below the ephemeral range from
    LOWEST_PORT, else above it, whichever gap holds MIN_GAP ports first; None when
    neither does (then free_port lets the OS choose)."""
    low, high = ephemeral_range(path)
    if low - LOWEST_PORT >= MIN_GAP:
        return LOWEST_PORT, low
    if HIGHEST_PORT - high >= MIN_GAP:
        return high + 1, HIGHEST_PORT + 1
    return None


def _bindable(host: str, port: int) -> bool:
    """True when a TCP socket can bind host:port right now (without SO_REUSEADDR, so a
    port still in TIME_WAIT counts as taken); False when it is in use.
    Raises: OSError for any other failure (the host is not an address of this machine,
    an IPv6 address, a name that does not resolve): no port would do."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise OSError(e.errno, f"cannot bind a port on {host!r}: {e.strerror}") from e
    return True


def free_port(host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    """A TCP port that `host` (an IPv4 address or name of this machine) can bind right
    now, drawn at random from `candidate_range()` and not one of `exclude` (ports handed
    out already but not bound yet). When there is no gap beside the ephemeral range,
    falls back to bind(0): then a restarted process may find its port taken again.

    Raises: OSError when TRIES draws all land on taken or excluded ports, or when `host`
    cannot be bound at all (see _bindable)."""
    span = candidate_range()
    if span is None:                       # no room beside the range: let the OS choose
        for _ in range(TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in exclude:
                return port
    else:
        for _ in range(TRIES):
            port = _rng.randrange(*span)
            if port not in exclude and _bindable(host, port):
                return port
    raise OSError(f"no free port on {host} in {TRIES} tries ({len(exclude)} excluded)")


__all__ = ["candidate_range", "ephemeral_range", "free_port"]
