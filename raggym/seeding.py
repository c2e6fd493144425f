"""Deterministic seed derivation shared by the engines and the rollout loop."""

from __future__ import annotations


def derive_seed(seed: int, index: int) -> int:
    """Seed of item ``index`` under ``seed`` (a fixed 63-bit mix of the two, splitmix64-style)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(index) * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x >> 1
