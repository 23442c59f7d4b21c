"""Data paths: how a transfer's bytes travel, one class per path, both ends of it in that class.

Pulls (a consumer reads a staged transfer, `PullPath`):
  TcpPull  "inline" - the bytes follow the ReadReply on the control socket
  ShmPull  "shm"    - the consumer copies them out of the producer's /dev/shm arena (same host)
  NixlPull "nixl"   - the consumer READs them through NIXL (UCX) from the producer's registered arena
  NixlDevicePull    - the same READ on the wire, straight into device (VRAM) KV blocks (label nixl_vram)
Pushes (a producer streams layer groups into a landing store, `PushPath`):
  TcpPush  "inline" - the bytes follow the Push frame
  NixlPush "nixl"   - the landing side READs them through NIXL from the sender's arena

`name` is the path's wire data_path, `label` the metric label of the bytes it carried, `streams`
whether those bytes travel on the control socket (then the connection is out of step while they are
partly sent, and fault injection can corrupt or cut them) rather than being fetched by the peer from
an arena the frame names by offsets. The control protocol (client.py, server.py, landing.py) asks the
path object for everything that differs, so adding or mocking a path is one class here.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, StoreFullError, TransferError
from kvconnectors.store.arena import SHM_DIR, ArenaRefused, open_peer_arena
from kvconnectors.store.config import _NAME_RE as SHM_NAME_RE  # a store's shm_name: its arena's file name
from kvconnectors.transport import block_shares, wire
from kvconnectors.transport.nixl_device import DeviceRows, merge_runs

if TYPE_CHECKING:
    from kvconnectors.transport.client import StoreClient
    from kvconnectors.transport.landing import ConnectionState, Landing
    from kvconnectors.transport.nixl import NixlSink, NixlSource
    from kvconnectors.transport.server import StoreServer

IOV_MAX = 1024  # Linux's limit on buffers per recvmsg
NIXL_BOUNCE_BYTES = 64 << 20       # landing side: registered once; larger pushes are READ in pieces
# A NIXL READ holds the landing side's one bounce buffer, so a stalled producer blocks every other
# producer's nixl pushes into this store: bound each READ by its size at a rate far below any link's.
NIXL_READ_FLOOR_S = 5.0
NIXL_READ_MIN_BYTES_PER_S = 50e6

# Blocks streamed layer group by layer group; a filter may change or cut them on the way (faults.py).
Outgoing = Callable[[Iterable[list[memoryview]], int, int], Iterator[list[memoryview]]]


class HungUp(Exception):
    """The connection must end now: its stream broke (`error`: what to record for the transfer)
    or a fault cut it on purpose (error None). Whoever holds the socket hangs up."""

    def __init__(self, error: TransferError | None = None):
        super().__init__(str(error) if error else "hung up")
        self.error = error


class PullPath(Protocol):
    name: str
    label: str
    streams: bool

    def read_into(self, sock: socket.socket, peer: str, read: wire.Read, reply: wire.ReadReply,
                  dest: Sequence[memoryview], *, deadline: float, sums: list[int] | None,
                  dest_addrs: np.ndarray | None = None) -> int:
        """Consumer: land the blocks `reply` offers into `dest` (layer-major), verify `sums` if
        given; bytes received. The client answers Release afterwards unless the path streams."""

    def serve(self, server: "StoreServer", sock: socket.socket, read: wire.Read, nvme_slots: int, ttl: float,
              checksums: list[int] | None, outgoing: Outgoing | None = None) -> None:
        """Producer: answer a validated, sealed Read with a ReadReply and the blocks (or where to find them)."""

    def close(self) -> None:
        """Release what the path holds (a NIXL agent)."""


class PushPath(Protocol):
    name: str
    label: str
    streams: bool

    def send(self, client: "StoreClient", head: dict[str, Any], pv: Any, layers: list[int], first: int,
             last: int, nbytes: int, deadline: float) -> None:
        """Sender: push blocks [first, last) of `layers` (pinned in `pv`) and wait for the Ack."""

    def check(self, landing: "Landing", push: wire.Push, rows: int) -> None:
        """Landing side: raise a TransferError if this push cannot land over this path."""

    def receive(self, landing: "Landing", sock: socket.socket, push: wire.Push,
                conn: "ConnectionState") -> ContextManager[np.ndarray]:
        """Landing side: the group's bytes, (rows, slot) uint8, valid inside the with-block."""

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


