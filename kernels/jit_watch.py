"""Counts Numba compilations inside a block of code, to tell a compile from a disk-cache load.

A Numba kernel (`cache=True`) is compiled on its first call in a process unless Numba's
disk cache ($NUMBA_CACHE_DIR, else __pycache__ beside the source) holds it for this CPU
and signature; loading it from there takes milliseconds, compiling the fused decode step
tens of seconds. Numba broadcasts a "numba:compile" event for each compilation it really
does (not for a cache load: numba/core/dispatcher.py `Dispatcher.compile`), which is what
`count_compiles` listens to. The engine's start-up warm-up reports it
(engine/model_runner.py `ModelRunner.warm_up`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from numba.core import event

__all__ = ["Compiles", "count_compiles"]


@dataclass
class Compiles:
    """The compilations seen inside `count_compiles`: `names` of the compiled functions, in
    order (a function inlined or called by another counts on its own when compiled apart)."""

    names: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        """How many compilations (0: everything came from Numba's disk cache or was loaded)."""
        return len(self.names)


class _Listener(event.Listener):
    """Records the name of each dispatcher whose compilation starts."""

    def __init__(self, out: Compiles):
        self.out = out

    def on_start(self, ev: event.Event) -> None:
        """A compilation starts: records its dispatcher's function name."""
        disp = (ev.data or {}).get("dispatcher")
        self.out.names.append(getattr(getattr(disp, "py_func", None), "__qualname__", "?"))

    def on_end(self, ev: event.Event) -> None:
        """Nothing to record at the end."""


@contextmanager
def count_compiles() -> Iterator[Compiles]:
    """Yields a Compiles that collects the Numba compilations run inside the block (in any
    thread of the process while it lasts)."""
    out = Compiles()
    with event.install_listener("numba:compile", _Listener(out)):
        yield out
