"""nixl: the bytes move by a NIXL (UCX) READ from the peer's registered arena, never on the socket.

Pull (`NixlPull`): the consumer's sink end READs the blocks the reply names into its registered
destination (`sink`, a transport.nixl.NixlSink), then verifies them; the producer's source end
answers offsets (offsets.py) and progresses its arena's agent (`source`) until the consumer answers.
Push (`NixlPush`): the sender names its arena's offsets in the Push frame and progresses its agent
until the Ack; the receiver READs the group into one registered bounce buffer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover.checksums import verify_checksums
from kvconnectors.transport import wire
from kvconnectors.transport.nixl import NixlSink, NixlSource
from kvconnectors.transport.paths.ends import PUSH_UNOFFERED
from kvconnectors.transport.paths.offsets import ArenaPull

NIXL_BOUNCE_BYTES = 64 << 20       # landing side: registered once; larger pushes are READ in pieces
# A NIXL READ holds the landing side's one bounce buffer, so a stalled producer blocks every other
# producer's nixl pushes into this store: bound each READ by its size at a rate far below any link's.
NIXL_READ_FLOOR_S = 5.0
NIXL_READ_MIN_BYTES_PER_S = 50e6


class NixlPull(ArenaPull):
    """The consumer READs the blocks through NIXL. A consumer passes its agent (`sink`, whose
    registered memory holds every destination view), a producer its arena's (`source`)."""
    name = label = "nixl"

    def __init__(self, *, sink: NixlSink | None = None, source: NixlSource | None = None):
        self.sink, self.source = sink, source

    def reply_fields(self, pv) -> dict[str, Any]:
        assert self.source is not None, "a nixl producer path needs its NixlSource"
        return {"nixl_agent_meta": self.source.metadata, "nixl_base_address": self.source.base_address}

    def progress(self, sock: socket.socket, deadline: float) -> None:
        # the READ's target must progress its agent: until the consumer's answer (or EOF) arrives
        assert self.source is not None
        self.source.serve_until_readable(sock, deadline)

    def read_into(self, sock, peer, read, reply, dest, *, deadline, sums, dest_addrs=None) -> int:
        self._check_reply(peer, reply, dest)
        nbytes = self.sink.read_blocks(peer, reply.nixl_agent_meta, reply.nixl_base_address, reply.offsets,
                                       dest, deadline, local_addrs=dest_addrs)
        if sums is not None:  # after the READ: NIXL hands over the bytes only once it is DONE
            verify_checksums(sums, dest, read.transfer_id, addrs=dest_addrs)
        return nbytes

    def _check_reply(self, peer, reply, dest) -> None:
        """A READ needs our agent, one producer offset per destination block and its agent metadata."""
        if self.sink is None:
            raise TransferError(FailureCause.PROTOCOL, "data_path 'nixl' needs the consumer's NIXL agent "
                                                       f"({type(self).__name__}(sink=...))")
        if not reply.offsets or len(reply.offsets) != len(dest):
            raise TransferError(FailureCause.PROTOCOL, f"nixl reply from {peer} without one offset per block")
        if not reply.nixl_agent_meta or reply.nixl_base_address <= 0:
            raise TransferError(FailureCause.PROTOCOL, f"nixl reply from {peer} without agent metadata")

    def close(self) -> None:
        for agent in (self.sink, self.source):
            if agent is not None:
                agent.close()
        self.sink = self.source = None


class NixlPush:
    """The landing side READs the group from the sender's arena. The sender passes its arena's
    agent (`source`); the landing side a factory for its agent (`sink_factory`), made at the first
    nixl push with one bounce buffer registered for its life."""
    name, label, streams = "nixl", "push_nixl", False

    def __init__(self, *, source: NixlSource | None = None, sink_factory: Callable[[], Any] | None = None):
        self.source, self._sink_factory = source, sink_factory
        self._sink: Any = None
        self._bounce: np.ndarray | None = None
        self._lock = threading.Lock()

    def send(self, push_frame, head, pv, layers, first, last, nbytes, deadline) -> None:
        assert self.source is not None, "a nixl push sender needs its NixlSource"
        offsets = np.concatenate([pv.offsets(layer)[first:last] for layer in layers]).tolist()
        msg = wire.Push(**head, data_path=self.name, offsets=offsets, nixl_agent_meta=self.source.metadata,
                        nixl_base_address=self.source.base_address)
        push_frame(msg, (), deadline, progress=self.source.serve_until_readable)

    def check(self, push, rows, row_bytes) -> None:
        if self._sink_factory is None:
            raise TransferError(FailureCause.PROTOCOL, f"push data_path 'nixl' {PUSH_UNOFFERED['nixl']}")
        if not push.offsets or len(push.offsets) != rows or push.nixl_base_address <= 0:
            raise TransferError(FailureCause.PROTOCOL, "nixl push without one offset per block")

    @contextmanager
    def receive(self, sock, push, row_bytes, bounce) -> Iterator[np.ndarray]:
        """READ the blocks into the one registered bounce buffer (in pieces when larger; then
        gathered into a plain buffer): one registration for the landing store's life."""
        slot = row_bytes  # a whole slot: head fragments come inline only
        offsets = np.asarray(push.offsets, dtype=np.uint64)
        meta = push.nixl_agent_meta or b""
        # keyed by the producer agent, not the connection: a reconnect reuses the loaded agent
        key = f"push-{xxhash.xxh3_64_hexdigest(meta)}"
        with self._lock:
            sink, bounce = self._agent()
            piece = max(1, bounce.size // slot)
            rows = len(offsets)
            out = np.empty((rows, slot), dtype=np.uint8) if rows > piece else None
            for start in range(0, rows, piece):
                n = min(piece, rows - start)
                dst = bounce[:n * slot].reshape(n, slot)
                local = np.uint64(bounce.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(slot)
                sink.read(key, meta, np.uint64(push.nixl_base_address) + offsets[start:start + n], local, slot,
                          read_deadline(n * slot))
                if out is None:
                    yield dst  # landed while the bounce buffer is still ours
                    return
                out[start:start + n] = dst
        yield out

    def _agent(self) -> tuple[Any, np.ndarray]:
        if self._sink is None:
            assert self._sink_factory is not None
            sink = self._sink_factory()
            bounce = np.empty((NIXL_BOUNCE_BYTES,), dtype=np.uint8)
            sink.register_regions([(int(bounce.ctypes.data), bounce.nbytes)])
            self._sink, self._bounce = sink, bounce
        assert self._bounce is not None
        return self._sink, self._bounce

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None


def read_deadline(nbytes: int) -> float:
    """When a NIXL READ of `nbytes` into the landing bounce buffer must have finished."""
    return time.monotonic() + min(60.0, NIXL_READ_FLOOR_S + nbytes / NIXL_READ_MIN_BYTES_PER_S)
