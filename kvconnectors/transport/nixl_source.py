"""The producer's NIXL agent (`NixlSource`): the store's DRAM arena registered once, its metadata
for the ReadReply, and its worker progressed while a consumer READs (nixl.py has the whole exchange).
"""

from __future__ import annotations

import select
import socket
import time

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.transport.nixl_agent import Backoff, create_agent, describe_error, reg_descs

logger = get_logger(__name__)


class NixlSource:
    """The producer's agent: registers the store's DRAM arena [base_address, +nbytes) once and
    progresses its UCX worker while a consumer READs from it."""

    def __init__(self, base_address: int, nbytes: int, *, name: str | None = None, tag: str = ""):
        if base_address <= 0 or nbytes <= 0:
            raise ValueError(f"bad arena region base=0x{base_address:x} nbytes={nbytes}")
        self.base_address, self.nbytes = int(base_address), int(nbytes)
        self._agent = create_agent("producer", name, tag)
        self.name: str = self._agent.name
        try:
            self._reg = self._agent.register_memory(reg_descs([(self.base_address, self.nbytes)]), "DRAM")
            self.metadata: bytes = self._agent.get_agent_metadata()  # after registering: it lists the arena
        except Exception as exc:
            self._agent = None
            raise TransferError(FailureCause.PROTOCOL, (
                f"NIXL producer agent {self.name!r} could not register the store arena "
                f"(0x{self.base_address:x}, {self.nbytes} B): {describe_error(exc)}")) from None
        self.progress_calls = 0
        self._closed = False

    def progress(self) -> None:
        """One progress pass of the agent's worker (answers wire-up, drains notifications)."""
        if self._closed:
            return
        self.progress_calls += 1
        try:
            self._agent.get_new_notifs()
        except Exception as exc:  # a progress error concerns one peer; its own READ reports it
            logger.debug("NIXL producer %s: progress failed: %s", self.name, describe_error(exc))

    def serve_until_readable(self, sock: socket.socket, deadline: float) -> None:
        """Progress the agent while the consumer's READ is in flight, until `sock` has something
        to read (its Release or Ack, or EOF when it went away). TIMEOUT at the deadline."""
        backoff = Backoff()
        while True:
            self.progress()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(FailureCause.TIMEOUT, (
                    f"consumer {_peer(sock)} neither released nor failed its NIXL read before the deadline"))
            if _readable(sock, min(backoff.next(), left)):
                return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as exc:
            logger.warning("NIXL producer %s: deregistering the arena failed: %s", self.name, describe_error(exc))
        self._agent = None  # the C++ agent goes with its last reference


def _readable(sock: socket.socket, timeout: float) -> bool:
    fd = sock.fileno()
    if fd < 0:
        return True  # closed under us: let the caller's recv report it
    if fd < 1024:  # select's FD_SETSIZE; it takes a microsecond timeout, poll only milliseconds
        r, _, x = select.select([fd], [], [fd], timeout)
        return bool(r or x)
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(p.poll(timeout * 1000.0))


def _peer(sock: socket.socket) -> str:
    try:
        return "%s:%s" % sock.getpeername()[:2]
    except OSError:
        return "?"
