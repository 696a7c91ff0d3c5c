"""Which x86 instruction-set level this CPU runs, detected once, for the CPU kernels' dispatch.

Each CPU kernel has a portable variant (torch or NumPy, no inline assembly) and variants per
ISA level where they pay. The levels, lowest first:

- ``portable``: any CPU, any architecture (ARM included): torch / NumPy paths only.
- ``avx2``: x86 with AVX2 and FMA (AMD EPYC before Zen 4, Intel since Haswell).
- ``avx512_vnni``: AVX-512 F/BW plus VNNI (``vpdpbusd``): the int8 GEMV of cpu_gemv.
- ``avx512_bf16``: the above plus AVX512-BF16 (``vdpbf16ps``): cpu_prefill's kernel.

Detection reads llvmlite's host CPU features (what Numba compiles for, so a kernel is only
chosen where its code can be generated), falling back to /proc/cpuinfo's flags, and never
raises: a CPU it cannot read is ``portable``. ``MOONCAKED_CPU_ISA`` caps the level (for
example ``avx2`` on an AVX-512 machine, to measure or test the AVX2 path there); it can
lower the level, never raise it past what the CPU has. Source: the ISA tiers llama.cpp's
ggml-cpu picks at start-up (x86 AVX2 / AVX-512 / AVX-VNNI), issue 30.
"""

from __future__ import annotations

import functools
import os
import platform

__all__ = ["LEVELS", "cpu_name", "has", "host_features", "isa_level", "level_at_least"]

LEVELS = ("portable", "avx2", "avx512_vnni", "avx512_bf16")
# What each level needs, as llvmlite / Linux spell the features.
_NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512_vnni": ("avx2", "fma", "avx512f", "avx512bw", "avx512vnni"),
    "avx512_bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512vnni", "avx512bf16"),
}
# /proc/cpuinfo spells a few flags differently from LLVM.
_CPUINFO_NAMES = {"avx512bf16": "avx512_bf16", "avx512vnni": "avx512_vnni"}
ENV_CAP = "MOONCAKED_CPU_ISA"


@functools.cache
def host_features() -> frozenset[str]:
    """The CPU's feature names as LLVM spells them (``avx2``, ``avx512vnni``, ...), an empty
    set on a non-x86 CPU or when neither llvmlite nor /proc/cpuinfo can tell."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return frozenset()
    try:
        from llvmlite import binding as llvm  # noqa: PLC0415 - optional at import time
        feats = llvm.get_host_cpu_features()
        return frozenset(k for k, v in feats.items() if v)
    except (ImportError, RuntimeError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    inverse = {v: k for k, v in _CPUINFO_NAMES.items()}
                    return frozenset(inverse.get(x, x) for x in flags)
    except OSError:
        pass
    return frozenset()


def _detected_level() -> str:
    feats = host_features()
    level = "portable"
    for name in LEVELS[1:]:
        if all(f in feats for f in _NEEDS[name]):
            level = name
    return level


def isa_level() -> str:
    """The ISA level the kernels use here: the CPU's highest level (see the module doc),
    capped by ``MOONCAKED_CPU_ISA`` when set. Raises ValueError for a cap that is not one of
    LEVELS."""
    level = _detected_level()
    cap = os.environ.get(ENV_CAP, "").strip().lower()
    if cap:
        if cap not in LEVELS:
            raise ValueError(f"{ENV_CAP}={cap!r}: expected one of {', '.join(LEVELS)}")
        if LEVELS.index(cap) < LEVELS.index(level):
            level = cap
    return level


def level_at_least(level: str) -> bool:
    """Whether isa_level() is `level` or higher. Raises ValueError for an unknown level."""
    if level not in LEVELS:
        raise ValueError(f"unknown ISA level {level!r}: expected one of {', '.join(LEVELS)}")
    return LEVELS.index(isa_level()) >= LEVELS.index(level)


def has(level: str) -> bool:
    """Alias of level_at_least, for the tests' ``cpu_isa`` marker and the kernels' checks."""
    return level_at_least(level)


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's ``model name``), else platform.processor() or
    the machine type; for logs, `ctl status` and benchmark JSON."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
