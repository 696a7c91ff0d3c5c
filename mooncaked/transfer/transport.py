"""The transport interface: how the engine moves a request's bytes to a peer.

After Mooncake's `Transport` (mooncake-transfer-engine/include/transport/transport.h),
which TcpTransport and RdmaTransport implement: the engine (engine.py) keeps segments,
batches and each request's deadline, and hands every request on a peer's segment to
one transport. A transport cuts it into slices (slicing.py), spreads them over its
paths (TCP connections, NIC pairs), retries a slice whose path broke on another path
(`ATTEMPTS` paths at most; RDMA falls back to TCP last) and turns the peer's refusals
into TransferError. Mooncake's register/unregisterLocalMemory are `register` and
`unregister` here; its `submitTransfer` is `transfer` (a request) and `move_slice` (one
slice); status and batches stay in the engine.

Implementations: tcp.TcpTransport (always), rdma.RdmaTransport (when the host has a
usable RDMA device). They share the engine's EndpointPool (one cap over every path).
"""

from __future__ import annotations

import abc
from typing import Callable, ClassVar

from .batch import TransferError
from .pool import EndpointPool
from .segment import LocalSegment, PeerSegment

ATTEMPTS = 3  # paths tried per slice before its request fails (RDMA then also tries TCP)
BULK_MIN_BYTES = 256 * 1024  # copies this large (TCP bulk slices, local memcpy) run in
                             # worker threads with the GIL released

Progress = Callable[[int], None]
"""Called with the bytes of each slice once it has moved."""


def refused(peer: PeerSegment, error: BaseException, where: str = "") -> TransferError:
    """The TransferError of a request the peer refused (final, never retried)."""
    return TransferError(f"refused by node {peer.node} {where or f'at {peer.host}:{peer.port}'}: "
                         f"{error}")


def unreachable(peer: PeerSegment, last_error: BaseException | None) -> TransferError:
    """The TransferError of a slice whose every path broke."""
    return TransferError(f"node {peer.node} at {peer.host}:{peer.port} is unreachable "
                         f"(segment {peer.name!r}): {last_error!r}")


class Transport(abc.ABC):
    """One way of moving bytes between local memory and peers' segments.

    Args:
        pool: the engine's endpoint pool (shared by every transport; keys start with the
            transport's path kind, e.g. "tcp", "bulk", "rdma").
        slice_size: largest slice of a request on one path, bytes.

    Attributes:
        name: "tcp" or "rdma" (the engine's `backend` is its preferred transport's name).
        closing: set by the engine when it starts closing; slices then stop retrying and
            fail with "transfer engine closed".
        slices_retried: slices moved to another path after theirs broke (stats).
    """

    name: ClassVar[str] = ""

    def __init__(self, pool: EndpointPool, slice_size: int):
        self.pool = pool
        self.slice_size = slice_size
        self.closing = False
        self.slices_retried = 0

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Starts what the transport serves (e.g. the TCP data server). Raises OSError."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases what the transport holds (server, NIC contexts). The engine has closed
        the endpoint pool and cancelled its transfers first."""

    def register(self, seg: LocalSegment) -> None:  # noqa: B027 - optional hook
        """Makes `seg` reachable by this transport (RDMA: memory regions). Default: nothing."""

    def unregister(self, seg: LocalSegment) -> None:  # noqa: B027 - optional hook
        """Undoes `register`. Default: nothing."""

    def segment_nics(self, seg: LocalSegment) -> list[dict]:
        """NIC entries (with rkeys) to publish in `seg`'s descriptor; [] without NICs."""
        return []

    @abc.abstractmethod
    def drop_paths(self, peer: PeerSegment) -> int:
        """Drops every pooled path to `peer` (it restarted or moved); returns how many."""

    @abc.abstractmethod
    async def transfer(self, peer: PeerSegment, read: bool, view: memoryview,
                       remote_offset: int, progress: Progress) -> None:
        """Moves a whole request: READ (`read` True) fills `view` from `peer`'s segment at
        `remote_offset` (bytes), WRITE sends `view` there; cut into slices of at most
        `slice_size` bytes that run concurrently, `progress(n)` after each.

        Raises: TransferError (refused, or a slice unreachable on every path); the caller
        bounds it in time (cancellation leaves no I/O touching `view`).
        """

    @abc.abstractmethod
    async def move_slice(self, peer: PeerSegment, read: bool, part: memoryview,
                         remote_offset: int) -> None:
        """Moves one slice (`part`, at most a few MiB) on one of the peer's paths, retried
        on another path when that one breaks. Raises TransferError."""

    def stats(self) -> dict:
        """Counters for the engine's stats (summed over transports where keys repeat)."""
        return {"slices_retried": self.slices_retried}

    def check_open(self) -> None:
        """Raises TransferError("transfer engine closed") once the engine is closing."""
        if self.closing:
            raise TransferError("transfer engine closed")


__all__ = ["Transport", "Progress", "ATTEMPTS", "BULK_MIN_BYTES", "refused", "unreachable"]
