"""A man in the middle for the sealed-connection tests: a TCP relay on 127.0.0.1 that cuts what it
forwards into units, the handshake's plain frames (two each way: Hello, Proof / Welcome, Ack) and
then the sealed records (sealed.py), and lets a hook change, drop, repeat or hold them."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

from kvconnectors.transport.sealed import TAG_BYTES

HANDSHAKE_UNITS = 2  # per direction; the first sealed record is unit 2
_LEN = struct.Struct("!I")
Hook = Callable[[int, str, int, bytes], list[bytes]]  # (connection, "c2s" | "s2c", unit, bytes) -> to send


def flip(unit: bytes, at: int = -1) -> bytes:
    """`unit` with one bit of byte `at` flipped (default: the last byte, inside the tag)."""
    b = bytearray(unit)
    b[at] ^= 0x01
    return bytes(b)


class Relay:
    """Forwards connections to 127.0.0.1:`target`. With a hook, each direction is parsed into units;
    without one, bytes pass unparsed (any protocol). `wire[direction]` holds every byte sent on."""

    def __init__(self, target: int, hook: Hook | None = None):
        self.target, self.hook = target, hook
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.wire = {"c2s": bytearray(), "s2c": bytearray()}
        self.connections = 0
        self._socks: list[socket.socket] = [self.listener]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                index = self.connections
                self.connections += 1
                self._socks += [client, server]
            for src, dst, d in ((client, server, "c2s"), (server, client, "s2c")):
                threading.Thread(target=self._pump, args=(index, src, dst, d), daemon=True).start()

    def _pump(self, conn: int, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            if self.hook is None:
                while chunk := src.recv(1 << 16):
                    self._send(dst, direction, chunk)
            else:
                unit = 0
                while (data := self._unit(src, sealed=unit >= HANDSHAKE_UNITS)) is not None:
                    for out in self.hook(conn, direction, unit, data):
                        self._send(dst, direction, out)
                    unit += 1
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _send(self, dst: socket.socket, direction: str, data: bytes) -> None:
        with self._lock:
            self.wire[direction] += data
        dst.sendall(data)

    @staticmethod
    def _unit(src: socket.socket, sealed: bool) -> bytes | None:
        head = _recv(src, _LEN.size)
        if head is None:
            return None
        (n,) = _LEN.unpack(head)
        body = _recv(src, n + (TAG_BYTES if sealed else 0))
        return None if body is None else head + body

    def close(self) -> None:
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


def _recv(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
