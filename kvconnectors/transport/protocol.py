"""Terms both ends of the transfer protocol share, in one low module every side may import.

- hanging up: `HungUp` (a connection must end now) and `hang_up` (end it);
- (checksums: `mover/checksums.py`, below the transport, so the mover's head slicer raises the same
  `checksum_mismatch` as the data paths);
- the wire_protection setting's check (`check_protection`), made by clients and servers alike;
- push: the size limit of one Push (`MAX_PUSH_BYTES`), the bytes that follow a Push frame
  (`trailing_bytes`), and the landing store's address in a ticket (`parse_target`).

It imports no data path and nothing that loads torch, so the scheduler reads push targets
without loading the data paths.
"""

from __future__ import annotations

import socket

from kvconnectors.errors import ConfigError, TransferError
from kvconnectors.transport import auth, wire

Addr = tuple[str, int]
INLINE = "inline"  # the data_path whose bytes follow their frame on the control socket (tcp)
MAX_PUSH_BYTES = 64 << 20  # data of one Push message at most (the landing side's NIXL bounce buffer, too)


class HungUp(Exception):
    """The connection must end now: its stream broke (`error`: what to record for the transfer)
    or a fault cut it on purpose (error None). Whoever holds the socket hangs up."""

    def __init__(self, error: TransferError | None = None):
        super().__init__(str(error) if error else "hung up")
        self.error = error


def hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def peer_name(sock: socket.socket) -> str:
    """host:port of the socket's peer, for logs ("?" once it is gone)."""
    try:
        return "%s:%s" % sock.getpeername()[:2]
    except OSError:
        return "?"


def check_protection(protection: str, secret: bytes | None) -> None:
    """The wire_protection setting of a client or server: a known value; "aead" needs the secret
    (its keys come from the handshake the secret authenticates)."""
    if protection not in wire.PROTECTIONS:
        raise ConfigError("wire_protection", protection, f"must be one of {', '.join(wire.PROTECTIONS)}")
    if protection == wire.AEAD and secret is None:
        raise ConfigError("wire_protection", protection, (
            f"needs the shared secret (secret_file or {auth.SECRET_ENV}): the sealing keys come from the "
            "handshake it authenticates"))


def trailing_bytes(push: wire.Push) -> int:
    """Bytes that follow this Push frame on the socket (to read or drain before the next frame)."""
    return push.nbytes if push.data_path == INLINE else 0


def parse_target(value: object) -> Addr:
    """`host:port` (IPv6 as `[addr]:port`) of a landing store, from kv_transfer_params."""
    if not isinstance(value, str) or ":" not in value or len(value) > 300:
        raise ValueError(f"push_target={value!r}: expected HOST:PORT")
    host, _, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"push_target={value!r}: expected HOST:PORT with a port in 1..65535")
    return host, int(port)
