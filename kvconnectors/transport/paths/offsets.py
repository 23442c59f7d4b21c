"""Pulls whose reply names arena offsets (shm, nixl): the consumer fetches the blocks itself.

The source end pins the entry, answers a ReadReply with each block's offset in the producer's
arena (and what the medium adds: the arena's name, an agent's metadata), serves whatever the
consumer's fetch needs until it answers, and hands that answer to the server
(`ReadContext.finish_offset_read`). Each medium's module subclasses `ArenaPull` with its sink end.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import numpy as np

from kvconnectors.errors import TransferError
from kvconnectors.transport import wire
from kvconnectors.transport.protocol import hang_up, peer_name


class ArenaPull:
    """The reply names arena offsets; the consumer fetches the blocks itself, then answers
    Release (done) or Ack(ok=False) (its fetch or checksum check failed: the entry stays for a
    retry). The entry stays pinned until that answer."""
    streams = False
    name = label = ""

    def reply_fields(self, pv) -> dict[str, Any]:
        raise NotImplementedError

    def progress(self, sock: socket.socket, deadline: float) -> None:
        """Serve whatever the consumer's fetch needs from this side until `sock` is readable."""

    def close(self) -> None:
        pass

    def serve(self, ctx, sock, read, nvme_slots, ttl, checksums, outgoing=None) -> None:
        last = read.first_block + read.num_blocks
        with ctx.store.pinned_views(read.transfer_id, read.layers) as pv:
            offsets = np.concatenate([pv.offsets(layer)[read.first_block:last] for layer in read.layers]).tolist()
            nbytes = len(offsets) * pv.slot_bytes
            wire.send_msg(sock, wire.ReadReply(ok=True, checksums=checksums, offsets=offsets, lease_ttl_s=ttl,
                                               **self.reply_fields(pv)))
            deadline = time.monotonic() + ctx.idle_timeout_s
            try:
                self.progress(sock, deadline)
                done = wire.recv_msg(sock, deadline)
            except TransferError as exc:
                # The consumer vanished or stalled mid-read: the reply stream is out of step, so drop
                # the connection (the with-block unpins; the lease decides the entry's fate).
                ctx.reject(exc.cause.value)
                ctx.log.info("%s read of %s by %s ended without a release: %s", self.name, read.transfer_id,
                             peer_name(sock), exc)
                hang_up(sock)
                return
        # Unpinned before the answer is handled: a Release then frees the slots before its Ack, so a
        # producer told "released" has the room back (answered inside the pin, the slots came back
        # only after the Ack, and a stage right after it could find the store full).
        ctx.finish_offset_read(sock, read, self.name, done, nbytes)
