"""Test-only corruption hooks, asked for per request, on every data path.

A negative control must show that the decode really used the bytes a data path delivered: corrupt
them silently and the tokens of a request that completes normally must change. Restarting servers
with a fault plan for that is slow and proves it only for the next run, so a request asks for it
itself, beside clean requests on the same running servers:

    prefill request: kv_transfer_params {"do_remote_decode": true, "kvc_fault": "corrupt"}

Only instances started with the TieredConnector setting `test_hooks: true` honour it (never set it
in production). The producer's scheduler marks the transfer id (`mark`); every hook fires on marked
ids only, and only in a process whose own config enables test hooks:

- "corrupt": where the data path delivers the bytes on the consumer side, before anything else
  touches them: a pull over tcp, shm or nixl (into the KV blocks), a push over tcp or nixl (into
  the landing store). The transfer's checksum check is skipped, as with `checksum: false`, so the
  corruption is silent.
- "corrupt_landed": push mode, when the landed copy is copied out of the landing store into the KV
  blocks (after the landing side's own checks).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

KINDS = ("corrupt", "corrupt_landed")
PARAM = "kvc_fault"               # the kv_transfer_params key a prefill request asks with
_MARK = "#kvc_fault="
_MARK_RE = re.compile(re.escape(_MARK) + r"([a-z_]+)")


def mark(transfer_id: str, kind: str) -> str:
    """`transfer_id` marked for `kind` (one of KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"{PARAM}={kind!r}: must be one of {', '.join(KINDS)}")
    return f"{transfer_id}{_MARK}{kind}"


def kind_of(transfer_id: str, enabled: bool) -> str | None:
    """The corruption asked for `transfer_id`, or None (always None when hooks are off here)."""
    if not enabled:
        return None
    m = _MARK_RE.search(transfer_id)
    return m.group(1) if m and m.group(1) in KINDS else None


def corrupt(blocks: Iterable[memoryview] | np.ndarray) -> None:
    """Flip every byte of each block in place (XOR 0x5A): sign, exponent and mantissa bits of every
    value whatever the dtype, so even a one-block prompt's attention sees different keys/values."""
    if isinstance(blocks, np.ndarray):
        flat = blocks.reshape(-1).view(np.uint8)
        np.bitwise_xor(flat, np.uint8(0x5A), out=flat)
        return
    for view in blocks:
        arr = np.frombuffer(view.cast("B") if view.format != "B" else view, dtype=np.uint8)
        np.bitwise_xor(arr, np.uint8(0x5A), out=arr)
