"""Consumer side of the control protocol: connect, authenticate, pull, renew, release.

Every call has a deadline; a dead or silent producer surfaces as a typed TransferError
(peer_unreachable / timeout), never as a hang.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import auth, wire

if TYPE_CHECKING:
    from kvconnectors.transport.nixl import NixlSink

IOV_MAX = 1024  # Linux's limit on buffers per recvmsg


class StoreClient:
    def __init__(self, host: str, port: int, *, compat: str, secret: bytes | None = None,
                 connect_timeout_s: float = 5.0, peer_name: str = ""):
        self.address = f"{host}:{port}"
        try:
            self.sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except OSError as exc:
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"cannot connect to producer {self.address}: {exc.strerror or exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._handshake(compat, secret, peer_name, time.monotonic() + connect_timeout_s)
        except BaseException:
            self.close()
            raise

    def _handshake(self, compat: str, secret: bytes | None, peer_name: str, deadline: float) -> None:
        wire.send_msg(self.sock, wire.Hello(version=wire.PROTOCOL_VERSION, compat_hash=compat, peer=peer_name))
        welcome = self._expect(wire.Welcome, deadline)
        if not welcome.ok:
            raise TransferError(FailureCause.PROTOCOL, f"producer {self.address} refused: {welcome.error}")
        if welcome.nonce is None:
            return
        if secret is None:
            raise TransferError(FailureCause.AUTH, f"producer {self.address} requires a shared secret; "
                                                   f"none is configured here ({auth.SECRET_ENV} or secret_file)")
        wire.send_msg(self.sock, wire.Proof(mac=auth.prove(secret, welcome.nonce)))
        ack = self._expect(wire.Ack, deadline)
        if not ack.ok:
            raise TransferError(FailureCause.AUTH, f"producer {self.address}: {ack.message}")

    def _expect(self, kind: type, deadline: float, max_bytes: int = wire.MAX_CONTROL_BYTES):
        msg = wire.recv_msg(self.sock, deadline, max_bytes)
        if isinstance(msg, kind) and (kind is wire.Welcome or getattr(msg, "ok", True)):
            return msg
        if isinstance(msg, (wire.Ack, wire.ReadReply)) and not msg.ok:
            # answered in step: the peer said no, the connection is fine
            raise TransferError(_cause(msg.cause), f"peer {self.address}: {msg.message}", refused=True)
        raise TransferError(FailureCause.PROTOCOL, f"expected {kind.__name__} from {self.address}, "
                                                   f"got {type(msg).__name__}")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    def read(self, transfer_id: str, layers: Sequence[int], first_block: int, dest: Sequence[memoryview],
             *, fingerprint: str, deadline: float, verify: bool = True, data_path: str = "inline",
             nixl: "NixlSink | None" = None, dest_addrs: np.ndarray | None = None) -> int:
        """Pull blocks [first_block, first_block + len(dest) / len(layers)) of `layers` into
        `dest` (one writable view per (layer, block), layer-major). Returns bytes received.
        data_path "nixl" READs through `nixl`, whose registered memory must hold every view;
        `dest_addrs` (uint64, one per view) spares it taking each view's address."""
        num_blocks = len(dest) // len(layers)
        if data_path == "nixl" and nixl is None:
            raise TransferError(FailureCause.PROTOCOL, "data_path 'nixl' needs the consumer's NIXL agent (nixl=)")
        self._send(wire.Read(transfer_id=transfer_id, layers=list(layers), first_block=first_block,
                             num_blocks=num_blocks, fingerprint=fingerprint, data_path=data_path))
        # Checksums and offsets grow with the prompt: allow ~32 bytes per (layer, block) beyond the
        # usual control-frame limit, still bounded by what this read asked for.
        reply = self._expect(wire.ReadReply, deadline, wire.MAX_CONTROL_BYTES + 32 * len(dest))
        sums = reply.checksums if verify else None
        if data_path == "nixl":
            return self._then_release(transfer_id, deadline, lambda: self._read_nixl(
                nixl, transfer_id, reply, dest, dest_addrs, deadline, sums))
        if data_path == "shm":
            return self._then_release(transfer_id, deadline,
                                      lambda: self._copy_from_shm(transfer_id, reply, dest, sums))
        slot = len(dest[0])
        if reply.nbytes != slot * len(dest):
            raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                f"producer {self.address} offers {reply.nbytes} bytes, expected {slot * len(dest)}"))
        self._recv_scattered(transfer_id, dest, num_blocks, deadline, sums)
        return reply.nbytes

    def _then_release(self, transfer_id: str, deadline: float, pull) -> int:
        """shm / nixl: run `pull` (copy or READ, then verify), then Release. On failure answer
        Ack(ok=False) instead, so the producer stops serving this read and keeps the entry (a retry
        can still have it), and the connection stays in step."""
        try:
            nbytes = pull()
        except TransferError as exc:
            try:
                wire.send_msg(self.sock, wire.Ack(ok=False, cause=exc.cause.value, message=exc.detail))
            except OSError:
                pass
            raise
        self._send(wire.Release(transfer_id=transfer_id))
        self._expect(wire.Ack, deadline)
        return nbytes

    def _read_nixl(self, nixl: "NixlSink", transfer_id: str, reply: wire.ReadReply, dest: Sequence[memoryview],
                   dest_addrs: np.ndarray | None, deadline: float, sums: list[int] | None) -> int:
        if not reply.offsets or len(reply.offsets) != len(dest):
            raise TransferError(FailureCause.PROTOCOL, f"nixl reply from {self.address} without one offset per block")
        if not reply.nixl_agent_meta or reply.nixl_base_address <= 0:
            raise TransferError(FailureCause.PROTOCOL, f"nixl reply from {self.address} without agent metadata")
        nbytes = nixl.read_blocks(self.address, reply.nixl_agent_meta, reply.nixl_base_address, reply.offsets,
                                  dest, deadline, local_addrs=dest_addrs)
        if sums is not None:  # after the READ: NIXL hands over the bytes only once it is DONE
            verify_checksums(sums, dest, transfer_id)
        return nbytes

    def _send(self, msg: wire.Message) -> None:
        try:
            wire.send_msg(self.sock, msg)
        except OSError as exc:  # EPIPE / ECONNRESET: the producer went away
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"connection to producer {self.address} lost: {exc.strerror or exc}") from None

    def _recv_scattered(self, transfer_id: str, dest: Sequence[memoryview], per_layer: int, deadline: float,
                        sums: list[int] | None) -> None:
        """Receive the blocks straight into `dest`, one recvmsg_into per layer (partial receives
        resume where they stopped), and verify each layer's checksums as soon as it has landed.

        Few large reads instead of one per block: every socket call gives up the GIL, and taking it
        back behind a busy engine thread costs up to a switch interval (5 ms) each time.
        """
        total, got = len(dest[0]) * len(dest), 0
        for start in range(0, len(dest), per_layer):
            layer = dest[start:start + per_layer]
            for i in range(0, len(layer), IOV_MAX):
                got = _recv_views(self.sock, list(layer[i:i + IOV_MAX]), deadline, got, total)
            if sums is not None:
                verify_checksums(sums[start:start + per_layer], layer, transfer_id, first=start, of=len(dest))

    def _copy_from_shm(self, transfer_id: str, reply: wire.ReadReply, dest: Sequence[memoryview],
                       sums: list[int] | None) -> int:
        """One copy per block out of the producer's arena (mapped once per arena, see _shm_arena),
        each block hashed right after its copy, while it is still in cache."""
        if not reply.offsets or len(reply.offsets) != len(dest):
            raise TransferError(FailureCause.PROTOCOL, "shm reply without one offset per block")
        arena = _shm_arena(reply.shm_path)
        size, slot = len(arena), len(dest[0])
        for i, (off, view) in enumerate(zip(reply.offsets, dest)):
            if not 0 <= off <= size - slot:
                raise TransferError(FailureCause.PROTOCOL, f"shm offset {off} outside the arena")
            if view.format != "B":
                view = view.cast("B")
            view[:] = arena[off:off + slot]
            if sums is not None and block_checksum(view) != sums[i]:
                verify_checksums(sums[i:i + 1], [view], transfer_id, first=i, of=len(dest))
        return slot * len(dest)

    def renew(self, transfer_ids: Sequence[str], deadline: float, batch: int = 4096) -> wire.RenewReply:
        """Renew many leases, in frames of at most `batch` ids (the server's limit)."""
        out = wire.RenewReply(remaining={}, missing={})
        ids = list(transfer_ids)
        for i in range(0, len(ids), batch):
            wire.send_msg(self.sock, wire.Renew(transfer_ids=ids[i:i + batch]))
            reply = self._expect(wire.RenewReply, deadline)
            out.remaining.update(reply.remaining)
            out.missing.update(reply.missing)
        return out

    def release(self, transfer_id: str, deadline: float) -> None:
        wire.send_msg(self.sock, wire.Release(transfer_id=transfer_id))
        self._expect(wire.Ack, deadline)

    def push(self, msg: wire.Push, data: Sequence[memoryview], deadline: float,
             progress: "Callable[[socket.socket, float], None] | None" = None) -> None:
        """Push one layer group into the peer's landing store and wait for its Ack. `data`: the
        bytes for data_path "inline" (layer-major, msg.nbytes in all); for "nixl" the peer READs
        from our arena meanwhile, and `progress(sock, deadline)` serves that until it answers."""
        from kvconnectors.transport.server import send_all  # noqa: PLC0415 - shared gather-send

        self._send(msg)
        if data:
            self.sock.settimeout(max(1e-3, deadline - time.monotonic()))
            try:
                send_all(self.sock, list(data))
            except socket.timeout:
                raise TransferError(FailureCause.TIMEOUT, f"push to {self.address} stalled") from None
            except OSError as exc:
                raise TransferError(FailureCause.PEER_UNREACHABLE,
                                    f"connection to {self.address} lost mid-push: {exc.strerror or exc}") from None
        if progress is not None:
            progress(self.sock, deadline)
        self._expect(wire.Ack, deadline)

    def push_end(self, transfer_id: str, deadline: float, error: TransferError | None = None) -> None:
        if error is None:
            self._send(wire.PushEnd(transfer_id=transfer_id))
        else:
            self._send(wire.PushEnd(transfer_id=transfer_id, ok=False, cause=error.cause.value,
                                    message=error.detail))
        self._expect(wire.Ack, deadline)

    def locate(self, transfer_id: str, deadline: float) -> wire.LocateReply:
        self._send(wire.Locate(transfer_id=transfer_id))
        return self._expect(wire.LocateReply, deadline)

    def status(self, deadline: float) -> wire.StatusReply:
        wire.send_msg(self.sock, wire.Status())
        return self._expect(wire.StatusReply, deadline)


