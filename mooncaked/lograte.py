"""Rate-limited log events: the first occurrence of a kind is logged, repeats within the
window are counted and summarised in the next line (`repeats`), so an outage that fails a
call every few milliseconds writes one line per window, not thousands."""

from __future__ import annotations

import time
from typing import Any

from mooncaked.log import EventLogger

DEFAULT_WINDOW_S = 30.0   # one line per kind of trouble per half minute is enough to act on


class RateLimitedLog:
    """Logs `event` at most once per window_s for each key; counts what it held back.

    `limited.warning(key, event, **fields)`: key groups repeats (e.g. the event name plus
    the peer). The line after a quiet spell carries `repeats=N` (lines held back since).
    """

    def __init__(self, log: EventLogger, window_s: float = DEFAULT_WINDOW_S):
        self.log, self.window_s = log, window_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, key: str) -> int | None:
        """None when key was logged within the window (the call is counted), else the
        number of repeats held back since its last line (0 for a first occurrence)."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.window_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)

    def warning(self, key: str, event: str, **fields: Any) -> None:
        """A warning, unless key was logged within the window."""
        held = self.allow(key)
        if held is not None:
            self.log.warning(event, **fields, **({"repeats": held} if held else {}))


__all__ = ["RateLimitedLog", "DEFAULT_WINDOW_S"]
