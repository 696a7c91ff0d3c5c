"""Requests, per-entry status and batches of the transfer engine's batch API.

After the Mooncake paper, section 3.2.3 (Listing 1): a caller allocates a batch
id, submits READ/WRITE requests into it (local buffer, remote segment + offset,
length), polls each entry's status or awaits the whole batch, and frees the id.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any, Callable

from .segment import LocalSegment, PeerSegment, as_byte_view


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


def local_view(req: TransferRequest, lookup: Callable[[str], LocalSegment | None]) -> memoryview:
    """Validates `req` and returns the local bytes it moves (a view, no copy).

    `lookup` resolves a `local` given as a segment name (this engine's segments).
    Raises: TypeError (not a TransferRequest, non-str segment, a local object without host
    memory); ValueError (bad op, negative offset or length, a local range past the
    buffer, a read-only READ target, an unknown local segment name).
    """
    if not isinstance(req, TransferRequest):
        raise TypeError(f"expected TransferRequest, got {type(req).__name__}")
    if not isinstance(req.op, TransferOp):
        raise ValueError(f"op must be TransferOp.READ or TransferOp.WRITE, got {req.op!r}")
    if not isinstance(req.segment, str):
        raise TypeError(f"segment must be a name (str), got {type(req.segment).__name__}")
    for field_name in ("remote_offset", "local_offset"):
        v = getattr(req, field_name)
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{field_name} must be an int >= 0, got {v!r}")
    local = req.local
    if isinstance(local, str):
        seg = lookup(local)
        if seg is None:
            raise ValueError(f"local buffer names no registered segment: {local!r}")
        whole = seg.view
    else:
        whole = as_byte_view(local, writable=req.op is TransferOp.READ)
    length = whole.nbytes - req.local_offset if req.length is None else req.length
    if not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    if req.local_offset + length > whole.nbytes:
        raise ValueError(f"local range [{req.local_offset}, {req.local_offset + length}) "
                         f"exceeds the local buffer ({whole.nbytes} bytes)")
    return whole[req.local_offset:req.local_offset + length]


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

    def add_moved(self, nbytes: int) -> None:
        """Counts `nbytes` more bytes moved (a transport's progress callback)."""
        self.moved += nbytes


class Batch:
    """A batch id's entries and a completion event (set when no entry is pending).

    Args: batch_id; capacity: most requests it holds (0: unbounded).
    """

    def __init__(self, batch_id: int, capacity: int):
        self.id = batch_id
        self.capacity = capacity  # 0: unbounded
        self.entries: list[_Entry] = []
        self.pending = 0
        self.done = asyncio.Event()
        self.done.set()  # an empty batch is complete

    def add(self, entry: _Entry) -> None:
        """Appends a pending entry."""
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

    def admit(self, requests: list[TransferRequest],
              local: Callable[[str], LocalSegment | None],
              target: Callable[[str], LocalSegment | PeerSegment | None]
              ) -> list[tuple[_Entry, LocalSegment | PeerSegment, memoryview]]:
        """Validates every request first (all or none), then adds them as entries; those
        naming an unknown segment (`target` gives None) or a range past the segment's length
        fail at once, empty ones are DONE. Returns (entry, target, local view) to run.

        `local` resolves local buffers given by segment name. Raises what `local_view`
        raises (TypeError, ValueError), before any entry is added.
        """
        prepared = [(r, local_view(r, local)) for r in requests]
        runs = []
        for req, view in prepared:
            entry = _Entry(req)
            self.add(entry)
            seg = target(req.segment)
            if seg is None:
                self.finish(entry, TransferState.FAILED,
                            f"unknown segment {req.segment!r} (add_peer_segment or open_segment "
                            "first)")
            elif req.remote_offset + view.nbytes > seg.length:
                self.finish(entry, TransferState.FAILED,
                            f"[{req.remote_offset}, {req.remote_offset + view.nbytes}) is out of "
                            f"bounds of segment {req.segment!r} ({seg.length} bytes)")
            elif view.nbytes == 0:
                self.finish(entry, TransferState.DONE)
            else:
                runs.append((entry, seg, view))
        return runs

    def statuses(self) -> list[TransferStatus]:
        """Every entry's status, in submission order."""
        return [e.status() for e in self.entries]


__all__ = ["TransferError", "UnknownSegmentError", "TransferOp", "TransferState",
           "TransferStatus", "TransferRequest", "Batch", "local_view"]
