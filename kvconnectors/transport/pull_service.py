"""The pull service of a store server: Read, Renew, Release, Locate and Status requests.

Every request is validated before it touches the store; what names a granted transfer must present
its token (grants.py), else it is answered exactly like an unknown id. A Read waits (at most
`seal_wait_s`) for its transfer to be fully staged, renews its lease, and is served by the data
path it names (paths.py), given a ReadContext: never this service itself. The consumer's answer to
a read it fetched itself from offsets (shm, nixl) comes back through `finish_offset_read`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.store import TieredStore
from kvconnectors.transport import wire
from kvconnectors.transport.auth import Session
from kvconnectors.transport.faults import FaultRule, with_fault
from kvconnectors.transport.grants import Grants
from kvconnectors.transport.paths import PULL_UNOFFERED, PullPath, ReadContext, offered
from kvconnectors.transport.protocol import peer_name
from kvconnectors.transport.server_counters import ServerCounters
from kvconnectors.transport.server_settings import SERVER_LOGGER, ServerSettings

logger = get_logger(SERVER_LOGGER)  # logs as the store server (operators and tests filter by it)
MAX_RENEW = wire.MAX_RENEW  # transfer ids per Renew message
MAX_BLOCKS = 1 << 24  # blocks of one read (a prompt of 16M tokens at block size 1)


class PullService:
    """Answers the pull requests of every connection, from their threads."""

    def __init__(self, store: TieredStore, settings: ServerSettings, grants: Grants, paths: dict[str, PullPath],
                 counters: ServerCounters, active_connections: Callable[[], int],
                 staging_failure: Callable[[str], TransferError | None] | None = None):
        """`paths`: the pull data paths offered, by name (the server's: shared, not copied).
        `staging_failure(transfer_id)`: why its staging failed, or None (a Read stops waiting on it)."""
        self.store, self.grants, self.paths, self.counters = store, grants, paths, counters
        self.fingerprint, self.num_layers = settings.fingerprint, settings.num_layers
        self.rows_fingerprint = settings.effective_rows_fingerprint
        self.idle_timeout_s, self.seal_wait_s, self.tp_size = settings.idle_timeout_s, settings.seal_wait_s, \
            settings.tp_size
        self.active_connections = active_connections
        self.staging_failure = staging_failure or (lambda tid: None)
        self._sealed = threading.Condition()

    def notify_sealed(self) -> None:
        """A transfer was sealed (or its staging failed): Reads waiting for one look again."""
        with self._sealed:
            self._sealed.notify_all()

    def _validate(self, msg: wire.Read, session: Session | None = None) -> PullPath:
        wire.check_transfer_id(msg.transfer_id)
        ours = self.rows_fingerprint if msg.fingerprint == self.rows_fingerprint else self.fingerprint
        wire.check_fingerprint(msg.fingerprint, ours, peer="consumer", us="producer",
                               reveal=session is not None and session.authenticated)
        wire.check_layers(msg.layers, self.num_layers)
        if not (0 <= msg.first_block < MAX_BLOCKS and 1 <= msg.num_blocks <= MAX_BLOCKS):
            raise TransferError(FailureCause.PROTOCOL,
                                f"bad block range first_block={msg.first_block} num_blocks={msg.num_blocks}")
        path = offered(self.paths, msg.data_path, PULL_UNOFFERED, "data_path")
        self.grants.check(msg.transfer_id, msg.token)
        return path

    def _wait_sealed(self, tid: str) -> None:
        deadline = time.monotonic() + self.seal_wait_s
        with self._sealed:
            while True:
                failure = self.staging_failure(tid)
                if failure is not None:
                    raise failure
                if self.store.is_sealed(tid):  # typed LeaseExpired / UnknownTransfer if gone
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(FailureCause.TIMEOUT, f"transfer {tid!r} was not fully staged in time")
                self._sealed.wait(left)

    def read(self, sock: socket.socket, msg: wire.Read, fault: FaultRule | None = None,
             session: Session | None = None) -> None:
        path = with_fault(self._validate(msg, session), fault)
        self._wait_sealed(msg.transfer_id)
        ttl = self.store.renew(msg.transfer_id)  # a consumer pulling keeps the lease alive
        info = self.store.info(msg.transfer_id)
        last = msg.first_block + msg.num_blocks
        if last > info.num_blocks:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                f"asked for blocks [{msg.first_block}, {last}) of a {info.num_blocks}-block transfer"))
        sums = (self.store.checksums(msg.transfer_id) or {}).get("xxh3")
        checksums = None if sums is None else [
            sums[layer * info.num_blocks + b] for layer in msg.layers for b in range(msg.first_block, last)]
        path.serve(self._read_context(), sock, msg, info.nvme_slots, ttl, checksums)

    # ------------------------------------------------------------------ for the data paths
    def _read_context(self) -> ReadContext:
        """What a path's source end is given to serve one read: never this service itself."""
        return ReadContext(store=self.store, idle_timeout_s=self.idle_timeout_s, count_read=self.count_read,
                           reject=self.counters.reject, finish_offset_read=self.finish_offset_read, log=logger)

    def count_read(self, nbytes: int) -> None:
        self.counters.count_read(nbytes)

    def finish_offset_read(self, sock: socket.socket, msg: wire.Read, path: str, done: wire.Message,
                           nbytes: int) -> None:
        """The consumer's answer to a read it fetched itself from offsets: Release (done: count it,
        release the entry), Ack(ok=True) (done: count it, keep the entry, which other consumer
        ranks read too, until the consumer's lease keeper releases it), Ack(ok=False) (its fetch
        failed: the entry stays for a retry), or anything else, out of protocol while a read is
        open (dispatching it here would nest pins without bound): drop the connection."""
        if isinstance(done, wire.Release):
            self.count_read(nbytes)
            self.release(sock, done)
        elif isinstance(done, wire.Ack) and done.ok:
            self.count_read(nbytes)
        elif isinstance(done, wire.Ack) and not done.ok:
            logger.info("consumer %s failed its %s read of %s: [%s] %s", peer_name(sock), path,
                        msg.transfer_id, done.cause, done.message)
        elif not isinstance(done, wire.Ack):
            self.counters.reject("protocol")
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def renew(self, sock: socket.socket, msg: wire.Renew) -> None:
        remaining: dict[str, float] = {}
        missing: dict[str, str] = {}
        if len(msg.transfer_ids) > MAX_RENEW:
            raise TransferError(FailureCause.PROTOCOL, f"{len(msg.transfer_ids)} transfer ids in one Renew; "
                                                       f"the limit is {MAX_RENEW}")
        if msg.tokens is not None and len(msg.tokens) != len(msg.transfer_ids):
            raise TransferError(FailureCause.PROTOCOL, f"a Renew with {len(msg.tokens)} tokens for "
                                                       f"{len(msg.transfer_ids)} transfer ids")
        size = wire.renew_bytes(msg.transfer_ids, msg.tokens)
        if size > wire.MAX_RENEW_BYTES:  # its reply might not fit a frame
            raise TransferError(FailureCause.PROTOCOL, f"a Renew of {size} bytes of ids and tokens; the limit "
                                                       f"is {wire.MAX_RENEW_BYTES} (split it)")
        for i, tid in enumerate(msg.transfer_ids):
            if not self.grants.authorized(tid, msg.tokens[i] if msg.tokens is not None else ""):
                missing[tid] = FailureCause.UNKNOWN_TRANSFER.value
                continue
            try:
                remaining[tid] = self.store.renew(tid)
            except TransferError as exc:
                missing[tid] = exc.cause.value
        wire.send_msg(sock, wire.RenewReply(remaining=remaining, missing=missing), limit=wire.MAX_CONTROL_BYTES)

    def status(self, sock: socket.socket) -> None:
        usage = self.store.usage()
        counters = {k: int(v) for k, v in self.store.stats.snapshot().items() if isinstance(v, (int, float))}
        wire.send_msg(sock, wire.StatusReply(
            entries=usage["entries"], dram_used_bytes=usage["dram"]["used_bytes"],
            nvme_used_bytes=usage["nvme"]["used_bytes"], pinned=usage["pinned"],
            active_connections=self.active_connections() - 1, counters=counters,  # minus this one
            rejected=dict(self.counters.rejected), auth_failures=self.counters.auth_failures,
            integrity_failures=self.counters.integrity_failures, tp_size=self.tp_size,
            dram_capacity_bytes=usage["dram"]["capacity_bytes"], nvme_capacity_bytes=usage["nvme"]["capacity_bytes"]),
            limit=wire.MAX_CONTROL_BYTES)

    def locate(self, sock: socket.socket, msg: wire.Locate) -> None:
        try:
            self.grants.check(msg.transfer_id, msg.token)
            info = self.store.info(msg.transfer_id)
        except TransferError:
            wire.send_msg(sock, wire.LocateReply(found=False))
            return
        wire.send_msg(sock, wire.LocateReply(found=True, dram_slots=info.dram_slots, nvme_slots=info.nvme_slots))

    def release(self, sock: socket.socket, msg: wire.Release) -> None:
        self.grants.check(msg.transfer_id, msg.token)
        self.store.release(msg.transfer_id)  # no-op for an entry that already ended
        wire.send_msg(sock, wire.Ack(ok=True))
