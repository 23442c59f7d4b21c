"""Negative controls for identity tests: corrupted KV must change what the decode produces.

An identity check (decode output == colocated) proves nothing unless the same harness, on the same
data path, sees a difference when the KV is wrong. The control requests run beside the clean ones
on the same servers (TieredConnector's per-request test hooks, kvconnectors/transport/tamper.py)
and count only if they completed normally: a failed request is not "output changed".
"""

from __future__ import annotations

from collections.abc import Sequence

from kvconnectors.testing.compare import first_mismatch

CONTROL_FINISH = "length"   # greedy requests with max_tokens and no stop tokens end here when all went well


def control_lengths(block_size: int) -> list[int]:
    """Prompt lengths at block boundaries, where an off-by-one in a data path hides."""
    return [block_size - 1, block_size, block_size + 1, 2 * block_size + 1]


def control_failures(expected: Sequence[Sequence[int]], decoded: Sequence[Sequence[int]],
                     finish_reasons: Sequence[str | None], lengths: Sequence[int] | None = None) -> list[str]:
    """Why the control did not prove anything (empty when it did): a corrupted request that failed
    or stopped early, or one that decoded exactly what the colocated run did."""
    problems = []
    for i, (want, got, reason) in enumerate(zip(expected, decoded, finish_reasons, strict=True)):
        what = f"request {i}" + (f" ({lengths[i]} prompt tokens)" if lengths is not None else "")
        if reason != CONTROL_FINISH:
            problems.append(f"{what} finished {reason!r}, not {CONTROL_FINISH!r}: a failed request proves nothing")
        elif first_mismatch([want], [got]) is None:
            problems.append(f"{what} decoded identically from corrupted KV: the decode did not use those bytes")
    return problems


def assert_control_changed(expected: Sequence[Sequence[int]], decoded: Sequence[Sequence[int]],
                           finish_reasons: Sequence[str | None], lengths: Sequence[int] | None = None,
                           what: str = "negative control") -> None:
    problems = control_failures(expected, decoded, finish_reasons, lengths)
    assert not problems, f"{what}: " + "; ".join(problems)
