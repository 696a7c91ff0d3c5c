"""A per-user cache of what loading a model file derives from it, so a node starts fast.

Parsing a GGUF file's header with gguf-py walks every element of its tokenizer arrays
(49k tokens and merges for the bundled model) and transformers converts the tokenizer
from that metadata: together 10-20 s of every node start on two cores, for a result
that depends only on the file. The loaders (gguf_index.py, tokenizer.py) keep that
result here, keyed by the file, and read it back on the next start.

The directory: $MOONCAKED_CACHE_DIR, else $CACHE_DIRECTORY (systemd's CacheDirectory=,
first of a colon-separated list), else $XDG_CACHE_HOME/mooncaked, else
~/.cache/mooncaked. The cache is an optimization only: an entry that cannot be written
is skipped (logged once), an entry that cannot be read is rebuilt from the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mooncaked.log import get_logger

log = get_logger("mooncaked.model.load_cache")

# Part of every key: bump it when what the loaders store changes shape.
FORMAT_VERSION = 1


def cache_dir() -> Path:
    """The cache's root directory (see the module docstring); not created here."""
    explicit = os.environ.get("MOONCAKED_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    systemd = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if systemd:
        return Path(systemd)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mooncaked"


def file_key(path: Path, *parts: str) -> str:
    """A key for what is derived from `path` as it is now: its resolved name, size and
    modification time (ns), the cache format and `parts` (e.g. a library's version).
    A file replaced or edited in place gets a new key. Raises OSError if `path` is gone."""
    p = path.resolve()
    st = p.stat()
    text = "\0".join([str(p), str(st.st_size), str(st.st_mtime_ns), str(FORMAT_VERSION), *parts])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def entry(kind: str, key: str) -> Path:
    """Where the entry `key` of `kind` (a sub-directory name, e.g. "gguf") lives."""
    return cache_dir() / kind / key


def write_file(path: Path, data: bytes) -> bool:
    """Writes `data` to `path` atomically (a temporary file renamed over it), so a
    concurrent reader sees the whole entry or none. Returns False, logged, when the
    cache cannot be written (read-only home, full disk): loading goes on without it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True
    except OSError as e:
        log.warning("load_cache_unwritable", path=str(path), error=str(e))
        return False


@contextlib.contextmanager
def building_dir(final: Path) -> Iterator[Path | None]:
    """Builds the directory entry `final`: yields a fresh private directory beside it to
    fill, then moves it to `final` in one rename. Yields None (logged) when the cache
    cannot be written; an OSError while filling is logged and the entry dropped. If
    another process published `final` first, its entry stays (it is equally good)."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    except OSError as e:
        log.warning("load_cache_unwritable", path=str(final), error=str(e))
        yield None
        return
    try:
        yield build
        os.rename(build, final)
    except OSError as e:
        if not final.is_dir():
            log.warning("load_cache_unwritable", path=str(final), error=str(e))
    finally:
        if build.exists():
            shutil.rmtree(build, ignore_errors=True)


__all__ = ["FORMAT_VERSION", "building_dir", "cache_dir", "entry", "file_key", "write_file"]
