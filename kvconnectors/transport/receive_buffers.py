"""Receive buffers of push mode: what every landing connection together may hold to receive pushes.

One pool shared by every connection, at most `cap` bytes (Landing's `max_receive_bytes`): a tcp push
borrows one chunk (for its rows bound for NVMe), a fault-wrapped one its whole group; a NIXL push
larger than its bounce buffer is counted against the cap. A push that would need more is refused
with store_full instead of allocating. Buffers are kept for reuse, never per connection. The bytes
of a refused push are drained into one shared scratch buffer, never looked at.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.store.sizes import format_size
from kvconnectors.transport import wire
from kvconnectors.transport.paths import NIXL_BOUNCE_BYTES, PushPath
from kvconnectors.transport.protocol import MAX_PUSH_BYTES, hang_up

MIN_RECEIVE_BYTES = 2 * MAX_PUSH_BYTES  # the default receive-buffer cap is at least this (128 MiB)
DRAIN_BYTES = 1 << 20              # refused pushes' bytes are read into one shared scratch buffer


class ReceiveBuffers:
    """Push receive buffers of every connection together, at most `cap` bytes. `lend` gives a buffer
    for one push (reusing a free one when it is large enough), `account` counts bytes a data path
    allocates itself; both raise STORE_FULL instead of going past the cap (free buffers are dropped
    first to make room), and `give_back` returns them."""

    def __init__(self, cap: int):
        if cap < 1:
            raise ValueError(f"receive-buffer cap must be >= 1 byte, got {cap}")
        self.cap = int(cap)
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._held = 0                 # bytes of free buffers + buffers lent + bytes accounted
        self.refusals = 0
        self._scratch = np.empty((DRAIN_BYTES,), dtype=np.uint8)  # refused bytes land here, unread

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    def lend(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [b for b in self._free if b.size >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.size)
                self._free = [b for b in self._free if b is not buf]
                return buf
            size = _rounded(nbytes)
            self._make_room(size if size <= self.cap - self._held + self._free_bytes() else nbytes)
            size = size if self._held + size <= self.cap else nbytes
            self._held += size
        return np.empty((size,), dtype=np.uint8)

    def account(self, nbytes: int) -> None:
        with self._lock:
            self._make_room(nbytes)
            self._held += nbytes

    def give_back(self, buf: np.ndarray | None = None, nbytes: int = 0) -> None:
        with self._lock:
            if buf is not None:
                self._free.append(buf)
            else:
                self._held -= nbytes

    def drop_free(self) -> None:
        """Let go of the buffers no push holds now (their memory goes back)."""
        with self._lock:
            self._held -= self._free_bytes()
            self._free = []

    def borrow(self, path: PushPath, nbytes: int) -> np.ndarray | int:
        """What receiving `nbytes` over `path` takes from the receive-buffer cap: a lent buffer
        (streamed bytes), bytes counted (a NIXL push larger than its bounce buffer is gathered in
        one of its own), or 0."""
        if path.streams:
            return self.lend(nbytes)
        if nbytes > NIXL_BOUNCE_BYTES:
            self.account(nbytes)
            return nbytes
        return 0

    def repay(self, loan: np.ndarray | int) -> None:
        if isinstance(loan, np.ndarray):
            self.give_back(loan)
        elif loan:
            self.give_back(nbytes=loan)

    def drain(self, sock: socket.socket, nbytes: int) -> bool:
        """Read and discard a refused Push's bytes (sizes already checked); False if the stream broke.
        Every connection drains into one scratch buffer: the bytes are never looked at."""
        left = nbytes
        deadline = time.monotonic() + 60
        view = memoryview(self._scratch)
        while left:
            n = min(left, view.nbytes)
            try:
                wire.recv_exact(sock, view[:n], deadline)
            except TransferError:
                hang_up(sock)
                return False
            left -= n
        return True

    def _free_bytes(self) -> int:
        return sum(b.size for b in self._free)

    def _make_room(self, nbytes: int) -> None:
        """(lock held) Drop free buffers, largest first, until `nbytes` more fit; else refuse."""
        if self._held - self._free_bytes() + nbytes > self.cap:
            self.refusals += 1
            raise TransferError(FailureCause.STORE_FULL, (
                f"landing receive buffers: a push of {format_size(nbytes)} does not fit the "
                f"{format_size(self.cap)} cap ({format_size(self._held - self._free_bytes())} in use by other pushes)"))
        self._free.sort(key=lambda b: b.size)
        while self._held + nbytes > self.cap:
            self._held -= self._free.pop().size


def _rounded(nbytes: int) -> int:
    """Buffer sizes in steps of an eighth of a power of two: pushes of slightly different sizes
    (prompts of different lengths) reuse a buffer instead of dropping and faulting in a new one."""
    if nbytes <= 1 << 16:
        return 1 << 16
    step = 1 << max(0, nbytes.bit_length() - 4)
    return -(-nbytes // step) * step
