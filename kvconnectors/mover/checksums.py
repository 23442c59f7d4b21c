"""The per-block checksum (xxh3-64 of one (layer, block) row), its check, and the error a mismatch
raises: the stager computes them, every data path and the head slicer check them.

Here, below the transport, so the mover's head slicer (`reslice.pack_checked_heads`) raises the same
`checksum_mismatch` as the data paths do. Numpy and xxhash only: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover import block_shares


def block_checksum(view) -> int:
    return xxhash.xxh3_64_intdigest(view)


def verify_checksums(expected: Sequence[int], dest: Sequence[memoryview], transfer_id: str, *,
                     first: int = 0, of: int | None = None, addrs=None) -> None:
    """`dest` are blocks first.. of a transfer of `of` blocks (default: just these); large lists are
    hashed in parallel shares (block_shares.py; natively given `addrs`, dest's addresses), the
    lowest mismatching block is the one named."""
    bad = block_shares.first_mismatch(expected, dest, addrs)
    if bad is not None:
        raise checksum_mismatch(transfer_id, first + bad, of or len(dest), dest[bad], expected[bad])


def checksum_mismatch(transfer_id: str, index: int, of: int, view, want: int) -> TransferError:
    """The error for block `index` of `of`, found not to match its staged checksum `want` (raised
    as found: the view is hashed again only to say what it holds)."""
    return TransferError(FailureCause.CHECKSUM_MISMATCH, (
        f"transfer {transfer_id!r}: block {index} of {of} has checksum {block_checksum(view):016x}, "
        f"producer staged {want:016x}"))
