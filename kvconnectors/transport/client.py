"""Consumer side of the control protocol: connect, authenticate, pull, renew, release.

Every call has a deadline; a dead or silent producer surfaces as a typed TransferError
(peer_unreachable / timeout), never as a hang. How the bytes of a read travel is the data path's
business (paths/); this module speaks the control protocol around it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import auth, wire
from kvconnectors.transport.nixl_device import DeviceRows
from kvconnectors.transport.paths import TCP_PULL, PullPath
from kvconnectors.transport.protocol import check_protection, hang_up


class _Older(Exception):
    """The server admits only an older protocol version, which this side may speak."""

    def __init__(self, version: int):
        self.version = version


class _ResetInHandshake(Exception):
    """The server closed or reset the connection before it admitted us (its Welcome, or the Ack of
    our proof): nothing was done on it (a server over its caps closes a connection at once, or
    before its last answer), so connecting again is always safe."""

    def __init__(self, error: TransferError):
        self.error = error


# Back-off before each new connection after a reset before the Welcome; then the reset is the answer
# (a server that resets every connection is refusing, and says so within a fraction of a second)
RESET_RETRY_S = (0.01, 0.05, 0.2)


class StoreClient:
    """One connection to a store server, authenticated at connect time.

    `compat`: the hash this side presents, or one per protocol version it may speak
    (wire.compat_hashes: the previous version too). Given both and no `secret`, a server that
    admits only the previous version (an instance not yet upgraded) is spoken to in that version:
    no authentication and no transfer tokens, which that server does not check anyway. With a
    `secret`, the server must prove it holds the same secret before this side proves anything
    (auth.py); one that cannot, or that admits only the previous version (whose server proves
    nothing), is refused with cause auth: a secret holder is never downgraded.

    `protection` (the TieredConnector setting wire_protection): "aead" seals every frame and KV
    byte after the handshake (sealed.py); it needs `secret` and a v4 server that runs "aead" too
    (never falls back to v3). Sides that disagree fail typed (auth), naming both values."""

    def __init__(self, host: str, port: int, *, compat: str | Mapping[int, str], secret: bytes | None = None,
                 connect_timeout_s: float = 5.0, peer_name: str = "", protection: str = wire.HANDSHAKE):
        self.address = f"{host}:{port}"
        check_protection(protection, secret)
        self.protection = protection
        hashes = dict(compat) if isinstance(compat, Mapping) else {wire.PROTOCOL_VERSION: compat}
        self._hashes = hashes
        deadline = time.monotonic() + connect_timeout_s
        self.session: auth.Session | None = None
        version = max(hashes)
        resets = 0
        while True:
            try:
                self._connect(host, port, deadline)
                self._handshake(version, hashes[version], secret, peer_name, deadline)
                return
            except _ResetInHandshake as reset:
                self.close()
                if resets == len(RESET_RETRY_S) or time.monotonic() + RESET_RETRY_S[resets] >= deadline:
                    raise reset.error from None
                time.sleep(RESET_RETRY_S[resets])
                resets += 1
            except _Older as older:
                self.close()
                if protection == wire.AEAD:
                    raise TransferError(FailureCause.AUTH, (
                        f"producer {self.address} admits only protocol v{older.version}, which cannot seal the "
                        "connection; wire_protection 'aead' needs v4 on both sides"), refused=True) from None
                if secret is not None:  # v3's server proves nothing: falling back would trust anyone
                    raise TransferError(FailureCause.AUTH, (
                        f"producer {self.address} admits only protocol v{older.version}, whose server proves "
                        "nothing (one-way authentication); a side holding the shared secret never speaks it. "
                        "Upgrade that producer"), refused=True) from None
                version = older.version  # an instance not upgraded yet, in a pool without a secret
            except BaseException:
                self.close()
                raise

    def _connect(self, host: str, port: int, deadline: float) -> None:
        try:
            self.sock = socket.create_connection((host, port), timeout=max(1e-3, deadline - time.monotonic()))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            error = TransferError(FailureCause.PEER_UNREACHABLE,
                                  f"cannot connect to producer {self.address}: {exc.strerror or exc}")
            if isinstance(exc, ConnectionResetError):  # accepted, then reset over a cap before we ran
                raise _ResetInHandshake(error) from None
            raise error from None

    @property
    def version(self) -> int:
        return self.session.version if self.session else wire.PROTOCOL_VERSION

    def _handshake(self, version: int, compat: str, secret: bytes | None, peer_name: str,
                   deadline: float) -> None:
        nonce = auth.new_nonce() if version >= 4 else None
        try:
            self._send(wire.Hello(version=version, compat_hash=compat, peer=peer_name, nonce=nonce,
                                  protection=self.protection))
            welcome = self._expect(wire.Welcome, deadline)
        except TransferError as exc:
            if exc.cause is FailureCause.PEER_UNREACHABLE and time.monotonic() < deadline:
                raise _ResetInHandshake(exc) from None  # closed or reset unanswered, not timed out
            raise
        if not welcome.ok:
            if wire.PROTECTION_MISMATCH in welcome.error:
                raise TransferError(FailureCause.AUTH, f"producer {self.address} refused: {welcome.error[:500]}",
                                    refused=True)
            admitted = wire.admitted_versions(welcome.error)
            older = wire.PREVIOUS_VERSION
            if version > older and version not in admitted and older in admitted and older in self._hashes:
                raise _Older(older)
            raise TransferError(FailureCause.PROTOCOL, f"producer {self.address} refused: {welcome.error[:500]}")
        if version < 4:  # only without a secret (see __init__)
            if welcome.nonce is not None:
                raise TransferError(FailureCause.AUTH, f"producer {self.address} requires a shared secret; "
                                                       f"none is configured here ({auth.SECRET_ENV} or secret_file)")
            self.session = auth.Session(id=auth.session_id(None), version=version, authenticated=False, mutual=False,
                                        peer=self.address, peer_name=peer_name)
            return
        if welcome.protection != self.protection:  # checked again through the proof (the transcript)
            raise TransferError(FailureCause.AUTH, wire.protection_mismatch(self.protection, welcome.protection,
                                                                            us="client") +
                                f" (producer {self.address}; a producer that predates the setting reads as "
                                f"{wire.HANDSHAKE!r})", refused=True)
        if welcome.nonce is None:  # the server holds no secret: it cannot prove anything
            if secret is not None:
                raise TransferError(FailureCause.AUTH, (
                    f"producer {self.address} does not prove the shared secret (it runs without one, or it is "
                    "not the producer); refusing it because this side holds one"))
            self.session = auth.Session(id=auth.session_id(None), version=version, authenticated=False,
                                        mutual=False, peer=self.address, peer_name=peer_name)
            return
        if secret is None:
            raise TransferError(FailureCause.AUTH, f"producer {self.address} requires a shared secret; "
                                                   f"none is configured here ({auth.SECRET_ENV} or secret_file)")
        th = auth.transcript(version, compat, peer_name, nonce, welcome.nonce, self.protection)
        matched = auth.verify_any(secret, auth.ROLE_SERVER, th, welcome.proof)  # during a rotation: either secret
        if matched is None:
            self._abort(deadline)
            raise TransferError(FailureCause.AUTH, (
                f"producer {self.address} did not prove the shared secret (another secret, or not the "
                "producer); nothing was proved to it"))
        try:
            self._send(wire.Proof(mac=auth.prove_role(matched, auth.ROLE_CLIENT, th)))  # the secret it proved
            ack = self._expect(wire.Ack, deadline)
        except TransferError as exc:
            if exc.cause is FailureCause.PEER_UNREACHABLE and time.monotonic() < deadline:
                raise _ResetInHandshake(exc) from None  # closed before it admitted us: not a refusal
            raise
        if not ack.ok:
            raise TransferError(FailureCause.AUTH, f"producer {self.address}: {ack.message}")
        key = auth.session_key(matched, th)
        self.session = auth.Session(id=auth.session_id(th), version=version, authenticated=True, mutual=True,
                                    peer=self.address, peer_name=peer_name, key=key, protection=self.protection)
        if self.protection == wire.AEAD:
            from kvconnectors.transport.sealed import SealedSocket, direction_keys

            send_key, recv_key = direction_keys(key, client=True)
            self.sock = SealedSocket(self.sock, send_key=send_key, recv_key=recv_key, peer=f"producer {self.address}",
                                     on_failure=lambda sock, error: hang_up(sock))

    def _abort(self, deadline: float) -> None:
        """Tell the server why we hang up (it counts a failed authentication) and wait briefly for
        it to close, so its count is settled when our caller sees the failure."""
        try:
            wire.send_msg(self.sock, wire.Ack(ok=False, cause=FailureCause.AUTH.value,
                                              message="the server did not prove the shared secret"))
            self.sock.settimeout(max(1e-3, min(deadline - time.monotonic(), 1.0)))
            while self.sock.recv(4096):
                pass
        except OSError:
            pass

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
            if hasattr(self, "sock"):  # not before the first connection was made
                self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    def read(self, transfer_id: str, layers: Sequence[int], first_block: int,
             dest: Sequence[memoryview] | DeviceRows,
             *, fingerprint: str, deadline: float, verify: bool = True, path: PullPath = TCP_PULL,
             dest_addrs: np.ndarray | None = None, token: str = "", release: bool = True,
             heads: Sequence[int] | None = None) -> int:
        """Pull blocks [first_block, first_block + len(dest) / len(layers)) of `layers` into
        `dest` (one writable view per (layer, block), layer-major; for NixlDevicePull the rows'
        device addresses, DeviceRows) over `path`. Returns bytes
        received. `dest_addrs` (uint64, one per view) spares a nixl path taking each view's address.
        `token`: the transfer's token from its ticket. A path that does not stream answers Release
        itself, or with `release=False` Ack(ok=True): read, keep the entry (another consumer rank
        reads it too; the lease keeper releases it); after a streamed read the caller releases.
        `heads` (path TCP_HEADS_PULL): [start, stop) of the producer rank's KV heads; each view
        then holds those heads of one row, packed (mover.reslice.pack_heads)."""
        read = wire.Read(transfer_id=transfer_id, layers=list(layers), first_block=first_block,
                         num_blocks=len(dest) // len(layers), fingerprint=fingerprint, data_path=path.name,
                         token=token, heads=None if heads is None else list(heads))
        self._send(read)
        # Checksums and offsets grow with the prompt: allow ~32 bytes per (layer, block) beyond the
        # usual control-frame limit, still bounded by what this read asked for.
        reply = self._expect(wire.ReadReply, deadline, wire.MAX_CONTROL_BYTES + 32 * len(dest))
        sums = reply.checksums if verify else None
        if sums is not None and len(sums) != len(dest):  # each block is checked against its own sum
            raise TransferError(FailureCause.PROTOCOL, f"producer {self.address} sent {len(sums)} checksums "
                                                       f"for {len(dest)} blocks")

        def pull() -> int:
            return path.read_into(self.sock, self.address, read, reply, dest, deadline=deadline, sums=sums,
                                  dest_addrs=dest_addrs)
        return pull() if path.streams else self._then_release(transfer_id, deadline, pull, token, release)

    def _then_release(self, transfer_id: str, deadline: float, pull, token: str = "", release: bool = True) -> int:
        """shm / nixl: run `pull` (copy or READ, then verify), then Release (or, `release=False`,
        Ack(ok=True), which is not answered). On failure answer Ack(ok=False) instead, so the
        producer stops serving this read and keeps the entry (a retry can still have it), and the
        connection stays in step."""
        try:
            nbytes = pull()
        except TransferError as exc:
            try:
                wire.send_msg(self.sock, wire.Ack(ok=False, cause=exc.cause.value, message=exc.detail))
            except OSError:
                pass
            raise
        if not release:
            self._send(wire.Ack(ok=True))
            return nbytes
        self._send(wire.Release(transfer_id=transfer_id, token=token))
        self._expect(wire.Ack, deadline)
        return nbytes

    def _send(self, msg: wire.Message) -> None:
        try:
            wire.send_msg(self.sock, msg)
        except OSError as exc:  # EPIPE / ECONNRESET: the producer went away
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"connection to producer {self.address} lost: {exc.strerror or exc}") from None

    def renew(self, transfer_ids: Sequence[str], deadline: float, batch: int = wire.MAX_RENEW,
              tokens: Sequence[str] | None = None) -> wire.RenewReply:
        """Renew many leases (`tokens`: each one's token, in the same order), in frames within the
        server's limits (wire.MAX_RENEW ids, wire.MAX_RENEW_BYTES of ids and tokens), so that every
        reply fits the control-frame limit too."""
        out = wire.RenewReply(remaining={}, missing={})
        ids = list(transfer_ids)
        toks = list(tokens) if tokens is not None else None
        if toks is not None and len(toks) != len(ids):
            raise ValueError(f"{len(toks)} tokens for {len(ids)} transfer ids")
        for i, j in wire.renew_batches(ids, toks, batch):
            self._send(wire.Renew(transfer_ids=ids[i:j], tokens=None if toks is None else toks[i:j]))
            reply = self._expect(wire.RenewReply, deadline)
            out.remaining.update(reply.remaining)
            out.missing.update(reply.missing)
        return out

    def release(self, transfer_id: str, deadline: float, token: str = "") -> None:
        self._send(wire.Release(transfer_id=transfer_id, token=token))
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

    def locate(self, transfer_id: str, deadline: float, token: str = "") -> wire.LocateReply:
        self._send(wire.Locate(transfer_id=transfer_id, token=token))
        return self._expect(wire.LocateReply, deadline)

    def status(self, deadline: float) -> wire.StatusReply:
        self._send(wire.Status())
        return self._expect(wire.StatusReply, deadline)


def store_status(host: str, port: int, *, secret: bytes | None = None, timeout_s: float = 5.0,
                 protection: str = wire.HANDSHAKE) -> wire.StatusReply:
    """Occupancy of a TieredConnector store server (entries, bytes per tier, connections)."""
    from kvconnectors.transport.auth import load_secret

    secret = secret if secret is not None else load_secret()
    with StoreClient(host, port, compat=wire.compat_hashes("tiered"), secret=secret,
                     connect_timeout_s=timeout_s, protection=protection) as client:
        return client.status(time.monotonic() + timeout_s)
