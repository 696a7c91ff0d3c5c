"""Requests, per-entry status and batches of the transfer engine's batch API.

After the Mooncake paper, section 3.2.3 (Listing 1): a caller allocates a batch
id, submits READ/WRITE requests into it (local buffer, remote segment + offset,
length), polls each entry's status or awaits the whole batch, and frees the id.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any


class TransferError(RuntimeError):
    """A transfer failed; `statuses` holds every entry's TransferStatus (batch conveniences)."""

    def __init__(self, message: str, statuses: list["TransferStatus"] | None = None):
        super().__init__(message)
        self.statuses = statuses or []


class UnknownSegmentError(KeyError):
    """No segment of that name is registered locally or known from a peer's descriptor."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown segment"


class TransferOp(enum.Enum):
    """READ copies remote segment bytes into the local buffer; WRITE copies local bytes out."""

    READ = "read"
    WRITE = "write"


class TransferState(enum.Enum):
    """State of one batch entry (Mooncake: WAITING/PENDING -> COMPLETED | FAILED | TIMEOUT)."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """Status of one batch entry.

    Attributes: `state`; `reason` (why it failed, empty otherwise); `bytes` (bytes moved,
    equal to the request's length once DONE).
    """

    state: TransferState
    reason: str = ""
    bytes: int = 0

    @property
    def done(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def failed(self) -> bool:
        return self.state is TransferState.FAILED


@dataclass(slots=True)
class TransferRequest:
    """One READ or WRITE between a local buffer and a (usually remote) segment.

    Attributes:
        op: TransferOp.READ (remote -> local) or TransferOp.WRITE (local -> remote).
        segment: name of the target segment (a peer's, added with `add_peer_segment` or
            `open_segment`, or one registered in this engine: then it is a local copy).
        remote_offset: byte offset into the target segment.
        local: the local buffer: anything exposing the buffer protocol (bytearray,
            memoryview, numpy array, contiguous CPU torch tensor), or the name of a segment
            registered in this engine. READ needs it writable. On RDMA paths it must lie
            inside a registered segment (otherwise the request goes over TCP).
        local_offset: byte offset into `local`.
        length: bytes to move; None means the rest of `local` after `local_offset`.

    Mirrors Mooncake's TransferRequest {opcode, source, target_id, target_offset, length}.
    """

    op: TransferOp
    segment: str
    remote_offset: int
    local: Any
    local_offset: int = 0
    length: int | None = None


class _Entry:
    """Engine-side state of one submitted request."""

    __slots__ = ("request", "state", "reason", "moved", "task")

    def __init__(self, request: TransferRequest):
        self.request = request
        self.state = TransferState.PENDING
        self.reason = ""
        self.moved = 0
        self.task: asyncio.Task | None = None

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.reason, self.moved)


class Batch:
    """A batch id's entries and a completion event (set when no entry is pending)."""

    def __init__(self, batch_id: int, capacity: int):
        self.id = batch_id
        self.capacity = capacity  # 0: unbounded
        self.entries: list[_Entry] = []
        self.pending = 0
        self.done = asyncio.Event()
        self.done.set()  # an empty batch is complete

    def add(self, entry: _Entry) -> None:
        self.entries.append(entry)
        self.pending += 1
        self.done.clear()

    def finish(self, entry: _Entry, state: TransferState, reason: str = "") -> None:
        """Moves a pending entry to DONE or FAILED (idempotent for finished entries)."""
        if entry.state is not TransferState.PENDING:
            return
        entry.state, entry.reason = state, reason
        self.pending -= 1
        if self.pending == 0:
            self.done.set()

    def statuses(self) -> list[TransferStatus]:
        return [e.status() for e in self.entries]


__all__ = ["TransferError", "UnknownSegmentError", "TransferOp", "TransferState",
           "TransferStatus", "TransferRequest", "Batch"]
