"""Consumer side of the control protocol: connect, authenticate, pull, renew, release.

Every call has a deadline; a dead or silent producer surfaces as a typed TransferError
(peer_unreachable / timeout), never as a hang.
"""

from __future__ import annotations

import mmap
import os
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import auth, wire

if TYPE_CHECKING:
    from kvconnectors.transport.nixl import NixlSink


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

    def _expect(self, kind: type, deadline: float):
        msg = wire.recv_msg(self.sock, deadline)
        if isinstance(msg, kind) and (kind is wire.Welcome or getattr(msg, "ok", True)):
            return msg
        if isinstance(msg, (wire.Ack, wire.ReadReply)) and not msg.ok:
            raise TransferError(FailureCause(msg.cause or "protocol"), f"producer {self.address}: {msg.message}")
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
             nixl: "NixlSink | None" = None) -> int:
        """Pull blocks [first_block, first_block + len(dest) / len(layers)) of `layers` into
        `dest` (one writable view per (layer, block), layer-major). Returns bytes received.
        data_path "nixl" READs through `nixl`, whose registered memory must hold every view."""
        num_blocks = len(dest) // len(layers)
        if data_path == "nixl" and nixl is None:
            raise TransferError(FailureCause.PROTOCOL, "data_path 'nixl' needs the consumer's NIXL agent (nixl=)")
        self._send(wire.Read(transfer_id=transfer_id, layers=list(layers), first_block=first_block,
                             num_blocks=num_blocks, fingerprint=fingerprint, data_path=data_path))
        reply = self._expect(wire.ReadReply, deadline)
        if data_path == "nixl":
            return self._read_nixl(nixl, transfer_id, reply, dest, deadline, verify)
        if data_path == "shm":
            nbytes = self._copy_from_shm(reply, dest)
            wire.send_msg(self.sock, wire.Release(transfer_id=transfer_id))
            self._expect(wire.Ack, deadline)
        else:
            slot = len(dest[0])
            if reply.nbytes != slot * len(dest):
                raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                    f"producer {self.address} offers {reply.nbytes} bytes, expected {slot * len(dest)}"))
            self._recv_scattered(dest, num_blocks, deadline)
            nbytes = reply.nbytes
        if verify and reply.checksums is not None:
            verify_checksums(reply.checksums, dest, transfer_id)
        return nbytes

    def _read_nixl(self, nixl: "NixlSink", transfer_id: str, reply: wire.ReadReply, dest: Sequence[memoryview],
                   deadline: float, verify: bool) -> int:
        """READ the blocks, verify, then Release; on failure answer Ack(ok=False) instead, so the
        producer stops serving this read and keeps the entry (a retry can still have it)."""
        try:
            if not reply.offsets or len(reply.offsets) != len(dest):
                raise TransferError(FailureCause.PROTOCOL,
                                    f"nixl reply from {self.address} without one offset per block")
            if not reply.nixl_agent_meta or reply.nixl_base_address <= 0:
                raise TransferError(FailureCause.PROTOCOL, f"nixl reply from {self.address} without agent metadata")
            nbytes = nixl.read_blocks(self.address, reply.nixl_agent_meta, reply.nixl_base_address, reply.offsets,
                                      dest, deadline)
            if verify and reply.checksums is not None:
                verify_checksums(reply.checksums, dest, transfer_id)
        except TransferError as exc:
            try:
                wire.send_msg(self.sock, wire.Ack(ok=False, cause=exc.cause.value, message=str(exc).split("] ", 1)[-1]))
            except OSError:
                pass
            raise
        self._send(wire.Release(transfer_id=transfer_id))
        self._expect(wire.Ack, deadline)
        return nbytes

    def _send(self, msg: wire.Message) -> None:
        try:
            wire.send_msg(self.sock, msg)
        except OSError as exc:  # EPIPE / ECONNRESET: the producer went away
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"connection to producer {self.address} lost: {exc.strerror or exc}") from None

    def _recv_scattered(self, dest: Sequence[memoryview], per_chunk: int, deadline: float) -> None:
        """Receive a chunk (one layer's blocks) per large recv, then scatter it into the blocks.

        One big read instead of one per block: every socket call gives up the GIL, and taking it
        back behind a busy engine thread costs up to a switch interval (5 ms) each time.
        """
        slot = len(dest[0])
        staging = np.empty(per_chunk * slot, dtype=np.uint8)
        for start in range(0, len(dest), per_chunk):
            wire.recv_exact(self.sock, memoryview(staging), deadline)
            rows = staging.reshape(per_chunk, slot)
            for i, view in enumerate(dest[start:start + per_chunk]):
                np.copyto(np.frombuffer(view, dtype=np.uint8), rows[i])

    def _copy_from_shm(self, reply: wire.ReadReply, dest: Sequence[memoryview]) -> int:
        if not reply.offsets or len(reply.offsets) != len(dest):
            raise TransferError(FailureCause.PROTOCOL, "shm reply without one offset per block")
        try:
            fd = os.open(reply.shm_path, os.O_RDONLY)
        except OSError as exc:
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"cannot open the producer's shm arena {reply.shm_path}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as arena:
                src = np.frombuffer(arena, dtype=np.uint8)
                slot = len(dest[0])
                for off, view in zip(reply.offsets, dest):
                    if not 0 <= off <= size - slot:
                        raise TransferError(FailureCause.PROTOCOL, f"shm offset {off} outside the arena")
                    np.copyto(np.frombuffer(view, dtype=np.uint8), src[off:off + slot])
                del src
        finally:
            os.close(fd)
        return slot * len(dest)

    def renew(self, transfer_ids: Sequence[str], deadline: float) -> wire.RenewReply:
        wire.send_msg(self.sock, wire.Renew(transfer_ids=list(transfer_ids)))
        return self._expect(wire.RenewReply, deadline)

    def release(self, transfer_id: str, deadline: float) -> None:
        wire.send_msg(self.sock, wire.Release(transfer_id=transfer_id))
        self._expect(wire.Ack, deadline)

    def status(self, deadline: float) -> wire.StatusReply:
        wire.send_msg(self.sock, wire.Status())
        return self._expect(wire.StatusReply, deadline)


def block_checksum(view) -> int:
    return xxhash.xxh3_64_intdigest(view)


def verify_checksums(expected: Sequence[int], dest: Sequence[memoryview], transfer_id: str) -> None:
    for i, (want, view) in enumerate(zip(expected, dest)):
        got = block_checksum(view)
        if got != want:
            raise TransferError(FailureCause.CHECKSUM_MISMATCH, (
                f"transfer {transfer_id!r}: block {i} of {len(dest)} has checksum {got:016x}, "
                f"producer staged {want:016x}"))


def store_status(host: str, port: int, *, secret: bytes | None = None, timeout_s: float = 5.0) -> wire.StatusReply:
    """Occupancy of a TieredConnector store server (entries, bytes per tier, connections)."""
    from kvconnectors.transport.auth import load_secret

    secret = secret if secret is not None else load_secret()
    with StoreClient(host, port, compat=wire.compat_hash("tiered"), secret=secret,
                     connect_timeout_s=timeout_s) as client:
        return client.status(time.monotonic() + timeout_s)
