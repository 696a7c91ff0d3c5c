"""A shutdown that always ends: SIGTERM/SIGINT handling for one mooncaked process.

The first SIGTERM or SIGINT asks for a graceful stop (the daemon drains, leaves the
cluster, exits 0) and arms a watchdog thread: if the process is still alive
`bound_s` seconds later (a drain that overran, a coordinator call that never
returns, a stuck C call), the watchdog ends it with `os._exit(EXIT_WATCHDOG)`. A
second SIGTERM or SIGINT ends the process at once (`os._exit(128 + signal)`), the
operator's "stop now".

The handlers are plain `signal.signal` handlers installed before the model loads,
so a signal during start-up (model load, coordinator connect) is seen too: it
sets the request, which the daemon checks between start-up steps, and the event
loop is woken with `call_soon_threadsafe`. A watchdog is a thread, not a task,
so it fires even when the event loop is blocked.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

from mooncaked.log import get_logger

log = get_logger(__name__)

EXIT_WATCHDOG = 70          # EX_SOFTWARE: the graceful stop overran its bound
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Shutdown:
    """Signal handling of one process (see the module doc).

    Args:
        bound_s: seconds from the first signal to the forced exit (the daemon passes
            cluster.drain_timeout_s plus a few seconds).
    Use: `install()` early in the main thread; in the event loop, `await wait()`
    (returns at the first signal) or check `requested`.
    """

    def __init__(self, bound_s: float):
        self.bound_s = bound_s
        self.signals = 0
        self.requested_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._watchdog: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        """True once a stop was asked for."""
        return self.requested_at is not None

    def install(self) -> "Shutdown":
        """Installs the SIGTERM/SIGINT handlers (main thread only)."""
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals > 1:
            # os._exit skips atexit and buffered logs; say why on stderr first.
            sys.stderr.write(f"mooncaked: second {name}: exiting now\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.request(name)

    def request(self, reason: str) -> None:
        """Asks for a graceful stop (as the first signal does) and arms the watchdog."""
        if self.requested_at is not None:
            return
        self.requested_at = time.monotonic()
        log.info("shutdown_requested", reason=reason, bound_s=self.bound_s)
        self._watchdog = threading.Thread(target=self._watch, name="shutdown-watchdog",
                                          daemon=True)
        self._watchdog.start()
        if self._loop is not None and self._event is not None:
            self._loop.call_soon_threadsafe(self._event.set)

    def _watch(self, bound_s: float | None = None, exit_code: int = EXIT_WATCHDOG,
               what: str = "graceful stop") -> None:
        bound_s = self.bound_s if bound_s is None else bound_s
        time.sleep(bound_s)
        sys.stderr.write(f"mooncaked: {what} did not finish within {bound_s:.0f} s; exiting\n")
        sys.stderr.flush()
        os._exit(exit_code)

    def bound_failed_start(self, exit_code: int, bound_s: float) -> None:
        """After a start-up step failed (the daemon returns `exit_code`): arms a watchdog
        that ends the process with that same code if its cleanup (leaving the coordinator,
        closing listeners and threads) is not over within bound_s seconds, so a failed
        start always exits and says why in its code."""
        threading.Thread(target=self._watch,
                         args=(bound_s, exit_code, "cleanup after a failed start"),
                         name="failed-start-watchdog", daemon=True).start()

    async def wait(self) -> None:
        """Returns once a stop has been requested (at once if it already was)."""
        if self._event is None:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        if self.requested:
            return
        await self._event.wait()

    def bind(self) -> None:
        """Binds to the running event loop, so a later signal wakes `wait()`."""
        if self._event is None:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
            if self.requested:
                self._event.set()

    async def race(self, coro, what: str):
        """Runs coro unless a stop is requested first; then cancels it and raises
        `ShutdownRequested`. For start-up steps that may block (coordinator connect)."""
        self.bind()
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        # The step may swallow its cancellation for a while; the watchdog bounds that.
        await asyncio.wait({task}, timeout=2.0)
        raise ShutdownRequested(what)


class ShutdownRequested(Exception):
    """A stop was asked for while a start-up step ran (the step was cancelled)."""


__all__ = ["Shutdown", "ShutdownRequested", "EXIT_WATCHDOG"]
