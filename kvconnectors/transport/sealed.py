"""Sealed connections (wire_protection "aead"): every byte after the handshake in AES-256-GCM records.

Once the v4 handshake has proved the shared secret both ways (auth.py), each side wraps its socket
in a `SealedSocket`. Everything the connection carries from then on, the control frames and the KV
bytes that follow a ReadReply (tcp pull) or a Push (tcp push) alike, travels as records:

    record = length (4 bytes, big-endian, 1..RECORD_BYTES) | AES-256-GCM(plaintext) | tag (16 bytes)
    key    = HKDF-Expand-SHA256(session key, "kvconnectors aead c2s v1" or "... s2c v1", 32)
    nonce  = 4 zero bytes | the direction's record counter (8 bytes, big-endian, from 0)
    aad    = the record's length field

The session key comes from the handshake transcript (both nonces), so every connection has its
own keys, and each direction its own key: a record cut from another connection, replayed,
reordered, dropped or sent back the other way fails its tag, as does a changed byte anywhere.
A failed tag is never a silent accept: the socket is broken from then on (every later receive
raises the same typed TransferError, cause auth), `on_failure` runs once (the server counts it,
answers in the other direction and hangs up) and the transfer fails typed. What a receiver had
already decrypted into a destination buffer before a failed tag may be garbage: the transfer
that owns the buffer fails, so nothing reads it.

Memory stays bounded: one ciphertext buffer per direction (RECORD_BYTES + tag) and one plaintext
buffer each way. A record that fits the caller's current view is decrypted straight into it (the KV
blocks), others through the plaintext buffer. Senders seal large views in place and gather small
ones into the plaintext buffer first. The AEAD is the `cryptography` library's (OpenSSL); nothing
here is home-made beyond the record framing.

Data paths that do not travel on this socket are not sealed by it: shm is same-host memory (never on
the network); NIXL moves bytes itself, so aead refuses it (tiered/config.py, server.py).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import wire

RECORD_BYTES = 256 << 10     # plaintext of one record at most: bounds both sides' buffers
TAG_BYTES = 16
_HEAD = struct.Struct("!I")
_NONCE_PREFIX = b"\0\0\0\0"
_MAX_RECORDS = 1 << 64       # a direction's counter never wraps (a nonce is never reused)
_C2S, _S2C = b"kvconnectors aead c2s v1", b"kvconnectors aead s2c v1"
SMALL_VIEW = 16 << 10        # views below this are gathered into one record rather than sealed alone


def direction_keys(session_key: bytes, *, client: bool) -> tuple[bytes, bytes]:
    """(send key, receive key) for this side of a connection, from the handshake's session key."""
    c2s, s2c = (HKDFExpand(hashes.SHA256(), 32, info).derive(session_key) for info in (_C2S, _S2C))
    return (c2s, s2c) if client else (s2c, c2s)


def _nonce(counter: int) -> bytes:
    return _NONCE_PREFIX + counter.to_bytes(8, "big")


def _bytes_view(buf) -> memoryview:
    v = buf if isinstance(buf, memoryview) else memoryview(buf)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