def trailing_bytes(push: wire.Push) -> int:
    """Bytes that follow this Push frame on the socket (to read or drain before the next frame)."""
    return push.nbytes if push.data_path == TcpPush.name else 0


def hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def block_checksum(view) -> int:
    return xxhash.xxh3_64_intdigest(view)


def verify_checksums(expected: Sequence[int], dest: Sequence[memoryview], transfer_id: str, *,
                     first: int = 0, of: int | None = None, addrs: np.ndarray | None = None) -> None:
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


# ====================================================================== pull: tcp
class TcpPull:
    """The bytes follow the ReadReply on the control socket, layer-major, block order."""
    name, label, streams = "inline", "tcp", True

    def read_into(self, sock, peer, read, reply, dest, *, deadline, sums, dest_addrs=None) -> int:
        slot = len(dest[0])
        if reply.nbytes != slot * len(dest):
            raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                f"producer {peer} offers {reply.nbytes} bytes, expected {slot * len(dest)}"))
        _recv_scattered(sock, read.transfer_id, dest, read.num_blocks, deadline, sums)
        return reply.nbytes

    def serve(self, server, sock, read, nvme_slots, ttl, checksums, outgoing=None) -> None:
        store = server.store
        if nvme_slots:
            # Spilled: stream it from the tiers through a bounce buffer rather than promote the
            # whole entry into DRAM first; it is read once and then released.
            self._send(server, sock, read, ttl, checksums, outgoing, _layers_from_tiers(store, read))
            return
        last = read.first_block + read.num_blocks
        with ExitStack() as pinned:
            try:
                pv = pinned.enter_context(store.pinned_views(read.transfer_id, read.layers))
            except StoreFullError:
                # Spilled to NVMe since the caller looked, and DRAM has no room to bring it back:
                # stream it from the tiers instead (nothing has been sent yet).
                self._send(server, sock, read, ttl, checksums, outgoing, _layers_from_tiers(store, read))
                return
            # a few views of contiguous arena runs per layer, not one per block (cheaper to build)
            layers = (pv.run_views(layer, read.first_block, last) for layer in read.layers)
            self._send(server, sock, read, ttl, checksums, outgoing, layers)

    @staticmethod
    def _send(server, sock, read, ttl, checksums, outgoing, layers, slot: int | None = None) -> None:
        slot = slot or server.store.slot_bytes  # bytes per (layer, block) on the wire
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
            server.log_failed_read(read, sent, nbytes, exc)
            hang_up(sock)
            return
        server.count_read(nbytes)

    def close(self) -> None:
        pass


