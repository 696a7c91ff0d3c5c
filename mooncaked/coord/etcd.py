"""The `etcd` coordination backend, over the maintained asyncio client `aetcd` (gRPC).

Checked against Debian's etcd-server 3.4.23: put/get/range, leases (grant, keep-alive,
revoke), transactions and prefix watches. Consensus is etcd's; this module only maps
the Coordinator primitives onto etcd v3 calls:

    create-if-absent  txn(create_revision(key) == 0, put(key, value, lease))
    delete-if-value   txn(value(key) == value, delete(key))
    snapshots         range(prefix) at revision R, then watch(prefix, start_revision=R+1)

Endpoints are tried in order: a call that cannot reach one endpoint moves the client
to the next for the following calls.

TLS: https:// endpoints use a gRPC secure channel (grpc.ssl_channel_credentials) with
cluster.etcd_ca_file (the CA that signed etcd's server certificate; empty: the system
roots) and, for etcd's --client-cert-auth, cluster.etcd_cert_file/etcd_key_file.
aetcd opens plain channels only, so `_TlsClient` overrides its connect() to open a
secure one; everything else is aetcd's.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.rtypes
import aetcd.watcher
import grpc

from ..config import ClusterSettings, ConfigError
from ..log import get_logger
from ..lograte import RateLimitedLog
from .coordinator import Coordinator
from mooncaked.wire.errors import CoordinationError

log = get_logger(__name__)
_limited = RateLimitedLog(log)   # an outage restarts every watch every few seconds


def parse_endpoint(url: str) -> tuple[str, int, bool]:
    """("host", port, tls) of an etcd client URL such as "http://127.0.0.1:2379" or
    "https://etcd1:2379".

    Raises: ConfigError for another scheme or a URL without host/port.
    """
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https"):
        raise ConfigError("<settings>", "cluster.etcd_endpoints",
                          f"{url!r}: only http:// and https:// endpoints are supported")
    if not parts.hostname or not parts.port:
        raise ConfigError("<settings>", "cluster.etcd_endpoints",
                          f"{url!r}: expected http(s)://HOST:PORT")
    return parts.hostname, parts.port, parts.scheme == "https"


def _read_pem(settings: ClusterSettings, key: str) -> bytes | None:
    path = getattr(settings, key)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError("<settings>", f"cluster.{key}",
                          f"cannot read {path}: {e.strerror or e}") from e


def channel_credentials(settings: ClusterSettings) -> grpc.ChannelCredentials:
    """TLS credentials from cluster.etcd_ca_file / etcd_cert_file / etcd_key_file.
    Raises: ConfigError when a file cannot be read."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(settings, "etcd_ca_file"),
        private_key=_read_pem(settings, "etcd_key_file"),
        certificate_chain=_read_pem(settings, "etcd_cert_file"))


