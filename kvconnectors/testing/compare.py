"""Greedy output identity: the correctness check for every transfer."""

from __future__ import annotations

from collections.abc import Sequence


def first_mismatch(expected: Sequence[Sequence[int]], actual: Sequence[Sequence[int]]) -> str | None:
    """None when all sequences are equal, else a message naming the first difference."""
    if len(expected) != len(actual):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if list(e) != list(a):
            pos = next((j for j, (x, y) in enumerate(zip(e, a)) if x != y), min(len(e), len(a)))
            return (f"prompt {i}: token {pos} differs: got {list(a)[pos:pos + 4]}..., "
                    f"expected {list(e)[pos:pos + 4]}... (lengths {len(a)} vs {len(e)})")
    return None


def assert_same_tokens(expected: Sequence[Sequence[int]], actual: Sequence[Sequence[int]],
                       what: str = "decode output") -> None:
    msg = first_mismatch(expected, actual)
    assert msg is None, f"{what} differs from the colocated run: {msg}"