def _cause(name: str) -> FailureCause:
    """A peer's cause string; one this version does not know (a newer peer) reads as protocol."""
    try:
        return FailureCause(name or "protocol")
    except ValueError:
        return FailureCause.PROTOCOL


def block_checksum(view) -> int:
    return xxhash.xxh3_64_intdigest(view)


def verify_checksums(expected: Sequence[int], dest: Sequence[memoryview], transfer_id: str, *,
                     first: int = 0, of: int | None = None) -> None:
    """`dest` are blocks first.. of a transfer of `of` blocks (default: just these)."""
    for i, (want, view) in enumerate(zip(expected, dest), first):
        got = block_checksum(view)
        if got != want:
            raise TransferError(FailureCause.CHECKSUM_MISMATCH, (
                f"transfer {transfer_id!r}: block {i} of {of or len(dest)} has checksum {got:016x}, "
                f"producer staged {want:016x}"))


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


# Read-only mappings of producers' shm arenas, kept across pulls: mapping (and faulting in) a
# 256 MiB arena costs tens of ms per pull. path -> ((dev, inode, size), memoryview of the mapping)
_SHM_MAX_ARENAS = 8
_shm_arenas: OrderedDict[str, tuple[tuple[int, int, int], memoryview]] = OrderedDict()
_shm_lock = threading.Lock()


def _shm_arena(path: str) -> memoryview:
    """The mapping of the arena at `path`, made once (MAP_POPULATE: no page fault per pull) and made
    again when the file changed (a restarted producer). Mappings of arenas that are gone are dropped
    (a mapping would keep an unlinked arena's memory alive), and the least recently used beyond
    _SHM_MAX_ARENAS. Dropped mappings are unmapped once no pull still copies from them."""
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
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"cannot open the producer's shm arena {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)  # the file we opened, which may differ from the one stat'ed above
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
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size


def store_status(host: str, port: int, *, secret: bytes | None = None, timeout_s: float = 5.0) -> wire.StatusReply:
    """Occupancy of a TieredConnector store server (entries, bytes per tier, connections)."""
    from kvconnectors.transport.auth import load_secret

    secret = secret if secret is not None else load_secret()
    with StoreClient(host, port, compat=wire.compat_hash("tiered"), secret=secret,
                     connect_timeout_s=timeout_s) as client:
        return client.status(time.monotonic() + timeout_s)
