"""Failpoints: named places where a test injects a fault into a live node process.

After FreeBSD's fail(9), etcd's gofail and TiKV's fail-rs: the code calls
`hit("name")` (or `await ahit("name")` in a coroutine) at a place where a real
fault can happen, and a test turns that point on in a running process to see
the fault handled, end to end, on real processes.

Off unless the process starts with the environment variable
``MOONCAKED_FAILPOINTS`` set (its value, possibly empty, is a list of
``name=action`` pairs separated by ``;`` to turn on at start). Only then does a
cluster node answer the control method ``debug.failpoint``; without it no peer
can turn a point on, and every check is one lookup in an empty dict.

Actions:
- ``off``: nothing happens.
- ``error``: the point raises `FailpointError` (a RuntimeError), as the real
  fault there would raise.
- ``pause``: ``ahit`` waits until the point is set again (to any action, ``off``
  included) or ``max_pause_s`` passes, then raises `FailpointError`; ``hit``
  treats it as ``off`` (a thread must never block the event loop).

`set_action` can also skip the first N hits and fire only a number of times.
Points used in the code (grep ``failpoints.hit``):
- ``node.prefill``: a prefill node holds a request after it counts as queued,
  before its prefill starts (async);
- ``node.kv_reserve``: a decode node refuses a receive buffer (the push is refused);
- ``prefill.kv_reserved``: a prefill node holds the decode node's answer to its
  reservation before reading it (async; a test cancels the request meanwhile);
- ``kv_push.write``: a prefill node's WRITE of pushed KV fails (the push fails
  part-way; the decode node READs instead);
- ``store.locate``: a store refuses a peer's read of its blocks (a prefix fetch fails);
- ``decode.kv_read``: a decode node holds (or fails) its READ of a prefill node's staged
  KV (async; a test kills the prefill node meanwhile).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from dataclasses import dataclass
from typing import Any

ENV = "MOONCAKED_FAILPOINTS"
ACTIONS = ("off", "error", "pause")


class FailpointError(RuntimeError):
    """Raised at a failpoint whose action is ``error`` (or a pause that outlived its bound)."""


@dataclass
class _Point:
    action: str
    skip: int = 0                # hits to let through before firing
    times: int | None = None     # fires left; None: until set off
    hits: int = 0                # hits seen while set (fired or skipped)
    fired: int = 0
    max_pause_s: float = 60.0


_points: dict[str, _Point] = {}
# One event per event loop (an asyncio.Event binds to the loop that first waits on it).
_changed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """True when this process started with MOONCAKED_FAILPOINTS set."""
    return ENV in os.environ


def set_action(name: str, action: str, *, skip: int = 0, times: int | None = None,
               max_pause_s: float = 60.0) -> None:
    """Sets failpoint `name` to `action` (one of ACTIONS).

    Args:
        skip: hits that pass before the point fires (e.g. 3: the 4th hit fails).
        times: how many times it fires, then it is off; None: until set again.
        max_pause_s: a pause raises FailpointError after this many seconds.
    Raises: ValueError for an unknown action or a negative count; RuntimeError when
    failpoints are not enabled in this process.
    """
    if not enabled():
        raise RuntimeError(f"failpoints are off in this process (start it with {ENV} set)")
    if action not in ACTIONS:
        raise ValueError(f"unknown failpoint action {action!r}; choose one of {ACTIONS}")
    if skip < 0 or (times is not None and times < 1) or max_pause_s <= 0:
        raise ValueError("skip must be >= 0, times >= 1 and max_pause_s > 0")
    if action == "off":
        _points.pop(name, None)
    else:
        _points[name] = _Point(action, skip, times, max_pause_s=max_pause_s)
    for event in list(_changed.values()):
        event.set()


def status() -> dict:
    """{name: {"action", "hits", "fired"}} of the points that are on."""
    return {n: {"action": p.action, "hits": p.hits, "fired": p.fired} for n, p in _points.items()}


def _fires(name: str) -> _Point | None:
    p = _points.get(name)
    if p is None:
        return None
    p.hits += 1
    if p.hits <= p.skip or (p.times is not None and p.fired >= p.times):
        return None
    p.fired += 1
    return p


def hit(name: str) -> None:
    """A synchronous failpoint. Raises: FailpointError when `name` is set to ``error``."""
    if not _points:
        return
    p = _fires(name)
    if p is not None and p.action == "error":
        raise FailpointError(f"failpoint {name}")


async def ahit(name: str) -> None:
    """An asynchronous failpoint: ``error`` raises, ``pause`` waits until the point changes.

    Raises: FailpointError for ``error``, or a pause longer than its max_pause_s.
    """
    if not _points:
        return
    p = _fires(name)
    if p is None:
        return
    if p.action == "error":
        raise FailpointError(f"failpoint {name}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + p.max_pause_s
    changed = _changed.setdefault(loop, asyncio.Event())
    while _points.get(name) is p:
        changed.clear()
        left = deadline - loop.time()
        if left <= 0:
            raise FailpointError(f"failpoint {name}: paused longer than {p.max_pause_s} s")
        try:
            await asyncio.wait_for(changed.wait(), left)
        except TimeoutError:
            pass


async def control_handler(payload: Any) -> dict:
    """The control method `debug.failpoint` (a node registers it only when enabled()).

    Payload: {"name", "action": "off" | "error" | "pause", "skip": int, "times": int |
    null}; without "action" it only reads (a paused point stays paused). Returns
    {"failpoints": status()}.
    Raises: ValueError for a malformed payload or an unknown action.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ValueError("debug.failpoint needs {'name': <point>, 'action': ...}")
    if "action" not in payload:
        return {"failpoints": status()}
    times = payload.get("times")
    set_action(payload["name"], str(payload.get("action", "off")),
               skip=int(payload.get("skip", 0)), times=None if times is None else int(times))
    return {"failpoints": status()}


def load_from_env() -> None:
    """Turns on the points listed in MOONCAKED_FAILPOINTS ("name=action;...").

    Raises: ValueError for a malformed entry or an unknown action.
    """
    spec = os.environ.get(ENV, "")
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        name, sep, action = entry.partition("=")
        if not sep or not name:
            raise ValueError(f"{ENV}: expected name=action, got {entry!r}")
        set_action(name.strip(), action.strip())


__all__ = ["ACTIONS", "ENV", "FailpointError", "ahit", "control_handler", "enabled", "hit", "load_from_env",
           "set_action", "status"]
