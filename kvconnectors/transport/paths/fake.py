"""An in-memory data path for unit tests, as httpx's MockTransport is for HTTP clients.

The control protocol runs for real (the server validates and answers the Read, the client checks
the reply, verifies the checksums and releases the entry); only the bytes skip the medium: the
source end copies the blocks out of the store into a `FakeMedium` both ends share, and the sink
end takes them from there. `handler(read, rows)` sees the rows on their way and returns the rows
to deliver (changed: a corruption the checksums must catch) or raises a TransferError (a medium
that fails), so a test exercises the client and the server without a socket stream, a shm arena
or a NIXL agent, and without reaching into their private methods.

    medium = FakeMedium()
    server = StoreServer(store, ..., paths=[TCP_PULL, FakePull(medium)])
    client.read(..., path=FakePull(medium))
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover.checksums import verify_checksums
from kvconnectors.transport import wire
from kvconnectors.transport.protocol import hang_up

Handler = Callable[[wire.Read, np.ndarray], np.ndarray]


class FakeMedium:
    """Rows handed from the source end to the sink end, by a handle the ReadReply carries."""

    def __init__(self, handler: Handler | None = None):
        self.handler = handler
        self.carried = 0  # bytes delivered to a sink end
        self._held: dict[int, np.ndarray] = {}
        self._handles = itertools.count(1)
        self._lock = threading.Lock()

    def put(self, rows: np.ndarray) -> int:
        with self._lock:
            handle = next(self._handles)
            self._held[handle] = rows
            return handle

    def take(self, handle: int) -> np.ndarray:
        with self._lock:
            rows = self._held.pop(handle, None)
        if rows is None:
            raise TransferError(FailureCause.PROTOCOL, f"fake medium holds nothing under handle {handle}")
        return rows


class FakePull:
    """Both ends of the in-memory pull; give the server and the client ones on the same medium."""
    name = label = "fake"
    streams = False  # the client answers Release (or Ack(ok=False)) after the sink end, as for shm

    def __init__(self, medium: FakeMedium):
        self.medium = medium

    def serve(self, ctx, sock, read, nvme_slots, ttl, checksums, outgoing=None) -> None:
        n = read.num_blocks
        rows = np.empty((len(read.layers) * n, ctx.store.slot_bytes), dtype=np.uint8)
        for i, layer in enumerate(read.layers):
            ctx.store.read_into(read.transfer_id, layer, read.first_block, rows[i * n:(i + 1) * n])
        handle = self.medium.put(rows)
        wire.send_msg(sock, wire.ReadReply(ok=True, checksums=checksums, offsets=[handle], nbytes=rows.nbytes,
                                           lease_ttl_s=ttl))
        try:
            done = wire.recv_msg(sock, time.monotonic() + ctx.idle_timeout_s)
        except TransferError as exc:
            ctx.reject(exc.cause.value)
            hang_up(sock)
            return
        ctx.finish_offset_read(sock, read, self.name, done, rows.nbytes)

    def read_into(self, sock, peer, read, reply, dest, *, deadline, sums, dest_addrs=None) -> int:
        if not reply.offsets or len(reply.offsets) != 1:
            raise TransferError(FailureCause.PROTOCOL, f"fake reply from {peer} without its one handle")
        rows = self.medium.take(reply.offsets[0])
        if self.medium.handler is not None:
            rows = self.medium.handler(read, rows)
        if rows.shape != (len(dest), len(dest[0])):
            raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                f"producer {peer} offers {rows.shape[0]} rows of {rows.shape[1]} B, expected {len(dest)} of {len(dest[0])}"))
        for view, row in zip(dest, rows):
            np.frombuffer(view, dtype=np.uint8)[:] = row
        if sums is not None:
            verify_checksums(sums, dest, read.transfer_id)
        self.medium.carried += rows.nbytes
        return rows.nbytes

    def close(self) -> None:
        pass
