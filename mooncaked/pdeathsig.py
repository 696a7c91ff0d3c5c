"""Children that die with their parent: Linux prctl(PR_SET_PDEATHSIG) through ctypes.

`mooncake up` starts its nodes (and etcd) with `preexec_fn=die_with_parent(SIGTERM)`:
if `mooncake up` itself is killed (kill -9 included, where it cannot clean up), the
kernel sends each child SIGTERM and the nodes drain and exit on their own, leaving no
orphans. Elsewhere than Linux it does nothing.

Caveat (prctl(2)): the signal fires when the *thread* that forked the child exits, so
start such children from a thread that lives as long as they should.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1     # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A preexec_fn for subprocess.Popen that sets the child's parent-death signal, or
    None where prctl is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:   # runs in the child between fork and exec: keep it tiny
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:     # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


__all__ = ["die_with_parent"]
