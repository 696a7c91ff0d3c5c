"""The topology matrix: preferred and secondary NICs for each memory location.

Mooncake paper, section 3.2.3: each memory location (a NUMA node's DRAM, a GPU's
HBM) has NICs that reach it cheaply (same NUMA node / PCIe switch: "preferred")
and others that reach it across the socket interconnect ("secondary"). A request
on memory at location L uses L's preferred NICs, each slice picking one; a slice
whose path fails is retried on another preferred NIC, then on a secondary one.

Detected from sysfs (/sys/class/infiniband/<dev>/device/numa_node); the config's
`transfer.nic_topology` overrides rows: {"cpu:0": [["mlx5_0"], ["mlx5_1"]]}.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from .segment import check_location

SYSFS_INFINIBAND = "/sys/class/infiniband"


def detect_nics(sysfs_root: str | Path = SYSFS_INFINIBAND) -> dict[str, int]:
    """RDMA devices named in sysfs and their NUMA node (-1 when unknown).

    Returns: {device name: numa node}, sorted by name; {} when the directory is absent
    (no RDMA support in the kernel).
    """
    root = Path(sysfs_root)
    if not root.is_dir():
        return {}
    nics = {}
    for dev in sorted(p.name for p in root.iterdir()):
        try:
            numa = int((root / dev / "device" / "numa_node").read_text().strip())
        except (OSError, ValueError):
            numa = -1
        nics[dev] = numa
    return nics


def parse_override(override: dict) -> dict[str, tuple[list[str], list[str]]]:
    """Validates `transfer.nic_topology`: location -> [[preferred...], [secondary...]].

    The secondary list may be omitted. Raises: ValueError naming the bad entry.
    """
    rows: dict[str, tuple[list[str], list[str]]] = {}
    for loc, value in override.items():
        check_location(loc)
        if (not isinstance(value, list) or not 1 <= len(value) <= 2
                or not all(isinstance(v, list) and all(isinstance(n, str) for n in v)
                           for v in value)):
            raise ValueError(f"nic_topology[{loc!r}] must be [[preferred NICs], "
                             f"[secondary NICs]], got {value!r}")
        rows[loc] = (list(value[0]), list(value[1]) if len(value) == 2 else [])
    return rows


@dataclass
class Topology:
    """NICs of this node and the matrix location -> (preferred, secondary).

    A location without a row uses every NIC as preferred.
    """

    nics: list[str]
    matrix: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    _turn: itertools.count = field(default_factory=itertools.count, repr=False)

    @classmethod
    def build(cls, nics: dict[str, int], override: dict | None = None,
              usable: set[str] | None = None) -> "Topology":
        """The matrix from detected NICs ({name: numa node}), then the override's rows.

        `usable`, when given, drops NICs that could not be opened (with their rows' entries).
        """
        names = [n for n in nics if usable is None or n in usable]
        matrix: dict[str, tuple[list[str], list[str]]] = {}
        for numa in sorted({nics[n] for n in names if nics[n] >= 0}):
            near = [n for n in names if nics[n] == numa]
            far = [n for n in names if nics[n] != numa]
            matrix[f"cpu:{numa}"] = (near, far)
        for loc, (pref, sec) in parse_override(override or {}).items():
            matrix[loc] = ([n for n in pref if n in names], [n for n in sec if n in names])
        return cls(names, matrix)

    def row(self, location: str) -> tuple[list[str], list[str]]:
        """(preferred, secondary) NICs for memory at `location`."""
        pref, sec = self.matrix.get(location, (self.nics, []))
        if not pref:  # an override may name only unusable NICs: fall back to all
            pref, sec = self.nics, []
        return pref, sec

    def paths(self, location: str) -> list[str]:
        """NICs to try for one slice, in order: a rotating preferred NIC first, then the other
        preferred ones, then the secondary ones. Successive calls start on successive
        preferred NICs, so the slices of one request spread over them.
        """
        pref, sec = self.row(location)
        if not pref:
            return list(sec)
        k = next(self._turn) % len(pref)
        return pref[k:] + pref[:k] + [n for n in sec if n not in pref]

    def to_dict(self) -> dict:
        """The matrix as plain data (for logs and the inspection API)."""
        return {"nics": list(self.nics),
                "matrix": {loc: [list(p), list(s)] for loc, (p, s) in self.matrix.items()}}


__all__ = ["detect_nics", "parse_override", "Topology", "SYSFS_INFINIBAND"]