class SealedSocket:
    """A connected socket whose traffic is sealed in both directions. Speaks the subset of the
    socket API the transport uses (sendall, sendmsg, recv_into, recvmsg_into, recv, timeouts,
    shutdown, close); one reader thread at a time, any number of senders (serialized).

    `on_failure(sock, error)`: called once, on the first record that fails its tag or framing."""

    def __init__(self, sock: socket.socket, *, send_key: bytes, recv_key: bytes, peer: str,
                 on_failure: Callable[["SealedSocket", TransferError], None] | None = None):
        self.raw, self.peer = sock, peer
        self._seal, self._open = AESGCM(send_key), AESGCM(recv_key)
        self._on_failure = on_failure
        self._send_lock = threading.Lock()
        self._sent = self._received = 0  # records per direction: the nonce counters
        self._out_plain = bytearray(RECORD_BYTES)
        self._out_fill = 0
        self._out_ct = bytearray(RECORD_BYTES + TAG_BYTES)
        self._in_head = bytearray(_HEAD.size)
        self._in_ct = bytearray(RECORD_BYTES + TAG_BYTES)
        self._in_got = 0                 # bytes of the current record (head + ciphertext) received
        self._in_plain = bytearray(RECORD_BYTES)
        self._in_start = self._in_end = 0  # decrypted bytes not handed out yet
        self._timeout: float | None = sock.gettimeout()
        self.broken: TransferError | None = None

    # ------------------------------------------------------------------ send
    def sendall(self, data) -> None:
        self.sendmsg([data])

    def sendmsg(self, buffers: Iterable, *_: object) -> int:
        """Seal and send every byte of `buffers` (never a partial send: returns the total)."""
        total = 0
        with self._send_lock:
            for buf in buffers:
                view = _bytes_view(buf)
                total += len(view)
                while view:
                    if self._out_fill == 0 and len(view) >= SMALL_VIEW:
                        n = min(len(view), RECORD_BYTES)
                        self._send_record(view[:n])  # sealed from the caller's buffer, no copy
                    else:
                        n = min(len(view), RECORD_BYTES - self._out_fill)
                        self._out_plain[self._out_fill:self._out_fill + n] = view[:n]
                        self._out_fill += n
                        if self._out_fill == RECORD_BYTES:
                            self._flush()
                    view = view[n:]
            self._flush()
        return total

    def _flush(self) -> None:
        if self._out_fill:
            n, self._out_fill = self._out_fill, 0
            self._send_record(memoryview(self._out_plain)[:n])

    def _send_record(self, plain: memoryview) -> None:
        if self._sent >= _MAX_RECORDS:
            raise TransferError(FailureCause.PROTOCOL, f"sealed connection to {self.peer} ran out of nonces")
        head = _HEAD.pack(len(plain))
        ct = memoryview(self._out_ct)[:len(plain) + TAG_BYTES]
        self._seal.encrypt_into(_nonce(self._sent), plain, head, ct)
        self._sent += 1
        wire.send_all(self.raw, [memoryview(head), ct])

    # ------------------------------------------------------------------ receive
    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        view = _bytes_view(buffer)
        return self._recv_views([view[:nbytes] if nbytes else view])

    def recvmsg_into(self, buffers, ancbufsize: int = 0, flags: int = 0):
        return self._recv_views([_bytes_view(b) for b in buffers]), [], 0, None

    def recv(self, nbytes: int, flags: int = 0) -> bytes:
        buf = bytearray(nbytes)
        return bytes(buf[:self.recv_into(buf)])

    def _recv_views(self, views: list[memoryview]) -> int:
        """Like recvmsg_into: at least one byte (0 at a clean end of stream), decrypted."""
        if self.broken is not None:
            raise self.broken
        views = [v for v in views if len(v)]
        if not views:
            return 0
        if self._in_start == self._in_end:
            length = self._read_record()
            if length == 0:
                return 0
            first = views[0]
            if len(first) >= length:  # the whole record fits the caller's buffer: decrypt into it
                self._decrypt(length, first[:length])
                return length
            self._decrypt(length, memoryview(self._in_plain)[:length])
            self._in_start, self._in_end = 0, length
        return self._hand_out(views)

    def _hand_out(self, views: list[memoryview]) -> int:
        got = 0
        for v in views:
            n = min(len(v), self._in_end - self._in_start)
            v[:n] = self._in_plain[self._in_start:self._in_start + n]
            self._in_start += n
            got += n
            if self._in_start == self._in_end:
                break
        return got

    def _read_record(self) -> int:
        """Receive the next whole record into the ciphertext buffer; its plaintext length, or 0
        when the peer closed between records. Resumes a record a timeout interrupted."""
        if self._timeout is None:
            return self._read_record_until(None)
        try:
            return self._read_record_until(time.monotonic() + self._timeout)
        finally:
            self.raw.settimeout(self._timeout)  # each raw recv had what was left; sends get the whole timeout

    def _read_record_until(self, deadline: float | None) -> int:
        head = _HEAD.size
        while self._in_got < head:
            k = self._raw_recv(memoryview(self._in_head)[self._in_got:], deadline)
            if k == 0:
                return 0 if self._in_got == 0 else self._cut()
            self._in_got += k
        (length,) = _HEAD.unpack(self._in_head)
        if not 0 < length <= RECORD_BYTES:
            self._fail(f"a record of {length} bytes (1..{RECORD_BYTES})")
        end = head + length + TAG_BYTES
        while self._in_got < end:
            k = self._raw_recv(memoryview(self._in_ct)[self._in_got - head:end - head], deadline)
            if k == 0:
                return self._cut()
            self._in_got += k
        self._in_got = 0
        return length

    def _cut(self) -> int:
        """The peer (or the path) closed in the middle of a record: read as a closed stream, which
        every caller reports typed (peer_unreachable), mid-frame or mid-KV."""
        self._in_got = 0
        return 0

    def _raw_recv(self, view: memoryview, deadline: float | None) -> int:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            self.raw.settimeout(left)
        return self.raw.recv_into(view)

    def _decrypt(self, length: int, out: memoryview) -> None:
        ct = memoryview(self._in_ct)[:length + TAG_BYTES]
        try:
            self._open.decrypt_into(_nonce(self._received), ct, bytes(self._in_head), out)
        except InvalidTag:
            self._fail(f"record {self._received} failed its tag (changed on the way, replayed, reordered, "
                       "or from another connection)")
        self._received += 1

    def _fail(self, why: str) -> None:
        self.broken = TransferError(FailureCause.AUTH, (
            f"sealed connection with {self.peer}: {why}; wire_protection 'aead' closes it"))
        callback, self._on_failure = self._on_failure, None
        if callback is not None:
            callback(self, self.broken)
        raise self.broken

    # ------------------------------------------------------------------ the rest of the socket API used
    def settimeout(self, value: float | None) -> None:
        self._timeout = value
        self.raw.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._timeout

    def pending(self) -> int:
        """Decrypted bytes buffered here (a select() on fileno() cannot see them)."""
        return self._in_end - self._in_start

    def fileno(self) -> int:
        return self.raw.fileno()

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()

    def setsockopt(self, *args) -> None:
        self.raw.setsockopt(*args)

    def getpeername(self):
        return self.raw.getpeername()

    def getsockname(self):
        return self.raw.getsockname()
