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

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import auth, wire


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
        if isinstance(msg, kind):
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
             *, fingerprint: str, deadline: float, verify: bool = True, data_path: str = "inline") -> int:
        """Pull blocks [first_block, first_block + len(dest) / len(layers)) of `layers` into
        `dest` (one writable view per (layer, block), layer-major). Returns bytes received."""
        num_blocks = len(dest) // len(layers)
        wire.send_msg(self.sock, wire.Read(transfer_id=transfer_id, layers=list(layers), first_block=first_block,
                                           num_blocks=num_blocks, fingerprint=fingerprint, data_path=data_path))
        reply = self._expect(wire.ReadReply, deadline)
        if data_path == "shm":
            nbytes = self._copy_from_shm(reply, dest)
            wire.send_msg(self.sock, wire.Release(transfer_id=transfer_id))
            self._expect(wire.Ack, deadline)
        else:
            slot = len(dest[0])
            if reply.nbytes != slot * len(dest):
                raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                    f"producer {self.address} offers {reply.nbytes} bytes, expected {slot * len(dest)}"))
            for view in dest:
                wire.recv_exact(self.sock, view, deadline)
            nbytes = reply.nbytes
        if verify and reply.checksums is not None:
            verify_checksums(reply.checksums, dest, transfer_id)
        return nbytes

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


def block_checksum(view) -> int:
    return xxhash.xxh3_64_intdigest(view)


def verify_checksums(expected: Sequence[int], dest: Sequence[memoryview], transfer_id: str) -> None:
    for i, (want, view) in enumerate(zip(expected, dest)):
        got = block_checksum(view)
        if got != want:
            raise TransferError(FailureCause.CHECKSUM_MISMATCH, (
                f"transfer {transfer_id!r}: block {i} of {len(dest)} has checksum {got:016x}, "
                f"producer staged {want:016x}"))
