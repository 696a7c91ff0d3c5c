"""Segments: named, registered memory regions, and their publishable descriptors.

A segment (Mooncake paper section 3.2.3) is a contiguous region of one node's
memory that peers may READ and WRITE through the transfer engine. The node
that registers it grants access to exactly [0, length) of it, guarded by a
random access key; the descriptor (a plain dict) tells peers where to dial and
what key to present. The store registers its DRAM pool as one segment.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DESCRIPTOR_VERSION = 1
MAX_NAME_BYTES = 255  # the wire header carries the name length in a u16; keep names short
_LOCATION_RE = re.compile(r"^(cpu|cuda):\d+$")


def as_byte_view(buf: Any, *, writable: bool) -> memoryview:
    """A flat unsigned-byte memoryview over `buf`'s memory, without copying.

    Args:
        buf: a buffer-protocol object (bytes, bytearray, memoryview, numpy array, mmap) or a
            contiguous CPU torch tensor (any dtype; viewed as its raw bytes).
        writable: require a writable buffer (targets of READ, registered segments).
    Returns: memoryview of format 'B', ndim 1, nbytes = the buffer's size in bytes.
    Raises: TypeError for objects without the buffer protocol or non-CPU tensors;
        ValueError for non-contiguous or (when `writable`) read-only buffers.
    """
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):  # torch.Tensor, duck-typed
        if buf.device.type != "cpu":
            raise TypeError(f"a {buf.device} tensor has no host buffer; the TCP path moves host "
                            "memory only (stage it through a CPU tensor)")
        if not buf.is_contiguous():
            raise ValueError("tensor is not contiguous; pass tensor.contiguous()")
        import torch  # noqa: PLC0415  (only reached with a tensor in hand)

        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise TypeError(f"{type(buf).__name__} does not expose the buffer protocol") from e
    if not mv.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    if writable and mv.readonly:
        raise ValueError(f"buffer of type {type(buf).__name__} is read-only")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def buffer_address(view: memoryview) -> int:
    """Virtual address of the first byte of `view` (for RDMA memory registration)."""
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def check_location(location: str) -> str:
    """Validates a memory location ("cpu:N" or "cuda:N"). Raises ValueError otherwise."""
    if not _LOCATION_RE.match(location):
        raise ValueError(f"memory location {location!r} is not 'cpu:N' or 'cuda:N'")
    return location


def check_name(name: str) -> str:
    """Validates a segment name (non-empty, at most 255 UTF-8 bytes). Raises ValueError."""
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"segment name {name!r} must be a non-empty string of at most "
                         f"{MAX_NAME_BYTES} UTF-8 bytes")
    return name


@dataclass
class LocalSegment:
    """A segment registered in this process.

    Attributes: `name`; `view` (flat byte memoryview over the registered memory);
    `location` ("cpu:0"...); `access_key` (16 random bytes peers must present);
    `address` (virtual address of byte 0); `rdma` (per-NIC memory registrations, filled by
    the RDMA backend: NIC name -> object with `.lkey`/`.rkey`).
    """

    name: str
    view: memoryview
    location: str
    access_key: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    address: int = 0
    rdma: dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.view.nbytes

    def contains(self, address: int, length: int) -> bool:
        """True when [address, address + length) lies inside this segment's memory."""
        return self.address <= address and address + length <= self.address + self.length


@dataclass(frozen=True)
class NicInfo:
    """One RDMA NIC port of a peer, as published in its descriptor."""

    name: str
    port: int
    gid: str
    lid: int
    mtu: int
    rkey: int


@dataclass(frozen=True)
class PeerSegment:
    """A segment on another node, parsed from its descriptor."""

    name: str
    node: str
    instance: str
    host: str
    port: int
    length: int
    location: str
    access_key: bytes
    rdma_addr: int = 0
    nics: tuple[NicInfo, ...] = ()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


def make_descriptor(seg: LocalSegment, *, node: str, instance: str, host: str, port: int,
                    nics: list[dict] | None = None) -> dict:
    """The publishable descriptor of a local segment: a JSON-safe dict.

    Keys: version, name, node, instance (changes on every engine start), host, port (data
    server), length (bytes), location, access_key (hex), transports (["tcp"] or
    ["rdma", "tcp"]), and with RDMA: rdma = {addr, nics: [{name, port, gid, lid, mtu, rkey}]}.
    """
    desc = {"version": DESCRIPTOR_VERSION, "name": seg.name, "node": node, "instance": instance,
            "host": host, "port": port, "length": seg.length, "location": seg.location,
            "access_key": seg.access_key.hex(), "transports": ["tcp"]}
    if nics:
        desc["transports"] = ["rdma", "tcp"]
        desc["rdma"] = {"addr": seg.address, "nics": nics}
    return desc


def parse_descriptor(desc: dict) -> PeerSegment:
    """Validates a peer's descriptor (as made by `make_descriptor`).

    Raises: ValueError naming the missing or malformed field.
    """
    if not isinstance(desc, dict):
        raise ValueError(f"segment descriptor must be a dict, got {type(desc).__name__}")

    def get(key: str, tp: type) -> Any:
        if key not in desc:
            raise ValueError(f"segment descriptor lacks {key!r}")
        v = desc[key]
        if not isinstance(v, tp) or (tp is int and isinstance(v, bool)):
            raise ValueError(f"segment descriptor field {key!r} must be {tp.__name__}, got {v!r}")
        return v

    if get("version", int) != DESCRIPTOR_VERSION:
        raise ValueError(f"segment descriptor version {desc['version']} is not "
                         f"{DESCRIPTOR_VERSION}")
    name = check_name(get("name", str))
    port, length = get("port", int), get("length", int)
    if not 0 < port < 65536:
        raise ValueError(f"segment descriptor port {port} out of range")
    if length < 0:
        raise ValueError(f"segment descriptor length {length} is negative")
    try:
        key = bytes.fromhex(get("access_key", str))
    except ValueError as e:
        raise ValueError("segment descriptor access_key is not hex") from e
    nics: list[NicInfo] = []
    rdma_addr = 0
    rdma = desc.get("rdma")
    if rdma is not None:
        try:
            rdma_addr = int(rdma["addr"])
            nics = [NicInfo(str(n["name"]), int(n["port"]), str(n["gid"]), int(n["lid"]),
                            int(n["mtu"]), int(n["rkey"])) for n in rdma["nics"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"segment descriptor rdma section is malformed: {e!r}") from e
    return PeerSegment(name=name, node=get("node", str), instance=get("instance", str),
                       host=get("host", str), port=port, length=length,
                       location=check_location(get("location", str)), access_key=key,
                       rdma_addr=rdma_addr, nics=tuple(nics))


__all__ = ["as_byte_view", "buffer_address", "check_location", "check_name", "LocalSegment",
           "PeerSegment", "NicInfo", "make_descriptor", "parse_descriptor"]