class _TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel (aetcd itself opens plain channels only)."""

    def __init__(self, *args, credentials: grpc.ChannelCredentials, **kwargs):
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        """As aetcd.Client.connect, with grpc.aio.secure_channel (no user/password auth:
        the client certificate is the credential)."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}",
                                                   self._credentials,
                                                   options=list(self._options.items()))
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel),
                                                  timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdCoordinator(Coordinator):
    """Coordinator over an etcd v3 cluster (settings.etcd_endpoints).

    Raises CoordinationError when etcd is unreachable or does not answer within
    op_timeout_s; the message names the endpoint.
    """

    backend = "etcd"

    def __init__(self, settings: ClusterSettings):
        super().__init__(settings)
        if not settings.etcd_endpoints:
            raise ConfigError("<settings>", "cluster.etcd_endpoints", "empty list")
        self.endpoints = [parse_endpoint(u) for u in settings.etcd_endpoints]
        self._credentials = channel_credentials(settings) \
            if any(tls for _, _, tls in self.endpoints) else None
        self._ep = 0
        self._client: aetcd.Client | None = None

    def _describe(self) -> str:
        host, port, tls = self.endpoints[self._ep]
        return f"etcd:{'https://' if tls else ''}{host}:{port}"

    def _c(self) -> aetcd.Client:
        if self._client is None:
            host, port, tls = self.endpoints[self._ep]
            if tls:
                self._client = _TlsClient(host=host, port=port,
                                          timeout=self.settings.op_timeout_s,
                                          credentials=self._credentials)
            else:
                self._client = aetcd.Client(host=host, port=port,
                                            timeout=self.settings.op_timeout_s)
        return self._client

    async def _failover(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _bounded(client.close(), self.settings.op_timeout_s)
        self._ep = (self._ep + 1) % len(self.endpoints)

    def _op_budget_s(self) -> float:
        return self.settings.op_timeout_s * len(self.endpoints) + 0.5

    async def _call(self, what: str, fn):
        """Runs fn(client), mapping client errors to CoordinationError.

        An endpoint that cannot be reached is left for the next one, each tried once.
        """
        for attempt in range(len(self.endpoints)):
            try:
                return await fn(self._c())
            except aetcd.exceptions.ClientError as e:
                where = self._describe()
                unreachable = isinstance(e, (aetcd.exceptions.ConnectionFailedError,
                                             aetcd.exceptions.ConnectionTimeoutError))
                if unreachable and len(self.endpoints) > 1:
                    _limited.warning(f"unreachable:{where}", "etcd_endpoint_unreachable",
                                     endpoint=where, error=str(e))
                    await self._failover()
                    if attempt + 1 < len(self.endpoints):
                        continue
                raise CoordinationError(f"{where}: {what}: {type(e).__name__}: {e}") from e

    async def _open(self) -> None:
        # gRPC connects lazily: a status call proves etcd answers.
        await self._call("status", lambda c: c.status())

    async def _close(self) -> None:
        if self._client is not None:
            await _bounded(self._client.close(), self.settings.op_timeout_s)
            self._client = None

    # ------------------------------------------------------------------ primitives

    async def _grant(self, ttl_s: float) -> int:
        lease = await self._call("lease grant", lambda c: c.lease(int(ttl_s)))
        return lease.id

    async def _refresh(self, lease: int) -> bool:
        reply = await self._call("lease keep-alive", lambda c: c.refresh_lease(lease))
        return reply is not None and reply.TTL > 0

    async def _revoke(self, lease: int) -> None:
        await self._call("lease revoke", lambda c: c.revoke_lease(lease))

    async def _put(self, key: str, raw: bytes, lease: int | None) -> None:
        await self._call(f"put {key}", lambda c: c.put(key.encode(), raw, lease=lease))

    async def _get(self, key: str) -> bytes | None:
        got = await self._call(f"get {key}", lambda c: c.get(key.encode()))
        return None if got is None else got.value

    async def _delete(self, key: str) -> bool:
        got = await self._call(f"delete {key}", lambda c: c.delete(key.encode()))
        return got is not None

    async def _list(self, prefix: str) -> dict[str, bytes]:
        rng = await self._call(f"range {prefix}", lambda c: c.get_prefix(prefix.encode()))
        return {kv.key.decode(): kv.value for kv in rng}

    async def _create(self, key: str, raw: bytes, lease: int | None) -> bool:
        def txn(c: aetcd.Client):
            k = key.encode()
            return c.transaction(compare=[c.transactions.create(k) == 0],
                                 success=[c.transactions.put(k, raw, lease=lease)], failure=[])
        ok, _ = await self._call(f"create {key}", txn)
        return ok

    async def _delete_if(self, key: str, raw: bytes) -> bool:
        def txn(c: aetcd.Client):
            k = key.encode()
            return c.transaction(compare=[c.transactions.value(k) == raw],
                                 success=[c.transactions.delete(k)], failure=[])
        ok, _ = await self._call(f"delete-if {key}", txn)
        return ok

    async def _snapshots(self, prefix: str) -> AsyncIterator[dict[str, bytes]]:
        """Range at revision R, then watch from R+1; on any stream error, start over."""
        backoff = 0.1
        last: dict[str, bytes] | None = None
        while True:
            watch = None
            try:
                rng = await self._op(self._call(f"range {prefix}",
                                                lambda c: c.get_prefix(prefix.encode())),
                                     f"range {prefix}")
                snap = {kv.key.decode(): kv.value for kv in rng}
                if snap != last:
                    last = dict(snap)
                    yield dict(snap)
                watch = await self._op(self._call(
                    f"watch {prefix}",
                    lambda c: c.watch_prefix(prefix.encode(),
                                             start_revision=rng.header.revision + 1)),
                    f"watch {prefix}")
                backoff = 0.1
                async for ev in watch:
                    key = ev.kv.key.decode()
                    if ev.kind == aetcd.rtypes.EventKind.PUT:
                        snap[key] = ev.kv.value
                    else:
                        snap.pop(key, None)
                    if snap != last:
                        last = dict(snap)
                        yield dict(snap)
                raise CoordinationError("watch stream ended")
            except (CoordinationError, aetcd.exceptions.ClientError) as e:
                _limited.warning(f"watch:{prefix}", "coord_watch_restart", prefix=prefix,
                                 error=str(e), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                if watch is not None:
                    await _bounded(watch.cancel(), 1.0)


async def _bounded(coro, timeout_s: float) -> None:
    """Runs a client cleanup call for at most timeout_s, ignoring its errors.

    Unlike asyncio.wait_for, it does not wait for a timed-out call to finish cancelling:
    a gRPC call that swallows its cancellation (an aetcd watcher stuck behind its own
    lock) must not hang a shutdown.
    """
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        log.warning("etcd_cleanup_timeout", timeout_s=timeout_s)
        return
    if not task.cancelled() and task.exception() is not None:
        log.debug("etcd_cleanup_failed", error=repr(task.exception()))


__all__ = ["EtcdCoordinator", "parse_endpoint"]
