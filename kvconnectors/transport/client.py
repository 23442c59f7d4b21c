"""Consumer side of the control protocol: connect, authenticate, pull, renew, release.

Every call has a deadline; a dead or silent producer surfaces as a typed TransferError
(peer_unreachable / timeout), never as a hang. How the bytes of a read travel is the data path's
business (paths.py); this module speaks the control protocol around it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import auth, wire
from kvconnectors.transport.paths import TCP_PULL, PullPath


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
            raise TransferError(wire.failure_cause(msg.cause), f"peer {self.address}: {msg.message}", refused=True)
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
             *, fingerprint: str, deadline: float, verify: bool = True, path: PullPath = TCP_PULL,
             dest_addrs: np.ndarray | None = None) -> int:
        """Pull blocks [first_block, first_block + len(dest) / len(layers)) of `layers` into
        `dest` (one writable view per (layer, block), layer-major) over `path`. Returns bytes
        received. `dest_addrs` (uint64, one per view) spares a nixl path taking each view's address.
        A path that does not stream answers Release itself; after a streamed read the caller does."""
        read = wire.Read(transfer_id=transfer_id, layers=list(layers), first_block=first_block,
                         num_blocks=len(dest) // len(layers), fingerprint=fingerprint, data_path=path.name)
        self._send(read)
        # Checksums and offsets grow with the prompt: allow ~32 bytes per (layer, block) beyond the
        # usual control-frame limit, still bounded by what this read asked for.
        reply = self._expect(wire.ReadReply, deadline, wire.MAX_CONTROL_BYTES + 32 * len(dest))
        sums = reply.checksums if verify else None

        def pull() -> int:
            return path.read_into(self.sock, self.address, read, reply, dest, deadline=deadline, sums=sums,
                                  dest_addrs=dest_addrs)
        return pull() if path.streams else self._then_release(transfer_id, deadline, pull)

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

    def _send(self, msg: wire.Message) -> None:
        try:
            wire.send_msg(self.sock, msg)
        except OSError as exc:  # EPIPE / ECONNRESET: the producer went away
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"connection to producer {self.address} lost: {exc.strerror or exc}") from None

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
        self._send(msg)
        if data:
            self.sock.settimeout(max(1e-3, deadline - time.monotonic()))
            try:
                wire.send_all(self.sock, list(data))
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


def store_status(host: str, port: int, *, secret: bytes | None = None, timeout_s: float = 5.0) -> wire.StatusReply:
    """Occupancy of a TieredConnector store server (entries, bytes per tier, connections)."""
    from kvconnectors.transport.auth import load_secret

    secret = secret if secret is not None else load_secret()
    with StoreClient(host, port, compat=wire.compat_hash("tiered"), secret=secret,
                     connect_timeout_s=timeout_s) as client:
        return client.status(time.monotonic() + timeout_s)
