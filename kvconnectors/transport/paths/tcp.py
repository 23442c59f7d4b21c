"""tcp: the bytes travel on the control socket itself, right after their frame.

Pull (`TcpPull`, data_path "inline"): the source end streams the blocks after its ReadReply,
layer-major, a few views of contiguous arena runs per layer (or through a bounce buffer from the
tiers, for an entry spilled to NVMe); the sink end receives them straight into the destination
views, one recvmsg_into per layer, checking each layer's checksums behind the next.
`TcpHeadsPull` ("inline_heads") streams only some KV heads of each row, for a consumer of another
TP size. Push (`TcpPush`, "inline"): the sender's Push frame is followed by the group's bytes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from kvconnectors.errors import FailureCause, StoreFullError, TransferError
from kvconnectors.mover import block_shares
from kvconnectors.mover.checksums import checksum_mismatch
from kvconnectors.transport import wire
from kvconnectors.transport.protocol import INLINE, HungUp, hang_up

IOV_MAX = 1024  # Linux's limit on buffers per recvmsg


class TcpPull:
    """The bytes follow the ReadReply on the control socket, layer-major, block order."""
    name, label, streams = INLINE, "tcp", True

    def read_into(self, sock, peer, read, reply, dest, *, deadline, sums, dest_addrs=None) -> int:
        slot = len(dest[0])
        if reply.nbytes != slot * len(dest):
            raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                f"producer {peer} offers {reply.nbytes} bytes, expected {slot * len(dest)}"))
        _recv_scattered(sock, read.transfer_id, dest, read.num_blocks, deadline, sums)
        return reply.nbytes

    def serve(self, ctx, sock, read, nvme_slots, ttl, checksums, outgoing=None) -> None:
        store = ctx.store
        if nvme_slots:
            # Spilled: stream it from the tiers through a bounce buffer rather than promote the
            # whole entry into DRAM first; it is read once and then released.
            self._send(ctx, sock, read, ttl, checksums, outgoing, _layers_from_tiers(store, read))
            return
        last = read.first_block + read.num_blocks
        with ExitStack() as pinned:
            try:
                pv = pinned.enter_context(store.pinned_views(read.transfer_id, read.layers))
            except StoreFullError:
                # Spilled to NVMe since the caller looked, and DRAM has no room to bring it back:
                # stream it from the tiers instead (nothing has been sent yet).
                self._send(ctx, sock, read, ttl, checksums, outgoing, _layers_from_tiers(store, read))
                return
            # a few views of contiguous arena runs per layer, not one per block (cheaper to build)
            layers = (pv.run_views(layer, read.first_block, last) for layer in read.layers)
            self._send(ctx, sock, read, ttl, checksums, outgoing, layers)

    @staticmethod
    def _send(ctx, sock, read, ttl, checksums, outgoing, layers, slot: int | None = None) -> None:
        slot = slot or ctx.store.slot_bytes  # bytes per (layer, block) on the wire
        nbytes = len(read.layers) * read.num_blocks * slot
        wire.send_msg(sock, wire.ReadReply(ok=True, nbytes=nbytes, checksums=checksums, lease_ttl_s=ttl))
        sent = 0
        try:
            for blocks in (outgoing(layers, nbytes, slot) if outgoing else layers):
                wire.send_all(sock, blocks)
                sent += sum(len(b) for b in blocks)
        except HungUp:
            hang_up(sock)
            return
        except TransferError as exc:
            # The OK reply is out and bytes may have followed: an error frame now would be read as
            # KV bytes. Hang up instead; the consumer sees a short stream (peer_unreachable).
            ctx.log.warning("read of %s failed after %d of %d bytes: %s", read.transfer_id, sent, nbytes, exc)
            hang_up(sock)
            return
        ctx.count_read(nbytes)

    def close(self) -> None:
        pass


class TcpHeadsPull(TcpPull):
    """tcp, some KV heads of each row: a consumer rank of a larger TP size keeps only a slice of
    this producer rank's heads, so only that slice travels (P TP 1 -> D TP 2: half the bytes). The
    server reads each row, checks it against the checksum it was staged with (what the consumer
    would have checked: corruption in the store still fails the read, as checksum_mismatch),
    packs the heads (rows of the same layout with fewer heads) and streams them, with xxh3
    checksums of the packed rows for the consumer to verify: `mover.reslice.pack_checked_heads`,
    the same check, pack and rehash as a sliced push. Offered by a producer whose rows can be
    sliced (`row_layout`); a server without it refuses the read in step, and the consumer reads
    whole rows instead."""
    name = "inline_heads"

    def __init__(self, row_layout: Any):
        self.row_layout = row_layout  # mover.reslice.RowLayout of this producer rank's rows

    def serve(self, ctx, sock, read, nvme_slots, ttl, checksums, outgoing=None) -> None:
        from kvconnectors.mover.heads import HeadRange  # imports torch: only producers that slice
        from kvconnectors.mover.reslice import pack_checked_heads

        rl, n = self.row_layout, read.num_blocks
        if read.heads is None or len(read.heads) != 2 or not 0 <= read.heads[0] < read.heads[1] <= rl.heads:
            raise TransferError(FailureCause.PROTOCOL, f"heads {read.heads!r}: need [start, stop) within this "
                                                       f"producer rank's {rl.heads} KV heads")
        heads = HeadRange(*read.heads)
        rows = np.empty((n, ctx.store.slot_bytes), dtype=np.uint8)
        packed: list[np.ndarray] = []
        sums: list[int] | None = None if checksums is None else []
        for i, layer in enumerate(read.layers):
            ctx.store.read_into(read.transfer_id, layer, read.first_block, rows)
            staged = None if checksums is None else checksums[i * n:(i + 1) * n]
            out, out_sums = pack_checked_heads(rows, rl, heads, staged, read.transfer_id, first=i * n,
                                               of=None if checksums is None else len(checksums))
            packed.append(out)
            if sums is not None:
                sums.extend(out_sums)
        # the whole read is packed before the reply: its checksums lead the bytes
        self._send(ctx, sock, read, ttl, sums, outgoing, ([memoryview(p.reshape(-1))] for p in packed),
                   slot=packed[0].shape[1])


def _layers_from_tiers(store, read: wire.Read) -> Iterator[list[memoryview]]:
    buf = np.empty((read.num_blocks, store.slot_bytes), dtype=np.uint8)
    for layer in read.layers:
        store.read_into(read.transfer_id, layer, read.first_block, buf)
        yield [memoryview(buf.reshape(-1))]  # sent before the next layer overwrites buf


def _recv_scattered(sock: socket.socket, transfer_id: str, dest: Sequence[memoryview], per_layer: int,
                    deadline: float, sums: list[int] | None) -> None:
    """Receive the blocks straight into `dest`, one recvmsg_into per layer (partial receives
    resume where they stopped); each layer's checksums are checked on another thread as soon as
    it has landed, while the next layer arrives (mover/block_shares.CheckBehind); the lowest
    mismatching block fails the read once every byte is in.

    Few large reads instead of one per block: every socket call gives up the GIL, and taking it
    back behind a busy engine thread costs up to a switch interval (5 ms) each time.
    """
    total, got = len(dest[0]) * len(dest), 0
    behind = block_shares.CheckBehind(sums) if sums is not None else None
    try:
        for start in range(0, len(dest), per_layer):
            layer = dest[start:start + per_layer]
            for i in range(0, len(layer), IOV_MAX):
                got = _recv_views(sock, list(layer[i:i + IOV_MAX]), deadline, got, total)
            if behind is not None:
                behind.add(start, layer)
        bad = behind.first_mismatch() if behind is not None else None
    finally:
        if behind is not None:
            behind.close()
    if bad is not None:
        raise checksum_mismatch(transfer_id, bad, len(dest), dest[bad], sums[bad])


def _recv_views(sock: socket.socket, views: list[memoryview], deadline: float, got: int, total: int) -> int:
    """Fill `views` (at most IOV_MAX) from the socket with recvmsg_into; `got` of `total` bytes of
    the whole read arrived before (for the messages). Same deadline semantics as wire.recv_exact:
    the deadline bounds the whole read. Returns the new `got`."""
    i = 0
    while i < len(views):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError(FailureCause.TIMEOUT, f"peer sent {got} of {total} bytes before the deadline")
        sock.settimeout(left)
        try:
            k = sock.recvmsg_into(views[i:])[0]
        except socket.timeout:
            raise TransferError(FailureCause.TIMEOUT, f"peer sent {got} of {total} bytes before the deadline") from None
        except OSError as exc:
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"connection lost after {got} of {total} bytes: {exc}") from None
        if k == 0:
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"peer closed the connection after {got} of {total} bytes")
        got += k
        while k:  # skip the views filled; trim a partly filled one
            n = len(views[i])
            if k < n:
                views[i] = views[i][k:]
                break
            k -= n
            i += 1
    return got


class TcpPush:
    """The group's bytes follow the Push frame, layer-major."""
    name, label, streams = INLINE, "push_tcp", True

    def send(self, push_frame, head, pv, layers, first, last, nbytes, deadline) -> None:
        views = [v for layer in layers for v in pv.run_views(layer, first, last)]
        push_frame(wire.Push(**head, nbytes=nbytes), views, deadline)

    def check(self, push, rows, row_bytes) -> None:
        if push.nbytes != rows * row_bytes:
            raise TransferError(FailureCause.LAYOUT_MISMATCH,
                                f"push of {push.nbytes} bytes for {rows} blocks of {row_bytes} B")

    @contextmanager
    def receive(self, sock, push, row_bytes, bounce) -> Iterator[np.ndarray]:
        # row_bytes: a slot, or a head fragment's shorter row
        rows = len(push.layers) * push.num_blocks
        buf = bounce(rows * row_bytes).reshape(rows, row_bytes)
        try:
            wire.recv_exact(sock, memoryview(buf.reshape(-1)), time.monotonic() + 60)
        except TransferError as exc:  # the stream itself broke
            raise HungUp(exc) from None
        yield buf

    def close(self) -> None:
        pass


TCP_PULL, TCP_PUSH = TcpPull(), TcpPush()
TCP_HEADS_PULL = TcpHeadsPull(None)  # the consumer's end (a producer's server has its own, with its row layout)