class TcpHeadsPull(TcpPull):
    """tcp, some KV heads of each row: a consumer rank of a larger TP size keeps only a slice of
    this producer rank's heads, so only that slice travels (P TP 1 -> D TP 2: half the bytes). The
    server reads each row, checks it against the checksum it was staged with (what the consumer
    would have checked: corruption in the store still fails the read, as checksum_mismatch),
    packs the heads (`mover.reslice.pack_heads`: rows of the same layout with fewer heads) and
    streams them, with xxh3 checksums of the packed rows for the consumer to verify. Offered by a
    producer whose rows can be sliced (`row_layout`); a server without it refuses the read in
    step, and the consumer reads whole rows instead."""
    name = "inline_heads"

    def __init__(self, row_layout: Any):
        self.row_layout = row_layout  # mover.reslice.RowLayout of this producer rank's rows

    def serve(self, server, sock, read, nvme_slots, ttl, checksums, outgoing=None) -> None:
        from kvconnectors.mover.heads import HeadRange  # imports torch: only producers that slice
        from kvconnectors.mover.reslice import pack_heads

        rl, n = self.row_layout, read.num_blocks
        if read.heads is None or len(read.heads) != 2 or not 0 <= read.heads[0] < read.heads[1] <= rl.heads:
            raise TransferError(FailureCause.PROTOCOL, f"heads {read.heads!r}: need [start, stop) within this "
                                                       f"producer rank's {rl.heads} KV heads")
        heads = HeadRange(*read.heads)
        rows = np.empty((n, server.store.slot_bytes), dtype=np.uint8)
        packed: list[np.ndarray] = []
        sums: list[int] | None = None if checksums is None else []
        for i, layer in enumerate(read.layers):
            server.store.read_into(read.transfer_id, layer, read.first_block, rows)
            if checksums is not None:
                verify_checksums(checksums[i * n:(i + 1) * n], [memoryview(r) for r in rows], read.transfer_id,
                                 first=i * n, of=len(checksums))
            packed.append(pack_heads(rows, rl, heads))
            if sums is not None:
                sums.extend(block_checksum(memoryview(r)) for r in packed[-1])
        # the whole read is packed before the reply: its checksums lead the bytes
        self._send(server, sock, read, ttl, sums, outgoing, ([memoryview(p.reshape(-1))] for p in packed),
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
    it has landed, while the next layer arrives (block_shares.CheckBehind); the lowest
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


# ====================================================================== pull: arena offsets (shm, nixl)
class _ArenaPull:
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

    def serve(self, server, sock, read, nvme_slots, ttl, checksums, outgoing=None) -> None:
        last = read.first_block + read.num_blocks
        with server.store.pinned_views(read.transfer_id, read.layers) as pv:
            offsets = np.concatenate([pv.offsets(layer)[read.first_block:last] for layer in read.layers]).tolist()
            nbytes = len(offsets) * pv.slot_bytes
            wire.send_msg(sock, wire.ReadReply(ok=True, checksums=checksums, offsets=offsets, lease_ttl_s=ttl,
                                               **self.reply_fields(pv)))
            deadline = time.monotonic() + server.idle_timeout_s
            try:
                self.progress(sock, deadline)
                done = wire.recv_msg(sock, deadline)
            except TransferError as exc:
                # The consumer vanished or stalled mid-read: the reply stream is out of step, so drop
                # the connection (the with-block unpins; the lease decides the entry's fate).
                server.counters.reject(exc.cause.value)
                server.log_unreleased(read, self.name, sock, exc)
                hang_up(sock)
                return
        # Unpinned before the answer is handled: a Release then frees the slots before its Ack, so a
        # producer told "released" has the room back (answered inside the pin, the slots came back
        # only after the Ack, and a stage right after it could find the store full).
        server.finish_offset_read(sock, read, self.name, done, nbytes)


class ShmPull(_ArenaPull):
    """One copy per block out of the producer's /dev/shm arena (same host).

    `arena`: the arena the ticket names for this producer rank (tiered.params.shm_arena). A reply
    naming any other (another live store of this host: another request's KV) is refused before
    anything is mapped; "" (the ticket names none) refuses every reply. None: unbound (the
    producer's end, which only answers, and readers of a trusted reply)."""
    name = label = "shm"

    def __init__(self, arena: str | None = None):
        self.arena = arena

    def reply_fields(self, pv) -> dict[str, Any]:
        return {"shm_path": pv.shm_path or ""}

    def read_into(self, sock, peer, read, reply, dest, *, deadline, sums, dest_addrs=None) -> int:
        """One copy per block out of the producer's arena (mapped once per arena, see _shm_arena),
        each block hashed right after its copy, while it is still in cache (the slot, or the
        destination: see block_shares.copy_blocks), in parallel shares (block_shares.py). The
        reply's shm_path is the producer's word: only a live store's arena under SHM_DIR is opened
        (see _shm_arena), and its offsets are checked before anything is copied."""
        if not reply.offsets or len(reply.offsets) != len(dest):
            raise TransferError(FailureCause.PROTOCOL, "shm reply without one offset per block")
        if self.arena is not None and reply.shm_path != self.arena:
            raise _shm_refused(str(reply.shm_path)[:200], peer, (
                "is not the arena its ticket names" + (f" ({self.arena})" if self.arena else
                                                       ": the ticket names no shm arena for this producer rank")))
        slot = dest[0].nbytes
        arena = _shm_arena(reply.shm_path, slot, len(dest), deadline, peer)
        bad = block_shares.copy_blocks(arena, reply.offsets, dest, sums, slot, dest_addrs)
        if bad is not None:
            raise checksum_mismatch(read.transfer_id, bad, len(dest), dest[bad], sums[bad])
        return slot * len(dest)


class NixlPull(_ArenaPull):
    """The consumer READs the blocks through NIXL. A consumer passes its agent (`sink`, whose
    registered memory holds every destination view), a producer its arena's (`source`)."""
    name = label = "nixl"

    def __init__(self, *, sink: "NixlSink | None" = None, source: "NixlSource | None" = None):
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


class NixlDevicePull(NixlPull):
    """GPU-direct: the consumer READs the blocks straight into its device KV cache, registered
    with its agent as VRAM (nixl_device.py). On the wire it is a nixl pull (the producer serves
    it the same way); its bytes are counted under `nixl_vram`. `dest` is a DeviceRows, not views.
    It cannot verify checksums (no host copy of the rows exists): asked to, it refuses the read
    rather than skip the check. NOT VALIDATED ON HARDWARE (nixl_device.CUDA_VALIDATED)."""
    label = "nixl_vram"

    def read_into(self, sock, peer, read, reply, dest, *, deadline, sums, dest_addrs=None) -> int:
        if not isinstance(dest, DeviceRows):
            raise TransferError(FailureCause.PROTOCOL, f"a GPU-direct nixl read needs DeviceRows, got "
                                                       f"{type(dest).__name__}")
        if sums is not None:
            raise TransferError(FailureCause.PROTOCOL, (
                "the GPU-direct nixl path cannot verify checksums (they are computed on host rows); "
                "a consumer that verifies uses the host path"))
        self._check_reply(peer, reply, dest)
        remote = np.uint64(reply.nixl_base_address) + np.asarray(reply.offsets, dtype=np.uint64)
        local, remote, lengths = merge_runs(dest.addrs, remote, dest.row_bytes)
        # returns only once NIXL says DONE: the bytes are in the device blocks when the load is reported
        return self.sink.read_runs(peer, reply.nixl_agent_meta, remote, local, lengths, deadline,
                                   mem="VRAM", device=dest.device)


TCP_PULL, SHM_PULL = TcpPull(), ShmPull()
TCP_HEADS_PULL = TcpHeadsPull(None)  # the consumer's end (a producer's server has its own, with its row layout)


# ====================================================================== push: tcp
class TcpPush:
    """The group's bytes follow the Push frame, layer-major."""
    name, label, streams = "inline", "push_tcp", True

    def send(self, client, head, pv, layers, first, last, nbytes, deadline) -> None:
        views = [v for layer in layers for v in pv.run_views(layer, first, last)]
        client.push(wire.Push(**head, nbytes=nbytes), views, deadline)

    def check(self, landing, push, rows) -> None:
        row = landing.row_bytes(push)
        if push.nbytes != rows * row:
            raise TransferError(FailureCause.LAYOUT_MISMATCH,
                                f"push of {push.nbytes} bytes for {rows} blocks of {row} B")

    @contextmanager
    def receive(self, landing, sock, push, conn) -> Iterator[np.ndarray]:
        slot = landing.row_bytes(push)  # a slot, or a head fragment's shorter row
        rows = len(push.layers) * push.num_blocks
        buf = conn.bounce(rows * slot).reshape(rows, slot)
        try:
            wire.recv_exact(sock, memoryview(buf.reshape(-1)), time.monotonic() + 60)
        except TransferError as exc:  # the stream itself broke
            raise HungUp(exc) from None
        yield buf

    def close(self) -> None:
        pass


# ====================================================================== push: nixl
class NixlPush:
    """The landing side READs the group from the sender's arena. The sender passes its arena's
    agent (`source`); the landing side a factory for its agent (`sink_factory`), made at the first
    nixl push with one bounce buffer registered for its life."""
    name, label, streams = "nixl", "push_nixl", False

    def __init__(self, *, source: "NixlSource | None" = None, sink_factory: Callable[[], Any] | None = None):
        self.source, self._sink_factory = source, sink_factory
        self._sink: Any = None
        self._bounce: np.ndarray | None = None
        self._lock = threading.Lock()

    def send(self, client, head, pv, layers, first, last, nbytes, deadline) -> None:
        assert self.source is not None, "a nixl push sender needs its NixlSource"
        offsets = np.concatenate([pv.offsets(layer)[first:last] for layer in layers]).tolist()
        msg = wire.Push(**head, data_path=self.name, offsets=offsets, nixl_agent_meta=self.source.metadata,
                        nixl_base_address=self.source.base_address)
        client.push(msg, (), deadline, progress=self.source.serve_until_readable)

    def check(self, landing, push, rows) -> None:
        if self._sink_factory is None:
            raise TransferError(FailureCause.PROTOCOL, f"push data_path 'nixl' {PUSH_UNOFFERED['nixl']}")
        if not push.offsets or len(push.offsets) != rows or push.nixl_base_address <= 0:
            raise TransferError(FailureCause.PROTOCOL, "nixl push without one offset per block")

    @contextmanager
    def receive(self, landing, sock, push, conn) -> Iterator[np.ndarray]:
        """READ the blocks into the one registered bounce buffer (in pieces when larger; then
        gathered into a plain buffer): one registration for the landing store's life."""
        slot = landing.store.slot_bytes
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


TCP_PUSH = TcpPush()


def read_deadline(nbytes: int) -> float:
    """When a NIXL READ of `nbytes` into the landing bounce buffer must have finished."""
    return time.monotonic() + min(60.0, NIXL_READ_FLOOR_S + nbytes / NIXL_READ_MIN_BYTES_PER_S)


# ====================================================================== shm arena mappings (consumer)
# Read-only mappings of producers' shm arenas, kept across pulls: mapping (and faulting in) a
# 256 MiB arena costs tens of ms per pull. path -> ((dev, inode, size), memoryview of the mapping)
_SHM_MAX_ARENAS = 8
_shm_arenas: OrderedDict[str, tuple[tuple[int, int, int], memoryview]] = OrderedDict()
_shm_lock = threading.Lock()


def _shm_refused(path: str, peer: str, why: str) -> TransferError:
    return TransferError(FailureCause.PROTOCOL, f"producer {peer} named shm arena {path!r}, which {why}; "
                                                "refusing to read it")


def _shm_arena(path: str, slot: int, nblocks: int, deadline: float, peer: str = "?") -> memoryview:
    """The mapping of the arena at `path`, made once (MAP_POPULATE: no page fault per pull) and made
    again when the file changed (a restarted producer). Mappings of arenas that are gone are dropped
    (a mapping would keep an unlinked arena's memory alive), and the least recently used beyond
    _SHM_MAX_ARENAS. Dropped mappings are unmapped once no pull still copies from them.

    `path` comes from the producer, so it is checked before anything is mapped (issue 16, finding 8):
    it must be SHM_DIR/<name> with a store's shm_name (no other directory, no ".."); the name must
    be a regular file (lstat: a symlink, FIFO, device, socket or directory is refused unopened); it
    is opened with O_NOFOLLOW | O_NONBLOCK (a swap since the lstat neither follows a link nor
    blocks), and what was opened must again be a regular file (fstat), owned by this process's user
    (a store creates its arena 0600), whose size is whole `slot`-byte slots and at least the
    `nblocks` slots this read needs, and whose exclusive lock is held (store/arena.py: a live
    store's arena; any other file in SHM_DIR is not). All before `deadline`. Every refusal is a
    typed TransferError (protocol), and nothing of the file is read. What this cannot tell apart:
    another live store's arena of the same user on this host (see the README's shm threat model)."""
    if time.monotonic() >= deadline:
        raise TransferError(FailureCause.TIMEOUT, "the load deadline passed before the shm arena was opened")
    name = os.path.basename(path) if isinstance(path, str) else ""
    if (not isinstance(path, str) or os.path.dirname(path) != SHM_DIR or not SHM_NAME_RE.match(name)
            or name in (".", "..")):
        raise _shm_refused(str(path), peer, f"is not {SHM_DIR}/<name> with a store's shm_name "
                                            "(1-64 characters of [A-Za-z0-9_.])")
    with _shm_lock:
        for other in list(_shm_arenas):
            if other != path and _file_id(other) != _shm_arenas[other][0]:
                del _shm_arenas[other]
        ident = _file_id(path)
        cached = _shm_arenas.get(path)
        if cached is not None and cached[0] == ident:
            _shm_arenas.move_to_end(path)
            return cached[1]
        _shm_arenas.pop(path, None)
        try:  # store/arena.py checks what the name is before opening it, then what was opened
            fd, st = open_peer_arena(path, slot=slot, min_bytes=slot * max(1, nblocks))
        except ArenaRefused as exc:
            raise _shm_refused(path, peer, exc.why) from None
        except OSError as exc:
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"cannot open the producer's shm arena {path}: {exc.strerror}") from None
        try:
            if time.monotonic() >= deadline:
                raise TransferError(FailureCause.TIMEOUT, "the load deadline passed while opening the shm arena")
            arena = memoryview(mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                         prot=mmap.PROT_READ))
        except (OSError, ValueError) as exc:  # ValueError: an empty file
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"cannot map the producer's shm arena {path}: {exc}") from None
        finally:
            os.close(fd)
        _shm_arenas[path] = ((st.st_dev, st.st_ino, st.st_size), arena)
        while len(_shm_arenas) > _SHM_MAX_ARENAS:
            _shm_arenas.popitem(last=False)
        return arena


def _file_id(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)  # a symlink swapped in for a mapped arena is a different file
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size
