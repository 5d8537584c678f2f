"""Stable 64-bit hashing shared by placement (HRW) and the simulator. Python's hash() is salted per process."""

from __future__ import annotations

MASK64 = 0xFFFFFFFFFFFFFFFF
GOLDEN = 0x9E3779B97F4A7C15
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB


def mix64(x: int) -> int:
    """splitmix64 finaliser: a fast, well-distributed 64-bit mix."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MUL1) & MASK64
    z = ((z ^ (z >> 27)) * MUL2) & MASK64
    return z ^ (z >> 31)


def string_key(text: str) -> int:
    """A stable 64-bit key for a string (FNV-1a, then mixed); equal in every process."""
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & MASK64
    return mix64(h)
