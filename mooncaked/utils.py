"""Small helpers shared across packages (no dependencies: anything may import this)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers (b > 0): how many b-sized pieces hold a items.

    Exact for any int size (no float rounding), e.g. blocks of `b` tokens needed for
    `a` tokens. cdiv(0, b) == 0; a negative `a` rounds toward +inf like math.ceil.
    Raises: ZeroDivisionError when b == 0.
    """
    return -(-a // b)


__all__ = ["cdiv"]
