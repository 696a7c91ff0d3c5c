"""The `local` coordination backend: one host, shared state in a directory.

Every node of a one-host cluster points `cluster.state_dir` at the same directory.
State is one JSON file, `coord.json`:

    {"boot_id": "...", "leases": {lease_id: expires_at}, "keys": {key: [value, lease_id|null]}}

Writers take an exclusive `fcntl.flock` on `coord.lock`, read the file, reap expired
leases and their keys, apply the change and replace the file atomically (write a
temporary file, then rename), so readers never need the lock: they read a complete
file and ignore keys whose lease has expired. A process killed while holding the
lock releases it (the kernel drops flock locks with the file descriptor).

Lease expiry uses CLOCK_MONOTONIC, which every process on the host shares and which
wall-clock steps do not move; the file records the kernel boot id, and after a
reboot every lease of the previous boot counts as expired. The file lives in a
runtime directory (tmpfs by default) and is not fsynced: it is coordination state,
rebuilt by the nodes as they (re)register.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import orjson

from ..config import ClusterSettings, cluster_state_dir
from ..log import get_logger
from .coordinator import Coordinator
from mooncaked.wire.errors import CoordinationError

log = get_logger(__name__)

_STATE = "coord.json"
_LOCK = "coord.lock"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: monotonic clocks are then per boot anyway
        return "unknown"


class LocalCoordinator(Coordinator):
    """Coordinator over a state directory shared by the processes of one host.

    Raises CoordinationError when the directory cannot be created, is not owned by
    this user (a shared /tmp must not let another user steer the cluster), or the lock
    cannot be taken within op_timeout_s.
    """

    backend = "local"

    def __init__(self, settings: ClusterSettings):
        super().__init__(settings)
        self.dir = cluster_state_dir(settings)
        self._boot = _boot_id()

    def _describe(self) -> str:
        return f"local:{self.dir}"

    # ------------------------------------------------------------------ files

    async def _open(self) -> None:
        await asyncio.to_thread(self._prepare_dir)

    def _prepare_dir(self) -> None:
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = self.dir.stat()
        except OSError as e:
            raise CoordinationError(f"{self._describe()}: cannot create state dir: {e}") from e
        if st.st_uid != os.getuid():
            raise CoordinationError(f"{self._describe()}: state dir is owned by uid {st.st_uid}, "
                                    f"not by this user ({os.getuid()})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CoordinationError(f"{self._describe()}: state dir is writable by other users")

    async def _close(self) -> None:
        return None

    def _read(self) -> dict:
        """The state file's content; an empty state if missing or corrupt (logged)."""
        try:
            data = orjson.loads((self.dir / _STATE).read_bytes())
            if not isinstance(data, dict) or not isinstance(data.get("keys"), dict) \
                    or not isinstance(data.get("leases"), dict):
                raise ValueError("unexpected structure")
        except FileNotFoundError:
            return {"boot_id": self._boot, "leases": {}, "keys": {}}
        except (OSError, ValueError) as e:  # orjson.JSONDecodeError is a ValueError
            log.error("coord_local_state_corrupt", path=str(self.dir / _STATE), error=str(e))
            return {"boot_id": self._boot, "leases": {}, "keys": {}}
        if data.get("boot_id") != self._boot:
            data["leases"] = {}               # leases of a previous boot are all dead
        return data

    @staticmethod
    def _live(data: dict, now: float) -> dict[str, tuple[str, Any]]:
        leases = data["leases"]
        return {k: (v, lease) for k, (v, lease) in data["keys"].items()
                if lease is None or leases.get(lease, 0.0) > now}

    def _write(self, data: dict) -> None:
        data["boot_id"] = self._boot
        tmp = self.dir / f".{_STATE}.{os.getpid()}.tmp"
        tmp.write_bytes(orjson.dumps(data))
        os.replace(tmp, self.dir / _STATE)

    def _locked(self, fn: Callable[[dict, float], Any]) -> Any:
        """Runs fn(state, now) under the exclusive lock; writes state back if fn says so.

        fn returns (result, changed). Expired leases and their keys are reaped first.
        """
        deadline = time.monotonic() + self.settings.op_timeout_s
        try:
            fd = os.open(self.dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise CoordinationError(f"{self._describe()}: cannot open lock file: {e}") from e
        try:
            delay = 0.001
            while True:               # non-blocking tries, so the op timeout holds
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise CoordinationError(f"{self._describe()}: flock: {e}") from e
                    if time.monotonic() > deadline:
                        raise CoordinationError(
                            f"{self._describe()}: lock held by another process for more than "
                            f"{self.settings.op_timeout_s} s") from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.02)
            now = time.monotonic()
            data = self._read()
            live_leases = {k: t for k, t in data["leases"].items() if t > now}
            reaped = len(live_leases) != len(data["leases"])
            data["leases"] = live_leases
            keys = {k: e for k, e in data["keys"].items() if e[1] is None or e[1] in live_leases}
            reaped |= len(keys) != len(data["keys"])
            data["keys"] = keys
            result, changed = fn(data, now)
            if changed or reaped:
                try:
                    self._write(data)
                except OSError as e:
                    raise CoordinationError(f"{self._describe()}: cannot write state: {e}") from e
            return result
        finally:
            os.close(fd)              # also releases the flock

    async def _tx(self, fn: Callable[[dict, float], Any]) -> Any:
        return await asyncio.to_thread(self._locked, fn)

    async def _view(self) -> dict[str, tuple[str, Any]]:
        def read():
            return self._live(self._read(), time.monotonic())
        return await asyncio.to_thread(read)

    # ------------------------------------------------------------------ primitives

    async def _grant(self, ttl_s: float) -> str:
        lease = uuid.uuid4().hex

        def fn(data, now):
            data["leases"][lease] = now + ttl_s
            return lease, True
        return await self._tx(fn)

    async def _refresh(self, lease: str) -> bool:
        def fn(data, now):
            if lease not in data["leases"]:
                return False, False
            data["leases"][lease] = now + self.ttl_s
            return True, True
        return await self._tx(fn)

    async def _revoke(self, lease: str) -> None:
        def fn(data, now):
            data["leases"].pop(lease, None)
            data["keys"] = {k: e for k, e in data["keys"].items() if e[1] != lease}
            return None, True
        await self._tx(fn)

    async def _put(self, key: str, raw: bytes, lease: str | None) -> None:
        value = raw.decode()

        def fn(data, now):
            if lease is not None and lease not in data["leases"]:
                raise CoordinationError(f"{self._describe()}: lease expired before put {key}")
            data["keys"][key] = [value, lease]
            return None, True
        await self._tx(fn)

    async def _get(self, key: str) -> bytes | None:
        entry = (await self._view()).get(key)
        return None if entry is None else entry[0].encode()

    async def _delete(self, key: str) -> bool:
        def fn(data, now):
            existed = data["keys"].pop(key, None) is not None
            return existed, existed
        return await self._tx(fn)

    async def _list(self, prefix: str) -> dict[str, bytes]:
        view = await self._view()
        return {k: v.encode() for k, (v, _) in view.items() if k.startswith(prefix)}

    async def _create(self, key: str, raw: bytes, lease: str | None) -> bool:
        value = raw.decode()

        def fn(data, now):
            if key in data["keys"]:
                return False, False
            if lease is not None and lease not in data["leases"]:
                return False, False
            data["keys"][key] = [value, lease]
            return True, True
        return await self._tx(fn)

    async def _delete_if(self, key: str, raw: bytes) -> bool:
        value = raw.decode()

        def fn(data, now):
            entry = data["keys"].get(key)
            if entry is None or entry[0] != value:
                return False, False
            del data["keys"][key]
            return True, True
        return await self._tx(fn)


__all__ = ["LocalCoordinator"]
