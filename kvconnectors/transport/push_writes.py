"""How a pushed layer group is written into the landing store, once its header was accepted.

tcp (`land_in_place`): the group is received straight into its store slots, a chunk
(IN_PLACE_CHUNK_BYTES) at a time: each chunk's slots are reserved just before its bytes are read and
committed once they pass their checksums (NVMe rows pass through the connection's lent buffer), so
a claim holds only what was delivered plus at most one chunk. Other paths (`land`): the whole group,
received by its data path, is verified, reserved and written in one call. Either way a refusal
leaves the stream in step (what is left of the push is drained) and the bytes landed are counted per
path in the landed-entry table. Head fragment rows land in the first bytes of a whole slot.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, StoreFullError, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.store import TieredStore
from kvconnectors.store.buffers import runs
from kvconnectors.store.views import WriteTarget
from kvconnectors.transport import tamper, wire
from kvconnectors.transport.landed_entries import LANDING_LOGGER, ConnectionState, LandedEntries
from kvconnectors.transport.paths import TCP_PUSH
from kvconnectors.transport.protocol import HungUp
from kvconnectors.transport.receive_buffers import ReceiveBuffers

logger = get_logger(LANDING_LOGGER)
IN_PLACE_CHUNK_BYTES = 1 << 20    # tcp pushes land in the store a chunk at a time (reserved just ahead)


class GroupWriter:
    """Writes accepted push groups into the store, from the receiver's connection threads."""

    def __init__(self, store: TieredStore, entries: LandedEntries, buffers: ReceiveBuffers, test_hooks: bool = False):
        self.store, self.entries, self.buffers = store, entries, buffers
        self.test_hooks = test_hooks  # honour per-transfer corruption marks (tamper.py): tests only

    @property
    def chunk_rows(self) -> int:
        return max(1, IN_PLACE_CHUNK_BYTES // self.store.slot_bytes)

    def land_in_place(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState, row_bytes: int) -> None:
        """tcp: receive the group straight into its store slots, a chunk at a time: reserve a chunk's
        slots, read its bytes into them (NVMe rows through the lent buffer), verify, commit. The decode
        then copies slot -> blocks: two host copies in all, and the reservation runs at most one chunk
        ahead of the bytes delivered. Every refusal leaves the stream in step (the rest is drained)."""
        tid = msg.transfer_id
        unread = [msg.nbytes]  # bytes of this push still on the socket
        try:
            self._receive_chunks(sock, msg, conn, unread, row_bytes)
        except (TransferError, HungUp):
            raise
        except Exception as exc:  # a bug: answer in step, keep serving
            logger.exception("landing %r from %s failed unexpectedly", tid, conn.peer)
            if not self.buffers.drain(sock, unread[0]):
                raise HungUp(None) from None
            raise TransferError(FailureCause.PROTOCOL,
                                f"internal error landing this push: {type(exc).__name__}") from None
        self.entries.count_landed(tid, TCP_PUSH.label, msg.nbytes)

    def _receive_chunks(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState, unread: list[int],
                        row_bytes: int) -> None:
        slot, tid, n_blocks = self.store.slot_bytes, msg.transfer_id, msg.num_blocks
        silent = tamper.kind_of(tid, self.test_hooks) == "corrupt"
        deadline = time.monotonic() + 60

        def refuse(err: TransferError) -> TransferError:
            if not self.buffers.drain(sock, unread[0]):
                raise HungUp(None)
            return err

        for li, layer in enumerate(msg.layers):
            for j in range(0, n_blocks, self.chunk_rows):
                n, first = min(self.chunk_rows, n_blocks - j), msg.first_block + j
                try:
                    self.store.reserve(tid, layer, first, n)
                    target = self.store.begin_write(tid, layer, first, n)
                except StoreFullError as exc:
                    raise refuse(TransferError(FailureCause.STORE_FULL, f"landing store: {exc.detail}")) from None
                except (ValueError, IndexError) as exc:  # e.g. sealed meanwhile, or a bound the checks missed
                    raise refuse(TransferError(FailureCause.PROTOCOL, f"pushed transfer {tid!r}: {exc}")) from None
                ok = False
                try:
                    rows = self._receive_rows(sock, target, conn, deadline, unread, row_bytes)
                    if silent:  # test hook: corrupt where the bytes landed, unnoticed by checksums
                        tamper.corrupt([memoryview(r) for r in rows])
                    if msg.checksums is not None and not silent:
                        bad = _bad_checksum(msg, rows, li * n_blocks + j)
                        if bad is not None:
                            raise refuse(bad)
                    ok = True
                finally:
                    nvme = conn.bounce(target.nvme_pos.size * slot).reshape(-1, slot) if ok else None
                    try:
                        self.store.end_write(target, nvme, ok=ok)
                    except OSError as exc:
                        if ok:  # (otherwise the error on its way out says more)
                            raise refuse(TransferError(FailureCause.STORE_FULL,
                                                       f"landing store write failed: {exc}")) from None

    def _receive_rows(self, sock: socket.socket, target: WriteTarget, conn: ConnectionState,
                      deadline: float, unread: list[int], row_bytes: int) -> list[np.ndarray]:
        """Read the target's rows, in order, into their DRAM slots (a run of consecutive slots in one
        read) or, for NVMe rows, the connection's lent buffer; returns the rows, in order. Rows
        shorter than a slot (head fragments) land in each slot's first `row_bytes`, one read each."""
        slot = self.store.slot_bytes
        segments = [(pos, target.slots[first:first + count]) for pos, first, count in target.dram_runs]
        if target.nvme_pos.size:
            bounce = conn.bounce(target.nvme_pos.size * slot).reshape(-1, slot)
            segments += [(int(target.nvme_pos[i]), bounce[i:i + count])
                         for i, _, count in runs(target.nvme_pos)]
        rows: list[np.ndarray] = []
        for _, seg in sorted(segments, key=lambda s: s[0]):
            if row_bytes != slot:  # a fragment's slot tails: never another transfer's old bytes
                seg[:, row_bytes:] = 0
            parts = [seg.reshape(-1)] if row_bytes == slot else [row[:row_bytes] for row in seg]
            for part in parts:
                try:
                    wire.recv_exact(sock, memoryview(part), deadline)
                except TransferError as exc:  # the stream itself broke
                    raise HungUp(exc) from None
                unread[0] -= part.nbytes
            rows.extend(seg if row_bytes == slot else parts)
        return rows

    def land(self, msg: wire.Push, buf: np.ndarray, label: str) -> None:
        """Verify, reserve and write one group that arrived over the path `label` (bytes counted
        per path)."""
        silent = tamper.kind_of(msg.transfer_id, self.test_hooks) == "corrupt"
        if silent:  # test hook: corrupt where the push delivered the bytes, unnoticed by checksums
            tamper.corrupt(buf)
        if msg.checksums is not None and not silent:
            bad = _bad_checksum(msg, buf, 0)
            if bad is not None:
                raise bad
        landed = buf.nbytes
        if buf.shape[1] != self.store.slot_bytes:  # head fragment rows: each in a slot's first bytes
            whole = np.zeros((buf.shape[0], self.store.slot_bytes), np.uint8)
            whole[:, :buf.shape[1]] = buf
            buf = whole
        try:
            self.store.reserve(msg.transfer_id, msg.layers, msg.first_block, buf.shape[0])
            self.store.write(msg.transfer_id, msg.layers, msg.first_block, buf)  # the group in one call
        except StoreFullError as exc:
            raise TransferError(FailureCause.STORE_FULL, f"landing store: {exc.detail}") from None
        except OSError as exc:
            raise TransferError(FailureCause.STORE_FULL, f"landing store write failed: {exc}") from None
        except (ValueError, IndexError) as exc:  # e.g. sealed meanwhile, or a bound the checks missed
            raise TransferError(FailureCause.PROTOCOL, f"pushed transfer {msg.transfer_id!r}: {exc}") from None
        self.entries.count_landed(msg.transfer_id, label, landed)


def _bad_checksum(msg: wire.Push, rows: Sequence[np.ndarray] | np.ndarray, base: int) -> TransferError | None:
    """The mismatch of the first of `rows` (the push's rows base, base+1, ...) whose xxh3 is not the
    producer's, or None."""
    for k, row in enumerate(rows):
        i = base + k
        got, want = xxhash.xxh3_64_intdigest(row), msg.checksums[i]
        if got != want:
            layer, block = msg.layers[i // msg.num_blocks], msg.first_block + i % msg.num_blocks
            return TransferError(FailureCause.CHECKSUM_MISMATCH, (
                f"pushed transfer {msg.transfer_id!r}: layer {layer} block {block} has checksum "
                f"{got:016x}, producer staged {want:016x}"))
    return None
