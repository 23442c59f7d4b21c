"""What a data path's ends are given, and what they promise: the low module every path imports.

A path never calls back into the server, the client or the landing store that uses it: each end
gets what it needs as plain values and callables.

- a pull's **source end** (`PullPath.serve`, producer) answers one validated Read from a
  `ReadContext`: a view of the store, the server's counters and its log, built by the server;
- a pull's **sink end** (`PullPath.read_into`, consumer) reads the reply's blocks into destination
  views;
- a push's **sender** (`PushPath.send`) gets a `PushFrame`, the callable that sends one Push and
  waits for its Ack (StoreClient.push);
- a push's **receiver** (`PushPath.check`, `PushPath.receive`, landing side) gets the push, the
  bytes of one of its rows and a lender of receive buffers.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import wire

# Blocks streamed layer group by layer group; a filter may change or cut them on the way (faults.py).
Outgoing = Callable[[Iterable[list[memoryview]], int, int], Iterator[list[memoryview]]]
# Sends one Push (with the bytes that follow it, for a streamed path) and waits for its Ack; a
# path whose peer fetches the bytes passes `progress(sock, deadline)` to serve that meanwhile.
PushFrame = Callable[..., None]  # (msg: wire.Push, data: Sequence[memoryview], deadline: float, progress=None)


class StoreView(Protocol):
    """What a source end reads from the producer's store (store.TieredStore)."""

    slot_bytes: int

    def pinned_views(self, transfer_id: str, layers: Sequence[int]) -> AbstractContextManager[Any]: ...

    def read_into(self, transfer_id: str, layer: int, first_block: int, out: np.ndarray) -> None: ...


@dataclass(frozen=True)
class ReadContext:
    """Everything a source end uses while it serves one read; the server builds it per read."""

    store: StoreView
    idle_timeout_s: float                    # how long the consumer may take to answer an offset read
    count_read: Callable[[int], None]        # a read served: its bytes
    reject: Callable[[str], None]            # a read ended early: the reason counted
    # the consumer's answer to a read it fetched itself: (sock, read, path name, answer, bytes)
    finish_offset_read: Callable[[socket.socket, wire.Read, str, wire.Message, int], None]
    log: logging.Logger | logging.LoggerAdapter


class PullPath(Protocol):
    name: str
    label: str
    streams: bool

    def read_into(self, sock: socket.socket, peer: str, read: wire.Read, reply: wire.ReadReply,
                  dest: Sequence[memoryview], *, deadline: float, sums: list[int] | None,
                  dest_addrs: np.ndarray | None = None) -> int:
        """Sink end (consumer): land the blocks `reply` offers into `dest` (layer-major), verify
        `sums` if given; bytes received. The client answers Release afterwards unless the path streams."""

    def serve(self, ctx: ReadContext, sock: socket.socket, read: wire.Read, nvme_slots: int, ttl: float,
              checksums: list[int] | None, outgoing: Outgoing | None = None) -> None:
        """Source end (producer): answer a validated, sealed Read with a ReadReply and the blocks
        (or where to find them)."""

    def close(self) -> None:
        """Release what the path holds (a NIXL agent)."""


class PushPath(Protocol):
    name: str
    label: str
    streams: bool

    def send(self, push_frame: PushFrame, head: dict[str, Any], pv: Any, layers: list[int], first: int,
             last: int, nbytes: int, deadline: float) -> None:
        """Sender: push blocks [first, last) of `layers` (pinned in `pv`) through `push_frame`."""

    def check(self, push: wire.Push, rows: int, row_bytes: int) -> None:
        """Receiver: raise a TransferError if this push of `rows` rows of `row_bytes` bytes cannot
        land over this path."""

    def receive(self, sock: socket.socket, push: wire.Push, row_bytes: int,
                bounce: Callable[[int], np.ndarray]) -> AbstractContextManager[np.ndarray]:
        """Receiver: the group's bytes, (rows, row_bytes) uint8, valid inside the with-block;
        `bounce(nbytes)` lends the receive buffer of this push."""

    def close(self) -> None:
        """Release what the path holds (a NIXL agent)."""


# Offered by name: why a server that does not offer a known path refuses it.
PULL_UNOFFERED = {"shm": "asked, but this store has no shm arena",
                  "nixl": "asked, but this producer was not started with transport 'nixl'"}
PUSH_UNOFFERED = {"nixl": "sent to a consumer that was not started with transport 'nixl'"}


def offered(paths, name: str, unoffered: dict[str, str], what: str):
    """The data path `name` among those this end offers, or a typed refusal that says why not
    (one this end could offer but does not, or one nobody knows)."""
    path = paths.get(name)
    if path is None:
        why = unoffered.get(name)
        raise TransferError(FailureCause.PROTOCOL, f"{what} {name!r} {why}" if why else f"unknown {what} {name!r}")
    return path
