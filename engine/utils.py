"""Small helpers the engine's modules share."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` tokens."""
    return -(-a // b)
